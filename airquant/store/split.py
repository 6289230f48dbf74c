"""One-time split of a checkpoint into one safetensors shard per module.

Atomic and resumable: each shard is written under a temp name, fsynced and renamed, then the
manifest is rewritten (``complete: false``) so an interrupted split resumes by skipping every
shard whose checksum still verifies (and so rewrites just a damaged one). Temp files of a killed
split are removed on the next run. A store that belongs to another model or setting is refused,
never overwritten.
"""

from __future__ import annotations

import hashlib
import json
import logging
import shutil
import struct
from pathlib import Path
from typing import Callable, Iterator

import torch
from safetensors.torch import save as st_save
from tqdm.auto import tqdm

from airquant import __version__
from airquant.errors import DiskSpaceError, StoreError
from airquant.layout import MoEInfo
from airquant.models import ModelSource
from airquant.quant.schemes import canonical_name
from airquant.store.files import refuse_links, remove_stale_temps, replace_folder, write_atomic
from airquant.store.integrity import checksum_bytes
from airquant.store.manifest import MANIFEST, Manifest, ShardEntry, load_manifest, save_manifest, shard_ok

log = logging.getLogger(__name__)

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
# Headroom for safetensors headers, tokenizer files and filesystem rounding.
_DISK_MARGIN = 1.02
_DISK_SLACK_BYTES = 64 << 20

# A hook that turns one group's tensors into what is stored: (tensors, modules-meta).
GroupTransform = Callable[[str, dict[str, torch.Tensor]], tuple[dict[str, torch.Tensor], dict[str, dict]]]


def shard_file(group: str) -> str:
    if group.startswith("layer."):
        return f"layer_{int(group.split('.')[1]):04d}.safetensors"
    return f"{group}.safetensors"


def _free_bytes(path: Path) -> int:
    return shutil.disk_usage(path).free


def estimate_bytes(source: ModelSource, dtype: str, bytes_per_weight: float | None = None) -> int:
    """Bytes the split will write, from tensor headers (no weights read)."""
    per = bytes_per_weight if bytes_per_weight is not None else DTYPES[dtype].itemsize
    total = 0
    for tensors in source.group_shapes().values():
        for shape in tensors.values():
            n = 1
            for d in shape:
                n *= d
            total += int(n * per)
    return total


def _store_identity(source: ModelSource) -> dict:
    spec = source.spec if source.kind in ("default", "hub") else str(source.path.resolve())
    return {"spec": spec, "kind": source.kind, "model_type": source.config.model_type,
            "name": source.name}


def _check_existing(store: Path, identity: dict, dtype: str, quant: dict) -> Manifest | None:
    if not (store / MANIFEST).is_file():
        if store.is_dir() and any(p.suffix == ".safetensors" for p in store.iterdir()):
            raise StoreError(f"{store} holds safetensors files but no manifest; choose an empty --store.")
        return None
    old = load_manifest(store)
    if old.source.get("spec") != identity["spec"] or old.dtype != dtype or not _same_quant(old.quant, quant):
        raise StoreError(
            f"{store} already holds {old.source.get('spec')} ({old.dtype}, quant {old.quant.get('method')}); "
            f"it is left untouched. Use another --store for {identity['spec']} ({dtype}, quant {quant.get('method')}).")
    return old


def _same_quant(old: dict, new: dict) -> bool:
    """Quant records compare with method aliases resolved: a store written with ``--quant keep`` resumes
    under its current name ``gguf`` (and the other way round)."""
    def canonical(q: dict) -> dict:
        return {**q, "method": canonical_name(q.get("method", "none"))}

    return canonical(old) == canonical(new)


def check_disk(store: Path, needed: int) -> None:
    """Raise ``DiskSpaceError`` unless ``store``'s disk has room for ``needed`` more bytes (with a margin)."""
    free = _free_bytes(store)
    want = int(needed * _DISK_MARGIN) + _DISK_SLACK_BYTES
    if free < want:
        raise DiskSpaceError(
            f"not enough disk space in {store}: the split needs about {want / 1e9:.2f} GB more, "
            f"{free / 1e9:.2f} GB are free. Free space or choose another --store.")


def _cast(tensors: dict[str, torch.Tensor], dtype: torch.dtype, keep: set[str]) -> dict[str, torch.Tensor]:
    """Dense float tensors to the store dtype; packed tensors and their scales (``keep``) as they are."""
    return {k: (v.to(dtype) if v.is_floating_point() and k not in keep else v).contiguous()
            for k, v in tensors.items()}


def write_shard(store: Path, group: str, tensors: dict[str, torch.Tensor], modules: dict[str, dict],
                schemes: dict[str, str], moe: MoEInfo | None = None) -> ShardEntry:
    """Serialize, hash (sha256 and the read checksum) and atomically write one shard; returns its manifest entry."""
    data = st_save(tensors, metadata={"airquant_group": group})
    file = shard_file(group)
    write_atomic(store / file, data)
    meta = {k: {"dtype": str(v.dtype).removeprefix("torch."), "shape": list(v.shape),
                "scheme": schemes.get(k, "dense")} for k, v in tensors.items()}
    experts = moe.record(tensors, data_offsets(data)) if moe is not None else {}
    return ShardEntry(group=group, file=file, bytes=len(data), sha256=hashlib.sha256(data).hexdigest(),
                      tensors=meta, modules=modules, experts=experts, checksum=checksum_bytes(data))


