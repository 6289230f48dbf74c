#!/usr/bin/env python
"""KV cache cost: the decode step at 8K context with each cache, and the 70B batch each leaves room for.

Two measurements (issue #5), written to ``results/kv_bench.json``:

* step: a llama3-8b-shaped bf16 store (random weights in real shapes), every layer resident on the
  GPU (no cap). A prompt of ``--context`` tokens less the new ones at the first of ``--batches``
  sequences, then ``WARM`` warm-up and ``--steps`` timed decode steps (mean; median beside it) with the plain bf16 cache
  (``none``, the issue's "FP16"), AirQuant's TurboQuant K4/V2 (``tq``, window 128, the router's
  preset) and the PyPI ``turboquant`` 0.2.0 (4 bits: one width for K and V). Per cache: prefill time,
  peak VRAM allocated, the part above the weights, and the bytes the cache holds after the prompt
  (``cache_nbytes``). Each further batch of ``--batches`` (e.g. ``8,32``) times ``none`` and ``tq``
  again on the same store: ``tq_over_fp16_step_bs32``, rows under ``details.by_batch``.
* batch: the largest batch under a 15 GB cap for a llama3-70b-shaped NF4 store (manifest only, the
  embedding in host RAM) at that context: the router's arithmetic (``airquant plan``) for ``none``
  and ``tq``; for ``turboquant``, which the router has no scheme for, the same formula with KV bytes
  per token derived from its measured cache, scaled from the 8B shape to the 70B one.

Caps are decimal GB. ``--quick`` runs the whole flow on the CPU with tiny truncated shapes (a test of
the script, not a measurement); VRAM fields are null there.

    python benchmarks/kv_bench.py  # a few minutes on one H200; the 8B store takes ~16 GB in --workdir
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from airquant.config import EngineConfig, GenerateConfig  # noqa: E402
from airquant.engine.memory.router import (  # noqa: E402
    DTYPE_BYTES,
    Candidate,
    Hardware,
    RouteError,
    Workload,
    _costs,
    route,
    tq_config,
    workload_for,
)
from airquant.errors import DependencyError  # noqa: E402
from airquant.eval.benchtables import target  # noqa: E402
from airquant.eval.kvmem import prefill_bytes  # noqa: E402
from airquant.kv import KVConfig, triton_kernel  # noqa: E402
from airquant.quant.kernels import device_capability  # noqa: E402
from airquant.store.synth import SynthSpec, synth  # noqa: E402
from airquant.units import GIB  # noqa: E402
from benchmarks import stream_bench as stream_mod  # noqa: E402
from benchmarks.stream_bench import (  # noqa: E402
    GB,
    Bench,
    bench_device,
    finish_paths,
    free_gpu,
    make_store,
    open_engine,
    prompt_ids,
    trace_steps,
    write_results,
)

log = logging.getLogger("kv_bench")
CACHES = {
    "none": KVConfig(),
    "tq": tq_config(),
    # turboquant 0.2.0 takes one bit-width for K and V (bits_k must equal bits_v).
    "turboquant": KVConfig(backend="turboquant", bits_k=4, bits_v=4, window=128),
}
TARGETS = {"tq_over_fp16_step": (1.15, "max")}  # key: (threshold, "min" | "max"); issue #38
FURTHER = ("none", "tq")  # the caches timed again at each further batch (the package is a comparison at the first)
# Untimed decode steps: Triton compiles its kernels at the first step over a quantized history, and the layer graphs
# take a warm-up call, a capture and a replay a key, then the pass graph's capture and its first replay (as
# graph_host_bench counts them). With one, the H100 run of 2026-12-05 timed those: plain batch-8 steps of 62, 25,
# 23 and 68 ms (median 43.5) where a replayed step took ~23.
WARM = 5


# -- step: decode time and memory per cache --------------------------------------------------------
def measure_cache(b: Bench, engine, ids: torch.Tensor, kv: KVConfig) -> dict:
    """Cache bytes after the prompt, then prefill and the mean decode step of a timed generation."""
    cache_bytes = prefill_bytes(engine, ids, kv)  # also warms up the prefill path at this shape
    engine.release_kv()  # the previous case's cache, kept for the layer graphs, is not the weights
    free_gpu()
    cuda = engine.device.type == "cuda"
    weights = torch.cuda.memory_allocated(engine.device) / GB if cuda else None
    engine.reset_stats()
    graphs = dict(engine.stats().get("layer_graphs") or {})
    gen = GenerateConfig(max_new_tokens=1 + WARM + b.args.steps, ignore_eos=True)
    out = engine.generate_requests([engine.request(row, gen) for row in ids.tolist()], kv=kv)
    assert all(c.new_tokens == gen.max_new_tokens for c in out)
    t = engine.last_timings
    stats = engine.stats()
    peak = stats.get("peak_vram_allocated_gb")
    # the layer graphs' counters over this generation (replays, captures, eager calls, whole-pass replays): whether
    # its decode steps ran under graphs (none on the CPU)
    graphs = {k: v - graphs.get(k, 0) for k, v in (stats.get("layer_graphs") or {}).items()} or None
    timed = t["step_s"][WARM:]
    # the mean over the timed steps: a TurboQuant cache's window flushes (every ``block`` steps) are part of its
    # cost, which a median over a window shorter than a flush period leaves out; the median beside it
    # the host's time to queue each timed step (``host_s``): near the step's own, the step waited for the host
    host = t.get("host_s", [])[WARM:]  # none where transformers' generate ran (the PyPI turboquant)
    # the TurboQuant kernel's autotuned tiles so far (its key leaves the batch out: the first batch's tiles run
    # the later ones), to tell runs whose figures differ apart
    kernel = sys.modules.get("airquant.kv.triton_kernel") if kv is not None and kv.backend == "tq" else None
    return {"step_s": statistics.fmean(timed), "step_median_s": statistics.median(timed), "steps_s": t["step_s"],
            "kernel_tiles": kernel.chosen_tiles() if kernel is not None else None,
            "step_host_s": statistics.fmean(host) if host else None,
            "warmup_steps": WARM, "prefill_s": t["prefill_s"],
            "cache_bytes": cache_bytes, "cache_bytes_per_token": cache_bytes / ids.numel(),
            "weights_vram_gb": weights, "peak_vram_gb": peak,
            "cache_vram_gb": peak - weights if cuda else None, "layer_graphs": graphs}


def history_kernel(device: torch.device, head_dim: int) -> str:
    """What reads the TurboQuant history of this run's decode calls (K4/V2, a few query rows a KV head, the model's
    half-precision dtype): ``triton_kernel.history_reader`` on this device, "torch" without Triton."""
    cap = device_capability(device) if device.type == "cuda" else None
    return "torch" if triton_kernel.triton is None else triton_kernel.history_reader(head_dim, cap)


def part_step(b: Bench) -> dict:
    """One row per cache on the 8B-shaped store (``{"error": ...}``: out of memory, or the package is missing) at the
    first batch; ``none`` and ``tq`` again at each further batch (``details.by_batch``)."""
    a = b.args
    store = make_store(b, "llama3-8b", "bfloat16", a.layers)
    dims = Candidate.open(store).dims
    b.results["settings"]["dims_8b"] = asdict(dims)
    b.results["settings"]["tq_history_kernel"] = history_kernel(b.device, dims.head_dim)
    first, by_batch = {}, {}

    def save() -> None:  # after every case: a later case that crashes keeps the earlier ones
        record(b, first, {}, by_batch)
        write_results(b, Path(a.out))

    step_rows(b, store, a.batch, CACHES, first, save, describe=True)
    for batch in a.batches[1:]:
        step_rows(b, store, batch, {name: CACHES[name] for name in FURTHER}, by_batch.setdefault(str(batch), {}),
                  save)
    if a.trace:  # after every row is timed: the profiler slows what runs after it in the process
        for batch, rows in ((a.batch, first), *((n, by_batch[str(n)]) for n in a.batches[1:])):
            trace_rows(b, store, batch, rows)
            save()
    b.drop(store)
    return first


def step_rows(b: Bench, store: Path, batch: int, caches: dict, rows: dict, save, describe: bool = False) -> None:
    """``caches`` timed at ``batch`` into ``rows``, ``save()`` after each; ``describe``: the plan into settings."""
    a = b.args
    engine = open_engine(b, store, None, batch_size=batch, context=a.context)
    if describe:
        b.results["settings"]["plan_8b"] = engine.plan.describe(engine.manifest.layer_bytes)
        b.results["settings"]["resident_layers_8b"] = len(engine.plan.vram_layers)
    ids = step_prompts(b, engine, batch)
    for name, kv in caches.items():
        try:
            rows[name] = {**measure_cache(b, engine, ids, kv), "after_profiler": stream_mod.PROFILED}
            log.info("batch %d, %s: %.4f s/step, prefill %.2f s, cache %.3f GB", batch, name, rows[name]["step_s"],
                     rows[name]["prefill_s"], rows[name]["cache_bytes"] / GB)
        except torch.OutOfMemoryError as exc:
            rows[name] = {"error": f"out of memory: {str(exc).splitlines()[0]}"}
        except DependencyError as exc:
            rows[name] = {"error": str(exc)}
        if "error" in rows[name]:
            log.warning("batch %d, %s: %s", batch, name, rows[name]["error"])
        free_gpu()
        save()
    engine.close()
    del engine
    free_gpu()


def step_prompts(b: Bench, engine, batch: int) -> torch.Tensor:
    """The prompts a batch's rows are timed (and traced) with: as long as the cache ends at ``--context`` tokens."""
    vocab = min(engine.config.vocab_size, len(engine.tokenizer))
    return prompt_ids(vocab, batch, b.args.context - 1 - WARM - b.args.steps)


