"""Headline tables of the benchmark scripts' JSON (benchmarks/*.py) for ``results/RESULTS.md``.

Each renderer takes the parsed file and returns Markdown lines: the figures a reader looks for, the
targets with met/missed, and where the numbers come from. Keys a file lacks (an older or partial
run) show as "—"; the full data stays in the JSON file, which the report names.
"""

from __future__ import annotations

from typing import Any, Callable

from airquant.eval.results import md_table

Renderer = Callable[[dict], list[str]]


def _f(value: Any, fmt: str = "{:.3g}") -> str:
    return "—" if value is None else fmt.format(value) if isinstance(value, (int, float)) else str(value)


def _source(data: dict) -> str:
    what = "synthetic weights of the real shapes (speed and memory only)" if data.get("synthetic") else "real weights"
    quick = " QUICK RUN: tiny shapes, not a measurement." if data.get("quick") else ""
    runs = {row.get("run"): row.get("device") for rows in data.values() if isinstance(rows, list)
            for row in rows if isinstance(row, dict) and row.get("run")}
    if len(runs) > 1:  # rows folded from several runs, maybe on other cards: the top-level device is the last's
        cards = sorted({d for d in runs.values() if d})
        named = f"; rows that name theirs: {', '.join(cards)}" if cards else ""
        return (f"Rows of {len(runs)} runs (each row's `run`; the runs and their cards in docs/BENCHMARKS.md{named}), "
                f"the last on **{data.get('device', '?')}**, {what}.{quick}")
    return f"Measured on **{data.get('device', '?')}**, {what}.{quick}"


def target(value: float | None, threshold: float, kind: str) -> dict:
    """A benchmark's ``targets`` entry: ``kind`` "min" (value >= threshold) or "max"; ``met`` None unmeasured."""
    met = None if value is None else (value >= threshold if kind == "min" else value <= threshold)
    return {"value": value, "target": threshold, "kind": kind, "met": met}


def _verdict(t: dict) -> str:
    if t.get("value") is None:  # a target its run could not measure, with the reason when recorded
        return "not measured" + (f": {t['why'].splitlines()[0][:120]}" if t.get("why") else "")
    return "met" if t.get("met") else "MISSED"


def _targets(data: dict) -> list[str]:
    targets = data.get("targets") or {}
    if not targets:
        return []
    rows = [[k, _f(t.get("value")), f"{'≥' if t.get('kind') == 'min' else '≤'} {_f(t.get('target'))}",
             _verdict(t)] for k, t in targets.items() if isinstance(t, dict)]
    return ["", *md_table(["target", "measured", "required", ""], rows)]


def stream_bench(d: dict) -> list[str]:
    rows = [
        ["pinned host→GPU link", _f(d.get("link_pinned_gbps"), "{:.1f} GB/s"), "measured in the same run"],
        ["8B bf16 decode step, batch 1, 4 GB cap", _f(d.get('bf16_bs1_step_s'), '{:.4f} s'),
         _f(d.get('bf16_bs1_link_fraction'), '{:.2f} of the link')],
        ["8B NF4 decode step, batch 1", _f(d.get('nf4_bs1_step_s'), '{:.4f} s'),
         _f(d.get('nf4_bs1_link_fraction'), '{:.2f} of the link')],
        ["AirLLM 4.0.0, same weights", _f(d.get('airllm_bs1_step_s'), '{:.2f} s'),
         f"{_f(d.get('airllm_over_airquant_bf16'), '{:.1f}')}× slower than AirQuant bf16"],
        ["transformers + accelerate offload", _f(d.get('accelerate_bs1_step_s'), '{:.3f} s'),
         f"{_f(d.get('accelerate_over_airquant_bf16'), '{:.1f}')}× slower than AirQuant bf16"],
        ["resident transformers (compute floor)", _f(d.get('resident_bs1_step_s'), '{:.4f} s'), ""],
        ["70B NF4, batch 1, 4 GB cap: peak VRAM", _f(d.get('vram70b_nf4_bs1_peak_gb'), '{:.2f} GB'), "allocated"],
    ]
    rows += [[f"70B NF4, 15 GB cap, batch {b}", _f(v, '{:.1f} tok/s'), ""]
             for b, v in (d.get("tok_s_by_batch") or {}).items()]
    return [_source(d), "", *md_table(["case", "figure", "note"], rows), *_targets(d), "",
            "![Streaming benchmark](stream_bench.png)"]


