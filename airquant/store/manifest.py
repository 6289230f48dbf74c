"""The shard store's manifest: what each shard holds, its size and checksum.

A store directory holds ``manifest.json``, ``config.json``, a ``tokenizer/`` folder and one
safetensors file per module (``embed``, ``layer.N``, ``norm``, ``lm_head``). The manifest is the
only source of truth for a tensor's scheme: nothing is guessed from file names.
"""

from __future__ import annotations

import hashlib
import json
import logging
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

from airquant.errors import ChecksumError, StoreError
from airquant.layout import group_order
from airquant.store.files import refuse_links, write_atomic
from airquant.store.header import read_header
from airquant.store.integrity import ALGO, IntegrityFix, checksum_file
from airquant.store.side_files import refuse_code

log = logging.getLogger(__name__)

FORMAT_VERSION = 1
MANIFEST = "manifest.json"
_HASH_CHUNK = 16 << 20


@dataclass
class ShardEntry:
    group: str  # embed | layer.N | norm | lm_head
    file: str
    bytes: int
    sha256: str  # of the whole file: `airquant info --verify`
    tensors: dict[str, dict]  # name -> {"dtype", "shape", "scheme"}
    modules: dict[str, dict] = field(default_factory=dict)  # quantized module -> scheme meta
    # Mixture-of-Experts layers: {"num", "top_k", "tensors": [...], "ranges": [[[start, end], ...] per expert]},
    # byte ranges inside the shard's data section (what an expert-aware reader fetches alone).
    experts: dict = field(default_factory=dict)
    # "xxh3_128:<hex>" of the whole file, checked as the engine reads it (store.integrity); "": an older
    # store: computed on each open until `airquant info --upgrade` records it.
    checksum: str = ""

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
    def from_dict(cls, data: dict, where: str = "the manifest") -> "Manifest":
        """``where``: the manifest's path, named in the errors."""
        data = dict(data)
        data.pop("layer_order", None)
        data.pop("total_bytes", None)
        version = data.get("format_version")
        if version != FORMAT_VERSION:
            raise StoreError(f"{where}: manifest format {version} is not {FORMAT_VERSION}; re-run `airquant shard` "
                             "into a new --store with this version of AirQuant.")
        known = {f.name for f in fields(ShardEntry)}
        try:
            shards = data.get("shards", {})
            for group, entry in shards.items():
                odd = sorted(set(entry) - known)
                if odd or not isinstance(entry.get("bytes"), int) or not isinstance(entry.get("file"), str):
                    raise ValueError(f"shard {group!r} has " + (f"unknown fields {odd}" if odd else
                                                                 "no integer 'bytes' or no 'file'"))
                if Path(entry["file"]).name != entry["file"]:
                    raise ValueError(f"shard {group!r} names a file outside the store: {entry['file']!r}")
            data["shards"] = {k: ShardEntry(**v) for k, v in shards.items()}
            manifest = cls(**data)
            manifest.check_groups()
            return manifest
        except (TypeError, ValueError, AttributeError) as exc:
            raise StoreError(f"{where} does not read as a manifest AirQuant wrote ({exc}); it was edited or damaged. "
                             "Re-run the `airquant shard` command that made the store to rewrite it.") from exc

    def check_groups(self) -> None:
        """A complete manifest lists a shard for each of its ``num_layers`` layers and its fixed parts."""
        if not isinstance(self.num_layers, int) or isinstance(self.num_layers, bool) or self.num_layers < 0:
            raise ValueError(f"num_layers is {self.num_layers!r}, not a count of layers")
        missing = [g for g in self.layer_order if g not in self.shards] if self.complete else []
        if missing:
            raise ValueError(f"it says num_layers {self.num_layers} and complete, but lists no shard for "
                             f"{', '.join(missing[:3])}{' ...' if len(missing) > 3 else ''}")


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_HASH_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def save_manifest(store: Path, manifest: Manifest) -> None:
    write_atomic(store / MANIFEST, manifest.to_json().encode())


def load_manifest(store: str | Path) -> Manifest:
    """The manifest of ``store``, read only (nothing in a store is written when it is read)."""
    store = Path(store)
    if not store.is_dir():
        raise StoreError(f"store {store} does not exist; create it with `airquant shard MODEL --store {store}`.")
    refuse_links(store)
    path = store / MANIFEST
    if not path.is_file():
        inside = sorted(str(d) for d in store.iterdir() if (d / MANIFEST).is_file())
        if inside:  # the folder `make run` fills holds one store per scheme
            raise StoreError(f"{store} is a folder of stores, not a store; name one of them: {', '.join(inside)}.")
        raise StoreError(f"{path} is missing: {store} is not an AirQuant store. "
                         f"Run `airquant shard MODEL --store {store}` first.")
    try:
        data = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise StoreError(f"{path} is not valid JSON ({exc}); re-run `airquant shard` to rebuild it.") from exc
    if not isinstance(data, dict):
        raise StoreError(f"{path} is not an AirQuant manifest (not a JSON object); re-run `airquant shard` to "
                         "rebuild it.")
    return Manifest.from_dict(data, str(path))


