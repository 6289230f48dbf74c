#!/usr/bin/env python
r"""Continuous batching against static batching on a streamed 70B, and the batch-1 step against the link.

Parts, each one device command well under the 600 s limit (results merged part by part into ``--out``):

* ``build``: a llama3-70b-shaped NF4 store written on the GPU, ~39 GB on disk.
* ``static``: static batching (``airquant batch`` before the decode loop): the requests in batches of ``--slots``
  through the same loop and kernels, a batch holding its slots until its longest sequence ends.
* ``continuous``: the same requests, same order, same slots through one decode loop (continuous batching).
* ``bs1_8b``: a llama3-8b-shaped bf16 store under a 4 GB cap (built if absent, ~16 GB), batch-1 decode step
  against the pinned host->GPU link: ``bs1_link_fraction`` = (bytes per step / step) / link.
* ``cpu_mixed``: the default model on CPU, 48 mixed chat prompts, 16 slots, max 256 new tokens, greedy: static vs
  continuous utilization and wall time (the figures in docs/BATCH_AND_RAY.md). ``report``: the table from the JSON.

Requests: ``--requests`` (512), prompt lengths uniform in 128..1024 tokens, ``max_new_tokens`` drawn (seed 0) from
a geometric distribution of mean 150 (p = 1/150) clipped to 1..512 (``--max-new``; random weights never stop by
themselves, so a request's own ``max_new_tokens`` stands in for its EOS); both parts take them longest prompt
first, the order ``airquant batch`` feeds either path. ``--kv none`` (the baseline, the ``continuous_*`` keys):
plain KV on the device at the most slots the router allows under the cap, the reserve planned for the decode loop's
passes as ``airquant batch`` plans it (``prefill="chunked"``). ``--kv tq`` (``continuous_tq_*``, ``tq_slots``) and
``--kv auto`` (``continuous_auto_*``, ``auto_slots``, ``auto_kv``) run the throughput planner's choice of offload,
slots and placement (``engine/memory/throughput.py``), what ``airquant batch --batch-size auto --kv tq|auto`` runs:
the format fixed to TurboQuant K4/V2, or chosen too.
``--slots`` and ``--kv-offload`` override; a continuous row whose placement ``--kv-offload`` / ``--no-kv-offload``
pins is named after it (``continuous_tq_device_*``, ``continuous_plain_offload_*``, ...: ``row_name``), so that
the placements the planner passed over run beside its pick (static keeps its keys: ``continuous_over_static`` pairs
the unpinned rows). Both parts record them, and ``continuous_over_static`` (plain) is written only when the two
parts ran with the same settings. ``tq_over_plain_useful_tok_s`` (and ``_steady_``), ``tq_slots_over_plain`` and
``auto_over_best_useful_tok_s`` (over every measured row; ``auto_best_row`` names the best) compare the KV rows with
plain continuous where they ran the same request stream for the same ``--seconds``; ``targets`` holds issue #38's
bars (``report`` recomputes both).

Time budget, no extrapolation: a streamed 70B pass takes ~0.6 s, so all 512 requests (~1300 passes at 64 slots)
do not fit one command. ``static`` and ``continuous`` each measure a window of ``--seconds`` (300) of wall time,
after the same warm-up of a few passes: the budget is checked between passes (a pass that would end past it by the
last pass's time is not started), and what ran is recorded: useful (generated) tokens, passes, requests admitted
and finished, ``*_slot_utilization`` = useful tokens / (slots x passes), ``*_useful_tok_s`` = useful tokens / wall.
These keys cover the whole window, prefill ramp included; ``*_steady_*`` count from the first pass in which every
slot produced a token. ``continuous_over_static`` = continuous_useful_tok_s / static_useful_tok_s, the ratio of
the two window rates (the JSON's ``method`` says so). A static window cut inside a batch overstates static (its
utilization only falls within a batch), so the ratio errs low.

On the H200 (``/tmp`` survives between commands while the machine stays warm; the repository copy does not, so
every command writes to /tmp/results and copies the JSON back through $OUT), in this order:

    # 1. build, ~150-240 s (store on the GPU; skip when /tmp/bb/llama3-70b-nf4/manifest.json exists)
    . benchmarks/device_env.sh && python benchmarks/batch_bench.py --part build
    # 2. static, ~360-420 s: import ~10, plan + open (70B layers pinned in RAM) ~30-70, warm-up ~5-30, window 300
    . benchmarks/device_env.sh && python benchmarks/batch_bench.py --part static --out /tmp/results/batch_bench.json \
        && cp /tmp/results/batch_bench.json $OUT/
    # 3. continuous, ~360-420 s (as 2)
    . benchmarks/device_env.sh && python benchmarks/batch_bench.py --part continuous \
        --out /tmp/results/batch_bench.json && cp /tmp/results/batch_bench.json $OUT/
    # 4. bs1_8b, ~120-200 s: the 70B store goes first (39 + 16 GB on a 64 GB disk); 8B build ~60-120, run ~30
    rm -rf /tmp/bb/llama3-70b-nf4 && . benchmarks/device_env.sh && python benchmarks/batch_bench.py \
        --part bs1_8b --out /tmp/results/batch_bench.json && cp /tmp/results/batch_bench.json $OUT/

A lost machine loses /tmp: rebuild (1), and carry the last JSON back into /tmp/results before 3 or 4.
``--quick`` runs every part on CPU on tiny random shapes (a test of the script, not a measurement).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # run from a checkout without installing
os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")

import torch  # noqa: E402
import transformers  # noqa: E402

from airquant.engine.decode import Request  # noqa: E402
from airquant.engine.runner import Engine  # noqa: E402
from airquant.eval.benchtables import target  # noqa: E402
from airquant.kv import KVConfig  # noqa: E402
from benchmarks import stream_bench as stream_mod  # noqa: E402
from benchmarks.batch_window import longest_first, run_continuous, run_static  # noqa: E402

log = logging.getLogger("batch_bench")
MEAN_NEW, MAX_NEW, PROMPT_RANGE = 150, 512, (128, 1024)


def workload(n: int, vocab: int, seed: int = 0, prompt_range=PROMPT_RANGE, mean_new=MEAN_NEW,
             max_new=MAX_NEW) -> list[Request]:
    """The stated distribution: prompt lengths uniform, new tokens geometric (mean ``mean_new``), clipped."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(prompt_range[0], prompt_range[1] + 1, (n,), generator=g).tolist()
    u = torch.rand(n, generator=g, dtype=torch.float64)
    new = torch.ceil(torch.log1p(-u) / torch.log1p(torch.tensor(-1.0 / mean_new, dtype=torch.float64)))
    new = new.clamp(1, max_new).long().tolist()
    return [Request(tuple(torch.randint(100, vocab - 1, (p,), generator=g).tolist()), m, ignore_eos=True)
            for p, m in zip(lengths, new)]


