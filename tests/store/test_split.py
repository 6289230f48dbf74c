import json
import os

import pytest
import torch
from safetensors.torch import load_file

from airquant.errors import ChecksumError, DiskSpaceError, StoreError
from airquant.models import resolve
from airquant.store import split as split_mod
from airquant.store.manifest import load_manifest, open_store
from airquant.store.split import split


def test_manifest_describes_every_shard(tiny_store, tiny_llama):
    m = load_manifest(tiny_store)
    assert m.complete and m.num_layers == 3 and not m.tied_lm_head
    assert m.layer_order == ["embed", "layer.0", "layer.1", "layer.2", "norm", "lm_head"]
    body = json.loads((tiny_store / "manifest.json").read_text())
    assert body["format_version"] == 1 and body["tool_version"] and body["total_bytes"] == m.total_bytes
    assert body["source"]["model_type"] == "llama"
    for group, entry in m.shards.items():
        path = tiny_store / entry.file
        assert path.stat().st_size == entry.bytes
        tensors = load_file(path)
        assert set(tensors) == set(entry.tensors)
        for name, meta in entry.tensors.items():
            assert meta["dtype"] == "float32" and meta["shape"] == list(tensors[name].shape)
            assert meta["scheme"] == "dense"
    assert (tiny_store / "config.json").is_file() and (tiny_store / "tokenizer").is_dir()


def test_shards_hold_the_source_weights(tiny_store, tiny_llama):
    src = load_file(tiny_llama / "model.safetensors")
    layer1 = load_file(tiny_store / "layer_0001.safetensors")
    for name, t in layer1.items():
        assert torch.equal(t, src[f"model.layers.1.{name}"])
    assert torch.equal(load_file(tiny_store / "lm_head.safetensors")["weight"], src["lm_head.weight"])


def test_tied_qwen2_has_no_lm_head_shard(tmp_path, tiny_qwen2):
    m = split(resolve(str(tiny_qwen2)), tmp_path / "s", dtype="bfloat16", progress=False)
    assert m.tied_lm_head and "lm_head" not in m.shards
    assert m.shards["layer.0"].tensors["self_attn.q_proj.bias"]["dtype"] == "bfloat16"


def _mtimes(store):
    return {p.name: p.stat().st_mtime_ns for p in store.glob("*.safetensors")}


def test_resume_redoes_only_bad_shards(tmp_path, tiny_llama):
    src = resolve(str(tiny_llama))
    store = tmp_path / "s"
    split(src, store, dtype="float32", progress=False)
    before = _mtimes(store)
    (store / "layer_0001.safetensors").unlink()
    with open(store / "layer_0002.safetensors", "r+b") as f:  # flip bytes in the data section
        f.seek(-16, os.SEEK_END)
        f.write(b"\x00" * 16)
    split(src, store, dtype="float32", progress=False)
    after = _mtimes(store)
    changed = {k for k in after if after[k] != before.get(k)}
    assert changed == {"layer_0001.safetensors", "layer_0002.safetensors"}
    open_store(store, verify=True)


def test_interrupted_split_leaves_store_resumable(tmp_path, tiny_llama):
    src = resolve(str(tiny_llama))
    store = tmp_path / "s"

    def boom(group, tensors):
        if group == "layer.1":
            raise RuntimeError("killed")
        return tensors, {}

    with pytest.raises(RuntimeError):
        split(src, store, dtype="float32", transform=boom, progress=False)
    m = load_manifest(store)
    assert not m.complete and set(m.shards) == {"embed", "layer.0"}
    assert not list(store.glob(".*tmp*"))
    with pytest.raises(StoreError, match="incomplete"):
        open_store(store)
    split(src, store, dtype="float32", progress=False)
    assert open_store(store, verify=True).complete