def open_store(store: str | Path, *, verify: bool = False) -> Manifest:
    """Load a complete store's manifest and check every shard's size and header (and sha256 when asked).

    Opening writes nothing: shards of an older store without a read checksum get one computed here, for
    this process (``airquant info --store STORE --upgrade`` records them)."""
    store = Path(store)
    manifest = load_manifest(store)
    if manifest.source.get("manifest_only"):
        raise StoreError(f"store {store} holds only a manifest (`airquant synth --manifest-only`): it can be "
                         "planned (`airquant plan`) but not run. Re-run the synth command without --manifest-only.")
    if not manifest.complete:
        raise StoreError(f"store {store} is incomplete (a split was interrupted); re-run the same "
                         "`airquant shard` command to finish it.")
    refuse_code(store)
    fix = repair_command(store, manifest)
    for entry in manifest.shards.values():
        check_shard(store, entry, verify=verify, fix=fix)
    check_no_extra_shards(store, manifest, fix)
    if filled := fill_checksums(store, manifest):
        log.warning("store %s: %d shards were written by an older AirQuant without a %s read checksum; computed "
                    "for this run only. `airquant info --store %s --upgrade` records them once.", store, filled,
                    ALGO, store)
    return manifest


def check_shard(store: Path, entry: ShardEntry, *, verify: bool, fix: str = "airquant shard ...") -> None:
    path = store / entry.file
    if not path.is_file():
        raise StoreError(f"shard {path} is missing ({entry.group}); `{fix}` writes it again (the others "
                         "verify and are kept).")
    size = path.stat().st_size
    if size != entry.bytes:
        raise StoreError(f"shard {path} has {size} bytes, the manifest says {entry.bytes} ({entry.group}: truncated "
                         f"or replaced); `{fix}` rewrites just that shard.")
    read_header(path, fix)
    if verify and sha256_file(path) != entry.sha256:
        raise ChecksumError(f"shard {path} does not match its sha256 in the manifest ({entry.group}: corrupted); "
                            f"`{fix}` rewrites just that shard.")


def check_no_extra_shards(store: Path, manifest: Manifest, fix: str) -> None:
    """A shard file the manifest does not list was put there by hand or by another tool: refuse to guess."""
    listed = {e.file for e in manifest.shards.values()}
    extra = sorted(p.name for p in store.glob("*.safetensors") if p.name not in listed)
    if extra:
        raise StoreError(f"store {store} holds {', '.join(extra[:5])}, which its manifest does not list (copied in "
                         "by hand, or left from another store). Move it out of the store; if the manifest is the "
                         f"damaged part, `{fix}` rebuilds it.")


def shard_ok(store: Path, entry: ShardEntry) -> bool:
    """Whether a shard file is whole and unchanged (fast checksum if recorded, else sha256): a resume keeps it."""
    path = store / entry.file
    if not path.is_file() or path.stat().st_size != entry.bytes:
        return False
    if entry.checksum:
        return checksum_file(path) == entry.checksum
    return bool(entry.sha256) and sha256_file(path) == entry.sha256


def fill_checksums(store: Path, manifest: Manifest) -> int:
    """Compute, in ``manifest`` only, the read checksum of shards written before it existed; returns how many."""
    missing = [e for e in manifest.shards.values() if not e.checksum.startswith(f"{ALGO}:")]
    for entry in missing:
        entry.checksum = checksum_file(store / entry.file)
    return len(missing)


def record_checksums(store: Path, manifest: Manifest) -> int:
    """``airquant info --upgrade``: compute and record (atomically) the read checksums an older store lacks;
    the one write into a store outside ``shard`` and ``synth``. Returns how many were recorded."""
    count = fill_checksums(store, manifest)
    if count:
        save_manifest(store, manifest)
    return count


def repair_command(store: Path, manifest: Manifest) -> str:
    """The command that rewrites a damaged shard of this store (a resume keeps every shard that verifies)."""
    src = manifest.source
    if manifest.synthetic and isinstance(src.get("synth"), dict):
        s = src["synth"]
        cmd = f"airquant synth --shape {s['shape']} --store {store}"
        method = manifest.quant.get("method")
        cmd += f" --dtype {method}" if method in ("nf4", "gptq") else ""
        cmd += f" --layers {s['layers']}" if s.get("layers") else ""
        cmd += " --dense-head" if s.get("dense_head") else ""
        return cmd + (f" --seed {s['seed']}" if s.get("seed") else "")
    cmd = f"airquant shard {src.get('spec')} --store {store} --dtype {manifest.dtype}"
    q = manifest.quant
    if q.get("method") in ("nf4", "int2", "gguf", "keep"):
        cmd += f" --quant {q['method']}"
        flags = {"nf4": ("blocksize", "double_quant"), "int2": ("group", "outliers", "calib", "error_feedback")}
        for name in flags.get(q["method"], ()):
            value = q.get(name)
            if value is True:
                cmd += f" --{name.replace('_', '-')}"
            elif value not in (None, False):
                cmd += f" --{name.replace('_', '-')} {value}"
    return cmd


def integrity_fix(store: Path, manifest: Manifest) -> IntegrityFix:
    return IntegrityFix(store, repair_command(store, manifest))