def plan_slots(store: Path, cap_gb: float | None, context: int, kv: str, offload: bool | None, limit: int):
    """Slots and KV cache the router allows under the cap (CPU: ``limit``)."""
    from airquant.config import EngineConfig
    from airquant.engine.memory.router import Candidate, Hardware, route, workload_for

    if cap_gb is None:
        return limit, kv, False
    hw = Hardware.detect("cuda", max_vram_gb=cap_gb * 1e9 / (1 << 30))
    wl = workload_for(EngineConfig(prefill="chunked"), batch_size=1, context=context, mode="streamed",
                      kv_schemes=(kv,), kv_offload=offload, host_embedding=True)
    r = route([Candidate.open(store)], hw, wl)
    return min(limit, r.max_batch), r.kv, r.kv_offload


def plan_mix(store: Path, args, requests: list[Request], kv_schemes=("none", "tq")):
    """``--kv auto`` (and ``tq``): the throughput planner's KV format (one of ``kv_schemes``), offload, slots and
    placement for these requests (``engine/memory/throughput.choose_mix``, what ``airquant batch --batch-size auto
    --kv auto|tq`` runs)."""
    from airquant.config import EngineConfig
    from airquant.engine.memory.router import Candidate, Hardware
    from airquant.engine.memory.throughput import JobShape, choose_mix

    job = JobShape(tuple(len(r.prompt_ids) for r in requests), tuple(r.max_new_tokens for r in requests), "bench")
    if args.quick:
        hw, link = Hardware(None, 8 << 30), None
    else:
        hw, link = Hardware.detect("cuda", max_vram_gb=args.cap_gb * 1e9 / (1 << 30)), pinned_link_gbps(False)
    cfg = EngineConfig(host_embedding=not args.quick, kv_offload=args.kv_offload)
    mix = choose_mix(Candidate.open(store), hw, cfg, job, link_gbps=link, max_slots=args.slots, kv_schemes=kv_schemes)
    log.info("throughput plan:\n%s", mix.describe())
    return mix


