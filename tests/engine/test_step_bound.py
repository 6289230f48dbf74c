"""A streamed decode step's lower bound: the slower of its link and disk bytes (engine/memory/step_bound.py)."""

from __future__ import annotations

import pytest

from airquant.engine.memory.placement import StreamPlan
from airquant.engine.memory.step_bound import step_bound

GB = 10**9


def plan(tiers: str) -> StreamPlan:
    return StreamPlan(tiers=[{"v": "vram", "r": "ram", "d": "disk"}[t] for t in tiers], slot_bytes=GB, slots=2,
                      fixed_bytes=0)


@pytest.mark.parametrize("tiers, link, disk, seconds, bound", [
    # The 70B NF4 T4 profile in small: RAM-tier bytes go over the link, disk-tier bytes off the disk and over it.
    ("vvrrdddd", 12.5, 2.0, 4 / 2.0, "disk"),
    ("vvrrdddd", 12.5, 100.0, 6 / 12.5, "link"),
    ("vvrrrrrr", 12.5, 0.1, 6 / 12.5, "link"),  # nothing on disk: a slow disk does not matter
    ("rrrr", None, 1.0, None, "compute"),  # a CPU run from RAM: no link, no disk
    ("rrdd", None, 0.5, 4.0, "disk"),  # a CPU run still reads its disk tier every step
])
def test_the_step_is_the_slowest_mover(tiers, link, disk, seconds, bound):
    b = step_bound(plan(tiers), [GB] * len(tiers), link_gbps=link, disk_gbps=disk)
    assert b.seconds == (pytest.approx(seconds) if seconds is not None else None) and b.bound == bound
    line = b.describe(batch=4)
    assert line.startswith("step      :") and (bound in line)
    if seconds:
        assert f"at most {4 / seconds:.2f} tok/s at batch 4" in line
