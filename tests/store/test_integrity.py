"""Checksums on every read: recorded at split time, checked as layers are read, named errors, the repair."""

import json
import shutil

import pytest

from airquant.engine.runner import Engine
from airquant.errors import ChecksumError, StoreError
from airquant.models import resolve
from airquant.store.integrity import ALGO, checksum_file
from airquant.store.manifest import load_manifest, open_store, repair_command
from airquant.store.split import split
from tests.store.conftest import run_cli


def flip(path, offset_from_end=64, n=4):
    """Flip ``n`` bytes inside the data section (the end of the file is weight data)."""
    with open(path, "r+b") as f:
        f.seek(-offset_from_end, 2)
        data = bytearray(f.read(n))
        f.seek(-offset_from_end, 2)
        f.write(bytes(b ^ 0xFF for b in data))


def test_split_records_a_read_checksum_per_shard(tiny_store):
    m = load_manifest(tiny_store)
    for entry in m.shards.values():
        assert entry.checksum.startswith(f"{ALGO}:")
        assert checksum_file(tiny_store / entry.file) == entry.checksum


def test_default_store_flipped_bytes_fail_generate(tmp_path, default_store):
    """The issue's example: 4 bytes flipped in layer_0005 made `generate` print an empty answer and exit 0."""
    store = tmp_path / "store"
    shutil.copytree(default_store, store)
    flip(store / "layer_0005.safetensors", offset_from_end=4096)
    rc, out, err = run_cli("generate", store, "--device", "cpu", "--prompt", "Hi", "--max-new-tokens", "2")
    assert rc == 2 and "###" not in out
    entry = load_manifest(store).shards["layer.5"]
    assert "layer_0005.safetensors" in err and entry.checksum.split(":")[1] in err
    assert checksum_file(store / "layer_0005.safetensors").split(":")[1] in err
    assert f"airquant shard default --store {store} --dtype bfloat16" in err


@pytest.mark.parametrize("tier", ["disk", "ram"])
def test_streamed_read_mismatch_names_shard_checksums_and_fix(store, tier):
    flip(store / "layer_0001.safetensors")
    engine = Engine.open(store, device="cpu", max_ram_gb=0 if tier == "disk" else None)
    assert engine.plan.tiers[1] == tier
    enc = engine.encode(["Hello"])
    with pytest.raises(ChecksumError) as exc:
        engine.forward(**enc)
    msg = str(exc.value)
    assert "layer_0001.safetensors" in msg and load_manifest(store).shards["layer.1"].checksum.split(":")[1] in msg
    assert repair_command(store, load_manifest(store)) in msg
    engine.close()


def test_resident_and_fixed_parts_are_checked_at_load(store):
    flip(store / "layer_0002.safetensors")
    with pytest.raises(ChecksumError, match="layer_0002.safetensors.*checked when loaded"):
        Engine.open(store, device="cpu", resident=True)
    flip(store / "layer_0002.safetensors")  # flipped back
    flip(store / "embed.safetensors")
    with pytest.raises(ChecksumError, match="embed.safetensors"):
        Engine.open(store, device="cpu")


def test_disk_tier_checks_every_read_ram_tier_once(store):
    disk = Engine.open(store, device="cpu", max_ram_gb=0)
    ram = Engine.open(store, device="cpu")
    enc = disk.encode(["Hello there"])
    checked = {}
    for name, engine in (("disk", disk), ("ram", ram)):
        engine.forward(**enc)
        first = engine.streamer.checks.checked_bytes
        engine.forward(**enc)
        checked[name] = (first, engine.streamer.checks.checked_bytes)
        engine.close()
    total = sum(load_manifest(store).layer_bytes)
    assert checked["ram"] == (total, total)
    assert checked["disk"][1] >= 2 * total > checked["disk"][0] >= total


def test_no_verify_reads_skips_the_check(store):
    flip(store / "layer_0001.safetensors")
    engine = Engine.open(store, device="cpu", verify_reads=False)
    assert engine.streamer.checks is None
    enc = engine.encode(["Hello"])
    assert engine.forward(**enc).shape[:2] == enc["input_ids"].shape  # damaged weights, but no check: it runs
    engine.close()


def test_rerunning_the_fix_rewrites_just_the_bad_shard(store, tiny_llama):
    flip(store / "layer_0001.safetensors")
    before = {p.name: p.stat().st_mtime_ns for p in store.glob("*.safetensors")}
    split(resolve(str(tiny_llama)), store, dtype="float32", progress=False)
    after = {p.name: p.stat().st_mtime_ns for p in store.glob("*.safetensors")}
    assert [n for n in before if before[n] != after[n]] == ["layer_0001.safetensors"]
    open_store(store, verify=True)


def test_opening_an_old_store_checks_its_reads_and_writes_nothing(store):
    """Checksums an older store lacks are computed for the run; only `info --upgrade` records them."""
    body = json.loads((store / "manifest.json").read_text())
    for entry in body["shards"].values():
        entry.pop("checksum")
    (store / "manifest.json").write_text(json.dumps(body))
    before = {p.name: (p.stat().st_mtime_ns, p.read_bytes()) for p in store.iterdir() if p.is_file()}
    manifest = open_store(store)
    assert all(checksum_file(store / e.file) == e.checksum for e in manifest.shards.values())
    assert {p.name: (p.stat().st_mtime_ns, p.read_bytes()) for p in store.iterdir() if p.is_file()} == before
    assert not any(e.checksum for e in load_manifest(store).shards.values())


def test_info_upgrade_records_checksums(store):
    body = json.loads((store / "manifest.json").read_text())
    for entry in body["shards"].values():
        entry["checksum"] = ""
    (store / "manifest.json").write_text(json.dumps(body))
    rc, out, _ = run_cli("info", "--store", store, "--upgrade")
    assert rc == 0 and f"recorded for {len(body['shards'])} shards" in out
    assert all(checksum_file(store / e.file) == e.checksum for e in load_manifest(store).shards.values())
    rc, out, _ = run_cli("info", "--store", store, "--upgrade", "--verify")
    assert rc == 0 and "all had one already" in out and "every sha256 matches" in out


def test_damaged_stores_give_named_errors(store):
    (store / "layer_0002.safetensors").write_bytes((store / "layer_0002.safetensors").read_bytes()[:-10])
    with pytest.raises(StoreError, match=r"layer_0002.safetensors has .* bytes.*\(layer.2: truncated"):
        open_store(store)
    (store / "layer_0002.safetensors").unlink()
    with pytest.raises(StoreError, match=r"layer_0002.safetensors is missing \(layer.2\)"):
        open_store(store)
