"""The shard store's manifest: what each shard holds, its size and checksum.

A store directory holds ``manifest.json``, ``config.json``, a ``tokenizer/`` folder and one
safetensors file per module (``embed``, ``layer.N``, ``norm``, ``lm_head``). The manifest is the
only source of truth for a tensor's scheme: nothing is guessed from file names.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path

from airquant.errors import ChecksumError, StoreError
from airquant.layout import group_order

FORMAT_VERSION = 1
MANIFEST = "manifest.json"
_HASH_CHUNK = 16 << 20


@dataclass
class ShardEntry:
    group: str  # embed | layer.N | norm | lm_head
    file: str
    bytes: int
    sha256: str
    tensors: dict[str, dict]  # name -> {"dtype", "shape", "scheme"}
    modules: dict[str, dict] = field(default_factory=dict)  # quantized module -> scheme meta
    # Mixture-of-Experts layers: {"num", "top_k", "tensors": [...], "ranges": [[[start, end], ...] per expert]},
    # byte ranges inside the shard's data section (what an expert-aware reader fetches alone).
    experts: dict = field(default_factory=dict)

    @property
    def is_layer(self) -> bool:
        return self.group.startswith("layer.")


@dataclass
class Manifest:
    source: dict  # {"spec", "kind", "model_type", "name"}
    dtype: str
    quant: dict  # {"method": "none"} or the QuantSpec as a dict
    num_layers: int
    tied_lm_head: bool
    shards: dict[str, ShardEntry] = field(default_factory=dict)
    complete: bool = False
    synthetic: bool = False
    layout: dict | None = None  # airquant.layout.Layout; None: the Llama layout of older stores
    format_version: int = FORMAT_VERSION
    tool_version: str = ""

    @property
    def layer_order(self) -> list[str]:
        return group_order(self.num_layers, self.tied_lm_head)

    @property
    def total_bytes(self) -> int:
        return sum(s.bytes for s in self.shards.values())

    @property
    def layer_bytes(self) -> list[int]:
        return [self.shards[f"layer.{i}"].bytes for i in range(self.num_layers)]

    @property
    def scheme(self) -> str:
        return self.quant.get("method", "none") if self.quant.get("method") != "none" else self.dtype

    def to_json(self) -> str:
        body = asdict(self)
        body["layer_order"] = self.layer_order
        body["total_bytes"] = self.total_bytes
        return json.dumps(body, indent=1, sort_keys=False)

    @classmethod
    def from_dict(cls, data: dict) -> "Manifest":
        data = dict(data)
        data.pop("layer_order", None)
        data.pop("total_bytes", None)
        version = data.get("format_version")
        if version != FORMAT_VERSION:
            raise StoreError(f"manifest format {version} is not {FORMAT_VERSION}; re-run `airquant shard` "
                             "into a new --store with this version of AirQuant.")
        data["shards"] = {k: ShardEntry(**v) for k, v in data.get("shards", {}).items()}
        return cls(**data)


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_HASH_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Write to a temp name, fsync, rename, fsync the directory: a crash leaves old or new, never half."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save_manifest(store: Path, manifest: Manifest) -> None:
    atomic_write_bytes(store / MANIFEST, manifest.to_json().encode())


def load_manifest(store: str | Path) -> Manifest:
    store = Path(store)
    if not store.is_dir():
        raise StoreError(f"store {store} does not exist; create it with `airquant shard MODEL --store {store}`.")
    path = store / MANIFEST
    if not path.is_file():
        raise StoreError(f"{path} is missing: {store} is not an AirQuant store. "
                         f"Run `airquant shard MODEL --store {store}` first.")
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise StoreError(f"{path} is not valid JSON ({exc}); re-run `airquant shard` to rebuild it.") from exc
    return Manifest.from_dict(data)


def open_store(store: str | Path, *, verify: bool = False) -> Manifest:
    """Load a complete store's manifest and check every shard's size (and sha256 when asked)."""
    store = Path(store)
    manifest = load_manifest(store)
    if manifest.source.get("manifest_only"):
        raise StoreError(f"store {store} holds only a manifest (`airquant synth --manifest-only`): it can be "
                         "planned (`airquant plan`) but not run. Re-run the synth command without --manifest-only.")
    if not manifest.complete:
        raise StoreError(f"store {store} is incomplete (a split was interrupted); re-run the same "
                         "`airquant shard` command to finish it.")
    for entry in manifest.shards.values():
        check_shard(store, entry, verify=verify)
    return manifest


def check_shard(store: Path, entry: ShardEntry, *, verify: bool) -> None:
    path = store / entry.file
    if not path.is_file():
        raise StoreError(f"shard {path} is missing; re-run `airquant shard` on this store to restore it.")
    size = path.stat().st_size
    if size != entry.bytes:
        raise StoreError(f"shard {path} has {size} bytes, the manifest says {entry.bytes} (truncated or "
                         "replaced); re-run `airquant shard` on this store to rewrite it.")
    if verify and sha256_file(path) != entry.sha256:
        raise ChecksumError(f"shard {path} does not match its sha256 in the manifest (corrupted); "
                            "re-run `airquant shard` on this store to rewrite it.")
