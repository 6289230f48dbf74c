"""RESULTS.md from a folder of rows written by hand, with known verdicts, plus foreign and broken files."""

from __future__ import annotations

import json
import re

import pytest

from airquant.errors import ResultsFileError
from airquant.eval.niah import NiahCell, NiahRow
from airquant.eval.parity import ParityRow
from airquant.eval.perf import BandwidthMeasurement, PerfRow
from airquant.eval.perplexity import PerplexityRow
from airquant.eval.report import REPORT_NAME, build_report
from airquant.eval.rouge import RougeRow
from airquant.eval.rows import RunInfo, default_row_name, row_to_dict, write_row

SMOL, BIG, SYNTH = "SmolLM2-135M-Instruct", "Llama-3.1-8B", "Llama-70B-shape"


def run(model, store, kv="none", *, synthetic=False, streamed=True, device="cuda", ts="2026-11-29T10:00:00+00:00"):
    return RunInfo(model=model, store_scheme=store, kv_scheme=kv, dtype="float16", device=device,
                   device_name="NVIDIA H200" if device == "cuda" else "cpu", synthetic=synthetic, streamed=streamed,
                   hardware={"cpu": "x"}, versions={"torch": "2.11.0", "transformers": "5.17.0", "airquant": "0.1.0"},
                   timestamp=ts)


def ppl(r, value, n=4096, max_length=1024, stride=512, data_sha="173c87a53759e020"):
    return PerplexityRow(run=r, ppl=value, mean_nll=0.0, n_tokens=n, n_scored=n - 1, n_windows=15,
                         max_length=max_length, stride=stride, limit_tokens=n, batch_size=1,
                         data_source=f"/data/wikitext2_test.raw (sha256 {data_sha})", seconds=1.0)


def rouge(r, value):
    return RougeRow(run=r, rougeL=value, rougeLsum=value + 0.05, n_samples=100, n_truncated=0, max_new_tokens=128,
                    max_length=8192, batch_size=8, chat=True, mean_prompt_tokens=900.0, mean_new_tokens=80.0,
                    instruction="x", data_source="x", seconds=1.0, samples=())


def niah(r, recall_8k, contexts=(4096, 8192)):
    cells = tuple(NiahCell(ctx, float(d), 0, ctx - 20, d / 100, "123456", "123456",
                           recall_8k if ctx == 8192 else 1.0, True) for ctx in contexts for d in (0, 50, 100))
    return NiahRow(run=r, recall=0.9, recall_at_longest=recall_8k, longest_context=max(contexts),
                   context_lengths=contexts, depths=(0.0, 50.0, 100.0), trials=1, max_new_tokens=16, batch_size=1,
                   chat=True, needle="x", question="x", data_source="x", seconds=1.0, cells=cells)


def perf(r, tok_s, vram, batch=1):
    link = BandwidthMeasurement(device=r.device, kind="h2d_pinned", gb_per_s=55.5, nbytes=1, seconds=1.0)
    return PerfRow(run=r, batch_size=batch, prompt_length=512, max_new_tokens=64, warmup=1, repeats=3, ttft_s=0.5,
                   prefill_tokens_per_s=1000.0, decode_tokens_per_s=tok_s, decode_step_s=1 / tok_s,
                   peak_vram_allocated_gb=vram, peak_vram_reserved_gb=None if vram is None else vram + 0.5,
                   host_rss_peak_gb=3.0, host_maxrss_gb=3.2, bytes_per_decode_step=10**9, bandwidth=link,
                   achieved_gb_per_s=10.0, mbu=0.18, data_source="x", samples=())


