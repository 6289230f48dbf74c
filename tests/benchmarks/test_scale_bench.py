"""benchmarks/scale_bench.py end to end on the CPU (--quick): both runs write every id once, and the Ray run's
time is split into generation and a fixed cost per job from the driver's own log line."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("ray")
pytest.importorskip("pyarrow")

from benchmarks.scale_bench import main  # noqa: E402


@pytest.mark.slow
def test_quick_run_splits_ray_time_into_generation_and_a_fixed_cost(tmp_path):
    assert main(["--quick", "--part", "all", "--workdir", str(tmp_path), "--results", str(tmp_path / "r")]) == 0
    r = json.loads((tmp_path / "r" / "scale_bench.json").read_text())
    assert r["plain"]["records"] == r["ray"]["records"] == r["prompts"]
    assert r["plain"]["new_tokens"] == r["ray"]["new_tokens"]  # greedy, same prompts: the same work
    ray = r["ray"]
    assert ray["engine_generate_s"] > 0 and ray["engine_open_s"] > 0 and ray["dispatch_s"] >= ray["engine_generate_s"]
    assert r["ray_fixed_overhead_s"] == pytest.approx(
        ray["wall_s"] - r["plain"]["wall_s"] - (ray["engine_generate_s"] - r["plain"]["job_s"]))
    assert r["ray_over_plain_wall"] == pytest.approx(ray["wall_s"] / r["plain"]["wall_s"])


def test_rows_of_different_sessions_are_not_compared():
    from benchmarks.scale_bench import summarize

    row = {"wall_s": 80.0, "job_s": 60.0, "useful_tok_s": 800.0}
    both = {"plain": {**row, "measured_at": "2026-12-02T02:14:00Z"},
            "ray": {**row, "wall_s": 100.0, "measured_at": "2026-12-02T02:16:00Z"}}
    summarize(both)
    assert both["ray_over_plain_wall"] == pytest.approx(1.25) and "unpaired" not in both
    mixed = {"plain": both["plain"], "ray": {**row, "wall_s": 100.0}, "ray_over_plain_wall": 1.25,
             "meets_target": False}
    summarize(mixed)  # ray from an older session, plain re-run alone
    assert "ray_over_plain_wall" not in mixed and "meets_target" not in mixed and "not one session" in mixed["unpaired"]
    apart = {"plain": both["plain"], "ray": {**both["ray"], "measured_at": "2026-12-01T20:00:00Z"}}
    summarize(apart)
    assert "ray_over_plain_wall" not in apart
