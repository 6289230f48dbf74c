"""benchmarks/t4_profile.py --quick --part 70b on the CPU: the rows and their host-RAM breakdown."""

import json

import pytest

from benchmarks.t4_profile import main

pytest.importorskip("bitsandbytes")


def test_quick_70b_rows_break_host_ram_down(tmp_path, capsys):
    out = tmp_path / "t4.json"
    assert main(["--quick", "--part", "70b", "--device", "cpu", "--workdir", str(tmp_path), "--out", str(out)]) == 0
    r = json.loads(out.read_text())
    warm = r["details"]["70b"]["warmup"]
    assert warm["store"] == "warm-llama3-70b-nf4-2l" and warm["rss_after_gb"] > 0
    for batch in ("1", "32"):
        row = r["details"]["70b"]["by_batch"][batch]
        h = row["host_ram"]
        assert set(h["planned_gb"]) == {"embedding", "staging", "ram_tier", "kv_offload", "expert_staging"}
        assert h["planned_gb"]["embedding"] > 0 and h["planned_gb"]["ram_tier"] > 0  # --host-embedding, RAM tier
        for part, held in h["held_gb"].items():  # the engine holds no more than the plan counted
            assert held <= h["planned_gb"].get(part, 0.0), part
        assert h["peak_gb"] == pytest.approx(row["peak_host_ram_gb"])
        assert h["unplanned_gb"] == pytest.approx(h["peak_gb"] - h["rss_at_budget_gb"] - h["planned_total_gb"])
        assert list(h["marks_gb"]) == ["budget (resident_layers=None)", "opened", "stepped"]
        parts = h["peak_parts_gb"]
        assert parts["rss"] == pytest.approx(h["peak_gb"], abs=1e-3)
        assert parts["anon"] + parts["file"] + parts["shmem"] == pytest.approx(parts["rss"], abs=1e-3)
        # The step is the slower of link and disk (the 70B profile read 20.7 GB from disk each step, left out before).
        assert row["disk_bytes_per_step"] >= 0 and row["t4_pcie3_bound"] in ("link", "disk")
        link_s, disk_s = row["bytes_per_step"] / 12.5e9, row["disk_bytes_per_step"] / (r["t4_70b_disk_gbps"] * 1e9)
        assert row["t4_pcie3_tok_s"] == pytest.approx(int(batch) / max(link_s, disk_s))
        assert row["t4_pcie3_bound"] == ("disk" if disk_s > link_s else "link")
    table = capsys.readouterr().out
    assert "host RAM bs1: peak" in table and "unplanned" in table and "t4_70b_bound_bs1_pcie3" in table