def open_engine(store: Path, args, slots: int, context: int, offload: bool, kv_cache: str = "none",
                placement=None):
    from airquant.config import EngineConfig

    cfg = EngineConfig(device="cpu" if args.quick else "cuda", max_vram_gb=None if args.quick else args.cap_gb * 1e9
                       / (1 << 30), batch_size=slots, context=context, host_embedding=not args.quick,
                       kv_offload=offload, kv_cache=kv_cache, prefill="chunked")  # as airquant batch runs
    return Engine.open(store, cfg, placement=placement)


def warm_up(engine, slots: int, kv, vocab: int) -> float:
    """A few passes outside the window, through a loop of ``slots`` slots: ``2 x slots`` 16-token prompts of 1..3
    new tokens, so prefill-only, mixed and decode-only passes all run once (allocation, kernel compilation and
    autotuning) before the first measured pass. Both parts make the same warm-up; a TurboQuant one's prompts are
    longer than its window, so that its history path (the Triton kernel over the pages, the flush) is compiled
    and tuned here too, not in the window's first passes (a 16-token prompt leaves no history behind a 128-token
    window)."""
    start = time.perf_counter()
    length = 16 if kv is None else kv.sink + kv.window + kv.block + 16
    loop = engine.decode_loop(slots, context=length + 4, kv=kv)
    loop.run([Request(tuple(min(100 + k + i, vocab - 1) for i in range(length)), 1 + k % 3, ignore_eos=True)
              for k in range(2 * slots)])
    return time.perf_counter() - start


SAME = ("slots", "kv", "kv_offload", "requests", "context", "distribution", "order")
METHOD = ("continuous_over_static = continuous_useful_tok_s / static_useful_tok_s. Each rate is useful (generated) "
          "tokens / wall seconds over the window its part ran (--seconds each, checked between passes), on the same "
          "request stream in the same order (longest prompt first, as airquant batch feeds both paths) with the same "
          "slots, after the same warm-up. The keys use the whole window (prefill ramp included); *_steady_* count "
          "from the first pass in which every slot produced a token. slot_utilization = useful tokens / (slots x "
          "passes) over the continuous window. Nothing is extrapolated to the requests the window did not reach; a "
          "static window cut inside a batch overstates static (its utilization only falls within a batch), so the "
          "ratio errs low.")