def quant_speed(d: dict) -> list[str]:
    rows = []
    for scheme, plans in (d.get("schemes") or {}).items():
        for plan, s in plans.items():
            for n, r in (s.get("batches") or {}).items():
                rows.append([scheme, plan, _f(s.get("store_gb"), "{:.2f}"), s.get("vram_layers"), n,
                             _f(r.get("ms_per_token"), "{:.1f}") if "step_s" in r else r.get("error", "—"),
                             _f(r.get("tok_s"), "{:.1f}"), _f(r.get("peak_allocated_gb"), "{:.2f}"),
                             _f(r.get("link_fraction"), "{:.2f}")])
    return [f"{_source(d)} Shape {d.get('shape')}, GPU capped to {_f(d.get('cap_gb'))} GB; pinned link "
            f"{_f(d.get('link_pinned_gbps'), '{:.1f} GB/s')}. `auto`: the planner's placement; `streamed`: no "
            "layer resident.", "",
            *md_table(["scheme", "plan", "store GB", "layers in VRAM", "batch", "ms / step", "tok/s",
                       "peak VRAM GB", "link share"], rows)]


def kv_bench(d: dict) -> list[str]:
    step, peak, cache = d.get("step_s") or {}, d.get("peak_vram_gb") or {}, d.get("cache_vram_gb") or {}
    batch70 = d.get("max_batch_70b_nf4_15gb") or {}
    names = {"none": "FP16/BF16 cache", "tq": "AirQuant TurboQuant K4/V2", "turboquant": "`turboquant` 0.2.0"}
    rows = [[names.get(k, k), _f(step.get(k), "{:.4f}"), _f(cache.get(k), "{:.2f}"), _f(peak.get(k), "{:.2f}"),
             _f(batch70.get(k), "{}")] for k in names if k in step or k in batch70]
    # Runs before stop 68 did not record it: on a GPU, each read its history with the Triton split kernel.
    history = (d.get("settings") or {}).get("tq_history_kernel", "triton")
    readers = {"gluon": "the Gluon kernel", "triton": "the Triton split kernel", "torch": "torch ops"}
    return [f"{_source(d)} Context {d.get('context')} tokens, batch {d.get('batch')}; TurboQuant history read by "
            f"{readers.get(history, history)}; AirQuant step ÷ FP16 step "
            f"{_f(d.get('tq_over_fp16_step'), '{:.2f}')}, `turboquant` ÷ FP16 "
            f"{_f(d.get('turboquant_over_fp16_step'), '{:.2f}')}"
            + "".join(f"; at batch {k.rsplit('_bs', 1)[1]}: AirQuant ÷ FP16 {_f(v, '{:.2f}')}"
                      for k, v in sorted(d.items()) if k.startswith("tq_over_fp16_step_bs")) + ".", "",
            *md_table(["cache", "decode step (s)", "cache + activations GB", "peak VRAM GB",
                       "largest batch, 70B NF4 under 15 GB"], rows), *_targets(d)]


def kv_attention_speed(d: dict) -> list[str]:
    """The TurboQuant attention of one layer over the loop's arena (kv_attention_speed --paged): each launch's time
    from the host and, where recorded, replayed as a CUDA graph with its history kernel's device time, beside sdpa
    over the same batch's bf16 cache and the packed bytes' floor."""
    settings, rows = d.get("settings") or {}, []
    for key, r in (d.get("rows") or {}).items():
        rows.append([key, "sdpa over the bf16 cache", _f(r.get("fp16_cache_sdpa_ms"), "{:.3f}"),
                     _f(r.get("fp16_cache_sdpa_graph_ms"), "{:.3f}"), "—", "1.00"])
        for name, k in (r.get("kernels") or {}).items():
            us = k.get("kernel_us") or {}
            history = us.get("_history_kernel", us.get("_split_kernel"))
            # graph over sdpa's graph where both were replayed (else over its host time), host over host otherwise
            best = k.get("graph_ms") or k.get("ms")
            sdpa = (k.get("graph_ms") and r.get("fp16_cache_sdpa_graph_ms")) or r.get("fp16_cache_sdpa_ms")
            rows.append([key, name, _f(k.get("ms"), "{:.3f}"), _f(k.get("graph_ms"), "{:.3f}"), _f(history, "{:.0f}"),
                         _f(best / sdpa if best and sdpa else None, "{:.2f}")])
    return [f"Measured on **{settings.get('device', '?')}**: {settings.get('tokens')} tokens a slot, "
            f"{settings.get('kv_heads')} KV heads of {settings.get('head_dim')}, {settings.get('kv')}, "
            f"{settings.get('dtype')}. Launch names: `v<cols><bytes>_p<programs>_n<BLOCK_N>_w<warps>_s<stages>_r<reg "
            "cap>` the Triton split kernel's history tiles, `gluon_...` the Gluon history kernel; the history "
            "column is that kernel's device time a call (the Gluon rows' window and merge are the Triton kernels').",
            "", *md_table(["batch, query heads a KV head", "launch", "ms (host)", "ms (CUDA graph)",
                           "history kernel µs", "÷ sdpa"], rows)]