def trace_rows(b: Bench, store: Path, batch: int, rows: dict) -> None:
    """``--trace``: where each timed ``FURTHER`` cache's step goes at ``batch`` (``rows[name]["trace"]``), on an
    engine of its own, after every row is timed (torch's profiler leaves CUPTI attached once it stops, and what
    runs after it pays for that: ``stream_bench.PROFILED``)."""
    a = b.args
    engine = open_engine(b, store, None, batch_size=batch, context=a.context)
    ids = step_prompts(b, engine, batch)
    try:
        for name in FURTHER:
            if name in rows and "error" not in rows[name]:
                rows[name]["trace"] = trace_steps(b, engine, ids, f"kv-{name}-bs{batch}", kv=CACHES[name],
                                                  new=min(a.steps, 8))
    finally:
        engine.close()
        del engine
        free_gpu()


# -- batch: the largest 70B NF4 batch under the cap ------------------------------------------------
def part_batch(b: Bench, turboquant_per_token_8b: float | None) -> dict:
    """The router's largest batch per cache; turboquant's from its measured bytes per token."""
    from transformers import AutoTokenizer

    a = b.args
    store = b.store_path("llama3-70b-nf4-manifest")
    tok = AutoTokenizer.from_pretrained(a.tokenizer) if a.tokenizer else None
    synth(SynthSpec("llama3-70b", "nf4"), store, manifest_only=True, progress=False, tokenizer=tok)
    cand = Candidate.open(store)
    hw = Hardware.detect("cuda", max_vram_gb=a.cap_gb * GB / GIB)
    wl = workload_for(EngineConfig(kv_offload=False), context=a.context, host_embedding=True)
    out = {}
    for scheme in ("none", "tq"):
        per_token = cand.dims.kv_bytes(scheme, a.context, DTYPE_BYTES["bfloat16"]) / a.context
        try:
            r = route([cand], hw, wl.updated(kv_schemes=(scheme,)))
            out[scheme] = {"max_batch": r.max_batch, "mode": r.mode, "lines": list(r.lines),
                           "kv_bytes_per_token": per_token}
        except RouteError as exc:
            out[scheme] = {"max_batch": 0, "error": str(exc), "kv_bytes_per_token": per_token}
    out["turboquant"] = turboquant_batch(b, cand, hw, wl, out["tq"].get("mode", "streamed"), turboquant_per_token_8b)
    b.drop(store)
    return out