def part_batch(args, which: str, results: dict) -> None:
    store = Path(args.store)
    vocab = json.loads((store / "config.json").read_text())["vocab_size"]
    requests = workload(args.requests, vocab, prompt_range=args.prompt_range, mean_new=args.mean_new,
                        max_new=args.max_new)
    context = max(len(r.prompt_ids) + r.max_new_tokens for r in requests)
    placement, planned = None, {}
    if args.kv in ("auto", "tq"):  # as airquant batch --kv auto|tq plans them
        mix = plan_mix(store, args, requests, ("none", "tq") if args.kv == "auto" else ("tq",))
        slots, kv_name, offload, placement = mix.choice.slots, mix.choice.kv, mix.choice.offload, mix.choice.plan
        planned = {"plan_pass_s": mix.choice.pass_s, "plan_kv_link_gb": mix.choice.kv_link_bytes / 1e9,
                   "link_gbps": mix.link_gbps}
    else:
        slots, kv_name, offload = plan_slots(store, None if args.quick else args.cap_gb, context, args.kv,
                                             args.kv_offload, args.slots)
    kv = KVConfig(backend="tq", bits_k=4, bits_v=2, window=128) if kv_name == "tq" else None
    settings = {"slots": slots, "kv": kv_name, "kv_offload": offload, "requests": len(requests), "context": context,
                "distribution": f"prompt uniform {args.prompt_range}, new tokens geometric mean {args.mean_new} "
                f"clipped to 1..{args.max_new}, seed 0", "order": "longest prompt first", **planned}
    engine = open_engine(store, args, slots, context, offload, kv_cache=kv_name, placement=placement)
    # Each --kv a row of its own: plain keeps the keys it always had; tq and auto (the throughput planner's
    # choice) get continuous_tq_* / continuous_auto_* and their settings as tq_* / auto_*; a placement pinned by
    # --kv-offload / --no-kv-offload names the row after it (row_name).
    name = row_name(args.kv, args.kv_offload if which == "continuous" else None)
    prefix = f"{which}_{name}" if name else which
    after_profiler = stream_mod.PROFILED  # a trace earlier in this process slows the window (stream_bench.PROFILED)
    try:
        warm = warm_up(engine, slots, kv, vocab)
        order = longest_first(requests)
        if which == "static":
            measured = run_static(engine, order, slots, kv, args.static_batches, args.seconds, prefix=prefix)
        else:
            measured = run_continuous(engine, order, slots, kv, context, args.seconds, prefix=prefix,
                                      trace_passes=args.trace_passes, trace_dir=args.trace_dir,
                                      trace_ramp=args.trace_ramp)
    finally:
        engine.close()
    link_floor(measured.get(f"{prefix}_trace"), planned.get("link_gbps"))
    shown = {f"{name}_{k}" if name else k: v for k, v in settings.items()}
    for key in (f"{prefix}_trace", f"{prefix}_ramp_trace", f"{prefix}_ramp_traced"):
        if key not in measured:  # an earlier run's trace of this row does not describe this window
            results.pop(key, None)
    device = "cpu" if args.quick else torch.cuda.get_device_name()
    results.update({**shown, **measured, f"{prefix}_settings": settings, f"{prefix}_warmup_s": warm,
                    f"{prefix}_after_profiler": after_profiler,
                    f"{prefix}_device": device, "method": METHOD, "synthetic": True, "quick": args.quick,
                    "device": device})
    compare(results)
    compare_kv(results)


def link_floor(trace: dict | None, link_gbps: float | None) -> None:
    """A traced pass against its bytes: ``last_pass_link_floor_ms`` = the pass's host-to-device bytes (weights and
    an offloaded cache's) over the pinned link measured before the run, and ``last_pass_over_link_floor`` = its
    wall over that: 1.0 is a pass that costs its bytes on the link and nothing more (issue #38's offload item)."""
    if not trace or not link_gbps or not trace.get("last_pass_memcpy_htod_gb"):
        return
    floor_ms = trace["last_pass_memcpy_htod_gb"] / link_gbps * 1e3
    trace["last_pass_link_floor_ms"] = floor_ms
    trace["last_pass_over_link_floor"] = trace["last_pass_wall_ms"] / floor_ms


def compare(results: dict) -> None:
    """``continuous_over_static`` when both parts ran with the same settings on the same card; otherwise none (and
    why)."""
    a, b = results.get("static_settings"), results.get("continuous_settings")
    results.pop("continuous_over_static", None)
    if a is None or b is None:
        return
    differ = [k for k in SAME if a.get(k) != b.get(k)] + other_card(results, "static", "continuous")
    if differ:
        results["continuous_over_static_missing"] = f"static and continuous ran with different {', '.join(differ)}"
        log.warning("no continuous_over_static: %s", results["continuous_over_static_missing"])
    elif results["static_useful_tok_s"]:
        results.pop("continuous_over_static_missing", None)
        results["continuous_over_static"] = results["continuous_useful_tok_s"] / results["static_useful_tok_s"]


def other_card(results: dict, row: str, base: str) -> list[str]:
    """``["device (A vs B)"]`` where ``row`` and ``base`` (key prefixes) ran on different cards, or either was written
    before rows named theirs: such rows are not compared; else []."""
    device = results.get(f"{row}_device"), results.get(f"{base}_device")
    if device[0] is None or device[0] != device[1]:
        return [f"device ({device[0] or 'not recorded'} vs {device[1] or 'not recorded'})"]
    return []


# --kv-offload / --no-kv-offload pin the cache's placement: such a row is named after it, so that a placement the
# planner passed over is measured beside its pick (auto_over_best is over every measured row).
PLACED = {True: "offload", False: "device"}
KV_ROWS = ("tq", "auto", *(f"{kv}_{where}" for kv in ("plain", "tq", "auto") for where in PLACED.values()))