@pytest.fixture(scope="module")
def results_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("results")
    cpu = dict(device="cpu", streamed=False)
    rows = [
        ppl(run(SMOL, "float32", **cpu), 24.50), ppl(run(SMOL, "nf4", **cpu), 30.70),
        ppl(run(SMOL, "float32", "tq-k4v2", **cpu), 25.80, data_sha="0123"), ppl(run(SMOL, "int2", **cpu), 410.0, n=4096),
        rouge(run(SMOL, "float32", **cpu), 0.20), niah(run(SMOL, "float32", **cpu), 1.0),
        perf(run(SMOL, "float32", **cpu), 30.0, None), perf(run(SMOL, "float32", **cpu), 90.0, None, batch=4),
        ppl(run(BIG, "float16"), 6.24), ppl(run(BIG, "nf4"), 6.50), ppl(run(BIG, "int2"), 8.00),
        rouge(run(BIG, "float16"), 0.30), rouge(run(BIG, "nf4"), 0.28), rouge(run(BIG, "int2"), 0.20),
        niah(run(BIG, "nf4"), 0.9), niah(run(BIG, "int2"), 0.5),
        perf(run(BIG, "float16"), 4.0, 16.0), perf(run(BIG, "nf4"), 12.0, 7.5),
        perf(run(BIG, "float16", streamed=False, ts="2026-11-30T10:00:00+00:00"), 50.0, 17.0),
        perf(run(SYNTH, "float16", synthetic=True), 0.5, 5.2), perf(run(SYNTH, "nf4", synthetic=True), 1.5, 3.1),
    ]
    for r in rows:
        name = default_row_name(r)
        write_row(r, d / (name if not (d / name).exists() else name.replace(".json", "__2.json")))
    parity = ParityRow(run=run(BIG, "nf4"), reference_run=run(BIG, "float16"), cosine_mean=0.9991, cosine_min=0.95,
                       top1_agreement=0.97, kl_mean=0.012, kl_max=0.4, n_positions=8000, n_windows=16, max_length=512,
                       stride=512, limit_tokens=8192, batch_size=1, data_source="x", seconds=1.0)
    write_row(parity, d / "parity.json")
    (d / "kv_quality.json").write_text(json.dumps([{"bits": 2, "mse": 0.128}, {"bits": 4, "mse": 0.0194}]))
    (d / "my_bench.json").write_text(json.dumps({"link_gbps": 55.5, "runs": [
        {"system": "airllm", "s_per_token": 10.2}, {"system": "airquant", "s_per_token": 0.31, "extra": [1, 2]}]}))
    (d / "stream_bench.json").write_text(json.dumps({
        "device": "NVIDIA H200", "synthetic": True, "link_pinned_gbps": 55.2, "bf16_bs1_step_s": 0.2546,
        "tok_s_by_batch": {"1": 1.7, "64": 106.5}, "details": {"huge": list(range(500))},
        "targets": {"batch64_over_batch1": {"value": 61.4, "target": 40, "kind": "min", "met": True},
                    "vram70b_nf4_bs1_peak_gb": {"value": 4.2, "target": 4, "kind": "max", "met": False}}}))
    (d / "quant_quality.json").write_text(json.dumps({"a": {"b": {"c": {"d": {"e": 1}}}}}))
    (d / "garbage.json").write_text("{not json")
    old = row_to_dict(ppl(run(SMOL, "gptq"), 99.0)) | {"schema_version": 0}
    (d / "old_schema.json").write_text(json.dumps(old))
    (d / ".ppl.json.abc.tmp").write_text("{half")
    build_report(d)
    return d


def section(text: str, title: str) -> str:
    """The section under the heading ``title`` (## or ###), up to the next heading of its level or above."""
    level = re.search(rf"^(#+) {re.escape(title)}$", text, re.M).group(1)
    body = text.split(f"{level} {title}\n", 1)[1]
    return re.split(rf"\n#{{2,{len(level)}}} ", body, maxsplit=1)[0]


def table_cells(text: str, first: str) -> dict[str, str]:
    """``{column heading: cell}`` of the table line starting with ``first`` (the first table found)."""
    lines = text.splitlines()
    at = next(i for i, line in enumerate(lines) if line.startswith(f"| {first} |"))
    header = next(lines[i - 1] for i in range(at, 0, -1) if lines[i].startswith("|---"))
    split = lambda line: [c.strip() for c in re.split(r"(?<!\\)\|", line)[1:-1]]  # noqa: E731
    return dict(zip(split(header)[1:], split(lines[at])[1:]))


