"""Where a routed MoE layer's expert bytes are: in the layer's shard (``LayerExperts``: each expert's byte
ranges, from the manifest, and where they sit inside a pool slot; ``read_range`` for a disk-tier layer), in the
RAM tier (``HostArrangement``: arranged once, after the checked read, so that each expert is one contiguous
copy) and in the device pool (``SlotTable``: which (shard, layer, expert) key each slot holds and which to
evict, LRU or LFU with decay). ``moe.pool`` moves the bytes; this module only keeps the books.
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass
from pathlib import Path

import torch

from airquant.engine.moe.sizing import LINE, POLICY_CHOICES, ExpertsError, Policy, aligned, experts_module
from airquant.store.manifest import ShardEntry

LFU_DECAY = 0.9  # per call of the pool: a count from 32 layers (one Mixtral step) ago weighs 0.03
_DECAY_PER_TICK = -math.log(LFU_DECAY)


# -- the pool's bookkeeping ------------------------------------------------------------------------
class SlotTable:
    """Which key each slot holds, and which slot to evict: least recently used, or least frequently used
    with the counts decayed by ``LFU_DECAY`` per call (so experts hot long ago fade out).

    Eviction is a heap, not a scan: a scan of every slot per miss (a 4 GB Qwen3-30B-A3B pool has ~600 slots,
    ~3 misses a layer, 48 layers) cost ~40 ms of host time a step, more than the copies the cache saved.
    A decayed LFU count ``score * d^(tick - stamp)`` ranks slots as ``log(score) + stamp * -log(d)`` does
    (the ``tick`` term is common to all), a key fixed until the slot is touched; heap entries whose key
    is stale are dropped when they surface. Ties go to the lowest slot, as a scan's ``min`` would."""

    def __init__(self, slots: int, policy: Policy):
        if policy not in POLICY_CHOICES:
            raise ExpertsError(f"expert cache policy {policy!r} is not one of {POLICY_CHOICES}.")
        self.policy, self.tick = policy, 0
        self.key_of: list[tuple | None] = [None] * slots
        self.slot_of: dict[tuple, int] = {}
        self.score = [0.0] * slots
        self.stamp = [0] * slots
        self._empty = list(range(slots))  # a heap of the slots holding no key
        self._ranked: list[tuple[float, int]] = [(self._rank(s), s) for s in range(slots)]  # heap, lazily stale

    def lookup(self, key: tuple) -> int | None:
        return self.slot_of.get(key)

    def touch(self, slot: int) -> None:
        if self.policy == "lru":
            self.score[slot] = float(self.tick)
        else:
            self.score[slot] = self._decayed(slot) + 1.0
        self.stamp[slot] = self.tick
        self._push(slot)

    def _decayed(self, slot: int) -> float:
        return self.score[slot] * LFU_DECAY ** (self.tick - self.stamp[slot])

    def _rank(self, slot: int) -> float:
        """A key that orders slots as the policy evicts them, and does not change as ticks pass."""
        if self.policy == "lru":
            return self.score[slot]
        score = self.score[slot]
        return (math.log(score) if score > 0 else -math.inf) + self.stamp[slot] * _DECAY_PER_TICK

    def _push(self, slot: int) -> None:
        heapq.heappush(self._ranked, (self._rank(slot), slot))
        if len(self._ranked) > 4 * len(self.key_of) + 64:  # stale entries: rebuild from the live keys
            self._ranked = [(self._rank(s), s) for s in range(len(self.key_of))]
            heapq.heapify(self._ranked)

    def victim(self, keep: set[int]) -> int:
        """An empty slot, else the policy's choice among those not in ``keep``."""
        skipped = []
        while self._empty and (self.key_of[self._empty[0]] is not None or self._empty[0] in keep):
            s = heapq.heappop(self._empty)
            if self.key_of[s] is None:
                skipped.append(s)  # empty but kept by this call: still empty afterwards
        found = self._empty[0] if self._empty else None
        for s in skipped:
            heapq.heappush(self._empty, s)
        if found is not None:
            return found
        held = []
        try:
            while self._ranked:
                rank, s = self._ranked[0]
                if rank != self._rank(s):
                    heapq.heappop(self._ranked)  # stale: the slot was touched or reassigned since
                elif s in keep:
                    held.append(heapq.heappop(self._ranked))
                else:
                    return s
            raise AssertionError("every expert slot is held by the current call; the pool is undersized")
        finally:
            for entry in held:
                heapq.heappush(self._ranked, entry)

    def assign(self, slot: int, key: tuple) -> None:
        self.forget(slot)
        self.key_of[slot], self.slot_of[key] = key, slot
        self.score[slot], self.stamp[slot] = 0.0, self.tick
        self._push(slot)

    def forget(self, slot: int) -> None:
        old = self.key_of[slot]
        if old is not None:
            del self.slot_of[old]
            heapq.heappush(self._empty, slot)
        self.key_of[slot] = None


