"""Writes into a store go through unguessable temp files; opening writes nothing; links are refused."""

import json
import os
import shutil

import pytest

from airquant.errors import StoreError
from airquant.models import resolve
from airquant.store.manifest import Manifest, open_store, save_manifest
from airquant.store.split import split
from tests.store.conftest import run_cli

VICTIM_TEXT = "a file outside the store\n"


@pytest.fixture
def victim(tmp_path):
    path = tmp_path / "victim.txt"
    path.write_text(VICTIM_TEXT)
    return path


def _old_format(store):
    """The store as an AirQuant before read checksums wrote it (what made opening write the manifest)."""
    body = json.loads((store / "manifest.json").read_text())
    for entry in body["shards"].values():
        entry["checksum"] = ""
    (store / "manifest.json").write_text(json.dumps(body))


def _plant_temp_links(store, victim, pids):
    """The issue's attack: a link at the temp name each pid would write the manifest through."""
    for pid in pids:
        os.symlink(victim, store / f".manifest.json.tmp-{pid}")


def _snapshot(store):
    return {p: (p.stat().st_mtime_ns, p.read_bytes()) for p in sorted(store.rglob("*")) if p.is_file()
            and not p.is_symlink()}


def test_opening_an_old_store_writes_nothing(store):
    _old_format(store)
    before = _snapshot(store)
    manifest = open_store(store, verify=True)
    assert all(e.checksum for e in manifest.shards.values())  # computed for this run, reads still checked
    assert _snapshot(store) == before


def test_info_verify_with_planted_temp_links_leaves_the_target_alone(store, victim):
    """`airquant info --verify` on a store holding links at every temp name: refused, nothing written."""
    _old_format(store)
    _plant_temp_links(store, victim, [os.getpid()])
    before = _snapshot(store)
    rc, _, err = run_cli("info", "--store", store, "--verify")
    assert victim.read_text() == VICTIM_TEXT
    assert rc == 2 and ".manifest.json.tmp-" in err and "symbolic link" in err
    assert _snapshot(store) == before


def test_a_write_never_goes_through_a_planted_temp_name(store, victim):
    """A temp name is unguessable; a link planted at the pid's old name is neither followed nor replaced."""
    _plant_temp_links(store, victim, [os.getpid()])
    manifest = Manifest.from_dict(json.loads((store / "manifest.json").read_text()))
    save_manifest(store, manifest)
    assert victim.read_text() == VICTIM_TEXT
    assert os.path.islink(store / f".manifest.json.tmp-{os.getpid()}")
    assert json.loads((store / "manifest.json").read_text())["num_layers"] == manifest.num_layers


def test_a_temp_file_is_created_exclusively(tmp_path, victim, monkeypatch):
    """Were the random part guessed, O_EXCL|O_NOFOLLOW makes the create fail instead of writing through."""
    from airquant.store import files

    monkeypatch.setattr(files.secrets, "token_hex", lambda n: "0" * 2 * n)
    os.symlink(victim, tmp_path / files.temp_name("out.json"))
    with pytest.raises(FileExistsError):
        files.write_atomic(tmp_path / "out.json", b"{}")
    assert victim.read_text() == VICTIM_TEXT and not (tmp_path / "out.json").exists()


def test_a_linked_shard_does_not_pass_verify(store, tmp_path):
    """A shard replaced by a link to an identical copy elsewhere: refused by open, --verify and the engine."""
    outside = tmp_path / "elsewhere.safetensors"
    shutil.copy(store / "layer_0001.safetensors", outside)
    (store / "layer_0001.safetensors").unlink()
    os.symlink(outside, store / "layer_0001.safetensors")
    with pytest.raises(StoreError, match=r"layer_0001.safetensors is a symbolic link .*Replace the link"):
        open_store(store, verify=True)
    rc, _, err = run_cli("info", "--store", store, "--verify")
    assert rc == 2 and "layer_0001.safetensors is a symbolic link" in err and "every sha256 matches" not in err


def test_a_linked_tokenizer_folder_is_refused(store, tmp_path):
    shutil.move(store / "tokenizer", tmp_path / "tok")
    os.symlink(tmp_path / "tok", store / "tokenizer")
    with pytest.raises(StoreError, match=r"tokenizer is a symbolic link"):
        open_store(store)


def test_split_refuses_a_store_holding_links(store, victim, tiny_llama):
    """A resumed split writes nothing into a store that holds a link (to the victim or anywhere)."""
    (store / "config.json").unlink()
    os.symlink(victim, store / "config.json")
    with pytest.raises(StoreError, match=r"config.json is a symbolic link"):
        split(resolve(str(tiny_llama)), store, dtype="float32", progress=False)
    assert victim.read_text() == VICTIM_TEXT


def test_stale_temps_of_a_killed_writer_are_removed(tmp_path):
    from airquant.store import files

    dead = 2 ** 22 + 1  # above the default pid_max: no such process
    (tmp_path / f".manifest.json{files.TMP_MARK}{dead}-00ff").write_text("half")
    (tmp_path / f".tokenizer{files.TMP_MARK}{dead}-abc").mkdir()
    (tmp_path / f".layer_0000.safetensors{files.TMP_MARK}{os.getpid()}-00ff").write_text("mine, still writing")
    removed = files.remove_stale_temps(tmp_path)
    assert sorted(removed) == [f".manifest.json{files.TMP_MARK}{dead}-00ff", f".tokenizer{files.TMP_MARK}{dead}-abc"]
    assert [p.name for p in tmp_path.iterdir()] == [f".layer_0000.safetensors{files.TMP_MARK}{os.getpid()}-00ff"]
