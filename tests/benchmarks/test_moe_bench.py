"""benchmarks/moe_bench.py end to end on tiny MoE shapes (CPU), and the hub-named checkpoint AirLLM reads."""

import json

import torch
from safetensors import safe_open

from airquant.engine.moe.compute import GEMV_TOKENS
from airquant.engine.runner import Engine
from airquant.store.export import export_hf
from airquant.store.synth import SynthSpec, synth
from benchmarks.moe_bench import QUICK, main, merge_rows

CASES = {(f"{m} nf4", 4.0, n) for m in ("mixtral-8x7b", "qwen3-30b-a3b") for n in (1, 2)}  # --quick: one cap


def test_quick_run_records_every_case(tmp_path, real_tokenizer, monkeypatch):
    from benchmarks import stream_bench

    monkeypatch.setattr(stream_bench, "PROFILED", False)  # in process: no trace of another test counts
    work, out = tmp_path / "work", tmp_path / "results"
    assert main(["--quick", "--workdir", str(work), "--results", str(out), "--trace", "nocache",
                 "--trace-dir", str(tmp_path / "traces")]) == 0
    r = json.loads((out / "moe_bench.json").read_text())
    assert r["synthetic"] and r["quick"] and r["link_pinned_gbps"] > 0
    assert CASES <= {(x["model"], x["cap_gb"], x["batch"]) for x in r["whole_layer"]}
    for row in r["whole_layer"]:
        assert row["error"] is None and row["step_s"] > 0 and row["effective_gbps"] > 0 and row["link_fraction"] > 0
        assert {"peak_allocated_gb", "peak_reserved_gb", "bytes_per_step", "kv_offload"} <= set(row)
    for shape, key in (("mixtral-8x7b", "mixtral_nf4"), ("qwen3-30b-a3b", "qwen3_30b_a3b_nf4")):
        assert r[f"{key}_bs1_link_fraction"] > 0
        # every layer streamed: a step moves exactly the layers' bytes, which --manifest-only predicts
        twin = synth(SynthSpec(shape, "nf4", layers=2, overrides=QUICK[shape]), tmp_path / shape, manifest_only=True,
                     tokenizer=real_tokenizer, progress=False)
        moved = {x["bytes_per_step"] for x in r["whole_layer"] if x["model"] == f"{shape} nf4"}
        assert moved == {sum(twin.layer_bytes)}
    modes = {x["case"]: (x["experts_asked"], x["experts_mode"]) for x in r["expert_aware"]
             if x["model"] == "mixtral-8x7b nf4"}
    # forced routed stays routed at a large batch; the default (auto) streams whole layers there (2 of 8 at batch 8)
    assert modes["lfu_bs256"] == ("routed", "routed") and modes["auto_bs256"] == ("auto", "whole")
    # the router's largest batches, planned: of all (the cache offloaded where that allows more), on the device
    top = {x["case"]: x for x in r["expert_aware"] if x["case"] in ("max_batch", "max_batch_device")}
    assert all(x["error"] is None and x["router_max_batch"] >= 1 and x["experts_asked"] == "auto" for x in top.values())
    assert top["max_batch"]["router_max_batch"] >= top["max_batch_device"]["router_max_batch"]
    assert top["max_batch_device"]["kv_offload"] is False
    assert r["mixtral_nf4_max_batch_tok_s"] == max(x["tok_s"] for x in top.values())  # the faster of the two
    # the A/B of the few-row path: lfu_stacked is lfu with expert_compute.GEMV_TOKENS = 0, both models
    ab = {(x["model"], x["case"]): x for x in r["expert_aware"] if x["case"] in ("lfu", "lfu_stacked")}
    assert len(ab) == 4 and all(x["error"] is None and x["step_s"] > 0 for x in ab.values())
    assert all(0 < x["host_s"] <= x["step_s"] for x in ab.values())  # the host's untraced time to queue a step
    assert {(c, x["gemv_tokens"], x["settings"].get("gemv_tokens")) for (_, c), x in ab.items()} == {
        ("lfu", GEMV_TOKENS, None), ("lfu_stacked", 0, 0)}
    # the host path (issue 37): its figures measured in the same run, its rows at batch 1, 4 and 16 (16 runs at 8
    # here) in both routed parts, every one computed on the host; auto's row and the ratio to the faster path
    assert r["host_gemv_gbps"] > 0 and r["host_memcpy_gbps"] > 0 and r["host_gemv_over_memcpy"] > 0
    host = {(x["model"], x["case"]): x for x in r["expert_aware"] if x["case"] in ("cpu_bs1", "cpu_bs4", "cpu_bs16")}
    assert len(host) == 6 and all(x["error"] is None and x["experts_mode"] == "cpu" and x["tok_s"] > 0
                                  and x["experts"]["calls"] > 0 for x in host.values())
    assert r["qwen3_30b_nf4_bs1_cpu_experts_tok_s"] > 0 and r["mixtral_nf4_bs1_cpu_experts_tok_s"] > 0
    assert r["qwen3_30b_nf4_bs1_auto_over_best"] == r["qwen3_30b_nf4_bs1_auto_tok_s"] / max(
        r["qwen3_30b_nf4_bs1_cpu_experts_tok_s"], r["qwen3_30b_nf4_bs1_tok_s"])
    traced = [x for x in r["expert_aware"] if x.get("trace")]  # --trace nocache: that case only, both models
    assert {x["case"] for x in traced} == {"nocache"} and all(x["trace"]["top_host"] for x in traced)
    assert len(list((tmp_path / "traces").glob("*nocache.json.gz"))) == len(traced)  # one timeline per traced case
    # a part traces after every row of it is timed (the profiler slows what runs after it): the first routed part's
    # rows, its whole-layer row among them, ran before any profile; the second part's after the first's trace
    first, second = ({x["case"] for x in r["expert_aware"] if x["model"] == m and x["after_profiler"] is after}
                     for m, after in (("mixtral-8x7b nf4", False), ("qwen3-30b-a3b nf4", True)))
    assert "nocache" in first and "max_batch" in first and "nocache" in second
    assert not [x for x in r["expert_aware"] if x["model"] == "mixtral-8x7b nf4" and x["after_profiler"]]
    assert [x["after_profiler"] for x in r["whole_layer"] if x["model"] == "mixtral-8x7b nf4"].count(False) == 3
    air = r["details"]["airllm"]
    assert air["layers"] == 2 and air["airquant_bf16"]["per_layer_s"] > 0 and air["airquant_nf4"]["per_layer_s"] > 0
    # AirLLM gives a time (and a ratio) or the error it stopped with, never neither
    assert (r["airllm_over_airquant_mixtral"] is None) == (r["airllm_error"] is not None)
    assert not [p for p in work.iterdir() if p.name != "results"]  # stores and the exported folder are dropped


