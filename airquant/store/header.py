"""A shard's safetensors header, read and checked before any of its bytes are trusted.

A safetensors file is an 8-byte little-endian header length, that many bytes of JSON (each tensor's
dtype, shape and ``[start, end)`` in the data section), then the data section. ``open_store`` reads
every shard's header through ``read_header``, so a damaged or crafted one (a length of 2^62, a dtype
no reader knows, offsets past the end of the file) is a ``StoreError`` naming the shard and the fix
before the engine reads it, not a MemoryError or KeyError in the middle of a run.
"""

from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass
from pathlib import Path

import torch

from airquant.errors import StoreError

ST_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool, "U16": torch.uint16, "U32": torch.uint32, "U64": torch.uint64,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}
# The safetensors library refuses headers above 100 MB; a store's largest (a MoE layer's hundreds of
# expert tensors) is a few hundred KB.
MAX_HEADER_BYTES = 100_000_000

TensorSpan = tuple[str, torch.dtype, tuple[int, ...], int, int]  # name, dtype, shape, start, end


@dataclass(frozen=True)
class ShardHeader:
    data_offset: int  # where the data section starts in the file
    tensors: tuple[TensorSpan, ...]  # sorted by start

    @property
    def nbytes(self) -> int:
        return max((t[4] for t in self.tensors), default=0)


def read_header(path: Path, fix: str = "re-run `airquant shard` on this store") -> ShardHeader:
    """The checked header of shard ``path``; ``StoreError`` naming the shard, the problem and ``fix`` otherwise."""
    def bad(problem: str) -> StoreError:
        return StoreError(f"shard {path} {problem}: it was damaged or not written by AirQuant. Fix: `{fix}` "
                          "rewrites just that shard.")

    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise bad("is truncated (no header)")
        (n,) = struct.unpack("<Q", head)
        if n > min(MAX_HEADER_BYTES, size - 8):
            raise bad(f"declares a header of {n} bytes in a file of {size}")
        try:
            header = json.loads(f.read(n))
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise bad(f"has a corrupt header ({exc})") from exc
    if not isinstance(header, dict):
        raise bad("has a header that is not a JSON object")
    header.pop("__metadata__", None)
    tensors = [_span(name, t, size - 8 - n, bad) for name, t in header.items()]
    return ShardHeader(data_offset=8 + n, tensors=tuple(sorted(tensors, key=lambda t: t[3])))


def _span(name: str, t, data_bytes: int, bad) -> TensorSpan:
    if not isinstance(t, dict) or t.get("dtype") not in ST_DTYPES:
        dtype = t.get("dtype") if isinstance(t, dict) else t
        raise bad(f"gives tensor {name!r} the dtype {dtype!r}, not one of {', '.join(ST_DTYPES)}")
    shape, offsets = t.get("shape"), t.get("data_offsets")
    if not (isinstance(shape, list) and all(isinstance(d, int) and d >= 0 for d in shape)
            and isinstance(offsets, list) and len(offsets) == 2 and all(isinstance(o, int) for o in offsets)):
        raise bad(f"gives tensor {name!r} the shape {shape!r} and offsets {offsets!r}")
    dtype = ST_DTYPES[t["dtype"]]
    start, end = offsets
    if not 0 <= start <= end <= data_bytes or end - start != math.prod(shape) * dtype.itemsize:
        raise bad(f"places tensor {name!r} ({t['dtype']} {shape}) at bytes [{start}, {end}) of a data section of "
                  f"{data_bytes}")
    return name, dtype, tuple(shape), start, end