def int2_gemv_table(d: dict) -> list[str]:
    rows = [[f"{r.get('out_features')}×{r.get('in_features')}", r.get("batch"), r.get("kernel"),
             _f(r.get("int2_ms"), "{:.4f}"), _f(r.get("int2_eager_ms"), "{:.4f}"),
             _f(r.get("fp16_dense_ms"), "{:.4f}"),
             _f(r.get("achieved_GBps"), "{:.0f}"), _f(r.get("fraction_of_copy_bw"), "{:.2f}")]
            for r in d.get("rows", [])]
    return [f"Measured on **{d.get('gpu', '?')}**; HBM copy bandwidth {_f(d.get('copy_bandwidth_GBps'), '{:.0f}')} "
            f"GB/s; target fraction ≥ {_f(d.get('target_fraction'))} for the batch-1 GEMV. "
            f"{('Timing: ' + d['timing'] + '.') if d.get('timing') else ''}", "",
            *md_table(["matrix", "batch", "kernel", "int2 ms", "int2 eager ms", "fp16 ms", "GB/s",
                       "fraction of copy BW"], rows)]


def quant_quality(d: dict) -> list[str]:
    rows = [[name, _f(s.get("ppl"), "{:.2f}"), _f(s.get("bits_per_weight"), "{:.2f}"),
             _f(s.get("logit_cosine"), "{:.3f}"), _f(s.get("top1_agreement"), "{:.3f}")]
            for name, s in (d.get("schemes") or {}).items() if isinstance(s, dict)]
    return [f"{d.get('model')} on {d.get('device')} ({d.get('dtype')}), calibration: {d.get('calibration')}.", "",
            *md_table(["scheme", "PPL", "bits/weight", "logit cosine", "top-1"], rows)]


def kv_quality(d: dict) -> list[str]:
    rows = [[r.get("label", name), _f(r.get("ppl"), "{:.2f}"), _f(r.get("bits_per_element"), "{:.2f}"),
             _f(r.get("logit_cosine"), "{:.4f}"), _f(r.get("top1_agreement"), "{:.3f}")]
            for name, r in (d.get("ppl_rows") or {}).items() if isinstance(r, dict)]
    mse = d.get("mse_d128") or {}
    comp = d.get("compression_vs_fp16") or {}
    mse_text = ", ".join(f"{k} {_f(v, '{:.4f}')}" for k, v in mse.items())
    comp_text = ", ".join(f"{k} tokens {_f(v, '{:.2f}')}×" for k, v in comp.items())
    return [f"MSE per unit vector at d=128: {mse_text}.", "", f"FP16 cache bytes ÷ K4/V2 cache bytes (window 128): {comp_text}.",
            "", *md_table(["cache", "PPL", "bits/element", "logit cosine", "top-1"], rows)]