def test_big_model_verdicts_against_fp16(results_dir):
    text = section((results_dir / REPORT_NAME).read_text(), BIG)
    assert table_cells(text, "PPL WikiText-2") == {"FP16 streamed": "6.24", "NF4": "6.50", "2-bit (int2)": "8.00"}
    assert table_cells(text, "ΔPPL ≤ 0.5 vs baseline") == {
        "FP16 streamed": "baseline", "NF4": "PASS (+0.26)", "2-bit (int2)": "FAIL (+1.76)"}
    assert table_cells(text, "ROUGE-L drop ≤ 0.03 vs baseline") == {
        "FP16 streamed": "baseline", "NF4": "PASS (-0.020)", "2-bit (int2)": "FAIL (-0.100)"}
    assert table_cells(text, "NiAH recall ≥ 0.8 at 8K") == {
        "FP16 streamed": "—", "NF4": "PASS (0.90)", "2-bit (int2)": "FAIL (0.50)"}
    assert table_cells(text, "peak VRAM < 8 GB") == {
        "FP16 streamed": "FAIL (16.00 GB)", "NF4": "PASS (7.50 GB)", "2-bit (int2)": "—"}
    assert table_cells(text, "NiAH recall @ longest context")["NF4"] == "0.90 @ 8192"
    # The newer resident run stays in the detail table: the headline column is the streamed one.
    assert table_cells(text, "Decode throughput (tok/s)")["FP16 streamed"] == "4.00 (bs 1)"
    detail = section((results_dir / REPORT_NAME).read_text(), "Performance detail")
    assert "| Llama-3.1-8B | FP16 resident | NVIDIA H200 | 1 |" in detail


def test_default_model_shows_reference_figures(results_dir):
    text = section((results_dir / REPORT_NAME).read_text(), SMOL)
    assert list(table_cells(text, "PPL WikiText-2")) == [
        "FP32 resident", "FP32 resident + TQ-KV K4/V2", "NF4", "2-bit (int2)"]
    assert table_cells(text, "fp32")["measured PPL"] == "24.50"
    assert table_cells(text, "NF4, block size 64")["Δ vs reference"] == "+0.3%"
    assert table_cells(text, "TQ-KV K4/V2")["reference PPL"] == "25.75 (+5.1 % vs fp32)"
    assert table_cells(text, "int2, 3.5 % outliers")["measured with"].endswith("settings: limit_tokens)")
    assert table_cells(text, "TQ-KV K4/V2")["measured with"].endswith("settings: limit_tokens, data)")
    assert table_cells(text, "PPL WikiText-2")["FP32 resident + TQ-KV K4/V2"] == "25.80 ¹"
    # At the reference settings a row goes to the headline table instead (test_report_headline.py).
    assert table_cells(text, "fp32")["measured with"].endswith("settings: limit_tokens)")
    assert table_cells(text, "Decode throughput (tok/s)")["FP32 resident"] == "30.00 (bs 1)"
    assert table_cells(text, "Peak VRAM allocated (GB)")["FP32 resident"] == "n/a (CPU)"
    assert "¹ perplexity measured with other text, tokens" in text


def test_synthetic_columns_are_speed_only(results_dir):
    text = section((results_dir / REPORT_NAME).read_text(), SYNTH)
    assert "| PPL" not in text  # no quality rows at all: the line is left out
    assert table_cells(text, "Decode throughput (tok/s)") == {"FP16 streamed †": "0.50 (bs 1)",
                                                              "NF4 †": "1.50 (bs 1)"}
    assert table_cells(text, "ΔPPL ≤ 0.5 vs baseline")["NF4 †"] == "n/a (synthetic)"
    assert table_cells(text, "peak VRAM < 8 GB")["NF4 †"] == "PASS (3.10 GB)"
    assert "† synthetic" in text


def test_other_sections_and_foreign_files(results_dir):
    text = (results_dir / REPORT_NAME).read_text()
    assert table_cells(section(text, "Logit parity"), BIG)["top-1 agreement"] == "0.9700"
    bench = section(text, "Speed benchmarks: synthetic 8B / 70B and MoE shapes, and the benchmark scripts")  # known benchmark files: headline tables, in a fixed order
    assert bench.index("### Layer streaming") < bench.index("### Weight quantization quality")
    assert "`stream_bench.json`" in bench and "| pinned host→GPU link | 55.2 GB/s |" in bench
    assert "| 70B NF4, 15 GB cap, batch 64 | 106.5 tok/s |" in bench and "| AirLLM 4.0.0, same weights | — |" in bench
    assert "| batch64_over_batch1 | 61.4 | ≥ 40 | met |" in bench and "| ≤ 4 | MISSED |" in bench
    assert "499" not in bench  # per-step detail stays in the JSON
    extras = section(text, "Other benchmark results")  # anything else: shown as found
    assert "### my_bench.json" in extras and "### kv_quality.json" in extras
    assert "| airquant | 0.31 | [1, 2] |" in extras and "| 2 | 0.128 |" in extras
    left_out = section(text, "Provenance").split("Files left out:")[1]
    assert "`garbage.json`" in left_out and "`old_schema.json`" in left_out and "tmp" not in left_out
    assert len(re.findall(r"^\| (ppl|rouge|niah|perf|parity)__", section(text, "Provenance"), re.M)) == 21