def turboquant_batch(b: Bench, cand: Candidate, hw: Hardware, wl: Workload, mode: str,
                     per_token_8b: float | None) -> dict:
    """The router's formula with turboquant's KV bytes: measured per token on the 8B shape, scaled to 70B."""
    if per_token_8b is None:
        return {"max_batch": None, "error": "turboquant was not measured (see cases.turboquant)"}
    small = b.results["settings"]["dims_8b"]
    d = cand.dims
    scale = d.num_layers * d.kv_heads * d.head_dim / (small["num_layers"] * small["kv_heads"] * small["head_dim"])
    per_token = per_token_8b * scale
    costs = _costs(cand, "none", hw, wl, b.args.context)
    costs = replace(costs, one=replace(costs.one, kv=int(per_token * b.args.context)))
    batch = costs.max_batch(mode, hw.plan_vram)  # the one planner's budget: the cap less its allocator margin
    return {"max_batch": batch, "mode": mode, "kv_bytes_per_token": per_token,
            "lines": [f"turboquant {mode} (derived): {costs.formula(mode, max(batch, 1))}"],
            "derived": f"cache_nbytes of turboquant's cache after the 8B prompt, {per_token_8b:.1f} B/token, "
                       f"x {scale:g} (layers x kv_heads x head_dim, 70B over the measured store)"}


