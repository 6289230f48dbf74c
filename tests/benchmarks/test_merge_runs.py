"""benchmarks/merge_runs.py: device chains that each started from one committed results file fold into one file
that keeps every chain's rows, re-measured cases replaced, derived keys recomputed (never copied)."""

import json

import pytest

from benchmarks import merge_runs


def _row(model, case, step, run):
    return {"model": model, "cap_gb": 4.0, "batch": 1, "case": case, "step_s": step, "run": run}


BASE = {"link_pinned_gbps": 50.0, "expert_aware": [_row("m", "nocache", 0.2, "old"), _row("m", "lfu", 0.1, "old")],
        "profiles": {"m-nocache": {"a": 1}}, "details": {"link": {"gbps": 50.0}, "host": {"x": 1}}}


def _run(**changes):
    run = json.loads(json.dumps(BASE))
    for key, value in changes.items():
        if key in merge_runs.ROWS:
            run[key] = [r for r in run[key] if (r["model"], r["case"]) not in {(v["model"], v["case"]) for v in value}]
            run[key] += value
        elif isinstance(value, dict):
            run[key].update(value)
        else:
            run[key] = value
    return run


def test_each_run_keeps_its_rows_and_a_remeasured_case_replaces_the_old():
    a = _run(expert_aware=[_row("m", "lfu", 0.05, "A"), _row("q", "direct", 0.03, "A")],
             profiles={"q-direct": {"b": 2}}, link_pinned_gbps=55.0)
    b = _run(expert_aware=[_row("x", "cpu", 0.4, "B")], details={"host": {"x": 2}}, link_pinned_gbps=54.0)
    merged = merge_runs.fold(BASE, [a, b])
    cases = {(r["model"], r["case"]): (r["step_s"], r["run"]) for r in merged["expert_aware"]}
    assert cases == {("m", "nocache"): (0.2, "old"), ("m", "lfu"): (0.05, "A"), ("q", "direct"): (0.03, "A"),
                     ("x", "cpu"): (0.4, "B")}
    assert merged["profiles"] == {"m-nocache": {"a": 1}, "q-direct": {"b": 2}}
    assert merged["details"] == {"link": {"gbps": 50.0}, "host": {"x": 2}}
    assert merged["link_pinned_gbps"] == 54.0  # the later run's value where both changed it


def test_applying_one_run_after_the_other_would_lose_rows_which_fold_keeps():
    a = _run(expert_aware=[_row("q", "direct", 0.03, "A")])
    b = _run(expert_aware=[_row("x", "cpu", 0.4, "B")])
    assert ("q", "direct") not in {(r["model"], r["case"]) for r in b["expert_aware"]}
    assert {("q", "direct"), ("x", "cpu")} <= {(r["model"], r["case"]) for r in merge_runs.fold(BASE, [a, b])["expert_aware"]}


def test_moe_bench_files_get_their_derived_keys_from_the_merged_rows(tmp_path):
    base = tmp_path / "moe_bench.json"
    base.write_text(json.dumps(BASE))
    run = tmp_path / "run_a.json"
    row = _row("qwen3-30b-a3b nf4", "lfu_direct_r1", 0.025, "A") | {"tok_s": 40.0}
    run.write_text(json.dumps(_run(expert_aware=[row], qwen3_30b_nf4_bs1_tok_s=1.0)))
    merge_runs.main([str(base), str(run)])
    merged = json.loads(base.read_text())
    assert merged["qwen3_30b_nf4_bs1_tok_s"] == 40.0  # recomputed from the row, not the run's stale 1.0
    assert merged["targets"]["qwen3_30b_nf4_bs1_tok_s"]["met"] is True


def test_changes_only_keeps_the_runs_rows_and_keys_without_the_bases(tmp_path):
    """An A/B on another card: its rows in a file of their own, derived keys from them alone; never over the base."""
    a = _run(expert_aware=[_row("q", "direct", 0.03, "A")], link_pinned_gbps=55.0)
    b = _run(expert_aware=[_row("m", "lfu", 0.05, "B")], details={"host": {"x": 2}})
    merged = merge_runs.fold(BASE, [a, b], changes_only=True)
    assert {(r["model"], r["case"]) for r in merged["expert_aware"]} == {("q", "direct"), ("m", "lfu")}
    assert merged["link_pinned_gbps"] == 55.0 and merged["details"] == {"host": {"x": 2}}
    assert "profiles" not in merged
    b["versions"], b["synthetic"] = {"torch": "2.11"}, True  # what the runs ran on, kept though unchanged
    assert merge_runs.fold({**BASE, **{k: b[k] for k in ("versions", "synthetic")}}, [a, b], True)["versions"] == \
        {"torch": "2.11"}
    base = tmp_path / "moe_bench.json"
    base.write_text(json.dumps(BASE))
    run = tmp_path / "run_a.json"
    run.write_text(json.dumps(a))
    with pytest.raises(SystemExit) as refused:
        merge_runs.main([str(base), str(run), "--changes-only"])
    assert refused.value.code == 2
    assert json.loads(base.read_text()) == BASE