def test_exported_mixtral_checkpoint_has_the_hub_names_and_the_same_model(tmp_path, real_tokenizer):
    from transformers import AutoModelForCausalLM

    store = tmp_path / "s"
    synth(SynthSpec("mixtral-8x7b", layers=2, overrides=QUICK["mixtral-8x7b"]), store, tokenizer=real_tokenizer,
          progress=False)
    folder = export_hf(store, tmp_path / "hf")
    index = json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"]
    assert "model.layers.1.block_sparse_moe.experts.7.w1.weight" in index and "model.norm.weight" in index
    assert not [k for k in index if "gate_up_proj" in k or "mlp.experts" in k]  # per expert, as Mixtral is published
    with safe_open(folder / index["model.layers.0.block_sparse_moe.experts.3.w2.weight"], "pt") as f:
        assert f.get_slice("model.layers.0.block_sparse_moe.experts.3.w2.weight").get_shape() == [128, 256]
    engine = Engine.open(store, device="cpu", dtype="float32")
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    enc = engine.encode(["A quick test of the exported experts"])
    with torch.no_grad():
        want = model(**enc).logits
    torch.testing.assert_close(engine.forward(**enc), want, rtol=1e-4, atol=1e-4)


def test_a_rerun_replaces_its_cases_and_keeps_the_others():
    row = lambda model, cap, batch, step: {"model": model, "cap_gb": cap, "batch": batch, "step_s": step}  # noqa: E731
    old = [row("m", 15.0, 1, 1.0), row("m", 4.0, 1, 2.0), row("q", 15.0, 1, 3.0)]
    merged = merge_rows(old, [row("m", 4.0, 1, 0.5), row("m", 4.0, 64, 0.7)])
    assert merged == [row("m", 15.0, 1, 1.0), row("q", 15.0, 1, 3.0), row("m", 4.0, 1, 0.5), row("m", 4.0, 64, 0.7)]
    cases = [{**row("m", 15.0, 256, 1.0), "case": "lfu_bs256"}, {**row("m", 15.0, 256, 2.0), "case": "auto_bs256"}]
    rerun = {**row("m", 15.0, 256, 3.0), "case": "auto_bs256"}
    assert merge_rows(cases, [rerun]) == [cases[0], rerun]  # same model, cap and batch, another case: kept