# -- reporting -------------------------------------------------------------------------------------
def record(b: Bench, cases: dict, plans: dict, by_batch: dict | None = None) -> None:
    """The keys from the first batch's ``cases``, the 70B ``plans`` and the further batches' rows (``by_batch``;
    None: those the file already holds)."""
    r = b.results
    if by_batch is None:
        by_batch = r.get("details", {}).get("by_batch", {})

    def per_cache(key: str, rows: dict = cases) -> dict:
        return {name: rows.get(name, {}).get(key) for name in CACHES}

    for key in ("step_s", "prefill_s", "peak_vram_gb", "cache_vram_gb"):
        r[key] = per_cache(key)
    r["cache_gb"] = {name: None if v is None else v / GB for name, v in per_cache("cache_bytes").items()}
    r["tq_over_fp16_step"] = _ratio(r["step_s"]["tq"], r["step_s"]["none"])
    r["turboquant_over_fp16_step"] = _ratio(r["step_s"]["turboquant"], r["step_s"]["none"])
    if plans:
        r["max_batch_70b_nf4_15gb"] = per_cache("max_batch", plans)
        r["kv_bytes_per_token_70b"] = per_cache("kv_bytes_per_token", plans)
    for batch, rows in by_batch.items():
        r[f"tq_over_fp16_step_bs{batch}"] = _ratio(rows.get("tq", {}).get("step_s"), rows.get("none", {}).get("step_s"))
    r["targets"] = check_targets(r)
    r["details"] = {"cases": cases, "batch_70b": plans, "by_batch": by_batch}


def check_targets(r: dict) -> dict:
    targets = dict(TARGETS)
    for key in [k for k in r if k.startswith("tq_over_fp16_step_bs")]:  # the same bar at every further batch
        targets[key] = TARGETS["tq_over_fp16_step"]
    return {key: target(r.get(key), *bar) for key, bar in targets.items()}


def _ratio(num: float | None, den: float | None) -> float | None:
    return num / den if num is not None and den else None


def versions() -> dict:
    from airquant.eval.rows import package_versions

    out = package_versions(("turboquant", "triton", "scipy"))
    out["cuda"] = torch.version.cuda
    return out


def print_table(b: Bench) -> None:
    r = b.results
    fmt = lambda v, f="{:.4f}": "-" if v is None else f.format(v)  # noqa: E731
    print(f"\nkv_bench on {r['device']} ({'QUICK: tiny shapes, not a measurement' if b.quick else 'real shapes'}): "
          f"llama3-8b bf16, context {r['context']}, batch {r['batch']}")
    print(f"  {'cache':<11} {'step s':>8} {'x plain':>8} {'prefill s':>10} {'peak GB':>8} {'above wts GB':>13} "
          f"{'cache GB':>9} {'70B NF4 batch @' + str(b.args.cap_gb) + ' GB':>22}")
    for name in CACHES:
        error = r["details"]["cases"][name].get("error")
        if error:
            print(f"  {name:<11} {error[:100]}")
            continue
        ratio = _ratio(r["step_s"][name], r["step_s"]["none"])
        print(f"  {name:<11} {fmt(r['step_s'][name]):>8} {fmt(ratio, '{:.2f}'):>8} {fmt(r['prefill_s'][name], '{:.2f}'):>10} {fmt(r['peak_vram_gb'][name], '{:.2f}'):>8}"
              f" {fmt(r['cache_vram_gb'][name], '{:.2f}'):>13} {fmt(r['cache_gb'][name], '{:.3f}'):>9}"
              f" {fmt(r.get('max_batch_70b_nf4_15gb', {}).get(name), '{:d}'):>22}")
    for batch, rows in (r["details"].get("by_batch") or {}).items():
        print(f"  batch {batch}: " + ", ".join(f"{name} {fmt(row.get('step_s'))} s/step" if "error" not in row
                                              else f"{name} {row['error'][:60]}" for name, row in rows.items()))
    print("targets:")
    for key, t in r["targets"].items():
        verdict = "not measured" if t["met"] is None else ("met" if t["met"] else "MISSED")
        print(f"  {key:<20} {fmt(t['value'], '{:.3f}')}  target {'>=' if t['kind'] == 'min' else '<='} "
              f"{t['target']:g}: {verdict}")