def test_plots_are_written_beside_the_report(results_dir):
    pngs = {p.name for p in results_dir.glob("*.png")}
    # One figure per device and setting: the SmolLM2 rows were measured at 4096 tokens and at the reference's 8192.
    assert {"ppl__smollm2-135m-instruct__cpu__4096t-window-1024-stride-512.png",
            "throughput_vs_batch__smollm2-135m-instruct__cpu__prompt-512t-64-new.png",
            "ppl__llama-3.1-8b__nvidia-h200__4096t-window-1024-stride-512.png"} <= pngs
    assert len([p for p in pngs if p.startswith("heatmap__niah__")]) == 3
    assert all((results_dir / p).read_bytes()[:4] == b"\x89PNG" for p in pngs)
    assert "![Throughput vs batch size](throughput_vs_batch__smollm2-135m-instruct__cpu__prompt-512t-64-new.png)" in \
        (results_dir / REPORT_NAME).read_text()


def test_empty_and_missing_folders(tmp_path):
    report = build_report(tmp_path, make_plots=False)
    assert "No result rows were found." in report.read_text()
    with pytest.raises(ResultsFileError, match="no such folder"):
        build_report(tmp_path / "nope")


def test_missing_matplotlib_is_a_note_not_a_failure(tmp_path, monkeypatch):
    from airquant.eval import plots

    write_row(ppl(run(SMOL, "float32"), 24.5), tmp_path / "ppl.json")
    monkeypatch.setattr(plots, "matplotlib_available", lambda: False)
    text = build_report(tmp_path).read_text()
    assert "Plots were skipped: matplotlib is not installed (pip install matplotlib==" in text
    assert not list(tmp_path.glob("*.png"))


def test_cpu_and_gpu_runs_of_one_model_get_columns_and_baselines_of_their_own(tmp_path):
    cpu = dict(device="cpu")
    rows = [ppl(run(SMOL, "bfloat16", **cpu), 26.0), ppl(run(SMOL, "nf4", **cpu), 34.0),
            ppl(run(SMOL, "bfloat16"), 18.0), ppl(run(SMOL, "nf4"), 22.5),
            perf(run(SMOL, "nf4", **cpu), 15.0, None), perf(run(SMOL, "nf4"), 23.0, 0.2)]
    names = [default_row_name(r) for r in rows]
    assert len(set(names)) == len(rows)  # a GPU row never takes a CPU row's file
    assert names[2].endswith("__cuda.json") and not names[0].endswith("__cuda.json")
    for r, name in zip(rows, names):
        write_row(r, tmp_path / name)
    text = section(build_report(tmp_path).read_text(), SMOL)
    assert table_cells(text, "PPL WikiText-2") == {
        "BF16 streamed · CPU": "26.00", "NF4 · CPU": "34.00",
        "BF16 streamed · NVIDIA H200": "18.00", "NF4 · NVIDIA H200": "22.50"}
    assert table_cells(text, "ΔPPL ≤ 0.5 vs baseline") == {
        "BF16 streamed · CPU": "baseline", "NF4 · CPU": "FAIL (+8.00)",
        "BF16 streamed · NVIDIA H200": "baseline", "NF4 · NVIDIA H200": "FAIL (+4.50)"}