def test_refuses_store_of_another_model(tmp_path, tiny_llama, tiny_qwen2):
    store = tmp_path / "s"
    split(resolve(str(tiny_llama)), store, dtype="float32", progress=False)
    before = _mtimes(store)
    manifest_before = (store / "manifest.json").read_bytes()
    with pytest.raises(StoreError, match="left untouched"):
        split(resolve(str(tiny_qwen2)), store, dtype="float32", progress=False)
    with pytest.raises(StoreError, match="left untouched"):
        split(resolve(str(tiny_llama)), store, dtype="bfloat16", progress=False)
    assert _mtimes(store) == before and (store / "manifest.json").read_bytes() == manifest_before


def test_disk_too_small_refuses_with_numbers(tmp_path, tiny_llama, monkeypatch):
    monkeypatch.setattr(split_mod, "_free_bytes", lambda path: 1000)
    with pytest.raises(DiskSpaceError, match=r"needs about .* GB more, .* GB are free"):
        split(resolve(str(tiny_llama)), tmp_path / "s", dtype="float32", progress=False)
    assert not list((tmp_path / "s").glob("*.safetensors"))


def test_bad_dtype(tmp_path, tiny_llama):
    with pytest.raises(StoreError, match="--dtype"):
        split(resolve(str(tiny_llama)), tmp_path / "s", dtype="int8", progress=False)


def test_checksum_and_truncation_are_caught(tmp_path, tiny_llama):
    store = tmp_path / "s"
    split(resolve(str(tiny_llama)), store, dtype="float32", progress=False)
    shard = store / "layer_0000.safetensors"
    data = bytearray(shard.read_bytes())
    data[-1] ^= 0xFF
    shard.write_bytes(bytes(data))
    open_store(store)  # sizes still match: only the hash tells
    with pytest.raises(ChecksumError, match="layer_0000.safetensors"):
        open_store(store, verify=True)
    shard.write_bytes(bytes(data[:-100]))
    with pytest.raises(StoreError, match="layer_0000.safetensors has .* bytes"):
        open_store(store)


def test_missing_store_and_manifest(tmp_path):
    with pytest.raises(StoreError, match="does not exist"):
        load_manifest(tmp_path / "nowhere")
    with pytest.raises(StoreError, match="manifest.json is missing"):
        load_manifest(tmp_path)


def test_the_bar_names_the_wait_before_the_first_shard_and_times_from_it(tmp_path, tiny_llama, monkeypatch):
    """The default model's GGUF index took ~30 s before shard 1: the bar sat at 0/32, then showed an ETA of 15 min."""
    import time

    bars = []

    class Bar(split_mod.tqdm):
        def __init__(self, *a, **kw):
            super().__init__(*a, **kw)
            self.postfixes = []
            bars.append(self)

        def set_postfix_str(self, s="", refresh=True):
            self.postfixes.append((s, self.n))
            super().set_postfix_str(s, refresh)

    source = resolve(str(tiny_llama))
    groups = source.tensor_groups

    def slow_index():
        time.sleep(1.0)
        yield from groups()

    monkeypatch.setattr(source, "tensor_groups", slow_index)
    monkeypatch.setattr(split_mod, "tqdm", Bar)
    start = time.perf_counter()
    split(source, tmp_path / "s", dtype="float32", progress=True)
    (bar,) = bars
    assert bar.postfixes[0] == ("reading the checkpoint's index", 0)
    assert bar.start_t - start >= 1.0  # the shards' rate and ETA leave the index's second out
    assert bar.n == bar.total


def test_a_refused_split_prints_its_error_on_a_line_of_its_own(tmp_path, tiny_llama, capsys):
    """The progress bar is closed (its line ended) before the CLI prints the error."""
    import shutil

    from safetensors.torch import save_file

    from airquant.cli import main

    folder = tmp_path / "model"
    shutil.copytree(tiny_llama, folder)
    weights = folder / "model.safetensors"
    kept = {k: v for k, v in load_file(weights).items() if ".layers.1." not in k}
    save_file(kept, weights, metadata={"format": "pt"})
    assert main(["shard", str(folder), "--store", str(tmp_path / "store"), "--dtype", "float32"]) == 2
    lines = capsys.readouterr().err.split("\n")
    error = [line for line in lines if "airquant: error:" in line]
    assert len(error) == 1 and error[0].startswith("airquant: error:") and "layer.1" in error[0]