def row_name(kv: str, offload: bool | None) -> str:
    """A continuous row's name in the results (its keys ``continuous_{name}_*``, its settings ``{name}_*``): ''
    for plain (the ``continuous_*`` keys), ``tq`` / ``auto`` for the planner's placement, or with the placement
    pinned ``plain_device``, ``tq_offload``, ``auto_device``, ..."""
    if offload is None:
        return "" if kv == "none" else kv
    return f"{'plain' if kv == 'none' else kv}_{PLACED[offload]}"


# Issue #38: TurboQuant rows against plain on the same request stream and window. key: (threshold, kind).
TARGETS = {"tq_over_plain_useful_tok_s": (3.0, "min"), "tq_slots_over_plain": (4.0, "min"),
           "auto_over_best_useful_tok_s": (0.95, "min")}
STREAM = ("requests", "context", "distribution", "order")  # what the KV rows must share with plain to compare


def differences(results: dict, row: str, base: str) -> list[str]:
    """What the rows ``row`` and ``base`` (key prefixes: ``continuous``, ``continuous_tq``, ...) ran differently:
    the request stream (``STREAM``), the window, the card; [] where they compare."""
    a, b = results[f"{row}_settings"], results[f"{base}_settings"]
    differ = [k for k in STREAM if a.get(k) != b.get(k)]
    window = results.get(f"{row}_budget_s"), results.get(f"{base}_budget_s")
    if window[0] != window[1]:
        differ.append(f"window ({window[0]} s vs {window[1]} s)")
    return differ + other_card(results, row, base)


def compare_kv(results: dict) -> None:
    """The KV rows (``--kv tq`` / ``auto``, and rows of a pinned placement, ``KV_ROWS``) over plain continuous,
    where they ran the same request stream for the same window on the same card: whole-window and steady rates,
    slots; ``auto_over_best`` = auto / the best measured row, ``auto_best_row`` names it. Rows that differ get no
    ratio and say why (``kv_ratios_missing``); ``targets`` checks the issue's bars. Without a plain row (a file of
    whole jobs, where plain would take the longest), the rows are compared with the TurboQuant row (else the
    first one measured), and ``auto_over_best`` sets auto against the rows beside it."""
    for key in ("tq_over_plain_useful_tok_s", "tq_over_plain_steady_useful_tok_s", "tq_slots_over_plain",
                "auto_over_best_useful_tok_s", "auto_best_row", "kv_ratios_missing", "targets"):
        results.pop(key, None)
    ran = {name: f"continuous_{name}" for name in KV_ROWS if f"continuous_{name}_settings" in results}
    if "continuous_settings" in results:
        base = ("plain", "continuous")
    elif "auto" in ran and len(ran) > 1:
        first = "tq" if "tq" in ran else next(n for n in ran if n != "auto")
        base = (first, ran.pop(first))
    else:
        return
    rates = {base[0]: results.get(f"{base[1]}_useful_tok_s")}
    missing = []
    for name, row in ran.items():
        differ = differences(results, row, base[1])
        if differ:
            missing.append(f"{name} and {base[0]} ran with different {', '.join(differ)}")
            continue
        rates[name] = results[f"{row}_useful_tok_s"]
        if name == "tq" and base[0] == "plain":
            results["tq_over_plain_useful_tok_s"] = rates["tq"] / rates["plain"]
            # a window too short for every slot to be filled (an offloaded cache's ramp) has no steady rate
            steady = results.get("continuous_tq_steady_useful_tok_s"), results.get("continuous_steady_useful_tok_s")
            results["tq_over_plain_steady_useful_tok_s"] = steady[0] / steady[1] if all(steady) else None
            results["tq_slots_over_plain"] = results["tq_slots"] / results["slots"]
    if "auto" in rates:
        best = max((n for n in rates if rates[n] is not None), key=rates.get)
        results["auto_over_best_useful_tok_s"] = rates["auto"] / rates[best]
        results["auto_best_row"] = best
    if missing:
        results["kv_ratios_missing"] = "; ".join(missing)
    results["targets"] = {key: target(results.get(key), *bar) for key, bar in TARGETS.items()}


