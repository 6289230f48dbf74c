"""Malformed stores give a StoreError naming the file, the problem and the fix, not a raw KeyError or MemoryError."""

import hashlib
import json
import shutil
import struct

import pytest
import xxhash

from airquant.engine.runner import Engine
from airquant.errors import StoreError
from airquant.store.manifest import load_manifest, open_store

SHARD = "layer_0001.safetensors"


@pytest.fixture
def store(tmp_path, tiny_store):
    dst = tmp_path / "store"
    shutil.copytree(tiny_store, dst)
    return dst


def _rewrite(store, data: bytes) -> None:
    """Replace the shard and record its sizes and checksums, as a crafted store would."""
    (store / SHARD).write_bytes(data)
    body = json.loads((store / "manifest.json").read_text())
    entry = body["shards"]["layer.1"]
    entry.update(bytes=len(data), sha256=hashlib.sha256(data).hexdigest(),
                 checksum=f"xxh3_128:{xxhash.xxh3_128_hexdigest(data)}")
    (store / "manifest.json").write_text(json.dumps(body))


def _header(store) -> tuple[dict, bytes]:
    data = (store / SHARD).read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    return json.loads(data[8:8 + n]), data[8 + n:]


def _with_header(header: dict, body: bytes) -> bytes:
    raw = json.dumps(header).encode()
    return struct.pack("<Q", len(raw)) + raw + body


def test_a_header_length_of_2_62_is_a_named_error(store):
    data = (store / SHARD).read_bytes()
    _rewrite(store, struct.pack("<Q", 2 ** 62) + data[8:])
    with pytest.raises(StoreError, match=rf"{SHARD} declares a header of {2 ** 62} bytes.*Fix: `airquant shard"):
        open_store(store)
    with pytest.raises(StoreError, match=SHARD):
        Engine.open(store, device="cpu")


def test_an_unknown_shard_dtype_is_a_named_error(store):
    header, body = _header(store)
    name = next(k for k in header if k != "__metadata__")
    header[name]["dtype"] = "Q32"
    _rewrite(store, _with_header(header, body))
    with pytest.raises(StoreError, match=rf"{SHARD} gives tensor '{name}' the dtype 'Q32'.*Fix: `airquant shard"):
        Engine.open(store, device="cpu")


def test_offsets_past_the_data_section_are_a_named_error(store):
    header, body = _header(store)
    name = next(k for k in header if k != "__metadata__")
    start, end = header[name]["data_offsets"]
    header[name]["data_offsets"] = [start + len(body), end + len(body)]
    _rewrite(store, _with_header(header, body))
    with pytest.raises(StoreError, match=rf"{SHARD} places tensor '{name}'"):
        open_store(store)


def test_num_layers_larger_than_the_shards_is_a_named_error(store):
    body = json.loads((store / "manifest.json").read_text())
    body["num_layers"] = 5
    (store / "manifest.json").write_text(json.dumps(body))
    with pytest.raises(StoreError, match=r"manifest.json .*num_layers 5 .* no shard for layer.3, layer.4.*Re-run"):
        load_manifest(store)
    with pytest.raises(StoreError, match=r"manifest.json"):
        Engine.open(store, device="cpu")