def test_a_target_its_case_could_not_measure_says_why_in_the_results_table():
    from airquant.eval.benchtables import _targets
    from benchmarks.moe_bench import unmeasured_why

    oom = "OutOfMemoryError: CUDA out of memory. Tried to allocate 672.00 MiB."
    results = {"expert_aware": [{"model": "mixtral-8x7b nf4", "case": "lfu_bs256", "error": oom}]}
    assert unmeasured_why(results, "mixtral_nf4_bs256_tok_s") == oom
    assert unmeasured_why(results, "qwen3_30b_nf4_bs1_tok_s") == "its case has not run"
    table = "\n".join(_targets({"targets": {"mixtral_nf4_bs256_tok_s": {
        "value": None, "target": 500, "kind": "min", "met": None, "why": oom}}}))
    assert "not measured: OutOfMemoryError" in table and "MISSED" not in table


def test_a_case_past_its_timeout_records_why_and_closes_its_engine(monkeypatch):
    """``--case-timeout``: a case still running when it expires gets ``CaseTimeout`` as its row's error (the part
    goes on), and its engine is closed; without a limit nothing fires."""
    import time
    from types import SimpleNamespace

    import pytest

    from benchmarks import moe_bench

    closed = []
    engine = SimpleNamespace(close=lambda: closed.append(1), experts=None)
    monkeypatch.setattr(moe_bench, "open_engine", lambda *a, **k: engine)
    monkeypatch.setattr(moe_bench, "decode_step", lambda *a, **k: time.sleep(5))
    args = SimpleNamespace(prompt_len=8, steps=2, trace=None, case_timeout=0.2, tiered=None)
    b = SimpleNamespace(args=args, results={})
    start = time.perf_counter()
    row = moe_bench.measure(b, None, "m nf4", 4.0, 1, "nocache", experts="routed")
    assert time.perf_counter() - start < 4
    assert row["error"].startswith("CaseTimeout: the case ran past --case-timeout 0.2 s") and closed == [1]
    with moe_bench.deadline(0):  # no limit
        time.sleep(0.01)
    with pytest.raises(moe_bench.CaseTimeout), moe_bench.deadline(0.05):
        time.sleep(1)


def test_auto_over_best_pairs_rows_of_one_run_only():
    """auto's ratio to the faster of the host and GPU rows is taken only from rows of one run: another run's
    machine may be faster or slower. The last run that had all three is kept (``details.auto_over_best``), so a
    later run re-measuring one row alone leaves that run's pairing; never paired, the key is absent and says why."""
    from benchmarks.moe_bench import auto_over_best, unmeasured_why

    def rows(runs: dict, gpu: float = 40.0) -> dict:
        speeds = {"auto_bs1": 30.0, "cpu_bs1": 3.0, "lfu_direct_r1": gpu}
        return {("qwen3-30b-a3b nf4", case): {"model": "qwen3-30b-a3b nf4", "case": case, "tok_s": speeds[case],
                                              "run": runs.get(case)} for case in speeds}

    r = {}
    auto_over_best(r, rows({"auto_bs1": "A", "cpu_bs1": "A", "lfu_direct_r1": "A"}))
    assert r["qwen3_30b_nf4_bs1_auto_over_best"] == 30.0 / 40.0
    assert r["details"]["auto_over_best"] == {"run": "A", "device": None, "auto_bs1_tok_s": 30.0, "cpu_bs1_tok_s": 3.0,
                                              "lfu_direct_r1_tok_s": 40.0, "value": 30.0 / 40.0}
    auto_over_best(r, rows({"auto_bs1": "A", "cpu_bs1": "A", "lfu_direct_r1": "B"}, gpu=60.0))
    assert r["qwen3_30b_nf4_bs1_auto_over_best"] == 30.0 / 40.0 and "auto_over_best_missing" not in r
    fresh = {}
    auto_over_best(fresh, rows({"auto_bs1": "A", "cpu_bs1": "A", "lfu_direct_r1": "B"}))
    assert "qwen3_30b_nf4_bs1_auto_over_best" not in fresh
    why = unmeasured_why({**fresh, "expert_aware": []}, "qwen3_30b_nf4_bs1_auto_over_best")
    assert "different runs" in why and "lfu_direct_r1: B" in why
    auto_over_best(fresh, rows({}))  # rows from before runs were stamped
    assert "qwen3_30b_nf4_bs1_auto_over_best" not in fresh and "unstamped" in fresh["auto_over_best_missing"]


