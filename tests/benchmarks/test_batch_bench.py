"""benchmarks/batch_bench.py --quick: every part on the CPU with tiny shapes, and the windows it records."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.batch_bench import link_floor, workload

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "batch_bench.py"


def bench(tmp: Path, part: str, *extra: str) -> dict:
    out = tmp / "batch_bench.json"
    proc = subprocess.run([sys.executable, str(SCRIPT), "--quick", "--part", part, "--store", str(tmp / "s70"),
                           "--store-8b", str(tmp / "s8"), "--out", str(out), *extra],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(out.read_text()) if out.exists() else {}


@pytest.fixture(scope="module")
def store_dir(tmp_path_factory) -> Path:
    tmp = tmp_path_factory.mktemp("bb")
    bench(tmp, "build")
    assert (tmp / "s70" / "manifest.json").is_file()
    return tmp


def fresh(store_dir: Path, name: str) -> Path:
    """A results folder of its own next to the shared store (the JSON merges part by part)."""
    tmp = store_dir / name
    tmp.mkdir()
    (tmp / "s70").symlink_to(store_dir / "s70")
    return tmp


def test_whole_runs_serve_every_request_and_compare(store_dir):
    tmp = fresh(store_dir, "whole")
    bench(tmp, "static", "--seconds", "1e6")
    r = bench(tmp, "continuous", "--seconds", "1e6")
    asked = sum(q.max_new_tokens for q in workload(48, 2048, prompt_range=(8, 24), mean_new=6,
                                                                 max_new=12))
    assert (r["requests"], r["slots"]) == (48, 8)
    for p in ("static", "continuous"):
        assert r[f"{p}_stopped_by_budget"] is False
        assert r[f"{p}_requests_finished"] == r[f"{p}_requests_admitted"] == 48
        assert r[f"{p}_useful_tokens"] == asked  # every request made exactly its own max_new_tokens
        assert 0 < r[f"{p}_slot_utilization"] <= 1 and r[f"{p}_useful_tok_s"] > 0
        assert r[f"{p}_settings"]["order"] == "longest prompt first"
    assert r["static_batches_completed"] == r["static_batches_total"] == 6
    # a finished sequence's slot is taken at the next pass: fewer passes for the same tokens
    assert r["continuous_passes"] < r["static_passes"]
    assert r["slot_utilization"] == r["continuous_slot_utilization"] > r["static_slot_utilization"]
    assert r["continuous_over_static"] == pytest.approx(r["continuous_useful_tok_s"] / r["static_useful_tok_s"])
    assert "continuous_useful_tok_s / static_useful_tok_s" in r["method"]
    assert r["quick"] is True and r["device"] == "cpu"
    # where a slow pass went: the ramp's passes (before every slot decoded) and the host's queueing of a decode
    # pass, each a median over the window; the allocator's counters only on CUDA
    ramp = r["continuous_ramp_pass_median_s"]  # None where the first pass already filled every slot
    assert (ramp is None) == (r["continuous_steady_from_pass"] == 0) and (ramp is None or ramp > 0)
    assert 0 < r["continuous_decode_host_median_s"] <= r["decode_pass_median_s"]
    assert r["continuous_allocator"] is None
    again = bench(tmp, "report")
    assert again == r  # report only prints


def test_budget_stopped_run_records_its_window(store_dir):
    tmp = fresh(store_dir, "budget")
    bench(tmp, "static", "--seconds", "0")  # 0 s: the window is the first pass
    r = bench(tmp, "continuous", "--seconds", "0")
    for p in ("static", "continuous"):
        assert r[f"{p}_stopped_by_budget"] is True and r[f"{p}_budget_s"] == 0
        assert r[f"{p}_passes"] == 1 and r[f"{p}_wall_s"] > 0
        assert r[f"{p}_requests_finished"] < r["requests"]
        assert 0 <= r[f"{p}_slot_utilization"] <= 1
        assert r[f"{p}_useful_tokens"] <= r["slots"] * r[f"{p}_passes"]
        steady = r[f"{p}_steady_slot_utilization"]
        assert steady is None or 0 <= steady <= 1
        assert (r[f"{p}_steady_from_pass"] is None) == (steady is None)
    assert r["static_batches_completed"] == 0 and r["static_batches_run"] == 1
    assert "continuous_over_static" in r


def test_passes_after_the_window_are_traced(store_dir):
    """--trace-passes: that many passes of the same loop after the window, under the profiler: their kinds and
    times, the device/host breakdown and where the host waited (none on the CPU), the timeline written."""
    tmp = fresh(store_dir, "traced")
    r = bench(tmp, "continuous", "--seconds", "0", "--trace-passes", "3", "--trace-dir", str(tmp / "traces"))
    t = r["continuous_trace"]
    assert t["passes"] == len(t["kinds"]) == len(t["pass_s"]) == 3
    assert set(t["kinds"]) <= {"decode", "with prompts"} and all(s > 0 for s in t["pass_s"])
    assert t["last_pass_wall_ms"] > 0 and t["syncs"] == [] and t["top_host"]
    assert (tmp / "traces" / "continuous-passes.json.gz").is_file()
    assert r["continuous_passes"] == 1  # the window's own figures leave the traced passes out
    assert r["continuous_after_profiler"] is False  # the window ran before the profiler started


def test_ramp_passes_are_traced_inside_their_window(store_dir):
    """--trace-ramp: the window's passes 2 and 3 (prompts still being admitted) under the profiler, counted in the
    window (which says it carries the profiler), the timeline written."""
    tmp = fresh(store_dir, "ramp")
    r = bench(tmp, "continuous", "--seconds", "0", "--trace-ramp", "2", "--trace-dir", str(tmp / "traces"))
    t = r["continuous_ramp_trace"]
    assert t["passes"] == len(t["kinds"]) == 2 and "with prompts" in t["kinds"]
    assert r["continuous_ramp_traced"] == 2 and r["continuous_passes"] == 3
    assert (tmp / "traces" / "continuous-ramp.json.gz").is_file()


def test_parts_with_different_slots_give_no_ratio(store_dir):
    tmp = fresh(store_dir, "differ")
    bench(tmp, "static", "--seconds", "0", "--slots", "4")
    r = bench(tmp, "continuous", "--seconds", "0")
    assert "continuous_over_static" not in r
    assert "slots" in r["continuous_over_static_missing"]


def test_parts_of_different_cards_give_no_ratio():
    """Static and continuous measured on different cards (or static from before parts named theirs): no ratio."""
    from benchmarks.batch_bench import compare

    settings = {"slots": 24, "requests": 512}
    r = {"static_settings": settings, "continuous_settings": settings, "static_useful_tok_s": 20.0,
         "continuous_useful_tok_s": 30.0, "static_device": "H100", "continuous_device": "H100"}
    compare(r)
    assert r["continuous_over_static"] == 1.5
    r["static_device"] = "H200"
    compare(r)
    assert "continuous_over_static" not in r
    assert "device (H200 vs H100)" in r["continuous_over_static_missing"]
    del r["static_device"]
    compare(r)
    assert "device (not recorded vs H100)" in r["continuous_over_static_missing"]


def test_bs1_8b_quick(tmp_path):
    r = bench(tmp_path, "bs1_8b")
    assert r["bs1_8b_step_s"] > 0 and r["bs1_8b_bytes_per_step"] > 0 and r["bs1_link_fraction"] > 0
    assert r["bs1_8b_kv_offload_step_s"] > 0 and r["bs1_8b_kv_offload_link_fraction"] > 0
    assert "offloaded" not in r["bs1_8b_plan"]  # the target's case keeps the KV cache on the device


@pytest.mark.slow
def test_cpu_mixed_quick(tmp_path, default_store):
    r = bench(tmp_path, "cpu_mixed", "--store-default", str(default_store))
    assert (r["cpu_mixed_prompts"], r["cpu_mixed_slots"]) == (6, 3)
    for k in ("cpu_mixed_static_utilization", "cpu_mixed_continuous_utilization"):
        assert 0 < r[k] <= 1
    assert r["cpu_mixed_useful_tokens"] > 0


def test_kv_auto_records_the_planners_row_beside_plain(store_dir):
    """``--kv auto``: the throughput planner's choice runs, and its row sits beside the plain one."""
    tmp = fresh(store_dir, "auto")
    bench(tmp, "continuous", "--seconds", "1e6")
    r = bench(tmp, "continuous", "--seconds", "1e6", "--kv", "auto")
    assert r["continuous_auto_useful_tok_s"] > 0 and r["continuous_useful_tok_s"] > 0
    assert r["continuous_auto_requests_finished"] == r["requests"] == 48
    assert 1 <= r["auto_slots"] <= 8 and r["auto_kv"] in ("none", "tq") and r["auto_kv_offload"] is False
    assert r["continuous_auto_settings"]["slots"] == r["auto_slots"] and r["slots"] == 8  # plain's, untouched