def test_a_figure_holds_one_device_and_one_setting(tmp_path):
    """throughput_vs_batch drew CPU lines flat at 0 beside the H200's, 32- and 512-token prompts on one axis."""
    cpu = dict(device="cpu")
    rows = [perf(run(SMOL, "bfloat16", **cpu), 3.0, None), perf(run(SMOL, "bfloat16", **cpu), 9.0, None, batch=4),
            perf(run(SMOL, "bfloat16"), 300.0, 0.3), perf(run(SMOL, "bfloat16"), 900.0, 0.3, batch=4),
            ppl(run(SMOL, "bfloat16", **cpu), 26.0, n=1024, max_length=512, stride=512), ppl(run(SMOL, "bfloat16"), 24.5)]
    for r in rows:
        write_row(r, tmp_path / default_row_name(r))
    build_report(tmp_path)
    pngs = sorted(p.name for p in tmp_path.glob("*.png"))
    assert [p for p in pngs if p.startswith("throughput")] == [
        "throughput_vs_batch__smollm2-135m-instruct__cpu__prompt-512t-64-new.png",
        "throughput_vs_batch__smollm2-135m-instruct__nvidia-h200__prompt-512t-64-new.png"]
    assert [p for p in pngs if p.startswith("ppl")] == [
        "ppl__smollm2-135m-instruct__cpu__1024t-window-512-stride-512.png",
        "ppl__smollm2-135m-instruct__nvidia-h200__4096t-window-1024-stride-512.png"]


def test_the_report_names_its_folder_as_typed(tmp_path, monkeypatch):
    """A results/local report said it was built by `airquant report local`."""
    (tmp_path / "results" / "local").mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    text = build_report(tmp_path / "results" / "local", make_plots=False).read_text()
    assert "by `airquant report results/local`" in text


def test_batch_bench_section_names_each_parts_card():
    """batch_bench's static and continuous parts are separate runs: where their cards differ (or the static part's
    was not recorded, as in files before it was), the section says so instead of one card for both."""
    from airquant.eval.benchtables import batch_bench

    both = {"device": "H100", "continuous_device": "H100", "static_device": "H100", "static_useful_tok_s": 12.0}
    assert "(measured on **H100**)" in batch_bench(both)[0]
    mixed = {**both, "static_device": "H200"}
    assert "continuous rows measured on **H100**, static rows on **H200**" in batch_bench(mixed)[0]
    older = {k: v for k, v in both.items() if k != "static_device"}
    assert "static rows on **a card the file did not record**" in batch_bench(older)[0]


def test_batch_bench_section_lists_the_kv_rows_with_their_cards_and_targets():
    """The loop's rows by KV cache (issue #38): each with its slots, where its cache lives and its card, and the
    targets over them; rows that were not compared say why; with plain alone there is no such table."""
    from airquant.eval.benchtables import batch_bench

    d = {"continuous_device": "H100", "continuous_useful_tok_s": 32.8, "slots": 24, "continuous_budget_s": 100.0,
         "continuous_auto_useful_tok_s": 90.5, "auto_slots": 192, "auto_kv_offload": True,
         "continuous_auto_device": "H200",
         "targets": {"auto_over_best_useful_tok_s": {"value": None, "target": 0.95, "kind": "min", "met": None}},
         "kv_ratios_missing": "auto and plain ran with different device (H200 vs H100)"}
    text = "\n".join(batch_bench(d))
    assert "| plain | 24 | device | 32.8 | — | H100 |" in text
    assert "| auto (the planner's) | 192 | host RAM | 90.5 | — | H200 |" in text
    assert "auto_over_best_useful_tok_s" in text and "Not compared: auto and plain ran with different device" in text
    assert "by KV cache" not in "\n".join(batch_bench({"continuous_useful_tok_s": 32.8, "slots": 24}))
    # a row whose placement was pinned (batch_bench --no-kv-offload) is listed under its own name
    d.update({"continuous_tq_device_useful_tok_s": 120.0, "tq_device_slots": 99, "tq_device_kv_offload": False,
              "continuous_tq_device_device": "H200", "auto_best_row": "tq_device"})
    text = "\n".join(batch_bench(d))
    assert "| TurboQuant K4/V2, device pinned | 99 | device | 120.0 | — | H200 |" in text
    assert "The best row measured (auto_over_best's denominator): tq_device." in text