def reliability(d: dict) -> list[str]:
    """benchmarks/faults.py: each injected fault, how often, how often the promise held, records lost, cases that
    crossed their scope (an attack that wrote or read past its store or model folder)."""
    where = (f"Run on {d.get('machine', '?')} ({d.get('cpus', '?')} CPUs), {d.get('model', '?')}, "
             f"airquant {d.get('airquant', '?')}, Python {d.get('python', '?')}.")
    quick = " QUICK RUN: the tests' tiny counts." if d.get("quick") else ""
    rows = [[r.get("case", r.get("part")), _f(r.get("tried"), "{}"), _f(r.get("survived"), "{}"),
             _f(r.get("records_lost"), "{}"), _f(r.get("crossed_scope", 0), "{}"),
             "skipped: " + r["skipped"] if r.get("skipped") else ("ok" if r.get("ok") else "FAILED"),
             r.get("detail", "")] for r in d.get("parts", []) if isinstance(r, dict)]
    totals = d.get("totals") or {}
    total = (f" In all: {totals.get('tried')} cases tried, {totals.get('survived')} survived, "
             f"{totals.get('records_lost')} records lost, {totals.get('crossed_scope', 0)} crossed scope."
             if totals else "")
    return [where + quick + total, "", *md_table(["fault", "tried", "survived", "records lost", "crossed scope", "",
                                                  "detail"], rows)]


def verify_bench(d: dict) -> list[str]:
    """benchmarks/verify_bench.py: streamed passes with the per-read checksum off and on."""
    rows = [[t.get("tier"), _f(t.get("layer_gb"), "{:.2f} GB"), _f((t.get("pass_s") or {}).get("off"), "{:.3f} s"),
             _f((t.get("pass_s") or {}).get("on"), "{:.3f} s"), _f(t.get("overhead_pct"), "{:+.2f} %"),
             _f(t.get("first_pass_overhead_pct"), "{:+.2f} %")] for t in d.get("tiers", []) if isinstance(t, dict)]
    quick = " QUICK RUN: a tiny store, not a measurement." if d.get("quick") else ""
    return [f"Measured on **{d.get('gpu') or d.get('device', '?')}**, store {d.get('store')} (synthetic weights), "
            f"median of the passes, checks off and on interleaved; xxh3-128 on one core "
            f"{_f(d.get('xxh3_128_gbps_one_core'), '{:.1f}')} GB/s; page cache dropped before disk-tier passes: "
            f"{d.get('cold_disk')}. Target: overhead ≤ 2 %.{quick}", "",
            *md_table(["tier", "layers", "pass, off", "pass, on", "overhead", "fill pass"], rows)]


def as_found(d: dict) -> list[str]:
    """Files whose schema this module does not know yet: where they were measured, their top-level figures
    and targets (the nested detail stays in the file)."""
    versions = d.get("versions") if isinstance(d.get("versions"), dict) else {}
    head = [_source(d)] + ([f"Versions: {', '.join(f'{k} {v}' for k, v in versions.items())}."] if versions else [])
    figures = [[k, _f(v)] for k, v in d.items() if isinstance(v, (int, float, str)) and not isinstance(v, bool)
               and k not in ("device", "quick")]
    return head + ["", *md_table(["figure", "value"], figures)] + _targets(d)


def moe_ab(d: dict) -> list[str]:
    """An A/B of benchmarks/moe_bench.py cases (``merge_runs --changes-only``): what ``as_found`` gives, then each
    case's row (its step, bytes a step and hit rate: what the pair differs by)."""
    rows = [[r.get("model"), r.get("cap_gb"), r.get("batch"), f"`{r.get('case')}`", _f(r.get("step_s"), "{:.4f}"),
             _f(r.get("tok_s"), "{:.1f}"), _f((r.get("decode_bytes_per_step") or 0) / 1e9 or None, "{:.3f}"),
             _f((r.get("experts") or {}).get("hit_rate"), "{:.2f}"), r.get("error") or r.get("run") or ""]
            for r in d.get("expert_aware", [])]
    return as_found(d) + ["", *md_table(["model", "cap GB", "batch", "case", "step s", "tok/s", "GB a step",
                                         "hits", "run (or error)"], rows)]


def _met(value: Any, target: float, kind: str) -> str:
    if value is None:
        return "not measured"
    return "met" if (value >= target if kind == "min" else value <= target) else "MISSED"