def test_kv_tq_runs_the_planners_turboquant_choice(store_dir):
    """``--kv tq`` runs what ``airquant batch --kv tq`` runs: the planner's slots for the TurboQuant format."""
    tmp = fresh(store_dir, "tq")
    r = bench(tmp, "continuous", "--seconds", "1e6", "--kv", "tq")
    assert r["tq_kv"] == "tq" and 1 <= r["tq_slots"] <= 8 and r["tq_kv_offload"] is False
    assert r["tq_link_gbps"] is None and r["tq_plan_pass_s"] is None  # a CPU run: no link, pass not modelled
    assert r["continuous_tq_requests_finished"] == r["tq_requests"] == 48 and r["continuous_tq_useful_tok_s"] > 0


def test_a_pinned_placement_is_a_row_of_its_own_and_a_rerun_drops_its_old_trace(store_dir):
    """``--kv tq --no-kv-offload``: the placement pinned, the row named after it beside the planner's ``tq`` row;
    run again without ``--trace-passes``, the row keeps no trace of the earlier window."""
    tmp = fresh(store_dir, "pinned")
    r = bench(tmp, "continuous", "--seconds", "0", "--kv", "tq", "--no-kv-offload", "--trace-passes", "1")
    assert r["tq_device_kv"] == "tq" and r["tq_device_kv_offload"] is False and 1 <= r["tq_device_slots"] <= 8
    assert r["continuous_tq_device_trace"]["passes"] == 1 and "continuous_tq_settings" not in r
    r = bench(tmp, "continuous", "--seconds", "0", "--kv", "tq", "--no-kv-offload")
    assert "continuous_tq_device_trace" not in r and r["continuous_tq_device_passes"] == 1