def test_kv_attention_speed_section_lists_each_launch_with_its_graph_and_history_kernel_time():
    """kv_attention_speed --paged (issue #38): a row per launch under sdpa's, its CUDA-graph time and history
    kernel's device time where recorded (the Gluon kernel's, else the Triton split kernel's), and the ratio to
    sdpa from the graph time where there is one."""
    from airquant.eval.benchtables import kv_attention_speed

    d = {"settings": {"device": "H100", "tokens": 8192, "kv_heads": 8, "head_dim": 128, "kv": "K4/V2",
                      "dtype": "bfloat16"},
         "rows": {"b32_g4": {"fp16_cache_sdpa_ms": 0.4, "kernels": {
             "v01_p1056_n32_w4_s1_r0": {"ms": 0.6, "graph_ms": 0.5, "kernel_us": {"_split_kernel": 450.0}},
             "gluon_p4224_n32_r0": {"ms": 0.7, "graph_ms": 0.2, "kernel_us": {"_split_kernel": 15.0,
                                                                             "_history_kernel": 150.0}},
             "v00_p1056_n32_w4_s1_r0": {"ms": 0.8}}}}}
    text = "\n".join(kv_attention_speed(d))
    assert "Measured on **H100**: 8192 tokens a slot" in text
    assert "| b32_g4 | sdpa over the bf16 cache | 0.400 | — | — | 1.00 |" in text
    assert "| b32_g4 | v01_p1056_n32_w4_s1_r0 | 0.600 | 0.500 | 450 | 1.25 |" in text
    assert "| b32_g4 | gluon_p4224_n32_r0 | 0.700 | 0.200 | 150 | 0.50 |" in text
    assert "| b32_g4 | v00_p1056_n32_w4_s1_r0 | 0.800 | — | — | 2.00 |" in text
    # sdpa replayed as a graph too: graph times over its graph time, host times over its host time
    d["rows"]["b32_g4"]["fp16_cache_sdpa_graph_ms"] = 0.25
    text = "\n".join(kv_attention_speed(d))
    assert "| b32_g4 | sdpa over the bf16 cache | 0.400 | 0.250 | — | 1.00 |" in text
    assert "| b32_g4 | gluon_p4224_n32_r0 | 0.700 | 0.200 | 150 | 0.80 |" in text
    assert "| b32_g4 | v00_p1056_n32_w4_s1_r0 | 0.800 | — | — | 2.00 |" in text


def test_kv_bench_section_names_the_history_kernel_of_its_run():
    """kv_bench runs record which kernel read the TurboQuant history (stop 68); the section says so, and runs from
    before that record read it with the Triton split kernel, the only one then."""
    from airquant.eval.benchtables import kv_bench

    d = {"device": "H200", "context": 8192, "batch": 8, "step_s": {"none": 0.018, "tq": 0.014},
         "tq_over_fp16_step": 0.79, "tq_over_fp16_step_bs32": 0.98, "settings": {"tq_history_kernel": "gluon"}}
    text = "\n".join(kv_bench(d))
    assert "history read by the Gluon kernel" in text and "at batch 32: AirQuant ÷ FP16 0.98" in text
    del d["settings"]
    assert "history read by the Triton split kernel" in "\n".join(kv_bench(d))


def test_moe_ab_section_lists_each_case_row():
    """An A/B file of moe_bench cases (merge_runs --changes-only) shows each case's step, bytes and hit rate, the
    figures the pair differs by, and an error where a case did not run."""
    from airquant.eval.benchtables import moe_ab

    d = {"device": "H200", "link_pinned_gbps": 55.4, "expert_aware": [
        {"model": "qwen3-30b-a3b nf4", "cap_gb": 4, "batch": 1, "case": "nocache_direct_specread", "step_s": 0.0511,
         "tok_s": 19.6, "decode_bytes_per_step": 1.261e9, "experts": {"hit_rate": 0.63}, "run": "r1"},
        {"model": "qwen3-30b-a3b nf4", "cap_gb": 4, "batch": 1, "case": "nocache_direct", "step_s": None,
         "error": "OutOfMemoryError: no room", "run": "r2"}]}
    text = "\n".join(moe_ab(d))
    assert "| `nocache_direct_specread` | 0.0511 | 19.6 | 1.261 | 0.63 | r1 |" in text
    assert "| `nocache_direct` | — | — | — | — | OutOfMemoryError: no room |" in text
    assert "| link_pinned_gbps | 55.4 |" in text
