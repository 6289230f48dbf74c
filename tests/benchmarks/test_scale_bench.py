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