def test_row_names_follow_the_kv_format_and_a_pinned_placement():
    from benchmarks.batch_bench import row_name

    assert [row_name(kv, None) for kv in ("none", "tq", "auto")] == ["", "tq", "auto"]
    assert [row_name(kv, True) for kv in ("none", "tq", "auto")] == ["plain_offload", "tq_offload", "auto_offload"]
    assert row_name("tq", False) == "tq_device"


def test_auto_is_set_against_every_measured_row_pinned_placements_included():
    """``auto_over_best`` over plain, the planner's TurboQuant row and the placements pinned beside it; the best
    row is named; a pinned row of another window is left out and says why."""
    from benchmarks.batch_bench import compare_kv

    stream = {"requests": 512, "context": 1466, "distribution": "d", "order": "longest prompt first"}
    r = {"slots": 24, "tq_slots": 192}
    for row, rate in (("", 33.7), ("_tq", 156.1), ("_auto", 158.6), ("_tq_device", 120.0)):
        r.update({f"continuous{row}_settings": stream, f"continuous{row}_budget_s": 200.0,
                  f"continuous{row}_useful_tok_s": rate, f"continuous{row}_device": "H200"})
    compare_kv(r)
    assert r["auto_over_best_useful_tok_s"] == 1.0 and r["auto_best_row"] == "auto"
    assert r["tq_over_plain_useful_tok_s"] == 156.1 / 33.7 and r["tq_slots_over_plain"] == 8.0
    r["continuous_tq_device_useful_tok_s"] = 200.0
    compare_kv(r)
    assert r["auto_over_best_useful_tok_s"] == 158.6 / 200.0 and r["auto_best_row"] == "tq_device"
    assert r["targets"]["auto_over_best_useful_tok_s"]["met"] is False
    r["continuous_tq_device_budget_s"] = 100.0
    compare_kv(r)
    assert r["auto_best_row"] == "auto" and "tq_device and plain ran with different window" in r["kv_ratios_missing"]
    # a file of whole jobs (no plain row): auto against the pinned row alone
    whole = {k: v for k, v in r.items() if k.startswith(("continuous_auto", "continuous_tq_device"))}
    whole["continuous_tq_device_budget_s"] = 200.0
    compare_kv(whole)
    assert whole["auto_over_best_useful_tok_s"] == 158.6 / 200.0 and "tq_over_plain_useful_tok_s" not in whole


def test_a_traced_pass_is_set_against_its_bytes_over_the_link():
    """``link_floor``: a traced pass's host-to-device bytes over the link measured before the run, and its wall over
    that; no bytes, no trace or no link (a CPU run) add nothing."""
    trace = {"last_pass_wall_ms": 1100.0, "last_pass_memcpy_htod_gb": 50.0}
    link_floor(trace, 50.0)
    assert trace["last_pass_link_floor_ms"] == 1000.0 and trace["last_pass_over_link_floor"] == pytest.approx(1.1)
    for trace, link in (({"last_pass_wall_ms": 5.0, "last_pass_memcpy_htod_gb": 0.0}, 50.0),
                        ({"last_pass_wall_ms": 5.0, "last_pass_memcpy_htod_gb": 1.0}, None)):
        link_floor(trace, link)
        assert "last_pass_over_link_floor" not in trace
    link_floor(None, 50.0)


