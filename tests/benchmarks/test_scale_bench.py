"""benchmarks/scale_bench.py end to end on the CPU (--quick): both runs write every id once, and the Ray run's
time is split into generation and a fixed cost per job from the driver's own log line; the multi part runs 1 and 2
CPU engines, its efficiency comes from its rows, and RESULTS.md shows it (or that it has not run)."""

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


@pytest.mark.slow
def test_quick_multi_part_runs_one_and_two_engines_and_reports_their_scaling(tmp_path):
    from airquant.eval.benchtables import scale_bench

    assert main(["--quick", "--part", "store", "multi", "--workdir", str(tmp_path),
                 "--results", str(tmp_path / "r")]) == 0
    m = json.loads((tmp_path / "r" / "scale_bench.json").read_text())["multi"]
    assert m["quick"] is True and m["engines"] == 2 and m["gpus_per_engine"] == 0 and set(m["runs"]) == {"1", "2"}
    one, two = m["runs"]["1"], m["runs"]["2"]
    for k in ("1", "2"):  # each output holds every prompt's id exactly once
        ids = [json.loads(line)["id"] for line in (tmp_path / f"out-multi-{k}.jsonl").read_text().splitlines()]
        assert sorted(ids) == list(range(m["prompts"]))
        assert m["runs"][k]["measured_at"] and m["runs"][k]["engine_generate_s"] > 0
    assert one["new_tokens"] == two["new_tokens"] == m["prompts"] * m["max_new_tokens"]
    assert m["scaling_efficiency"] == pytest.approx(two["useful_tok_s"] / (2 * one["useful_tok_s"]))
    assert m["generation_scaling_efficiency"] == pytest.approx(
        (two["new_tokens"] / two["engine_generate_s"]) / (one["new_tokens"] / one["engine_generate_s"]))
    assert m["meets_target"] is None  # a CPU run is not a measurement
    ram = m["host_ram"]
    assert ram["method"].startswith("planned, not measured") and ram["engines"] == 2
    assert ram["per_engine_bytes"] > 0 and ram["total_bytes"] == 2 * ram["per_engine_bytes"]
    assert ram["verdict"] == ("fits" if ram["total_bytes"] <= ram["machine_available_bytes"] else "does not fit")
    assert "needs a machine of 2 or more GPUs" in m["link"]["skipped"]
    text = "\n".join(scale_bench({"multi": m}))
    assert f"**{m['scaling_efficiency']:.3f}**" in text and "target ≥ 0.9: quick run" in text
    assert "QUICK RUN" in text and "| 2 |" in text and "not run" not in text


def test_multi_summary_pairs_rows_of_one_session_and_the_report_says_when_absent():
    from airquant.eval.benchtables import scale_bench
    from benchmarks.scale_bench import summarize_multi

    row = {"new_tokens": 1000, "measured_at": "2026-12-02T02:14:00Z"}
    m = {"engines": 2, "runs": {"1": {**row, "useful_tok_s": 100.0, "engine_generate_s": 8.0},
                                "2": {**row, "useful_tok_s": 190.0, "engine_generate_s": 8.4}}}
    summarize_multi(m)
    assert m["scaling_efficiency"] == pytest.approx(0.95) and m["meets_target"] is True
    assert m["generation_scaling_efficiency"] == pytest.approx(8.0 / 8.4)
    m["runs"]["2"]["measured_at"] = "2026-12-01T20:00:00Z"  # re-run alone in another session
    summarize_multi(m)
    assert "scaling_efficiency" not in m and "meets_target" not in m and "run again" in m["unpaired"]
    assert "not run: needs a machine of several GPUs" in "\n".join(scale_bench({}))


def test_link_threads_copy_at_once_and_a_failing_device_stops_them_all():
    from benchmarks.scale_machine import copy_seconds, link_per_device

    link = link_per_device(["cpu", "cpu:0"], nbytes=1 << 20, repeats=3)  # two threads: a test of the flow
    assert set(link["per_device"]) == {"cpu", "cpu:0"} and link["kind"] == "cpu_memcpy"
    for r in link["per_device"].values():
        assert r["alone_gbps"] > 0 and r["together_over_alone"] == pytest.approx(r["together_gbps"] / r["alone_gbps"])
    assert len(copy_seconds(["cpu", "cpu:0"], 1 << 16, 4)["cpu"]) == 4
    with pytest.raises(Exception, match="(?i)cuda|device|torch not compiled"):
        copy_seconds(["cpu", "no-such-device:0"], 1 << 16, 2)  # the other thread must not wait on the barrier


@pytest.mark.gpu
def test_pinned_link_per_gpu_alone_and_together():
    import torch

    from benchmarks.scale_machine import link_per_device

    gpus = [f"cuda:{i}" for i in range(torch.cuda.device_count())]
    link = link_per_device(gpus, nbytes=64 << 20, repeats=3)
    assert link["kind"] == "h2d_pinned" and set(link["per_device"]) == set(gpus)
    assert all(r["together_gbps"] > 0 and r["alone_gbps"] > 0 for r in link["per_device"].values())