@dataclass(frozen=True)
class LayerExperts:
    """One MoE layer's experts: their tensors (names inside the block), where each expert's slices sit in
    the shard's data section, and where they sit inside a pool slot."""

    index: int
    top_k: int
    module: str  # the experts module, e.g. "mlp.experts"
    names: tuple[str, ...]  # its tensors, relative to the module ("gate_up_proj", "down_proj.absmax", ...)
    dtypes: tuple[torch.dtype, ...]
    shapes: tuple[tuple[int, ...], ...]  # per expert (the stored shape less its leading expert dim)
    dense: tuple[bool, ...]  # a dense floating tensor (cast to the compute dtype), not a quantized payload
    offsets: tuple[int, ...]  # inside a slot
    ranges: tuple[tuple[tuple[int, int], ...], ...]  # [expert][tensor] (start, end) in the data section
    key: str  # the shard's identity: a cache key never matches another store's or a rewritten shard's
    path: Path
    data_offset: int

    @classmethod
    def of(cls, index: int, entry: ShardEntry, layout, store: Path) -> "LayerExperts":
        full = tuple(entry.experts["tensors"])
        module = experts_module(full)
        specs = {name: (dtype, shape) for name, dtype, shape, _, _ in layout.tensors}
        offsets = slot_offsets(entry.experts["ranges"][0])
        return cls(index=index, top_k=int(entry.experts["top_k"]), module=module, names=tuple(n[len(module) + 1:] for n in full),
                   dtypes=tuple(specs[n][0] for n in full), shapes=tuple(tuple(specs[n][1][1:]) for n in full),
                   dense=tuple(entry.tensors[n].get("scheme", "dense") == "dense" and specs[n][0].is_floating_point
                               for n in full),
                   offsets=tuple(offsets), ranges=tuple(tuple(map(tuple, r)) for r in entry.experts["ranges"]),
                   key=f"{(store / entry.file).resolve()}:{entry.sha256}", path=layout.path,
                   data_offset=layout.data_offset)

    @property
    def full_names(self) -> tuple[str, ...]:
        return tuple(f"{self.module}.{n}" for n in self.names)

    def expert_bytes(self, e: int) -> int:
        return sum(end - start for start, end in self.ranges[e])

    def host_views(self, src: torch.Tensor | None, e: int, arranged: "HostArrangement | None" = None
                   ) -> dict[str, torch.Tensor]:
        """Expert ``e``'s tensors (names relative to the module) as typed, shaped host tensors: views into
        ``src`` (the layer's data section in host memory, uint8, in the file's order or as ``arranged``), or
        read from the shard when ``src`` is None (a disk-tier layer, or one the RAM tier has not read yet).
        The one place the host path reads the ranges. A slice whose start is not a multiple of its dtype's
        size is copied (a view must be aligned)."""
        out = {}
        base = arranged.expert_start(e) if src is not None and arranged is not None else None
        for name, dtype, shape, (start, end), off in zip(self.names, self.dtypes, self.shapes, self.ranges[e],
                                                         self.offsets):
            if base is not None:
                raw = src[base + off:base + off + end - start]
            else:
                raw = src[start:end] if src is not None else read_range(self, start, end)
            if raw.data_ptr() % dtype.itemsize:
                raw = raw.clone()
            out[name] = raw.view(dtype).view(shape)
        return out


def slot_offsets(ranges: list) -> tuple[int, ...]:
    """Where an expert's tensor slices (``ranges``: its [start, end) per tensor) sit inside a pool slot: in
    tensor order, each on an ``ALIGN`` boundary."""
    offsets, at = [], 0
    for start, end in ranges:
        offsets.append(at)
        at += aligned(end - start)
    return tuple(offsets)