def test_kv_rows_compare_with_plain_only_over_the_same_window():
    """The #38 ratios: TurboQuant and the planner's row over plain when they ran the same stream and window on the
    same card; a different window, or a row of another card (or one that did not record its card), gives no ratio
    and says why."""
    from benchmarks.batch_bench import compare_kv

    stream = {"requests": 512, "context": 1466, "distribution": "d", "order": "longest prompt first"}
    r = {"continuous_settings": {**stream, "slots": 24}, "slots": 24, "continuous_budget_s": 100.0,
         "continuous_useful_tok_s": 30.0, "continuous_steady_useful_tok_s": 33.0,
         "continuous_tq_settings": {**stream, "slots": 99}, "tq_slots": 99, "continuous_tq_budget_s": 100.0,
         "continuous_tq_useful_tok_s": 45.0, "continuous_tq_steady_useful_tok_s": 99.0,
         "continuous_auto_settings": {**stream, "slots": 64}, "continuous_auto_budget_s": 100.0,
         "continuous_auto_useful_tok_s": 60.0}
    r.update({f"continuous{row}_device": "H100" for row in ("", "_tq", "_auto")})
    compare_kv(r)
    assert r["tq_over_plain_useful_tok_s"] == 1.5 and r["tq_over_plain_steady_useful_tok_s"] == 3.0
    assert r["tq_slots_over_plain"] == 99 / 24 and r["auto_over_best_useful_tok_s"] == 1.0
    assert r["targets"]["tq_over_plain_useful_tok_s"]["met"] is False and r["targets"]["tq_slots_over_plain"]["met"]
    r["continuous_tq_budget_s"] = 300.0
    compare_kv(r)
    assert "tq_over_plain_useful_tok_s" not in r and "window (300.0 s vs 100.0 s)" in r["kv_ratios_missing"]
    assert r["auto_over_best_useful_tok_s"] == 1.0 and r["targets"]["tq_slots_over_plain"]["met"] is None
    r["continuous_tq_budget_s"], r["continuous_auto_device"] = 100.0, "H200"
    compare_kv(r)
    assert r["tq_over_plain_useful_tok_s"] == 1.5 and "auto_over_best_useful_tok_s" not in r
    assert "auto and plain ran with different device (H200 vs H100)" in r["kv_ratios_missing"]
    del r["continuous_auto_device"]
    compare_kv(r)
    assert "device (not recorded vs H100)" in r["kv_ratios_missing"]
    # a window that ended inside the ramp (no pass with every slot filled: no steady rate) still compares
    r["continuous_steady_useful_tok_s"] = r["continuous_tq_steady_useful_tok_s"] = None
    compare_kv(r)
    assert r["tq_over_plain_useful_tok_s"] == 1.5 and r["tq_over_plain_steady_useful_tok_s"] is None
    # a file of whole jobs has no plain row: auto against the TurboQuant row alone, on the same stream and card
    whole = {k: v for k, v in r.items() if not k.startswith(("continuous_settings", "continuous_useful",
                                                              "continuous_budget", "continuous_device"))}
    whole["continuous_auto_device"] = "H100"
    compare_kv(whole)
    assert whole["auto_over_best_useful_tok_s"] == 1.0 and "tq_over_plain_useful_tok_s" not in whole
    whole["continuous_auto_useful_tok_s"] = 36.0
    compare_kv(whole)
    assert whole["auto_over_best_useful_tok_s"] == 0.8
    assert whole["targets"]["auto_over_best_useful_tok_s"]["met"] is False
    whole["continuous_auto_settings"] = {**stream, "requests": 256, "slots": 64}
    compare_kv(whole)
    assert "auto_over_best_useful_tok_s" not in whole and "requests" in whole["kv_ratios_missing"]


def test_max_new_sets_the_clip_of_each_requests_new_tokens():
    from benchmarks.batch_bench import MAX_NEW, parse_args

    assert parse_args(["--part", "continuous"]).max_new == MAX_NEW
    assert parse_args(["--part", "continuous", "--quick"]).max_new == 12
    args = parse_args(["--part", "continuous", "--max-new", "256"])
    assert args.max_new == 256 and parse_args(["--part", "continuous", "--quick", "--max-new", "5"]).max_new == 5
    clipped = workload(128, 1000, prompt_range=args.prompt_range, mean_new=args.mean_new, max_new=args.max_new)
    assert max(r.max_new_tokens for r in clipped) == 256  # geometric, mean 150: 128 draws reach the clip
    with pytest.raises(SystemExit):
        parse_args(["--part", "continuous", "--max-new", "0"])
