"""The streaming state: host tiers, device slots, the copy stream and the prefetch schedule.

Each layer shard is moved as one flat byte block (the safetensors data section, read straight into
a buffer) so packed 4-bit or 2-bit layers travel exactly as stored, and one large copy runs at the
link's speed. On CUDA, copies run on a dedicated stream into pre-allocated device slots, ordered
with events: layer i+1 is in flight while layer i computes. On CPU the "device" tensors are views
into the host buffer itself.
"""

from __future__ import annotations

import json
import logging
import struct
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch

from airquant.engine.plan import StreamPlan
from airquant.errors import StoreError
from airquant.store.manifest import Manifest

log = logging.getLogger(__name__)

ST_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool, "U16": torch.uint16, "U32": torch.uint32, "U64": torch.uint64,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}


@dataclass(frozen=True)
class ShardLayout:
    """Where each tensor sits inside a shard's data section."""

    path: Path
    data_offset: int
    nbytes: int
    tensors: tuple[tuple[str, torch.dtype, tuple[int, ...], int, int], ...]  # name, dtype, shape, start, end

    def views(self, flat: torch.Tensor) -> dict[str, torch.Tensor]:
        out = {}
        for name, dtype, shape, start, end in self.tensors:
            raw = flat[start:end]
            if start % dtype.itemsize:  # safetensors sorts by alignment, so this is rare
                raw = raw.clone()
            out[name] = raw.view(dtype).view(shape)
        return out


def read_layout(path: Path) -> ShardLayout:
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise StoreError(f"shard {path} is truncated (no header); re-run `airquant shard` on this store.")
        (n,) = struct.unpack("<Q", head)
        try:
            header = json.loads(f.read(n))
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise StoreError(f"shard {path} has a corrupt header; re-run `airquant shard` on this store.") from exc
    header.pop("__metadata__", None)
    tensors = tuple(sorted(
        ((name, ST_DTYPES[t["dtype"]], tuple(t["shape"]), *t["data_offsets"]) for name, t in header.items()),
        key=lambda t: t[3]))
    nbytes = max((t[4] for t in tensors), default=0)
    return ShardLayout(path=path, data_offset=8 + n, nbytes=nbytes, tensors=tensors)


def read_into(layout: ShardLayout, flat: torch.Tensor) -> None:
    """Read a shard's data section into the first ``layout.nbytes`` of a uint8 buffer."""
    view = memoryview(flat.numpy()).cast("B")[: layout.nbytes]
    with open(layout.path, "rb", buffering=0) as f:
        f.seek(layout.data_offset)
        got = 0
        while got < layout.nbytes:
            n = f.readinto(view[got:])
            if not n:
                raise StoreError(f"shard {layout.path} is truncated ({got} of {layout.nbytes} data bytes); "
                                 "re-run `airquant shard` on this store.")
            got += n


