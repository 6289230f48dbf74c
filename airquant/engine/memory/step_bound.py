"""How long a streamed decode step takes at least: the slowest of the byte movers its plan sets to work.

Every decode step moves each streamed layer once: the layers of the RAM tier over the host->GPU link, the layers
of the disk tier off the disk first and then over the link. The read-ahead overlaps the two, so a step takes at
least the longer of ``streamed bytes / link`` and ``disk-tier bytes / disk read speed`` (compute and the
resident layers are left out: a lower bound). A prediction from the link alone told a Colab user 0.47 tok/s
for a 70B NF4 profile that reads 20.7 GB from disk every step; from a Drive-mounted store that is minutes.
"""

from __future__ import annotations

from dataclasses import dataclass

from airquant.engine.memory.placement import StreamPlan
from airquant.units import GB

PCIE3_GBPS = 12.5  # a T4's link (PCIe 3 x16, pinned copies): what a plan for a card without one measured assumes


@dataclass(frozen=True)
class StepBound:
    link_bytes: int  # every streamed layer's bytes: RAM tier and disk tier
    disk_bytes: int  # the disk tier's bytes, read again each step
    link_gbps: float | None  # None: no link (a CPU run) or not known
    disk_gbps: float | None  # None: not measured

    @property
    def link_s(self) -> float | None:
        return self.link_bytes / (self.link_gbps * GB) if self.link_gbps and self.link_bytes else None

    @property
    def disk_s(self) -> float | None:
        return self.disk_bytes / (self.disk_gbps * GB) if self.disk_gbps and self.disk_bytes else None

    @property
    def seconds(self) -> float | None:
        """The step's lower bound (None: nothing streamed, or no speed to divide by)."""
        times = [t for t in (self.link_s, self.disk_s) if t is not None]
        return max(times) if times else None

    @property
    def bound(self) -> str:
        """Which mover sets the bound: "disk", "link", or "compute" when neither moves anything here."""
        if self.seconds is None:
            return "compute"
        return "disk" if self.disk_s == self.seconds else "link"

    def describe(self, batch: int, link_note: str = "") -> str:
        """One line: the bound, each mover's bytes and time, and the tokens/s it allows at ``batch``."""
        if self.seconds is None:
            why = "no layer is streamed" if not self.link_bytes else "no speed to divide by"
            return f"step      : {why}: a decode step is bound by compute here"
        parts = []
        if self.disk_s is not None:
            parts.append(f"disk {self.disk_bytes / GB:.2f} GB at {self.disk_gbps:.2f} GB/s = {self.disk_s:.3f} s")
        if self.link_s is not None:
            parts.append(f"link {self.link_bytes / GB:.2f} GB at {self.link_gbps:.2f} GB/s{link_note} = "
                         f"{self.link_s:.3f} s")
        return (f"step      : >= {self.seconds:.3f} s per decode step, bound by the {self.bound} "
                f"({'; '.join(parts)}): at most {batch / self.seconds:.2f} tok/s at batch {batch}")


def step_bound(plan: StreamPlan, layer_bytes: list[int], *, link_gbps: float | None,
               disk_gbps: float | None) -> StepBound:
    """The bound of ``plan``'s decode step; ``link_gbps`` None where layers go to no GPU (a CPU run)."""
    ram = sum(layer_bytes[i] for i in plan.ram_layers)
    disk = sum(layer_bytes[i] for i in plan.disk_layers)
    return StepBound(link_bytes=ram + disk, disk_bytes=disk, link_gbps=link_gbps, disk_gbps=disk_gbps)
