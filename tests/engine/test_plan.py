import pytest

from airquant.engine.plan import Budgets, PlanError, plan_layers

GB = 10**9


@pytest.mark.parametrize("vram, ram, override, tiers", [
    # CPU: nothing in VRAM; RAM decides what is pinned and what is read from disk
    (None, 10 * GB, None, ["ram"] * 4),
    (None, 2 * GB, None, ["ram", "ram", "disk", "disk"]),
    (None, 0, None, ["disk"] * 4),
    # fixed 1 GB + 2 slots x 1 GB + reserve 1 GB = 4 GB floor; the rest holds leading layers
    (4 * GB, 10 * GB, None, ["ram"] * 4),
    (6 * GB, 10 * GB, None, ["vram", "vram", "ram", "ram"]),
    (6 * GB, 1 * GB, None, ["vram", "vram", "ram", "disk"]),
    (100 * GB, 0, None, ["vram"] * 4),
    (100 * GB, 10 * GB, 1, ["vram", "ram", "ram", "ram"]),
])
def test_placement_table(vram, ram, override, tiers):
    plan = plan_layers([GB] * 4, GB, Budgets(vram_bytes=vram, ram_bytes=ram, resident_layers=override,
                                             reserve_bytes=GB if vram else 0))
    assert plan.tiers == tiers
    assert plan.slot_bytes == GB
    text = plan.describe([GB] * 4)
    assert "why:" in text


def test_all_resident_needs_no_slots():
    plan = plan_layers([GB] * 2, GB, Budgets(vram_bytes=100 * GB, ram_bytes=0))
    assert plan.slots == 0 and plan.vram_layers == [0, 1]


def test_budget_below_floor_is_a_clear_error():
    with pytest.raises(PlanError, match=r"cannot hold .* raise --max-vram"):
        plan_layers([GB] * 4, GB, Budgets(vram_bytes=2 * GB, ram_bytes=0))
