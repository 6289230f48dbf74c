"""Where each decoder layer lives while the model runs: VRAM, pinned host RAM, or disk.

Pure arithmetic over the manifest's byte counts and the budgets, so it is tested with tables and
printed by ``airquant plan`` before anything is loaded.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from airquant.errors import AirQuantError

Tier = Literal["vram", "ram", "disk"]
GB = 1e9


class PlanError(AirQuantError):
    """The budgets cannot hold even the minimum the engine needs."""


@dataclass(frozen=True)
class Budgets:
    vram_bytes: int | None  # None: no GPU (CPU run), layers are used from host memory directly
    ram_bytes: int
    resident_layers: int | None = None  # override of the automatic VRAM-resident count
    slots: int = 2  # device buffers for streamed layers (double buffering)
    reserve_bytes: int = 0  # activations + KV cache + workspace kept free on the device


@dataclass
class StreamPlan:
    tiers: list[Tier]
    slot_bytes: int
    slots: int
    fixed_bytes: int  # embeddings, final norm, lm_head on the device
    reasons: list[str] = field(default_factory=list)

    @property
    def vram_layers(self) -> list[int]:
        return [i for i, t in enumerate(self.tiers) if t == "vram"]

    @property
    def ram_layers(self) -> list[int]:
        return [i for i, t in enumerate(self.tiers) if t == "ram"]

    @property
    def disk_layers(self) -> list[int]:
        return [i for i, t in enumerate(self.tiers) if t == "disk"]

    def describe(self, layer_bytes: list[int]) -> str:
        def total(idx: list[int]) -> str:
            return f"{sum(layer_bytes[i] for i in idx) / GB:.2f} GB"

        lines = [
            f"layers resident in VRAM : {_ranges(self.vram_layers)} ({total(self.vram_layers)})",
            f"layers pinned in RAM    : {_ranges(self.ram_layers)} ({total(self.ram_layers)})",
            f"layers read from disk   : {_ranges(self.disk_layers)} ({total(self.disk_layers)})",
            f"device slots            : {self.slots} x {self.slot_bytes / GB:.3f} GB",
            f"embeddings/norm/lm_head : {self.fixed_bytes / GB:.3f} GB on the device",
        ]
        return "\n".join(lines + [f"why: {r}" for r in self.reasons])


def _ranges(idx: list[int]) -> str:
    if not idx:
        return "none"
    out, start, prev = [], idx[0], idx[0]
    for i in idx[1:] + [None]:
        if i is not None and i == prev + 1:
            prev = i
            continue
        out.append(f"{start}" if start == prev else f"{start}-{prev}")
        if i is not None:
            start = prev = i
    return ",".join(out)


def plan_layers(layer_bytes: list[int], fixed_bytes: int, budgets: Budgets) -> StreamPlan:
    """Place layers: as many leading layers in VRAM as the budget spares, then pinned RAM, then disk."""
    n = len(layer_bytes)
    slot = max(layer_bytes) if layer_bytes else 0
    reasons: list[str] = []
    tiers: list[Tier] = ["disk"] * n
    if budgets.vram_bytes is None:
        resident = 0
        reasons.append("no GPU: layers are used in host memory, nothing to keep in VRAM")
    else:
        floor = fixed_bytes + budgets.slots * slot + budgets.reserve_bytes
        if floor > budgets.vram_bytes:
            raise PlanError(
                f"the GPU budget {budgets.vram_bytes / GB:.2f} GB cannot hold embeddings/lm_head "
                f"({fixed_bytes / GB:.2f} GB) + {budgets.slots} layer buffers ({budgets.slots * slot / GB:.2f} GB) "
                f"+ reserve ({budgets.reserve_bytes / GB:.2f} GB) = {floor / GB:.2f} GB; raise --max-vram, "
                "use a compressed store (--quant nf4) or a smaller batch/context.")
        spare = budgets.vram_bytes - floor
        resident = _fit(layer_bytes, spare)
        reasons.append(f"VRAM {budgets.vram_bytes / GB:.2f} GB - fixed {fixed_bytes / GB:.2f} - slots "
                       f"{budgets.slots * slot / GB:.2f} - reserve {budgets.reserve_bytes / GB:.2f} leaves "
                       f"{spare / GB:.2f} GB: {resident} layer(s) fit")
        if budgets.resident_layers is not None:
            resident = min(budgets.resident_layers, n)
            reasons.append(f"resident layers set to {resident} by request")
        if resident == n:
            reasons.append("every layer fits: no streaming needed")
    for i in range(resident):
        tiers[i] = "vram"
    ram_left = budgets.ram_bytes
    for i in range(resident, n):
        if layer_bytes[i] <= ram_left:
            tiers[i] = "ram"
            ram_left -= layer_bytes[i]
    streamed = [i for i in range(resident, n)]
    in_ram = sum(1 for i in streamed if tiers[i] == "ram")
    reasons.append(f"RAM budget {budgets.ram_bytes / GB:.2f} GB holds {in_ram} of {len(streamed)} streamed layer(s)"
                   + ("" if in_ram == len(streamed) else "; the rest are read from disk with read-ahead"))
    slots = 0 if resident == n else budgets.slots
    return StreamPlan(tiers=tiers, slot_bytes=slot, slots=slots, fixed_bytes=fixed_bytes, reasons=reasons)


def _fit(layer_bytes: list[int], budget: int) -> int:
    used = 0
    for i, b in enumerate(layer_bytes):
        if used + b > budget:
            return i
        used += b
    return len(layer_bytes)