# -- main ------------------------------------------------------------------------------------------
def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=None,
                   help="the JSON written (default: results/kv_bench.json, or WORKDIR/results/ with --quick)")
    p.add_argument("--workdir", default=str(REPO / "bench-work"), help="where the synthetic stores are written")
    p.add_argument("--quick", action="store_true", help="tiny truncated shapes on the CPU: tests the script")
    p.add_argument("--part", choices=["all", "batch"], default="all",
                   help="batch: only re-derive the 70B largest batches (planner arithmetic, any machine) from "
                        "the decode measurements already in --out")
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    p.add_argument("--keep-stores", action="store_true", help="keep the stores (and reuse them next run)")
    p.add_argument("--context", type=int, default=8192, help="tokens per sequence at the last decode step")
    p.add_argument("--batches", default="8",
                   help="comma list: every cache at the first, none and tq again at each further one (e.g. 8,32)")
    p.add_argument("--steps", type=int, default=32,
                   help="timed decode steps after the warm-up ones (32: one flush period of the tq window's blocks)")
    p.add_argument("--cap-gb", type=float, default=15.0, help="GPU cap (GB) of the 70B largest-batch plan")
    p.add_argument("--layers", type=int, default=None, help="truncate the 8B shape (default: all 32 layers)")
    p.add_argument("--trace", action="store_true",
                   help="also profile the plain and TQ generations at each batch (prefill included): device time "
                        "by kind and the top ops, under details.cases.<cache>.trace (further batches: "
                        "details.by_batch.<batch>.<cache>.trace)")
    p.add_argument("--trace-dir", default=None, metavar="DIR", help="and write their timelines there (gzipped)")
    p.add_argument("--tokenizer", default=str(REPO / "tests" / "data" / "smollm2_tokenizer"),
                   help="tokenizer folder for the stores (default: the SmolLM2 tokenizer shipped in tests/data)")
    args = p.parse_args(argv)
    try:
        args.batches = [int(x) for x in args.batches.split(",") if x.strip()]
    except ValueError:
        p.error(f"--batches {args.batches!r}: give whole numbers separated by commas, e.g. 8,32")
    if not args.batches or min(args.batches) < 1:
        p.error("--batches needs at least one batch size of 1 or more")
    if args.quick:  # past the 128-token window and some 32-token blocks, so the quantized history is used
        args.context, args.batches = min(args.context, 300), [min(x, 2) if i == 0 else min(x, 3)
                                                             for i, x in enumerate(args.batches)]
        args.steps = min(args.steps, 4)
    # A batch once: a further batch equal to the first is timed as the first (record() takes its rows, by_batch)
    args.batches = list(dict.fromkeys(args.batches))
    args.batch = args.batches[0]
    finish_paths(args, "kv_bench.json")
    return args


def main(argv=None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    args = parse_args(argv)
    device = bench_device(args)
    out = Path(args.out)
    if args.part == "batch":
        return rederive_batches(args, device, out)
    b = Bench(args, device)
    b.results.update(device=torch.cuda.get_device_name(0) if device.type == "cuda" else "cpu", synthetic=True,
                     quick=args.quick, versions=versions(), context=args.context, batch=args.batch,
                     batches=args.batches,
                     settings={"caches": {name: asdict(kv) for name, kv in CACHES.items()}, "steps": args.steps,
                               "warmup_steps": WARM, "prompt_len": args.context - 1 - WARM - args.steps,
                               "store_8b": "llama3-8b bfloat16 (synthetic), no VRAM cap",
                               "store_70b": "llama3-70b nf4 (manifest only), embedding in host RAM",
                               "cap_gb": args.cap_gb, "layers_8b": 2 if args.quick else args.layers})
    start = time.perf_counter()
    cases = part_step(b)
    turboquant = cases["turboquant"].get("cache_bytes_per_token")
    record(b, cases, part_batch(b, turboquant))
    b.results["seconds"] = time.perf_counter() - start
    write_results(b, out)
    print_table(b)
    print(f"\nwrote {out}")
    return 0


def rederive_batches(args, device: torch.device, out: Path) -> int:
    """The 70B largest-batch part again (e.g. after a planner change), keeping the measured decode cases."""
    if not out.is_file():
        raise SystemExit(f"{out}: no earlier kv_bench run to update; run the whole benchmark (without --part).")
    b = Bench(args, device, results=json.loads(out.read_text()))
    cases = b.results["details"]["cases"]
    record(b, cases, part_batch(b, cases.get("turboquant", {}).get("cache_bytes_per_token")))
    b.results["batch_rederived"] = time.strftime("%Y-%m-%dT%H:%M:%S")
    write_results(b, out)
    print_table(b)
    print(f"\nupdated the 70B batches in {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