def test_the_host_part_records_the_cpu_and_its_thread_scaling(tmp_path):
    """``--part host``: the GEMV and copy on all threads (the keys auto weighs), on one and on half of them, and
    what the CPU is (whether a GEMV short of the copy is bound per core)."""
    assert main(["--quick", "--part", "host", "--results", str(tmp_path)]) == 0
    out = json.loads((tmp_path / "moe_bench.json").read_text())
    host = out["details"]["host"]
    assert out["host_gemv_gbps"] > 0 and out["host_memcpy_gbps"] > 0
    assert host["gemv_gbps_1_thread"] > 0 and host["gemv_gbps_half_threads"] > 0
    assert host["half_threads"] == max(1, host["threads"] // 2)
    assert host["logical_cpus"] >= host["physical_cores"] >= 1 and "cpu_model" in host


def test_the_cache_speedup_pairs_rows_whose_dense_parts_sit_alike():
    """The cached row streams its dense parts (the planner gives the hot set their room), the default no-cache row
    keeps them (a fixed cache size): the speedup is set against the no-cache row that streams them too, of the
    same run, so the pair differs by the cache alone; without such a row, the default one."""
    from benchmarks.moe_bench import nocache_like

    model = "qwen3-30b-a3b nf4"
    row = lambda case, dense, run="a": {"case": case, "dense_resident_gb": dense, "run": run}  # noqa: E731
    cached = row("lfu_direct_r1", 0.0)
    rows = {(model, "nocache_direct"): row("nocache_direct", 0.54),
            (model, "nocache_direct_streamdense"): row("nocache_direct_streamdense", 0.0)}
    assert nocache_like(rows, model, cached)["case"] == "nocache_direct_streamdense"
    assert nocache_like(rows, model, row("lfu_direct_r1", 0.54))["case"] == "nocache_direct"
    rows[(model, "nocache_direct_streamdense")]["run"] = "b"  # another run's row is not paired
    assert nocache_like(rows, model, cached)["case"] == "nocache_direct"
    assert nocache_like(rows, model, {"case": "lfu_direct_r1"})["case"] == "nocache_direct"  # rows before the field


def _routed(model: str, case: str, run: str, tok_s: float) -> dict:
    return {"model": model, "case": case, "run": run, "tok_s": tok_s, "step_s": 1 / tok_s, "error": None,
            "device": "gpu"}


def test_the_no_cache_floor_reads_the_newest_run_of_the_default_path():
    from benchmarks.moe_bench import target_row

    m = "mixtral-8x7b nf4"
    rows = {(m, c): _routed(m, c, run, t) for c, run, t in (
        ("nocache_direct", "2026-12-06T06:06:51", 6.2), ("nocache_direct_huge", "2026-12-06T06:06:51", 6.8),
        ("nocache", "2026-12-06T04:38:10", 5.3))}
    key = "mixtral_nf4_bs1_step_over_bytes_floor"
    assert target_row(rows, key)["case"] == "nocache_direct_huge"  # same run: the huge-page (default) row first
    rows[(m, "nocache_direct")] = _routed(m, "nocache_direct", "2026-12-07T01:00:00", 6.9)
    assert target_row(rows, key)["case"] == "nocache_direct"  # a later run of the default case
    assert target_row(rows, "mixtral_nf4_bs1_tok_s") is None  # other keys keep their case order


def test_the_default_path_keys_read_rows_on_the_default_norms(monkeypatch):
    from airquant.engine import norms
    from benchmarks.moe_bench import ran_with, target_row

    m = "qwen3-30b-a3b nf4"
    eager = _routed(m, "lfu_direct_r1", "2026-12-06T09:06:53", 50.5)  # before the field: transformers' norms
    fused = {**_routed(m, "lfu_direct_r1_fusednorm", "2026-12-06T09:06:02", 53.8), "settings": {"fused_norm": True}}
    rows = {(m, "lfu_direct_r1"): eager, (m, "lfu_direct_r1_fusednorm"): fused}
    assert (ran_with(eager, "norms", "fused_norm"), ran_with(fused, "norms", "fused_norm")) == ("eager", "fused")
    key = "qwen3_30b_nf4_bs1_tok_s"
    monkeypatch.setattr(norms, "FUSED_RMS_NORM", True)
    assert target_row(rows, key) is fused
    later = {**_routed(m, "lfu_direct_r1", "2026-12-07T01:00:00", 55.0), "norms": "fused"}  # the default now
    rows[(m, "lfu_direct_r1")] = later
    assert target_row(rows, key) is later  # both on the default norms: the newest run's (NEWEST, since wave3_moe25)
    del rows[(m, "lfu_direct_r1_fusednorm")]
    assert target_row(rows, key) is later
    monkeypatch.setattr(norms, "FUSED_RMS_NORM", False)  # no row on the default norms: any row, as before
    assert target_row(rows, key) is later
    n = {(m, c): {**_routed(m, c, "2026-12-06T08:58:00", t), "norms": f}
         for c, t, f in (("nocache_direct", 28.9, "eager"), ("nocache_direct_fusednorm", 30.2, "fused"))}
    assert target_row(n, "qwen3_30b_nf4_bs1_nocache_over_floor")["case"] == "nocache_direct"
    monkeypatch.setattr(norms, "FUSED_RMS_NORM", True)
    assert target_row(n, "qwen3_30b_nf4_bs1_nocache_over_floor")["case"] == "nocache_direct_fusednorm"


def test_the_default_path_keys_read_rows_on_the_default_rotary_embedding(monkeypatch):
    from airquant.engine import norms, rope
    from benchmarks.moe_bench import ran_with, target_row

    monkeypatch.setattr(norms, "FUSED_RMS_NORM", True)
    m = "qwen3-30b-a3b nf4"
    eager = {**_routed(m, "lfu_direct_r1", "2026-12-06T13:52:00", 70.7), "norms": "fused", "rope": "eager"}
    fused = {**_routed(m, "lfu_direct_r1_fusedrope", "2026-12-06T13:53:00", 74.9), "norms": "fused",
             "rope": "fused"}
    rows = {(m, "lfu_direct_r1"): eager, (m, "lfu_direct_r1_fusedrope"): fused}
    assert (ran_with(eager, "rope", "fused_rope"), ran_with(fused, "rope", "fused_rope")) == ("eager", "fused")
    assert ran_with({"settings": {"fused_rope": True}}, "rope", "fused_rope") == "fused"  # rows before the field
    assert ran_with({}, "rope", "fused_rope") == "eager"
    key = "qwen3_30b_nf4_bs1_tok_s"
    monkeypatch.setattr(rope, "FUSED_ROPE", True)
    assert target_row(rows, key) is fused
    later = {**eager, "run": "2026-12-07T01:00:00"}  # a later run, but on transformers' rotary embedding
    rows[(m, "lfu_direct_r1")] = later
    assert target_row(rows, key) is fused
    monkeypatch.setattr(rope, "FUSED_ROPE", False)
    assert target_row(rows, key) is later
    del rows[(m, "lfu_direct_r1")]
    assert target_row(rows, key) is fused  # no row on the default: any row, as before