def part_bs1_8b(args, results: dict) -> None:
    """Batch-1 streamed decode step of a bf16 8B under a 4 GB cap, against the pinned link: with the KV cache on
    the GPU (the target's case) and with it offloaded to host RAM (what KV offload costs a streamed step)."""
    store = Path(args.store_8b)
    if not (store / "manifest.json").exists():
        synth(store, "llama3-8b", "bfloat16", args.quick)
    link = pinned_link_gbps(args.quick)  # before the engine: its VRAM cap stays on the process after close
    # The workload of stream_bench's 8B case (batch 1, a 128-token prompt and 12 new tokens). Planned for the
    # model's whole context the KV cache does not fit beside 4 GB of weights and is offloaded (the device run of
    # 2026-12-01: 0.83 of the link that way), which the second case measures on purpose.
    on_gpu, offloaded = (bs1_step(args, store, kv_offload) for kv_offload in (False, True))
    results.update({"bs1_8b_step_s": on_gpu["step"], "bs1_8b_bytes_per_step": on_gpu["moved"],
                    "link_pinned_gbps": link, "bs1_link_fraction": on_gpu["moved"] / on_gpu["step"] / 1e9 / link,
                    "bs1_8b_plan": on_gpu["plan"],
                    "bs1_8b_kv_offload_step_s": offloaded["step"],
                    "bs1_8b_kv_offload_link_fraction": offloaded["moved"] / offloaded["step"] / 1e9 / link,
                    "bs1_8b_device": "cpu" if args.quick else torch.cuda.get_device_name(),
                    "bs1_8b_versions": {"torch": torch.__version__, "transformers": transformers.__version__}})


def bs1_step(args, store: Path, kv_offload: bool) -> dict:
    """Median batch-1 decode step (after two warm-up steps), the bytes it moves and the plan it ran."""
    from airquant.config import EngineConfig, GenerateConfig

    engine = Engine.open(store, EngineConfig(device="cpu" if args.quick else "cuda", resident_layers=0,
                                             max_vram_gb=None if args.quick else 4e9 / (1 << 30), batch_size=1,
                                             context=128 + 12 + 3, kv_offload=kv_offload))
    try:
        ids = torch.randint(100, 1000, (1, 128))
        engine.generate_requests([engine.request(row, GenerateConfig(max_new_tokens=2, ignore_eos=True))
                                  for row in ids.tolist()])  # warm
        engine.generate_requests([engine.request(row, GenerateConfig(max_new_tokens=12, ignore_eos=True))
                                  for row in ids.tolist()])
        return {"step": statistics.median(engine.last_timings["step_s"][2:]),
                "moved": engine.describe()["bytes_per_decode_step"],
                "plan": engine.plan.describe(engine.manifest.layer_bytes)}
    finally:
        engine.close()


def pinned_link_gbps(quick: bool) -> float:
    nbytes = (64 << 20) if quick else (1 << 30)
    src = torch.empty(nbytes, dtype=torch.uint8, pin_memory=not quick)
    dst = torch.empty(nbytes, dtype=torch.uint8, device="cpu" if quick else "cuda")
    times = []
    for _ in range(5):
        if not quick:
            torch.cuda.synchronize()
        t = time.perf_counter()
        dst.copy_(src, non_blocking=True)
        if not quick:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    return nbytes / statistics.median(times) / 1e9


MIXED_TASKS = ["Summarize in one sentence: {}", "Write a short report on: {}", "What is the main question raised "
               "by this text? {}", "Answer briefly: {}"]