def batch_bench(d: dict) -> list[str]:
    """benchmarks/batch_bench.py: static vs continuous batching on a streamed 70B, the 8B batch-1 step against
    the link, and the default model's mixed job on the CPU. Parts run on different machines: each says where."""
    c70 = [[k, _f(d.get(k)), *([f"≥ {t}", _met(d.get(k), t, "min")] if t else ["", ""])]
           for k, t in (("static_useful_tok_s", None), ("continuous_useful_tok_s", 300), ("continuous_over_static", 2.0),
                        ("slot_utilization", 0.9), ("static_slot_utilization", None), ("slots", None))]
    bs1 = [["pinned host→GPU link", _f(d.get("link_pinned_gbps"), "{:.1f} GB/s"), "", ""],
           ["batch-1 decode step", _f(d.get("bs1_8b_step_s"), "{:.3f} s"), "", ""],
           ["bytes moved per step", _f((d.get("bs1_8b_bytes_per_step") or 0) / 1e9 or None, "{:.2f} GB"), "", ""],
           ["fraction of the link", _f(d.get("bs1_link_fraction"), "{:.3f}"), "≥ 0.9",
            _met(d.get("bs1_link_fraction"), 0.9, "min")],
           ["with the KV cache offloaded to host RAM: step", _f(d.get("bs1_8b_kv_offload_step_s"), "{:.3f} s"), "", ""],
           ["with the KV cache offloaded: fraction of the link", _f(d.get("bs1_8b_kv_offload_link_fraction"), "{:.3f}"),
            "", ""]]
    cpu = [[path, _f(d.get(f"cpu_mixed_{path}_utilization"), "{:.2f}"), _f(d.get(f"cpu_mixed_{path}_wall_s"), "{:.1f} s")]
           for path in ("static", "continuous")]
    # the static and continuous parts are separate runs, possibly on different cards (older files kept no
    # static_device): each part says its own
    cont = d.get("continuous_device", d.get("device", "not run yet"))
    static = d.get("static_device", "a card the file did not record" if "static_useful_tok_s" in d else "not run yet")
    where = (f"measured on **{cont}**" if static == cont
             else f"continuous rows measured on **{cont}**, static rows on **{static}**")
    return [f"70B-shaped NF4 store under a 15 GB cap, {d.get('requests', 512)} requests ({where}):", "",
            *md_table(["figure", "value", "target", ""], c70), *_batch_kv(d), "",
            f"8B-shaped bf16 store under a 4 GB cap, batch 1 (measured on **{d.get('bs1_8b_device', 'not run yet')}**):",
            "", *md_table(["figure", "value", "target", ""], bs1), "",
            f"Default model on the CPU, {d.get('cpu_mixed_prompts', '?')} mixed chat prompts, "
            f"{d.get('cpu_mixed_slots', '?')} slots, greedy (static batching vs the decode loop):", "",
            *md_table(["batching", "slot utilization", "wall time"], cpu)]


KV_ROW_NAMES = {"": "plain", "tq": "TurboQuant K4/V2", "auto": "auto (the planner's)"}  # batch_bench.row_name


def _batch_kv(d: dict) -> list[str]:
    """batch_bench's continuous rows by KV cache (``--kv none|tq|auto``, each its own run: its card named; a row
    whose placement was pinned is named after it, ``tq_device``) and issue #38's targets over them (``compare_kv``:
    only rows of one stream, window and card are compared)."""
    found = {k[len("continuous_"):-len("_useful_tok_s")] for k in d
             if k.startswith("continuous_") and k.endswith("_useful_tok_s") and "steady" not in k}
    names = ["", "tq", "auto", *sorted(found - {"", "tq", "auto"})]
    rows = []
    for name in names:
        row, prefix = (f"_{name}", f"{name}_") if name else ("", "")
        if d.get(f"continuous{row}_useful_tok_s") is None:
            continue
        kv, _, pinned = name.partition("_")
        label = KV_ROW_NAMES.get(kv if kv != "plain" else "", name) + (f", {pinned} pinned" if pinned else "")
        where = "host RAM" if d.get(f"{prefix}kv_offload") else "device"
        rows.append([label, _f(d.get(f"{prefix}slots")), where, _f(d.get(f"continuous{row}_useful_tok_s"), "{:.1f}"),
                     _f(d.get(f"continuous{row}_steady_useful_tok_s"), "{:.1f}"),
                     str(d.get(f"continuous{row}_device") or "not recorded")])
    if len(rows) < 2:
        return []
    missing, best = d.get("kv_ratios_missing"), d.get("auto_best_row")
    return ["", f"The continuous loop by KV cache, {_f(d.get('continuous_budget_s'), '{:.0f}')} s windows:", "",
            *md_table(["KV cache", "slots", "cache on", "useful tok/s", "steady", "card"], rows), *_targets(d),
            *(["", f"The best row measured (auto_over_best's denominator): {best}."] if best else []),
            *(["", f"Not compared: {missing}."] if missing else [])]


