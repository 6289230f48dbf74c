"""Where a routed MoE layer's expert bytes are: in the layer's shard (``LayerExperts``: each expert's byte
ranges, from the manifest, and where they sit inside a pool slot; ``read_range`` for a disk-tier layer) and in
the device pool (``SlotTable``: which (shard, layer, expert) key each slot holds and which to evict, LRU or LFU
with decay). ``engine.experts`` moves the bytes; this module only keeps the books.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from airquant.engine.expert_plan import POLICY_CHOICES, ExpertsError, Policy, aligned, experts_module
from airquant.store.manifest import ShardEntry

LFU_DECAY = 0.9  # per call of the pool: a count from 32 layers (one Mixtral step) ago weighs 0.03


# -- the pool's bookkeeping ------------------------------------------------------------------------
class SlotTable:
    """Which key each slot holds, and which slot to evict: least recently used, or least frequently used
    with the counts decayed by ``LFU_DECAY`` per call (so experts hot long ago fade out)."""

    def __init__(self, slots: int, policy: Policy):
        if policy not in POLICY_CHOICES:
            raise ExpertsError(f"expert cache policy {policy!r} is not one of {POLICY_CHOICES}.")
        self.policy, self.tick = policy, 0
        self.key_of: list[tuple | None] = [None] * slots
        self.slot_of: dict[tuple, int] = {}
        self.score = [0.0] * slots
        self.stamp = [0] * slots

    def lookup(self, key: tuple) -> int | None:
        return self.slot_of.get(key)

    def touch(self, slot: int) -> None:
        if self.policy == "lru":
            self.score[slot] = float(self.tick)
        else:
            self.score[slot] = self._decayed(slot) + 1.0
        self.stamp[slot] = self.tick

    def _decayed(self, slot: int) -> float:
        return self.score[slot] * LFU_DECAY ** (self.tick - self.stamp[slot])

    def victim(self, keep: set[int]) -> int:
        """An empty slot, else the policy's choice among those not in ``keep``."""
        free = [s for s, k in enumerate(self.key_of) if k is None and s not in keep]
        if free:
            return free[0]
        rank = (lambda s: self.score[s]) if self.policy == "lru" else self._decayed
        candidates = [s for s in range(len(self.key_of)) if s not in keep]
        if not candidates:
            raise AssertionError("every expert slot is held by the current call; the pool is undersized")
        return min(candidates, key=rank)

    def assign(self, slot: int, key: tuple) -> None:
        self.forget(slot)
        self.key_of[slot], self.slot_of[key] = key, slot
        self.score[slot], self.stamp[slot] = 0.0, self.tick

    def forget(self, slot: int) -> None:
        old = self.key_of[slot]
        if old is not None:
            del self.slot_of[old]
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
        offsets, at = [], 0
        for start, end in entry.experts["ranges"][0]:
            offsets.append(at)
            at += aligned(end - start)
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