def part_cpu_mixed(args, results: dict) -> None:
    """The default model on CPU: 48 mixed chat prompts, 16 slots, greedy, max 256 new tokens."""
    from airquant.config import GenerateConfig
    from airquant.eval.data import LOCAL_DEFAULTS, find_local

    store = Path(args.store_default)
    if not (store / "manifest.json").exists():
        subprocess.run([sys.executable, "-m", "airquant.cli", "shard", "default", "--store", str(store), "--quiet"],
                       check=True)
    texts = _mixed_texts(find_local("cnn_dailymail") if "cnn_dailymail" in LOCAL_DEFAULTS else None,
                         args.mixed_prompts)
    engine = Engine.open(store, device="cpu")
    gen = GenerateConfig(max_new_tokens=args.mixed_new, chat=True)
    try:
        reqs = [engine.request(engine.prompt_ids(MIXED_TASKS[k % 4].format(t), True), gen)
                for k, t in enumerate(texts)]
        static = run_static(engine, longest_first(reqs), args.mixed_slots, None)
        start = time.perf_counter()
        loop = engine.decode_loop(args.mixed_slots, context=max(len(r.prompt_ids) for r in reqs) + args.mixed_new)
        seqs = loop.run(reqs)
        wall = time.perf_counter() - start
    finally:
        engine.close()
    useful = sum(len(s.out) + s.eos_hit for s in seqs)
    results.update({"cpu_mixed_static_utilization": static["static_slot_utilization"],
                    "cpu_mixed_static_wall_s": static["static_wall_s"],
                    "cpu_mixed_continuous_utilization": loop.stats.utilization(args.mixed_slots),
                    "cpu_mixed_continuous_wall_s": wall, "cpu_mixed_useful_tokens": useful,
                    "cpu_mixed_prompts": len(reqs), "cpu_mixed_slots": args.mixed_slots})


def _mixed_texts(path, n: int) -> list[str]:
    """Article openings (CNN/DailyMail where a local copy exists, else fixed sentences), cut to 60 words."""
    if path is not None:
        from airquant.eval.data import load_cnn_dailymail

        examples, _ = load_cnn_dailymail(path, limit=n)
        return [" ".join(e.article.split()[:60]) for e in examples]
    base = ("The city council voted on Tuesday to expand the bus network after a year of rising ridership, "
            "while critics warned that the plan leaves the outer districts without service").split()
    return [" ".join(base[: 8 + (k * 7) % len(base)]) for k in range(n)]


QUICK_SHAPE = (("hidden", 128), ("intermediate", 256), ("heads", 4), ("kv_heads", 2), ("vocab", 2048))


def synth(store: Path, shape: str, dtype: str, quick: bool) -> None:
    """A random-weight store of ``shape`` (``--quick``: 2 layers of tiny dimensions on the CPU), with the default
    model's tokenizer from tests/data (the device has no model package)."""
    from transformers import AutoTokenizer

    from airquant.store.synth import SynthSpec
    from airquant.store.synth import synth as write

    spec = SynthSpec(shape, dtype, layers=2 if quick else None, overrides=QUICK_SHAPE if quick else ())
    start = time.perf_counter()
    write(spec, store, device="cpu" if quick else "cuda", progress=not quick,
          tokenizer=AutoTokenizer.from_pretrained(REPO / "tests" / "data" / "smollm2_tokenizer"))
    log.info("store %s written in %.0f s", store, time.perf_counter() - start)