def scale_bench(d: dict) -> list[str]:
    """benchmarks/scale_bench.py: the same batch job through Ray (one engine) and plain ``airquant batch``."""
    rows = [[name, _f(r.get("wall_s"), "{:.1f} s"), _f(r.get("job_s"), "{:.1f} s"), _f(r.get("new_tokens"), "{}"),
             _f(r.get("useful_tok_s"), "{:.1f}")] for name in ("plain", "ray") if (r := d.get(name))]
    ratio = d.get("ray_over_plain_wall")
    return [_source(d) + f" {d.get('prompts')} prompts, batch {d.get('batch_size')}, {d.get('max_new_tokens')} new "
            f"tokens each, {d.get('shape')} {d.get('dtype')} store, {d.get('engines')} Ray engine.", "",
            *md_table(["run", "wall", "job (engine)", "new tokens", "useful tok/s"], rows), "",
            f"Ray wall ÷ plain wall: **{_f(ratio, '{:.3f}')}** (target ≤ {_f(d.get('target_ray_over_plain_wall'))}: "
            f"{_met(ratio, d.get('target_ray_over_plain_wall') or 1.05, 'max')})."
            + (f" {d['unpaired']}." if d.get("unpaired") else ""), "", *_scale_multi(d.get("multi"))]


def _scale_multi(m: dict | None) -> list[str]:
    """scale_bench's multi part: the same job on 1 and N engines, one GPU each (issue 23)."""
    if not m:
        return ["Across GPUs (`--part multi`): not run: needs a machine of several GPUs."]
    rows = [[k, _f(r.get("wall_s"), "{:.1f} s"), _f(r.get("job_s"), "{:.1f} s"), _f(r.get("new_tokens"), "{}"),
             _f(r.get("useful_tok_s"), "{:.1f}"), _f(r.get("engine_generate_s"), "{:.1f} s")]
            for k, r in (m.get("runs") or {}).items()]
    eff, target = m.get("scaling_efficiency"), m.get("target_scaling_efficiency") or 0.9
    ram, link = m.get("host_ram") or {}, m.get("link") or {}
    quick = " QUICK RUN: CPU engines on a tiny store, not a measurement." if m.get("quick") else ""
    lines = [f"Across GPUs (`--part multi`): measured on **{m.get('device', '?')}** ({m.get('gpus')} GPUs), the same "
             f"job on 1 and {m.get('engines')} Ray engines, {m.get('gpus_per_engine')} GPU each.{quick}", "",
             *md_table(["engines", "wall", "job (driver)", "new tokens", "useful tok/s", "generating (engines)"], rows),
             "", f"Scaling efficiency, tok/s with N ÷ (N × tok/s with 1): **{_f(eff, '{:.3f}')}** (target ≥ "
             f"{_f(target)}: {'quick run' if m.get('quick') else _met(eff, target, 'min')}); per engine-second of "
             f"generation {_f(m.get('generation_scaling_efficiency'), '{:.3f}')}."
             + (f" {m['unpaired']}." if m.get("unpaired") else "")]
    if ram:
        lines += ["", f"Host RAM: {_f(ram.get('per_engine_bytes', 0) / 1e9, '{:.2f}')} GB per engine × "
                  f"{ram.get('engines')} of {_f(ram.get('machine_available_bytes', 0) / 1e9, '{:.1f}')} GB available: "
                  f"**{ram.get('verdict')}** (planned, not measured; each engine pins its own tier)."]
    per = link.get("per_device") or {}
    lines += ["", "Pinned link per GPU, all copying at once: " + (f"not measured ({link['skipped']})."
              if "skipped" in link else ", ".join(f"{d} {_f(r.get('together_gbps'), '{:.1f}')} GB/s (alone "
                                                  f"{_f(r.get('alone_gbps'), '{:.1f}')})" for d, r in per.items())
              + ".")]
    return lines