def data_offsets(data: bytes) -> dict[str, tuple[int, int]]:
    """Each tensor's [start, end) inside a serialized safetensors file's data section."""
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + n])
    header.pop("__metadata__", None)
    return {k: tuple(v["data_offsets"]) for k, v in header.items()}


def _finished(store: Path, manifest: Manifest) -> bool:
    """Every shard of a complete manifest is on disk and checks out, and the side files are there."""
    side = (store / "config.json").is_file() and (store / "tokenizer").is_dir()
    return side and all(shard_ok(store, e) for e in manifest.shards.values())


def _save_side_files(store: Path, source: ModelSource) -> None:
    cfg = source.clean_config()
    write_atomic(store / "config.json", json.dumps(cfg, indent=1).encode())
    gen_cfg = source.path / "generation_config.json"
    if not source.gguf_file and gen_cfg.is_file():
        write_atomic(store / "generation_config.json", gen_cfg.read_bytes())
    replace_folder(store / "tokenizer", source.tokenizer().save_pretrained)


def _timed_from_first(groups: Iterator, bar: tqdm) -> Iterator:
    """``groups``, with the bar saying what the wait before the first is, and its clock restarted after it.

    A source indexes its checkpoint before the first group (a GGUF: ~30 s on 2 cores); counted as the first
    shard's time it made the bar show ``0/32`` and then an ETA of half an hour for a minute of work."""
    bar.set_postfix_str("reading the checkpoint's index", refresh=True)
    first = next(groups, None)
    done = bar.n
    bar.reset()
    bar.n = bar.last_print_n = done
    bar.set_postfix_str("", refresh=True)
    if first is not None:
        yield first
        yield from groups


def split(source: ModelSource, store: str | Path, *, dtype: str = "bfloat16", quant: dict | None = None,
          transform: GroupTransform | None = None, bytes_per_weight: float | None = None,
          progress: bool = True) -> Manifest:
    """Split ``source`` into ``store``; resumes an interrupted split of the same source and settings."""
    if dtype not in DTYPES:
        raise StoreError(f"--dtype {dtype} is not one of {', '.join(DTYPES)}.")
    quant = quant or {"method": "none"}
    store = Path(store)
    store.mkdir(parents=True, exist_ok=True)
    refuse_links(store)
    identity = _store_identity(source)
    old = _check_existing(store, identity, dtype, quant)
    if old is not None and old.complete and _finished(store, old):
        # Nothing is rewritten, not even the side files: a finished store may be open in another process
        # (the pipeline's parallel configurations re-check the stores they share).
        log.info("store %s is complete and its shards check out: nothing to do", store)
        if old.quant != quant:  # recorded under an older name of the same scheme (`keep` for `gguf`)
            old.quant = quant
            save_manifest(store, old)
        return old
    if stale := remove_stale_temps(store):
        log.info("removed %d temp files of an interrupted split: %s", len(stale), stale[:3])
    source.check_tensors()
    manifest = Manifest(source=identity, dtype=dtype, quant=quant, num_layers=source.num_layers,
                        tied_lm_head=source.tied, tool_version=__version__, layout=source.layout.to_dict())
    keep = {g: e for g, e in (old.shards.items() if old else []) if shard_ok(store, e)}
    remaining = estimate_bytes(source, dtype, bytes_per_weight) - sum(e.bytes for e in keep.values())
    check_disk(store, max(remaining, 0))
    _save_side_files(store, source)
    manifest.shards.update(keep)
    todo = [g for g in manifest.layer_order if g not in keep]
    # The bar is closed (its line ended) before an error propagates, so the CLI prints the error on a line of its own.
    with tqdm(total=len(manifest.layer_order), initial=len(keep), desc="split", unit="shard",
              disable=not progress) as bar:
        for group, tensors in _timed_from_first(source.tensor_groups(), bar) if todo else ():
            if group in keep:
                continue
            modules: dict[str, dict] = {}
            if transform is not None:  # quantizers see the source precision, not the store dtype
                tensors, modules = transform(group, tensors)
            schemes = {f"{m}.{s}": meta["scheme"] for m, meta in modules.items() for s in meta.get("tensors", [])}
            tensors = _cast(tensors, DTYPES[dtype], keep=set(schemes))
            manifest.shards[group] = write_shard(store, group, tensors, modules, schemes, source.moe_info(group))
            save_manifest(store, manifest)
            bar.update(1)
    missing = [g for g in manifest.layer_order if g not in manifest.shards]
    if missing:
        raise StoreError(f"the source yielded no tensors for {missing}; the checkpoint is incomplete.")
    manifest.complete = True
    save_manifest(store, manifest)
    log.info("store %s: %d shards, %.1f MB", store, len(manifest.shards), manifest.total_bytes / 1e6)
    return manifest