def report(results: dict) -> None:
    keys = ["slots", "kv", "kv_offload", "requests", "static_batches_run", "static_batches_completed",
            "static_requests_finished", "static_wall_s", "static_passes", "static_useful_tok_s",
            "static_steady_useful_tok_s", "static_slot_utilization", "continuous_requests_finished",
            "continuous_wall_s", "continuous_passes", "continuous_useful_tok_s", "continuous_steady_useful_tok_s",
            "slot_utilization", "continuous_steady_slot_utilization", "continuous_over_static",
            "continuous_over_static_missing", "tq_slots", "continuous_tq_useful_tok_s", "auto_slots", "auto_kv",
            "auto_kv_offload", "continuous_auto_useful_tok_s", "tq_over_plain_useful_tok_s",
            "tq_over_plain_steady_useful_tok_s", "tq_slots_over_plain", "auto_over_best_useful_tok_s",
            "auto_best_row", "kv_ratios_missing",
            "bs1_8b_step_s", "link_pinned_gbps", "bs1_link_fraction", "cpu_mixed_static_utilization",
            "cpu_mixed_continuous_utilization", "cpu_mixed_static_wall_s", "cpu_mixed_continuous_wall_s"]
    for k in keys:
        if k in results:
            v = results[k]
            print(f"  {k:<34} {v:.3f}" if isinstance(v, float) else f"  {k:<34} {v}")
    for k, t in results.get("targets", {}).items():
        if t["value"] is not None:
            sign = ">=" if t["kind"] == "min" else "<="
            print(f"  target {k} {t['value']:.3f} {sign} {t['target']}: {'met' if t['met'] else 'MISSED'}")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--part", required=True, choices=["build", "static", "continuous", "bs1_8b", "cpu_mixed", "report"])
    p.add_argument("--store", default="/tmp/bb/llama3-70b-nf4")
    p.add_argument("--store-8b", default="/tmp/bb/llama3-8b-bf16")
    p.add_argument("--store-default", default="/tmp/bb/default")
    p.add_argument("--requests", type=int, default=None, help="default 512 (--quick: 48)")
    p.add_argument("--max-new", type=int, default=None,
                   help=f"the clip of each request's max_new_tokens, default {MAX_NEW} (--quick: 12): a whole job "
                        "(--seconds past its end) takes at least this many passes")
    p.add_argument("--slots", type=int, default=None,
                   help="upper bound, default 256 as `airquant batch --max-batch` (--quick: 8); the router or "
                        "the planner may allow fewer under the cap")
    p.add_argument("--seconds", type=float, default=300.0,
                   help="static/continuous: wall-time budget of the measured window (checked between passes)")
    p.add_argument("--static-batches", type=int, default=None,
                   help="at most this many static batches (default: as many as --seconds allows)")
    p.add_argument("--cap-gb", type=float, default=15.0, help="GPU cap, decimal GB")
    p.add_argument("--kv", choices=["none", "tq", "auto"], default="none",
                   help="none: plain (continuous_* keys); tq: TurboQuant K4/V2 (continuous_tq_*); auto: the throughput "
                        "planner's KV format, offload and slots (continuous_auto_*)")
    p.add_argument("--kv-offload", action=argparse.BooleanOptionalAction, default=None,
                   help="pin the cache in host RAM (or on the device: --no-kv-offload); default: the router's or "
                        "the planner's choice. A pinned continuous row is named after it (continuous_tq_device_*)")
    p.add_argument("--mixed-prompts", type=int, default=None, help="default 48 (--quick: 6)")
    p.add_argument("--mixed-slots", type=int, default=None, help="default 16 (--quick: 3)")
    p.add_argument("--mixed-new", type=int, default=None, help="default 256 (--quick: 8)")
    p.add_argument("--trace-passes", type=int, default=0,
                   help="continuous: this many more passes after the window under torch's profiler ({row}_trace: "
                        "device busy time, where the host waited, top ops)")
    p.add_argument("--trace-ramp", type=int, default=0,
                   help="continuous: the window's passes 2 .. 1+N (prompts being admitted) under torch's profiler "
                        "({row}_ramp_trace); the window then carries the profiler's overhead: give it its own --out")
    p.add_argument("--trace-dir", default=None, help="--trace-passes/--trace-ramp: where the timelines go (.json.gz)")
    p.add_argument("--quick", action="store_true", help="CPU, tiny shapes: a test of the script")
    p.add_argument("--out", default="results/batch_bench.json")
    args = p.parse_args(argv)
    args.prompt_range, args.mean_new = ((8, 24), 6) if args.quick else (PROMPT_RANGE, MEAN_NEW)
    sizes = {"requests": (512, 48), "slots": (256, 8), "mixed_prompts": (48, 6), "mixed_slots": (16, 3),
             "mixed_new": (256, 8), "max_new": (MAX_NEW, 12)}
    for name, (full, quick) in sizes.items():
        if getattr(args, name) is None:
            setattr(args, name, quick if args.quick else full)
    if args.seconds < 0:
        p.error("--seconds must be >= 0 (0 measures one pass)")
    if args.max_new < 1:
        p.error("--max-new must be >= 1")
    return args


def main(argv=None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
    args = parse_args(argv)
    out = Path(args.out)
    results = json.loads(out.read_text()) if out.exists() else {}
    if args.part == "build":  # the store only: the results file is left as it is
        synth(Path(args.store), "llama3-70b", "nf4", args.quick)
        return 0
    if args.part in ("static", "continuous"):
        part_batch(args, args.part, results)
    elif args.part == "bs1_8b":
        part_bs1_8b(args, results)
    elif args.part == "cpu_mixed":
        part_cpu_mixed(args, results)
    else:  # report: the ratios again from what the file holds (rows merged from several calls)
        compare(results)
        compare_kv(results)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=1, sort_keys=True) + "\n")
    report(results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