def t4_profile(d: dict) -> list[str]:
    """benchmarks/t4_profile.py: the T4's limits emulated on a bigger GPU; speeds are predictions from bytes."""
    prof = d.get("profile") or {}
    rows = [["fp16 PPL ÷ bf16 PPL, default model, reference settings", _f(d.get("fp16_ppl_over_bf16"), "{:.5f}"),
             "≤ 1.005", _met(d.get("fp16_ppl_over_bf16"), 1.005, "max")],
            ["70B NF4: bytes moved per decode step (batch 1)", _f((d.get("t4_70b_bytes_per_step") or 0) / 1e9 or None, "{:.2f} GB"), "", ""],
            ["70B NF4: predicted T4 tok/s, batch 1 (PCIe 3, 12.5 GB/s)", _f(d.get("t4_70b_pred_tok_s_bs1_pcie3"), "{:.2f}"),
             "", "prediction"],
            ["70B NF4: predicted T4 tok/s, batch 32 (PCIe 3)", _f(d.get("t4_70b_pred_tok_s_bs32_pcie3"), "{:.1f}"), "",
             "prediction"],
            ["70B NF4: peak VRAM", _f(d.get("t4_70b_peak_vram_gb"), "{:.2f} GB"), f"≤ {prof.get('vram_gb', 15)} GB",
             _met(d.get("t4_70b_peak_vram_gb"), prof.get("vram_gb", 15), "max")],
            ["70B NF4: peak host RAM (process RSS)", _f(d.get("t4_70b_peak_host_ram_gb"), "{:.2f} GB"),
             f"≤ {prof.get('ram_gb', 12)} GB", _met(d.get("t4_70b_peak_host_ram_gb"), prof.get("ram_gb", 12), "max")]]
    return [f"Measured on **{d.get('device', '?')}**: PPL on the default model (real weights), the 70B rows on a "
            f"70B-shaped synthetic NF4 store (speed and memory only). Profile: GPU capped to {prof.get('vram_gb')} GB, host RAM budget {prof.get('ram_gb')} GB, "
            f"compute capability {prof.get('capability')} forced, compute dtype {d.get('t4_70b_dtype')}. "
            f"{d.get('model_note', '')}.", "", *md_table(["figure", "value", "target", ""], rows)]


def uva_bench(d: dict) -> list[str]:
    """A kernel's reads of pinned host RAM: the copy engine, a plain read kernel and the tiered NF4 kernel's
    code launch against the sweep's fastest, per model and projection (every row stays in the JSON)."""
    link = d.get("link_pinned_gbps")
    rows = [["copy engine, pinned host→GPU", _f(link, "{:.1f}"), "1.00", "—"],
            ["plain read kernel, best", _f(d.get("read_best_gbps"), "{:.1f}"), _f(d.get("read_over_link"), "{:.2f}"),
             "—"]]
    for key, b in (d.get("tiered_best") or {}).items():
        best = b.get("best") or {}
        launch = ", ".join(f"{k} {v}" for k, v in best.items() if v not in (None, False))
        rows.append([f"tiered kernel {key}: the sweep's first launch", _f(b.get("default_gbps"), "{:.1f}"),
                     _f(b.get("default_over_link"), "{:.2f}"), "—"])
        rows.append([f"tiered kernel {key}: fastest", _f(b.get("best_gbps"), "{:.1f}"),
                     _f(b.get("best_over_link"), "{:.2f}"), launch or "the code's"])
    return [f"Measured on **{d.get('device', '?')}**, random NF4 experts of the real shapes (speed only). Every "
            "expert in host RAM, calls cycling over the experts (the L2 never holds them). The sweep's first launch "
            "is the code's at the time of the run, reading each image's own code books.", "",
            *md_table(["reader", "GB/s", "of the link", "launch"], rows)]