class LayerStreamer:
    """Owns every buffer, stream, event and read-ahead future used to bring layers to the device."""

    def __init__(self, store: Path, manifest: Manifest, plan: StreamPlan, device: torch.device,
                 compute_dtype: torch.dtype, readahead: int = 2):
        self.device, self.compute_dtype, self.plan = device, compute_dtype, plan
        self.n = manifest.num_layers
        entries = [manifest.shards[f"layer.{i}"] for i in range(self.n)]
        self.layouts = [read_layout(store / e.file) for e in entries]
        self.dense = [{k for k, m in e.tensors.items() if m.get("scheme", "dense") == "dense"} for e in entries]
        self.cuda = device.type == "cuda"
        self.bytes_copied = 0
        self._host: dict[int, torch.Tensor] = {}  # RAM tier, filled once on first use
        self._vram: dict[int, dict[str, torch.Tensor]] = {}
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="airquant-read")
        self._reads: dict[int, tuple[Future, int]] = {}  # disk layer -> (future, staging index)
        self._readahead = max(1, readahead)
        size = max((l.nbytes for l in self.layouts), default=0)
        self._staging = [self._host_buffer(size) for _ in range(self._readahead + 1)] if plan.disk_layers else []
        self._staging_free = [None] * len(self._staging)  # CUDA event: staging copy finished
        self._next_staging = 0
        self.streamed = [i for i in range(self.n) if plan.tiers[i] != "vram"]
        if self.cuda:
            self._copy_stream = torch.cuda.Stream(device)
            self._slots = [torch.empty(size, dtype=torch.uint8, device=device) for _ in range(max(plan.slots, 1))]
            self._slot_free = [None] * len(self._slots)
            self._last_slot = -1
            self._inflight: dict[int, tuple[int, torch.cuda.Event]] = {}

    def _host_buffer(self, nbytes: int) -> torch.Tensor:
        # Page-locked memory is what lets host->device copies run at the link's full speed.
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=self.cuda)

    # -- host side -------------------------------------------------------------------------
    def _host_flat(self, i: int) -> tuple[torch.Tensor, int | None]:
        """The layer's bytes in host memory, and the staging index holding them (disk tier)."""
        tier = self.plan.tiers[i]
        if tier in ("ram", "vram"):
            if i not in self._host:
                buf = self._host_buffer(self.layouts[i].nbytes)
                read_into(self.layouts[i], buf)
                if tier == "vram":
                    return buf, None
                self._host[i] = buf
            return self._host[i], None
        self._schedule_reads(i)
        future, k = self._reads.pop(i)
        future.result()
        return self._staging[k], k

    def _schedule_reads(self, i: int) -> None:
        order = [j for j in self._cycle_from(i) if self.plan.tiers[j] == "disk"][: self._readahead]
        for j in order:
            if j in self._reads:
                continue
            k = self._next_staging
            self._next_staging = (k + 1) % len(self._staging)
            self._reads[j] = (self._pool.submit(self._read_staging, j, k), k)

    def _read_staging(self, j: int, k: int) -> None:
        event = self._staging_free[k]
        if event is not None:
            event.synchronize()
        read_into(self.layouts[j], self._staging[k])

    def _cycle_from(self, i: int) -> list[int]:
        return [(i + d) % self.n for d in range(self.n)]

    # -- device side -----------------------------------------------------------------------
    def fetch(self, i: int) -> dict[str, torch.Tensor]:
        """Tensors of layer i on the compute device, valid until ``release(i)``."""
        if self.plan.tiers[i] == "vram":
            if i not in self._vram:
                flat, _ = self._host_flat(i)
                self._vram[i] = self._cast(i, self.layouts[i].views(flat.to(self.device)))
            tensors = self._vram[i]
        elif not self.cuda:
            flat, _ = self._host_flat(i)
            tensors = self._cast(i, self.layouts[i].views(flat))
        else:
            self._issue_copy(i)
            slot, done = self._inflight[i]
            torch.cuda.current_stream(self.device).wait_event(done)
            tensors = self._cast(i, self.layouts[i].views(self._slots[slot]))
        self._prefetch_after(i)
        return tensors

    def release(self, i: int) -> None:
        if self.cuda and i in self._inflight:
            slot, _ = self._inflight.pop(i)
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(self.device))
            self._slot_free[slot] = event

    def _prefetch_after(self, i: int) -> None:
        if not self.streamed:
            return
        upcoming = [j for j in self._cycle_from(i)[1:] if self.plan.tiers[j] != "vram"]
        if self.cuda:
            for j in upcoming[: len(self._slots) - 1]:
                self._issue_copy(j)
        elif self.plan.disk_layers:
            self._schedule_reads(upcoming[0])

    def _issue_copy(self, i: int) -> None:
        if i in self._inflight:
            return
        held = {s for s, _ in self._inflight.values()}
        free = [s for s in range(len(self._slots)) if s not in held]
        if not free:
            return  # every slot holds a layer not yet released; issued again at its fetch
        slot = min(free, key=lambda s: (s - self._last_slot - 1) % len(self._slots))
        self._last_slot = slot
        flat, k = self._host_flat(i)
        nbytes = self.layouts[i].nbytes
        with torch.cuda.stream(self._copy_stream):
            if self._slot_free[slot] is not None:
                self._copy_stream.wait_event(self._slot_free[slot])
            self._slots[slot][:nbytes].copy_(flat[:nbytes], non_blocking=True)
            done = torch.cuda.Event()
            done.record(self._copy_stream)
        if k is not None:
            self._staging_free[k] = done
        self._inflight[i] = (slot, done)
        self.bytes_copied += nbytes

    def _cast(self, i: int, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        dense = self.dense[i]
        return {k: (v.to(self.compute_dtype) if k in dense and v.is_floating_point()
                    and v.dtype != self.compute_dtype else v) for k, v in tensors.items()}

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)