@dataclass(frozen=True)
class HostArrangement:
    """A routed layer's RAM-tier bytes arranged for one copy per transfer: the tensors the layer copy carries,
    packed exactly as the device slot holds them (``[0, dense_bytes)``), then each expert's pool-slot image
    (``[expert_start(e), + image_bytes)``, one every ``stride`` bytes).

    A shard stores an MoE layer tensor-major (safetensors orders tensors by dtype, then name): an expert's
    packed weights, absmax codes and nested absmax sit in six or more places, and so did its copies (~80
    ``cudaMemcpyAsync`` a Qwen3-30B-A3B layer at batch 1, each with its slicing, more host time than the GPU
    took). The file order is kept for the read, whose checksum covers it; the bytes are arranged after the
    check, once, in the read-ahead thread."""

    file_bytes: int  # the data section as read (and checked)
    dense_runs: tuple[tuple[int, int, int], ...]  # (file start, arranged start, bytes): the layer copy's tensors
    dense_bytes: int
    expert_ranges: tuple[tuple[tuple[int, int], ...], ...]  # [expert][tensor] (start, end) in file order
    offsets: tuple[int, ...]  # each tensor's place inside an expert's image (= its pool slot's)
    image_bytes: int  # one expert's image, up to the end of its last tensor
    stride: int

    @classmethod
    def of(cls, file_bytes: int, dense_runs, dense_bytes: int, expert_ranges: list) -> "HostArrangement":
        ranges = tuple(tuple(map(tuple, r)) for r in expert_ranges)
        offsets = slot_offsets(ranges[0])
        image = offsets[-1] + ranges[0][-1][1] - ranges[0][-1][0]
        return cls(file_bytes=file_bytes, dense_runs=tuple(map(tuple, dense_runs)), dense_bytes=dense_bytes,
                   expert_ranges=ranges, offsets=offsets, image_bytes=image, stride=-(-image // LINE) * LINE)

    @property
    def experts_start(self) -> int:
        return -(-self.dense_bytes // LINE) * LINE

    @property
    def nbytes(self) -> int:
        """The host buffer the layer needs: its file's data section, read first, then arranged in place."""
        return max(self.file_bytes, self.experts_start + len(self.expert_ranges) * self.stride)

    def expert_start(self, e: int) -> int:
        return self.experts_start + e * self.stride

    def arrange(self, buf: torch.Tensor) -> None:
        """``buf`` holds the file's data section in ``[0, file_bytes)``; rewrite it in the arranged order.
        Every byte moves (a transient copy of the section is the source)."""
        src = buf[:self.file_bytes].clone()
        for start, at, n in self.dense_runs:
            buf[at:at + n].copy_(src[start:start + n])
        for e, ranges in enumerate(self.expert_ranges):
            base = self.expert_start(e)
            for (start, end), off in zip(ranges, self.offsets):
                buf[base + off:base + off + end - start].copy_(src[start:end])


def image_parts(layer: LayerExperts, down: str, image_bytes: int) -> tuple[tuple[tuple[int, int], ...], ...]:
    """An expert's image as two copies, each ((start, end), ...) inside it: the longest run of consecutive tensors
    of the ``down`` matrix (its packed weight and absmax, which a shard stores side by side), and the rest
    (the first matrix, the code books, the down matrix's small tables). What the first projection reads is all in
    the rest. No run of the down matrix: the whole image, then nothing."""
    spans = sorted((off, off + end - start, name == f"{down}_bias" or name.startswith(f"{down}."))
                   for name, off, (start, end) in zip(layer.names, layer.offsets, layer.ranges[0]))
    best, run = (0, 0), None
    for start, end, is_down in spans:
        run = (run[0] if run else start, end) if is_down else None
        if run and run[1] - run[0] > best[1] - best[0]:
            best = run
    if best == (0, 0):
        return ((0, image_bytes),), ()
    return tuple(r for r in ((0, best[0]), (best[1], image_bytes)) if r[1] > r[0]), (best,)


def read_range(layer: LayerExperts, start: int, end: int) -> torch.Tensor:
    """Bytes [start, end) of a layer's data section, read from its shard file (a disk-tier layer)."""
    buf = torch.empty(end - start, dtype=torch.uint8)
    view = memoryview(buf.numpy()).cast("B")
    with open(layer.path, "rb", buffering=0) as f:
        f.seek(layer.data_offset + start)
        got = 0
        while got < len(view):
            n = f.readinto(view[got:])
            if not n:
                raise ExpertsError(f"shard {layer.path} is truncated; re-run `airquant shard` on this store.")
            got += n
    return buf