# Speed benchmarks of the synthetic shapes first (the report's order), then quality benchmarks.
RENDERERS: dict[str, tuple[str, Renderer]] = {
    "stream_bench.json": ("Layer streaming vs AirLLM and accelerate (benchmarks/stream_bench.py)", stream_bench),
    "moe_bench.json": ("MoE shapes: expert streaming (benchmarks/moe_bench.py)", as_found),
    "moe_bench_prompt1024.json": ("MoE shapes, the batch-1 hot set after 1024-token prompts (benchmarks/moe_bench.py "
                                  "--prompt-len 1024, into a copy of moe_bench.json)", as_found),
    "moe_router_ab.json": ("MoE shapes, the fused top-k router against the eager ops: Qwen3-30B-A3B batch 1, each case "
                           "in its own process on one H200 (benchmarks/moe_bench.py *_fusedrouter cases; folded by "
                           "benchmarks/merge_runs.py --changes-only)", moe_ab),
    "moe_specread_ab.json": ("MoE shapes, same-layer speculative reads against direct reads alone (off by default): "
                             "Qwen3-30B-A3B and Mixtral batch 1, each case in its own process on one H200 "
                             "(benchmarks/moe_bench.py *_specread cases; folded by benchmarks/merge_runs.py "
                             "--changes-only)", moe_ab),
    "batch_bench.json": ("Continuous batching and the decode loop (benchmarks/batch_bench.py)", batch_bench),
    "batch_bench_offload.json": ("The decode loop with its TurboQuant cache in host RAM (benchmarks/batch_bench.py "
                                 "--kv tq --kv-offload)", as_found),
    "batch_bench_recheck.json": ("The same loop, --kv tq re-run alone: the planner's TurboQuant choice, its cache "
                                 "offloaded, after the copy_target fix (benchmarks/batch_bench.py --kv tq, into a "
                                 "copy of batch_bench.json)", batch_bench),
    "batch_bench_job.json": ("The decode loop over whole jobs, each run to its end (benchmarks/batch_bench.py "
                             "--seconds 900 --requests 128 --max-new 256)", as_found),
    "scale_bench.json": ("Ray Data: against plain `airquant batch` on one GPU, and across GPUs "
                         "(benchmarks/scale_bench.py)", scale_bench),
    "t4_profile.json": ("A Colab T4 emulated on the H200: predictions, not T4 measurements "
                        "(benchmarks/t4_profile.py)", t4_profile),
    "reliability.json": ("Reliability: injected faults (benchmarks/faults.py)", reliability),
    "verify_bench.json": ("Reliability: checksums on every read (benchmarks/verify_bench.py)", verify_bench),
    "quant_speed.json": ("Compressed layer files, decode speed (benchmarks/quant_speed.py)", quant_speed),
    "kv_bench.json": ("Compressed KV cache on the GPU (benchmarks/kv_bench.py)", kv_bench),
    "kv_bench_bs32.json": ("The same at batch 32 alone, its decode passes traced (benchmarks/kv_bench.py --batches 32 "
                           "--trace)", kv_bench),
    "kv_bench_rerun.json": ("The same, a re-run on another machine (benchmarks/kv_bench.py)", kv_bench),
    "kv_bench_triton.json": ("The same run's machine and store, the TurboQuant history read by the Triton split "
                             "kernel (AIRQUANT_TQ_HISTORY=triton benchmarks/kv_bench.py --batches 8,32)", kv_bench),
    "kv_attention_speed_gluon.json": ("The TurboQuant attention of one layer, the Triton split kernel against the "
                                      "Gluon history kernel (benchmarks/kv_attention_speed.py --paged --sweep short)",
                                      kv_attention_speed),
    "int2_gemv.json": ("Fused int2 GEMV bandwidth (benchmarks/quant_int2_gemv.py)", int2_gemv_table),
    "uva_bench.json": ("Kernel reads of pinned host RAM, tiered NF4 launches (benchmarks/uva_bench.py)", uva_bench),
    "uva_bench_focus.json": ("The same, focused sweep after the code-book and alignment change "
                             "(benchmarks/uva_bench.py --configs focus)", uva_bench),
    "uva_hostmem.json": ("The tiered kernel over host memory made three ways: torch-pinned, registered, registered on "
                         "huge pages (benchmarks/uva_bench.py --host-memory)", uva_bench),
    "quant_quality.json": ("Weight quantization quality (benchmarks/quant_quality.py)", quant_quality),
    "kv_quality.json": ("KV-cache quantization quality (benchmarks/kv_quality.py)", kv_quality),
}
