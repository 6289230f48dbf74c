#!/usr/bin/env python
"""Mixture-of-Experts streaming: whole MoE layers over the pinned link, and AirLLM on the same Mixtral weights.

One run measures the link and the systems on the same weights (random, in real shapes: speed does not
depend on values), prints a short table last and merges its numbers into ``results/moe_bench.json``.
Parts, each under 10 minutes on one H200 (run them as separate commands where a command may not run
longer):

* ``link``: pinned host->GPU copy bandwidth (1 GiB copies, median).
* ``mixtral``: a Mixtral-8x7B-shaped NF4 store (26.5 GB, written on the GPU), every layer streamed
  (``resident_layers=0``, embedding in host RAM), the GPU capped to 15 GB and to 4 GB: one decode step
  (prompt 128) at batch 1, 64 and 256. A case that does not fit records its error instead of a time.
* ``qwen3``: the same for a Qwen3-30B-A3B-shaped NF4 store (17.6 GB).
* ``mixtral_routed`` / ``qwen3_routed``: expert-aware streaming (``ROUTED_CASES``, ``--cases``), forced with
  ``experts="routed"``; ``cpu_bs1/4/16``: the routed experts computed on the host CPU (``experts="cpu"``,
  engine/moe/host); ``auto_bs1`` and ``auto_bs256``: the default ``--experts auto``, weighing host against
  link with the figures measured in the same run, its row recording the mode the engine chose (``experts_mode``).
* ``host``: the host NF4 GEMV bandwidth (packed bytes read a second, quant/kernels/nf4_cpu) and a plain host
  copy's on the same threads, so the kernel's efficiency shows; run with the routed parts.
* ``airllm``: a bf16 Mixtral-shaped store of ``--airllm-layers`` layers, exported as the hub's checkpoint
  (per-expert ``block_sparse_moe.experts.N.w1`` names, as Mixtral is published), run by AirLLM 4.0.0, and
  AirQuant bf16 and NF4 on the same layer count: the batch-1 decode step per layer. When AirLLM raises,
  its exception text is the result.

Link fraction = bytes of the layers streamed per step / step time / pinned link bandwidth. Caps are
decimal GB (4 GB = 4e9 bytes). Stores are deleted after their part unless ``--keep-stores``, so the disk
holds one at a time (at most 26.5 GB; the airllm part about 13 GB at 2 layers: two of the 6.3 GB bf16 store,
its exported checkpoint and AirLLM's own split at once). ``--quick`` runs the whole flow on the CPU with
tiny shapes (a test of the script, not a measurement).

    python benchmarks/moe_bench.py --part link && python benchmarks/moe_bench.py --part mixtral \
        && python benchmarks/moe_bench.py --part qwen3 && python benchmarks/moe_bench.py --part airllm
"""

from __future__ import annotations

import os

# Fewer, growable segments: a capped card (set_per_process_memory_fraction) is not lost to fragmentation.
os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")

import argparse  # noqa: E402
import json  # noqa: E402
import logging  # noqa: E402
import math  # noqa: E402
import signal  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from contextlib import contextmanager  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from airquant.engine import layer_graphs as graphs_mod  # noqa: E402
from airquant.engine import moe_router as router_mod  # noqa: E402
from airquant.engine import norms as norms_mod  # noqa: E402
from airquant.engine import rope as rope_mod  # noqa: E402
from airquant.engine import streamer as streamer_mod  # noqa: E402
from airquant.engine.decode import loop as loop_mod  # noqa: E402
from airquant.engine.decode import slots as slots_mod  # noqa: E402
from airquant.engine.memory.placement import PlanError  # noqa: E402
from airquant.engine.moe import compute as expert_compute  # noqa: E402
from airquant.engine.moe import direct as direct_mod  # noqa: E402
from airquant.engine.moe import pool as experts_mod  # noqa: E402
from airquant.engine.moe import sizing as sizing_mod  # noqa: E402
from airquant.engine.moe.host import HostExperts  # noqa: E402
from airquant.engine.profile import summarize  # noqa: E402
from airquant.eval.benchtables import target  # noqa: E402
from airquant.quant.kernels import nf4_moe  # noqa: E402
from airquant.store.export import export_hf  # noqa: E402
from airquant.store.synth import SynthSpec, synth  # noqa: E402
from airquant.units import GIB  # noqa: E402
from benchmarks import stream_bench as stream_mod  # noqa: E402
from benchmarks.stream_bench import (  # noqa: E402
    GB,
    Bench,
    bench_device,
    cap_gpu,
    decode_step,
    finish_paths,
    free_gpu,
    hf_decode_step,
    len_vocab,
    open_engine,
    part_link,
    prompt_ids,
    trace_steps,
    versions,
    write_results,
)

log = logging.getLogger("moe_bench")
TARGETS = {"host_gemv_over_memcpy": 0.5, "qwen3_30b_nf4_bs1_auto_over_best": 0.95,
           "mixtral_nf4_bs1_link_fraction": 0.9, "qwen3_30b_a3b_nf4_bs1_link_fraction": 0.9,  # minimums
           "qwen3_30b_a3b_nf4_bs64_link_fraction": 0.8, "qwen3_30b_a3b_nf4_bs256_link_fraction": 0.8,
           "mixtral_nf4_bs1_tok_s": 12, "mixtral_nf4_bs256_tok_s": 500, "mixtral_nf4_max_batch_tok_s": 800,
           "qwen3_30b_nf4_bs1_tok_s": 30, "airllm_over_airquant_mixtral_bs1": 30, "gpt_oss_120b_nf4_bs1_tok_s": 15}
MAX_TARGETS = {"mixtral_nf4_bs1_bytes_fraction": 0.35, "mixtral_nf4_bs1_step_over_bytes_floor": 1.15,
               "qwen3_30b_nf4_bs1_nocache_over_floor": 1.3}
SHAPES = {"mixtral": ("mixtral-8x7b", "mixtral_nf4"), "qwen3": ("qwen3-30b-a3b", "qwen3_30b_a3b_nf4"),
          "gptoss": ("gpt-oss-120b", "gpt_oss_120b_nf4")}
# --quick: two layers of small experts, as many per token as the real models route (2 of 8; 8 of 16 for Qwen3).
_QUICK_BASE = (("hidden", 128), ("intermediate", 256), ("heads", 4), ("kv_heads", 2), ("vocab", 2048))
QUICK = {"mixtral-8x7b": _QUICK_BASE, "gpt-oss-120b": _QUICK_BASE + (("head_dim", 32), ("experts", 16)),
         "qwen3-30b-a3b": _QUICK_BASE + (("head_dim", 32), ("moe_intermediate", 64), ("experts", 16))}


# -- stores ----------------------------------------------------------------------------------------
def make_store(b: Bench, shape: str, dtype: str, layers: int | None) -> Path:
    from transformers import AutoTokenizer

    layers = 2 if b.quick else layers
    spec = SynthSpec(shape, dtype, layers=layers, overrides=QUICK[shape] if b.quick else ())
    path = b.store_path(f"{shape}-{dtype}" + (f"-{layers}L" if layers else ""))
    tok = AutoTokenizer.from_pretrained(b.args.tokenizer) if b.args.tokenizer else None
    start = time.perf_counter()
    m = synth(spec, path, device=b.device.type, tokenizer=tok, progress=not b.quick)
    log.info("store %s: %.2f GB in %.1f s", path, m.total_bytes / GB, time.perf_counter() - start)
    return path


# -- measurements ----------------------------------------------------------------------------------
class CaseTimeout(Exception):
    """A case ran past ``--case-timeout``: its row records it and the part goes on to the next case."""


@contextmanager
def deadline(seconds: float | None):
    """Raise ``CaseTimeout`` in the main thread once ``seconds`` have passed (None or 0: no limit). Python code
    stops at its next bytecode; a kernel or C call running then finishes first."""
    if not seconds:
        yield
        return

    def expire(signum, frame):
        raise CaseTimeout(f"the case ran past --case-timeout {seconds:g} s")

    old = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def measure(b: Bench, store: Path, model: str, cap_gb: float, batch: int, case: str | None = None,
            **kw) -> dict:
    """One streamed decode step (whole layers; ``experts`` in ``kw``, "routed" or "auto": expert-aware, ``case``
    names the row, which records the mode asked for and the one the engine chose); a case that does not fit
    gives its error instead."""
    a, link = b.args, b.results.get("link_pinned_gbps")
    row: dict = {"model": model, "cap_gb": cap_gb, "batch": batch, "prompt_len": a.prompt_len, "error": None,
                 "fused": expert_compute.FUSED, "run": RUN, "device": b.results.get("device"),
                 "norms": "fused" if norms_mod.FUSED_RMS_NORM else "eager", "after_profiler": stream_mod.PROFILED,
                 "rope": "fused" if rope_mod.FUSED_ROPE else "eager",
                 "router": "fused" if router_mod.FUSED_ROUTER else "eager"}
    if case is not None:
        row.update(case=case, settings={k: v for k, v in kw.items() if k != "experts"}, experts_asked=kw["experts"],
                   gemv_tokens=expert_compute.GEMV_TOKENS, fused=expert_compute.FUSED, uva_copy=experts_mod.UVA_COPY,
                   direct=experts_mod.DIRECT, static_passes=slots_mod.STATIC_PASSES)
    kw, launch = engine_settings(kw), tiered_launch(b, model)
    if launch != nf4_moe.TIERED:
        row["tiered"] = {proj: vars(c) for proj, c in launch.items()}
    try:
        with deadline(a.case_timeout), case_engine(b, store, cap_gb, batch, kw, launch) as engine:
            if case is not None:  # what --experts auto picked for this batch (expert_plan.choose_experts)
                row["experts_mode"] = "whole" if engine.experts is None else \
                    "cpu" if isinstance(engine.experts, HostExperts) else "routed"
            step = decode_step(b, engine, batch, f"{model}-cap{cap_gb:g}-bs{batch}" + (f"-{case}" if case else ""))
            # The timed decode's counters, before a trace or the bytes' runs add passes of their own: the layer
            # graphs' captures and replays, the experts' hits and pairs (one read of the device counters).
            stats = engine.stats()
            row["layer_graphs"], report = stats.get("layer_graphs"), stats.get("experts")
            row["dense_resident_gb"] = stats.get("dense_resident_gb", 0.0)  # --dense-resident: kept, not moved
            if isinstance(engine.experts, HostExperts):  # the link carries the dense parts only
                row.update(experts=report, decode_bytes_per_step=routed_step_bytes(b, engine, batch))
                step["bytes_per_step"] = row["decode_bytes_per_step"]
            elif engine.experts is not None:
                row.update(experts=report, pool=engine.experts.plan.describe(), uva=engine.experts.uva,
                           decode_bytes_per_step=routed_step_bytes(b, engine, batch))
                step["bytes_per_step"] = row["decode_bytes_per_step"]
            gbps = step["bytes_per_step"] / step["step_s"] / GB
            # host_s: the host's time to queue a step (the decode loop to the pass's last launch), untraced
            row.update(step_s=step["step_s"], host_s=step["host_s"], ahead_passes=step["ahead_passes"],
                       tok_s=step["tok_s"], prefill_s=step["prefill_s"], bytes_per_step=step["bytes_per_step"],
                       effective_gbps=gbps,
                       link_fraction=gbps / link if link else None, kv_offload=engine.plan.kv_offload,
                       peak_allocated_gb=step["peak_allocated_gb"], peak_reserved_gb=step["peak_reserved_gb"])
    except (PlanError, torch.OutOfMemoryError, CaseTimeout) as exc:  # did not fit under this cap, or too long
        row["error"] = f"{type(exc).__name__}: {exc}"
        if torch.cuda.is_available():
            row["peak_allocated_gb"] = torch.cuda.max_memory_allocated() / GB
            row["peak_reserved_gb"] = torch.cuda.max_memory_reserved() / GB
        log.warning("%s cap %g GB batch %d: %s", model, cap_gb, batch, row["error"])
    return row


def engine_settings(kw: dict) -> dict:
    """A case's engine settings: its ``SWITCHES`` left out (``switches`` sets those module constants around the
    case), whole layers unless it says which experts."""
    kw = {k: v for k, v in kw.items() if k not in SWITCHES}
    kw.setdefault("experts", "whole")
    return kw


@contextmanager
def case_engine(b: Bench, store: Path, cap_gb: float, batch: int, kw: dict, launch: dict):
    """A case's engine under the tiered kernel's ``launch`` (``tiered_launch``: the model's); closed after (unpins
    the RAM tier; open_engine frees the device before the next case)."""
    engine, default = None, nf4_moe.TIERED
    nf4_moe.TIERED = launch
    try:
        engine = open_engine(b, store, cap_gb, resident_layers=0, host_embedding=True, batch_size=batch,
                             context=b.args.prompt_len + b.args.steps + 3, verify_reads=False, **kw)
        yield engine
    finally:
        nf4_moe.TIERED = default
        if engine is not None:
            engine.close()


def trace_case(b: Bench, store: Path, model: str, cap_gb: float, batch: int, case: str, **kw) -> dict:
    """``--trace``: a timed case again, on an engine of its own, under torch's profiler: first the generations its
    timed run made (``decode_step``'s: the RAM tier filled, the layer graphs captured, the hot set warmed), untimed,
    then the traced passes (``stream_bench.trace_steps``). Run after every case of the part is timed: the profiler
    slows what runs after it in the process (``stream_bench.PROFILED``)."""
    from airquant.config import GenerateConfig

    with deadline(b.args.case_timeout), \
            case_engine(b, store, cap_gb, batch, engine_settings(kw), tiered_launch(b, model)) as engine:
        ids = prompt_ids(min(engine.config.vocab_size, len(engine.tokenizer)), batch, b.args.prompt_len)
        for new in (2, 2 + b.args.steps):
            engine.generate_requests([engine.request(row, GenerateConfig(max_new_tokens=new, ignore_eos=True))
                                      for row in ids.tolist()])
        return trace_steps(b, engine, ids, f"{model}-bs{batch}-{case}".replace(" ", "-"), new=b.args.trace_passes)


def routed_step_bytes(b: Bench, engine, batch: int) -> float:
    """Bytes one decode step moves: a run of 1 + k new tokens less a run of 1 (the same prefill)."""
    from airquant.config import GenerateConfig

    ids = prompt_ids(min(engine.config.vocab_size, len(engine.tokenizer)), batch, b.args.prompt_len)
    moved = []
    for new in (1, 3):
        engine.reset_stats()
        engine.generate_requests([engine.request(row, GenerateConfig(max_new_tokens=new, ignore_eos=True))
                                  for row in ids.tolist()])
        moved.append(engine.stats()["bytes_streamed"])
    return (moved[1] - moved[0]) / 2


def part_whole_layer(b: Bench, name: str) -> None:
    a, (shape, _) = b.args, SHAPES[name]
    batches = (1, 2) if b.quick else tuple(int(x) for x in a.batches.split(","))
    caps = tuple(float(x) for x in a.caps.split(","))
    caps = caps[-1:] if b.quick else caps  # a cap means nothing on the CPU: one is enough to run the flow
    store = make_store(b, shape, "nf4", a.layers)
    rows = [measure(b, store, f"{shape} nf4", cap, n) for cap in caps for n in batches]
    free_gpu()
    b.drop(store)
    b.results["whole_layer"] = merge_rows(b.results.get("whole_layer", []), rows)
    derive_keys(b)


LARGE_BATCHES = (64, 256)


def derive_keys(b: Bench) -> None:
    """The link-fraction keys from the merged rows: a run of one cap keeps the other cap's rows, and the key
    always reads the batch-1 row at the largest cap measured (every layer streams under each cap; the larger
    one leaves compute the most room)."""
    for shape, key in SHAPES.values():
        bs1 = [r for r in b.results.get("whole_layer", []) if r["model"] == f"{shape} nf4" and r["batch"] == 1
               and r.get("link_fraction") is not None]
        if bs1:
            b.results[f"{key}_bs1_link_fraction"] = max(bs1, key=lambda r: r["cap_gb"])["link_fraction"]
        for batch in LARGE_BATCHES:  # fine-grained MoE at large batches (issue 34): the 15 GB rows
            row = next((r for r in b.results.get("whole_layer", []) if r["model"] == f"{shape} nf4"
                        and r["batch"] == batch and r["cap_gb"] == 15.0 and r.get("link_fraction") is not None), None)
            if row is not None:
                b.results[f"{key}_bs{batch}_link_fraction"] = row["link_fraction"]


def merge_rows(old: list[dict], new: list[dict]) -> list[dict]:
    """Rows of earlier runs, less the cases measured again, then the new rows (a rerun replaces its cases;
    expert-aware rows are told apart by their case too: lfu_bs256 and auto_bs256 share model, cap and batch)."""
    case = lambda r: (r["model"], r["cap_gb"], r["batch"], r.get("case"))  # noqa: E731
    fresh = {case(r) for r in new}
    return [r for r in old if case(r) not in fresh] + new


def run_airllm(b: Bench, folder: Path) -> dict:
    """AirLLM 4.0.0's batch-1 decode step on the checkpoint, or the error it stopped with."""
    try:
        from airllm import AutoModel
    except ImportError as exc:
        return {"error": f"airllm is not installed ({exc}); pip install airllm==4.0.0"}
    dev = "cuda:0" if b.device.type == "cuda" else "cpu"
    ids = prompt_ids(len_vocab(folder), 1, b.args.prompt_len)
    split_dir = b.store_path("airllm-split")
    free_gpu()
    cap_gpu(b.args.cap_airllm)
    model = None
    try:
        model = AutoModel.from_pretrained(str(folder), compression=None, layer_shards_saving_path=str(split_dir),
                                          device=dev)
        row = hf_decode_step(model.generate, ids, 1 + b.args.airllm_steps, dev)
        row["error"] = None
    except Exception as exc:  # noqa: BLE001 - AirLLM's failure on this model is the measurement: recorded, not hidden
        log.exception("AirLLM failed on %s", folder)
        row = {"error": f"{type(exc).__name__}: {exc}"}
    row["peak_allocated_gb"] = torch.cuda.max_memory_allocated() / GB if torch.cuda.is_available() else None
    del model
    free_gpu()
    cap_gpu(None)
    b.drop(split_dir)
    return row


def part_airllm(b: Bench) -> None:
    a = b.args
    layers = 2 if b.quick else a.airllm_layers
    out: dict = {"layers": layers, "cap_gb": a.cap_airllm, "batch": 1}
    bf16 = make_store(b, "mixtral-8x7b", "bfloat16", layers)
    out["airquant_bf16"] = measure(b, bf16, "mixtral-8x7b bf16", a.cap_airllm, 1)
    folder = export_hf(bf16, b.store_path("mixtral-8x7b-hf"))
    b.drop(bf16)
    out["airllm"] = run_airllm(b, folder)
    b.drop(folder)
    nf4 = make_store(b, "mixtral-8x7b", "nf4", layers)
    out["airquant_nf4"] = measure(b, nf4, "mixtral-8x7b nf4", a.cap_airllm, 1)
    b.drop(nf4)
    for case in ("airquant_bf16", "airquant_nf4", "airllm"):
        step = out[case].get("step_s")
        out[case]["per_layer_s"] = step / layers if step else None
    r = b.results
    r["airllm_over_airquant_mixtral"] = _ratio(out["airllm"]["per_layer_s"], out["airquant_bf16"]["per_layer_s"])
    r["airllm_over_airquant_mixtral_nf4"] = _ratio(out["airllm"]["per_layer_s"], out["airquant_nf4"]["per_layer_s"])
    r["airllm_error"] = out["airllm"]["error"]
    r.setdefault("details", {})["airllm"] = out


def _ratio(num: float | None, den: float | None) -> float | None:
    return num / den if num is not None and den else None


# -- expert-aware streaming (engine/moe/pool.py) -----------------------------------------------------------
# Batch 1 with direct reads: no cache at all, and the hot set renewed every pass (the default).
NOCACHE_DIRECT = dict(experts="routed", expert_cache_gb=0.0, expert_prefetch=False, direct=True)
HOT_SET_DIRECT = dict(experts="routed", expert_policy="lfu", direct=True, refresh=1)


def direct_pair(suffix: str, **changed) -> dict:
    """``nocache_direct_<suffix>`` and ``lfu_direct_r1_<suffix>``: the two batch-1 direct-read cases with
    ``changed`` (engine settings or ``SWITCHES``), an A/B against ``nocache_direct`` and ``lfu_direct_r1``."""
    return {f"nocache_direct_{suffix}": (1, {**NOCACHE_DIRECT, **changed}),
            f"lfu_direct_r1_{suffix}": (1, {**HOT_SET_DIRECT, **changed})}


ROUTED_CASES = {  # name: (batch, EngineConfig fields); cache 0 = every routed expert copied, no speculation
    # The copy path (pool.DIRECT off): each call's routing read to the host, its experts copied into pool slots.
    "nocache": (1, dict(experts="routed", expert_cache_gb=0.0, expert_prefetch=False, direct=False)),
    "lfu": (1, dict(experts="routed", expert_policy="lfu", direct=False)),
    "lru": (1, dict(experts="routed", expert_policy="lru", direct=False)),
    # A/B of lfu: few-row experts decoded to stacked dense weights instead of bitsandbytes' 4-bit matmul
    # (expert_compute.GEMV_TOKENS = 0 for the case; its row's settings and gemv_tokens say so).
    "lfu_stacked": (1, dict(experts="routed", expert_policy="lfu", gemv_tokens=0, fused=False)),
    # A/B of the fused path, same run (issue 34): the per-expert path before it (bitsandbytes' 4-bit matmul per
    # expert), and the fused kernels with every copy of a call by one kernel reading the RAM tier (uva_copy).
    "nocache_unfused": (1, dict(experts="routed", expert_cache_gb=0.0, expert_prefetch=False, fused=False,
                                uva_copy=False)),
    "nocache_uva": (1, dict(experts="routed", expert_cache_gb=0.0, expert_prefetch=False, uva_copy=True,
                            direct=False)),
    "lfu_unfused": (1, dict(experts="routed", expert_policy="lfu", fused=False, uva_copy=False)),
    # Direct reads (engine/moe/direct.py): the tiered kernels read each expert from the VRAM hot set or the pinned
    # RAM tier by the routing on the device: no copy, no host sync a layer. lfu_direct_r1 is the default (the hot
    # set refreshed every pass); lfu_direct refreshes it every 8 passes.
    "nocache_direct": (1, dict(NOCACHE_DIRECT)),
    "lfu_direct": (1, dict(experts="routed", expert_policy="lfu", direct=True, refresh=8)),
    "lfu_direct_r1": (1, dict(HOT_SET_DIRECT)),
    "lfu_bs4_direct": (4, dict(experts="routed", expert_policy="lfu", direct=True, refresh=8)),
    # The same without layer graphs (engine/layer_graphs.py, on by default): every op launched from Python.
    **direct_pair("eager", cuda_graphs=False),
    "lfu_bs4_direct_eager": (4, dict(experts="routed", expert_policy="lfu", direct=True, refresh=8, cuda_graphs=False)),
    # The layer graphs with the cache write and attention as an eager island between two graphs (the path before
    # static passes, engine/decode/slots.py STATIC_PASSES): what capturing the attention gains.
    **direct_pair("island", static=False),
    # Each layer replaying its own graph, every pass (engine/layer_graphs.py PASS_GRAPHS off): what replaying a
    # whole decode pass as one graph from its first layer's call gains.
    **direct_pair("nopass", pass_graphs=False),
    # The dense parts (attention, norms, router) copied through the slots every step as before --dense-resident
    # (planner._dense_resident, on by default): what keeping them in VRAM gains, the cache then larger.
    **direct_pair("streamdense", dense_resident=False),
    "cpu_bs1_streamdense": (1, dict(experts="cpu", dense_resident=False)),
    # The RAM tier on huge pages (engine/streamer HUGE_PAGES, the default since wave3_moe19) or on 4 KB pages:
    # whether the direct reads' kernel reads it faster through the GPU's page tables.
    **direct_pair("huge", huge_pages=True),
    **direct_pair("4k", huge_pages=False),
    # The standard RMSNorm as one fused kernel and a multiply (engine/norms.py FUSED_RMS_NORM): "fusednorm" measured
    # it while it was off (wave3_moe21-23) and now equals the default; "eagernorm" is transformers' eight kernels a
    # call, the A/B since.
    **direct_pair("fusednorm", fused_norm=True),
    **direct_pair("eagernorm", fused_norm=False),
    # The fused RMSNorm as one kernel (engine/norms.py ONE_KERNEL, engine/norm_kernel.py): "onenorm" measured it
    # while it was off (wave3_moe38) and now equals the default; "twonorm" is rms_norm and a multiply, the A/B since.
    **direct_pair("onenorm", one_kernel_norm=True),
    **direct_pair("twonorm", one_kernel_norm=False),
    # Routed prefills gathered and decoded stacked, the plan holding both (expert_compute.FUSED_PREFILL off), against
    # the default since wave3_moe25: the grouped kernel from the pool's slots, that VRAM left to the hot set.
    **direct_pair("stackedprefill", fused_prefill=False),
    # The standard rotary embedding of query and key as one kernel (engine/rope.py FUSED_ROPE): "fusedrope" measured
    # it while it was off (wave3_moe27) and now equals the default; "eagerrope" is transformers' ~10 small kernels a
    # layer, the A/B since.
    **direct_pair("fusedrope", fused_rope=True),
    **direct_pair("eagerrope", fused_rope=False),
    # Static passes as before decode/slots.py LEAN_STATIC: each layer gathering and scattering its rows and building
    # its boolean mask (~12 small kernels a layer in the layer graph), against the views and the mask built once a
    # pass of the default.
    **direct_pair("indexstatic", lean_static=False),
    # The standard top-k router's softmax, top-k and renormalization as one kernel (engine/moe_router.py FUSED_ROUTER)
    # against transformers' seven small kernels a layer: "fusedrouter" measured it before it was the default
    # (wave3_moe29r), "eagerrouter" measures the eager ops since.
    **direct_pair("fusedrouter", fused_router=True),
    **direct_pair("eagerrouter", fused_router=False),
    # Same-layer speculative reads (engine/moe/sizing.py SPECULATE): each layer's experts guessed from its input
    # before its attention and copied while the link would idle. By default (auto) only without a hot set, as many
    # guesses as SPECULATE_BYTES holds (Qwen3-30B-A3B's no-cache case: 2); "nospec" never, "specread" all top-k.
    **direct_pair("nospec", spec_read=False),
    **direct_pair("specread", spec_read=True),
    # The same copying only the 4 (3, 2, 1) most confident guesses (sizing.SPECULATE_GUESSES): what the idle link
    # carries.
    **direct_pair("specread4", spec_read=True, spec_guesses=4),
    **direct_pair("specread2", spec_read=True, spec_guesses=2),
    **direct_pair("specread1", spec_read=True, spec_guesses=1),
    **direct_pair("specread3", spec_read=True, spec_guesses=3),
    # Copied reads (engine/moe/sizing.py COPY_READS_MIN_BYTES; pool._run_copied): a no-cache call whose experts
    # bring ~96 MB or more over the link (Mixtral-8x7B's two, not Qwen3-30B-A3B's eight) reads its routing to the
    # host and has the copy engine bring them in, up parts first. "copied" takes them for every call, "uvaread"
    # for none (the tiered kernel reads every expert from the RAM tier); the hot-set case never takes them.
    **direct_pair("copied", copy_reads=0),
    **direct_pair("uvaread", copy_reads=None),
    # A decode pass's graph captured in 4 graphs split at layer boundaries (engine/layer_graphs.py PASS_GRAPH_PARTS,
    # 1 by default): the GPU runs the first while the host launches the next (one launch of the whole pass kept the
    # GPU idle 1.57 ms of Qwen3-30B-A3B's hot-set step, wave3_moe33).
    **direct_pair("passparts", pass_parts=4),
    # Each greedy decode pass queued before the pass before's tokens are read (engine/decode/loop.py QUEUE_AHEAD,
    # on a GPU by default): the device goes from pass to pass while the host turns the last one around. "ahead"
    # measured it while it was off (wave3_moe38, with host syncs left in the pass) and equals the default now;
    # "readfirst" reads each pass's tokens before the next is queued, the A/B since.
    **direct_pair("ahead", queue_ahead=True),
    **direct_pair("readfirst", queue_ahead=False),
    "lfu_bs4": (4, dict(experts="routed", expert_policy="lfu", direct=False)),
    "lfu_bs256": (256, dict(experts="routed", expert_policy="lfu")),
    "lfu_bs16": (16, dict(experts="routed", expert_policy="lfu")),
    # What a user gets by default: --experts auto at batch 256 (the rule streams whole layers there).
    "auto_bs256": (256, dict(experts="auto")),
    # Routed experts computed on the host CPU (issue 37), and auto weighing host against link at batch 1 (with
    # the host GEMV and link figures of this run: part_host, part_link).
    "cpu_bs1": (1, dict(experts="cpu")), "cpu_bs4": (4, dict(experts="cpu")), "cpu_bs16": (16, dict(experts="cpu")),
    "auto_bs1": (1, dict(experts="auto")),
}
# auto_bs1 first: in wave3_moe12 it ran right after cpu_bs1 and took 0.0429 s a step where lfu_direct_r1, the
# same pool, hits and bytes, took 0.0305 s; in wave3_moe8, with no host case before it, 0.965 of the GPU row.
# Whatever the host case leaves behind (its OpenMP threads, host allocations) is kept out of auto's row.
HOST_CASES = ("auto_bs1", "cpu_bs1", "cpu_bs4", "cpu_bs16")
QUICK_BATCH = 8  # --quick: batches over 8 run at 8 (tiny shapes, 2 of 8 experts: auto streams whole layers)


def router_batches(b: Bench, store: Path, cap_gb: float, context: int) -> dict[bool, int]:
    """The largest batch ``airquant plan`` allows for this store under ``cap_gb`` (streamed as measure opens
    it, --experts auto, plain KV), by where the KV cache lives: {False: on the device, True: offloaded to host
    RAM}; an option that does not fit is left out."""
    from airquant.config import EngineConfig
    from airquant.engine.memory.router import Hardware, RouteError, plan_route, workload_for

    hw = Hardware.detect(b.device.type, cap_gb * GB / GIB, None)
    found = {}
    for offload in (False, True):
        cfg = EngineConfig(experts="auto", resident_layers=0, host_embedding=True, kv_offload=offload)
        try:
            route = plan_route([store], hw, workload_for(cfg, batch_size=1, context=context, mode="streamed",
                                                          kv_schemes=("none",)))
        except RouteError:
            continue
        if route.max_batch >= 1:
            found[route.kv_offload] = route.max_batch
    if not found:
        raise PlanError(f"{store}: no batch fits {cap_gb:g} GB")
    return found


MAX_BATCH_CASES = {"max_batch": True, "max_batch_device": False}  # case: the KV cache offloaded


def measure_max_batch(b: Bench, store: Path, model: str, cap: float, case: str) -> dict:
    """The router's largest batch under the cap as a user runs it (--experts auto): ``max_batch`` the largest
    of all (the KV cache offloaded where that allows more), ``max_batch_device`` with the cache on the device;
    at most --max-batch. As a batch job does, an out-of-memory batch is halved (twice at most), and said."""
    a = b.args
    batches = router_batches(b, store, cap, a.prompt_len + a.steps + 3)
    offload = max(batches, key=batches.get) if MAX_BATCH_CASES[case] else False
    largest = batches.get(offload)
    if largest is None:
        return {"model": model, "cap_gb": cap, "batch": 0, "case": case, "error": "the router has no such option"}
    batch, failed = (4 if b.quick else min(largest, a.max_batch)), []
    while True:
        row = measure(b, store, model, cap, batch, case, experts="auto", kv_offload=offload)
        if "OutOfMemoryError" not in str(row["error"]) or len(failed) == 2:
            break
        failed.append({"batch": batch, "error": row["error"][:300]})
        batch //= 2
    return {**row, "router_max_batch": largest, "out_of_memory_at": failed}


GPTOSS_LAYERS, GPTOSS_ALL_LAYERS = 12, 36
PART_CASES = {"qwen3": ("nocache", "lfu", "nocache_unfused", "lfu_unfused", "lfu_bs4", "nocache_uva", "lfu_stacked",
                        "lfu_bs16", "nocache_direct", "lfu_direct", "lfu_bs4_direct", "lfu_direct_r1",
                        "nocache_direct_eager", "lfu_direct_r1_eager", "lfu_bs4_direct_eager",
                        "nocache_direct_island", "lfu_direct_r1_island", "nocache_direct_streamdense",
                        "lfu_direct_r1_streamdense", "cpu_bs1_streamdense", "nocache_direct_nopass",
                        "lfu_direct_r1_nopass", "nocache_direct_huge", "lfu_direct_r1_huge", "nocache_direct_4k",
                        "lfu_direct_r1_4k", "nocache_direct_fusednorm", "lfu_direct_r1_fusednorm",
                        "nocache_direct_eagernorm", "lfu_direct_r1_eagernorm", "nocache_direct_onenorm",
                        "lfu_direct_r1_onenorm", "nocache_direct_stackedprefill",
                        "lfu_direct_r1_stackedprefill", "nocache_direct_fusedrope", "lfu_direct_r1_fusedrope",
                        "nocache_direct_eagerrope", "lfu_direct_r1_eagerrope", "nocache_direct_indexstatic",
                        "lfu_direct_r1_indexstatic", "nocache_direct_fusedrouter", "lfu_direct_r1_fusedrouter",
                        "nocache_direct_eagerrouter", "lfu_direct_r1_eagerrouter", "nocache_direct_specread",
                        "lfu_direct_r1_specread", "nocache_direct_specread4", "lfu_direct_r1_specread4",
                        "nocache_direct_specread2", "lfu_direct_r1_specread2", "nocache_direct_nospec",
                        "nocache_direct_specread1",
                        "lfu_direct_r1_specread1", "nocache_direct_specread3", "lfu_direct_r1_specread3",
                        "nocache_direct_copied", "nocache_direct_uvaread", "nocache_direct_passparts",
                        "lfu_direct_r1_passparts", "nocache_direct_ahead", "lfu_direct_r1_ahead",
                        "nocache_direct_readfirst", "lfu_direct_r1_readfirst", "nocache_direct_twonorm",
                        "lfu_direct_r1_twonorm", *HOST_CASES),
              "gptoss": ("nocache", "lfu", "nocache_unfused", "lfu_unfused", "nocache_direct", "lfu_direct_r1",
                         "nocache_direct_eager", "lfu_direct_r1_eager", "nocache_direct_island",
                         "nocache_direct_streamdense", "lfu_direct_r1_streamdense", "nocache_direct_nopass",
                         "nocache_direct_copied", "nocache_direct_uvaread"),
              "mixtral": (*ROUTED_CASES, *MAX_BATCH_CASES)}
SWITCHES = {"gemv_tokens": (expert_compute, "GEMV_TOKENS"), "fused": (expert_compute, "FUSED"),
            "uva_copy": (experts_mod, "UVA_COPY"), "direct": (experts_mod, "DIRECT"),
            "refresh": (direct_mod, "REFRESH_PASSES"), "static": (slots_mod, "STATIC_PASSES"),
            "pass_graphs": (graphs_mod, "PASS_GRAPHS"), "huge_pages": (streamer_mod, "HUGE_PAGES"),
            "fused_norm": (norms_mod, "FUSED_RMS_NORM"), "one_kernel_norm": (norms_mod, "ONE_KERNEL"),
            "fused_prefill": (expert_compute, "FUSED_PREFILL"),
            "fused_rope": (rope_mod, "FUSED_ROPE"), "lean_static": (slots_mod, "LEAN_STATIC"),
            "fused_router": (router_mod, "FUSED_ROUTER"), "spec_read": (sizing_mod, "SPECULATE"),
            "spec_guesses": (sizing_mod, "SPECULATE_GUESSES"), "copy_reads": (sizing_mod, "COPY_READS_MIN_BYTES"),
            "pass_parts": (graphs_mod, "PASS_GRAPH_PARTS"), "queue_ahead": (loop_mod, "QUEUE_AHEAD")}


RUN = time.strftime("%Y-%m-%dT%H:%M:%S")  # this process's rows (keys that compare rows pair one run's)
HOST_SECONDS = 2.0  # the host GEMV and copy measurements together (--quick: a tenth)


def part_host(b: Bench) -> None:
    """The host NF4 GEMV bandwidth at batch 1 (packed bytes read a second, over 64 MB of distinct matrices) and a
    plain copy's on the same threads: the figures ``auto`` weighs against the link, and the kernel's efficiency.
    Beside them (``details.host``): the same on one thread and on half the threads, and what the CPU is."""
    from airquant.quant.kernels import nf4_cpu

    seconds = HOST_SECONDS / 10 if b.quick else HOST_SECONDS
    bw = nf4_cpu.measure(seconds)
    b.results.update(host_gemv_gbps=bw.gemv_gbps, host_memcpy_gbps=bw.copy_gbps, host_gemv_over_memcpy=bw.efficiency)
    # One thread: whether the kernel is short of compute (one thread near the copy's pace, many threads scaling
    # less than the copy does) or of memory (one thread far below it). Half the threads: a GEMV as fast there as
    # on all of them is bound per core (SMT siblings sharing a core's vector units, or all-core clocks).
    one = nf4_cpu.measure(seconds / 2, n_threads=1)
    half = nf4_cpu.measure(seconds / 2, n_threads=max(1, bw.threads // 2))
    b.results.setdefault("details", {})["host"] = {"kernel": bw.kernel, "threads": bw.threads,
                                                   "gemv_gbps_1_thread": one.gemv_gbps,
                                                   "memcpy_gbps_1_thread": one.copy_gbps,
                                                   "half_threads": half.threads, "gemv_gbps_half_threads": half.gemv_gbps,
                                                   "memcpy_gbps_half_threads": half.copy_gbps, **host_cpu()}
    for m in (bw, one, half):
        log.info("%s", m.describe())


def host_cpu() -> dict:
    """What the host CPU is: its model, logical CPUs, physical cores (psutil) and the logical CPUs sharing cpu0's
    core (its SMT siblings; a VM may hide them)."""
    import psutil

    from airquant.eval.rows import hardware_info

    info: dict = {"logical_cpus": os.cpu_count(), "physical_cores": psutil.cpu_count(logical=False),
                  "cpu_model": hardware_info("cpu")["cpu"]}
    try:
        info["cpu0_siblings"] = Path("/sys/devices/system/cpu/cpu0/topology/thread_siblings_list").read_text().strip()
    except OSError:
        pass
    return info


def part_routed(b: Bench, name: str) -> None:
    a, (shape, _) = b.args, SHAPES[name]
    # gpt-oss-120b's NF4 store (~62 GB) does not fit the GPU machine's 64 GB disk beside the others: its first
    # GPTOSS_LAYERS layers stand for all 36 (the key scales the step; the row records the layers measured).
    layers = a.layers or (GPTOSS_LAYERS if name == "gptoss" and not b.quick else None)
    store = make_store(b, shape, a.experts_dtype, layers)
    label = f"{shape} {a.experts_dtype}"  # the targets read the nf4 rows; int2 and gptq rows stand beside them
    cap = 4.0 if name == "qwen3" else 15.0
    cases = PART_CASES[name]
    chosen = [c for c in cases if not a.cases or c in a.cases.split(",")]
    rows, settings = [], {}
    for case in chosen:
        if case in MAX_BATCH_CASES:
            if a.max_batch:
                rows.append(measure_max_batch(b, store, label, cap, case))
        elif case in ROUTED_CASES:
            batch, kw = ROUTED_CASES[case]
            if kw["experts"] == "auto":  # weighed with this run's figures, not a file of another machine's
                kw = {**kw, "host_gemv_gbps": b.results.get("host_gemv_gbps"),
                      "link_gbps": b.results.get("link_pinned_gbps") if b.device.type == "cuda" else None}
            settings[case] = kw
            with switches(kw):
                rows.append(measure(b, store, label, cap, min(batch, QUICK_BATCH) if b.quick else batch, case, **kw))
    # the bytes fraction's denominator, same run
    whole = [measure(b, store, label, cap, 1)] if "nocache" in chosen else []
    for row in rows:  # every case timed first: the profiler slows what runs after it in this process
        if row.get("case") in (a.trace or "").split(",") and row.get("case") in settings and not row["error"]:
            kw = settings[row["case"]]
            with switches(kw):
                try:
                    row["trace"] = trace_case(b, store, label, cap, row["batch"], row["case"], **kw)
                except (PlanError, torch.OutOfMemoryError, CaseTimeout) as exc:
                    row["trace_error"] = f"{type(exc).__name__}: {exc}"
    for row in rows + whole:
        row["layers"] = layers
    free_gpu()
    b.drop(store)
    b.results["whole_layer"] = merge_rows(b.results.get("whole_layer", []), whole)
    b.results["expert_aware"] = merge_rows(b.results.get("expert_aware", []), rows)
    derive_keys(b)  # the whole-layer batch-1 row came again with nocache: its link-fraction key follows it
    derive_routed_keys(b)


@contextmanager
def switches(kw: dict):
    """The module constants a case names (``SWITCHES``: ``GEMV_TOKENS``, ``FUSED``, ``UVA_COPY``) set for it."""
    old = {name: getattr(mod, attr) for name, (mod, attr) in SWITCHES.items()}
    for name, (mod, attr) in SWITCHES.items():
        if name in kw:
            setattr(mod, attr, kw[name])
    try:
        yield
    finally:
        for name, (mod, attr) in SWITCHES.items():
            setattr(mod, attr, old[name])


def tiered_launch(b: Bench, model: str) -> dict:
    """The tiered kernel's launch per projection for ``model``'s rows: with ``--tiered FILE``, the fastest
    config uva_bench.py measured for this model's shapes (its ``tiered_best``), else the default."""
    launch = dict(nf4_moe.TIERED)
    if b.args.tiered:
        best = json.loads(Path(b.args.tiered).read_text()).get("tiered_best", {})
        for proj in ("up", "down"):
            found = best.get(f"{model.split()[0]} {proj}")
            if found:
                c = found["best"]
                launch[proj] = nf4_moe.TieredConfig(c["block_n"], c["block_w"], c["warps"], c["prefetch"],
                                                    bool(c.get("split")))
    return launch


def derive_routed_keys(b: Bench) -> None:
    r, link = b.results, b.results.get("link_pinned_gbps")
    rows = {(x["model"], x["case"]): x for x in r.get("expert_aware", [])}
    whole = {(x["model"], x["cap_gb"], x["batch"]): x for x in r.get("whole_layer", [])}
    mix = target_row(rows, "mixtral_nf4_bs1_step_over_bytes_floor")
    full = whole.get(("mixtral-8x7b nf4", 15.0, 1))
    if mix and mix.get("step_s") and full and full.get("bytes_per_step"):
        r["mixtral_nf4_bs1_bytes_fraction"] = mix["decode_bytes_per_step"] / full["bytes_per_step"]
        if row_link(mix, link):
            r["mixtral_nf4_bs1_step_over_bytes_floor"] = mix["step_s"] / (mix["decode_bytes_per_step"] / GB
                                                                          / row_link(mix, link))
    for key in TOK_S_KEYS:
        row = target_row(rows, key)
        if row and row.get("tok_s"):
            r[key] = row["tok_s"]
    oss = target_row(rows, "gpt_oss_120b_nf4_bs1_tok_s")
    if oss and oss.get("tok_s") and oss.get("layers"):
        r["gpt_oss_120b_nf4_bs1_tok_s"] = oss["tok_s"] * oss["layers"] / GPTOSS_ALL_LAYERS
    auto_over_best(r, rows)
    qwen = target_row(rows, "qwen3_30b_nf4_bs1_nocache_over_floor")
    if qwen and qwen.get("step_s") and row_link(qwen, link):
        r["qwen3_30b_nf4_bs1_nocache_over_floor"] = qwen["step_s"] / (qwen["decode_bytes_per_step"] / GB
                                                                      / row_link(qwen, link))
    for prefix, model in (("mixtral_nf4_bs1", "mixtral-8x7b nf4"), ("qwen3_30b_nf4_bs1", "qwen3-30b-a3b nf4")):
        cached = rows.get((model, "lfu_direct_r1"))
        cache_speedup(r, prefix, nocache_like(rows, model, cached), cached, link)
    air = r.get("details", {}).get("airllm", {}).get("airllm", {}).get("per_layer_s")
    if air and mix and mix.get("step_s"):
        layers = b.args.layers or 32
        r["airllm_over_airquant_mixtral_bs1"] = air * layers / mix["step_s"]


def auto_over_best(r: dict, rows: dict) -> None:
    """``qwen3_30b_nf4_bs1_auto_over_best``: auto's row against the faster of the host and GPU routed rows, all
    three from one run (``run``: a machine's speed moves between runs; rows of other runs or without a run
    are not paired). The three figures of the last run that had all of them are kept in
    ``details.auto_over_best``: a later run that re-measures one of the rows alone (its case replaces the older
    row) leaves the key at that run's pairing, which the record names; without one ``auto_over_best_missing``
    says why there is no value."""
    r.pop("qwen3_30b_nf4_bs1_auto_over_best", None)
    r.pop("auto_over_best_missing", None)
    keys = ("qwen3_30b_nf4_bs1_auto_tok_s", "qwen3_30b_nf4_bs1_cpu_experts_tok_s", "qwen3_30b_nf4_bs1_tok_s")
    found = [target_row(rows, key) for key in keys]
    if not all(row and row.get("tok_s") for row in found):
        return
    runs = [row.get("run") for row in found]
    if None not in runs and len(set(runs)) == 1:
        r.setdefault("details", {})["auto_over_best"] = {
            "run": runs[0], "device": found[0].get("device"),
            **{f"{row['case']}_tok_s": row["tok_s"] for row in found},
            "value": found[0]["tok_s"] / max(row["tok_s"] for row in found[1:])}
    kept = r.get("details", {}).get("auto_over_best")
    if kept:
        r["qwen3_30b_nf4_bs1_auto_over_best"] = kept["value"]
        return
    r["auto_over_best_missing"] = ("auto_bs1, cpu_bs1 and the GPU routed row ran in different runs ("
                                   + ", ".join(f"{row['case']}: {row.get('run') or 'unstamped'}"
                                               for row in found) + "): re-run them together")


def row_link(row: dict, link: float | None) -> float | None:
    """The pinned link bandwidth of the run that measured ``row`` (its effective GB/s over its link fraction),
    else ``link`` (the file's latest): a floor is set against the link of the same run."""
    if row.get("effective_gbps") and row.get("link_fraction"):
        return row["effective_gbps"] / row["link_fraction"]
    return link


# -- reporting -------------------------------------------------------------------------------------
# The expert_aware rows (model, cases in order of preference) each key's value comes from; a key without a value
# says why by the first row's error. mixtral_nf4_bs256_tok_s is what a user gets by default (--experts auto)
# where measured, the forced-routed row beside it otherwise.
# The cache-on and no-cache keys read the default path's row (direct reads) where it ran, else the copy path's.
NOCACHE_DEFAULT = ("nocache_direct_fusedrouter", "nocache_direct_fusedrope", "nocache_direct_fusednorm",
                   "nocache_direct_huge", "nocache_direct", "nocache")  # see NEWEST
HOT_SET_DEFAULT = ("lfu_direct_r1_fusedrouter", "lfu_direct_r1_fusedrope", "lfu_direct_r1_fusednorm", "lfu_direct_r1",
                   "lfu")  # see DEFAULT_PATH
TARGET_ROWS = {"mixtral_nf4_bs1_tok_s": ("mixtral-8x7b nf4", HOT_SET_DEFAULT),
               "mixtral_nf4_bs256_tok_s": ("mixtral-8x7b nf4", ("auto_bs256", "lfu_bs256")),
               "mixtral_nf4_bs256_routed_tok_s": ("mixtral-8x7b nf4", ("lfu_bs256",)),
               "mixtral_nf4_max_batch_tok_s": ("mixtral-8x7b nf4", ("max_batch", "max_batch_device")),
               "qwen3_30b_nf4_bs1_tok_s": ("qwen3-30b-a3b nf4", HOT_SET_DEFAULT),
               "qwen3_30b_nf4_bs1_nocache_tok_s": ("qwen3-30b-a3b nf4", NOCACHE_DEFAULT),
               "qwen3_30b_nf4_bs1_copy_tok_s": ("qwen3-30b-a3b nf4", ("lfu",)),
               "qwen3_30b_nf4_bs1_copy_nocache_tok_s": ("qwen3-30b-a3b nf4", ("nocache",)),
               "mixtral_nf4_bs1_copy_tok_s": ("mixtral-8x7b nf4", ("lfu",)),
               "qwen3_30b_nf4_bs1_unfused_tok_s": ("qwen3-30b-a3b nf4", ("nocache_unfused",)),
               "qwen3_30b_nf4_bs1_cpu_experts_tok_s": ("qwen3-30b-a3b nf4", ("cpu_bs1",)),
               "qwen3_30b_nf4_bs4_cpu_experts_tok_s": ("qwen3-30b-a3b nf4", ("cpu_bs4",)),
               "qwen3_30b_nf4_bs16_cpu_experts_tok_s": ("qwen3-30b-a3b nf4", ("cpu_bs16",)),
               "qwen3_30b_nf4_bs1_auto_tok_s": ("qwen3-30b-a3b nf4", ("auto_bs1",)),
               "mixtral_nf4_bs1_cpu_experts_tok_s": ("mixtral-8x7b nf4", ("cpu_bs1",)),
               "qwen3_30b_nf4_bs1_auto_over_best": ("qwen3-30b-a3b nf4", ("auto_bs1",)),
               "gpt_oss_120b_nf4_bs1_tok_s": ("gpt-oss-120b nf4", HOT_SET_DEFAULT),
               "qwen3_30b_nf4_bs1_nocache_over_floor": ("qwen3-30b-a3b nf4", NOCACHE_DEFAULT),
               "mixtral_nf4_bs1_bytes_fraction": ("mixtral-8x7b nf4", NOCACHE_DEFAULT),
               "mixtral_nf4_bs1_step_over_bytes_floor": ("mixtral-8x7b nf4", NOCACHE_DEFAULT)}
TOK_S_KEYS = [k for k in TARGET_ROWS if k.endswith("_tok_s")]


FASTEST = {"mixtral_nf4_max_batch_tok_s"}  # keys that read the fastest of their cases (the router's two largest)
# Keys that read their newest run's row (then the first case of it): the no-cache default path's. Its huge-page RAM
# tier (engine/streamer HUGE_PAGES) became the default after wave3_moe19, whose ``nocache_direct`` rows ran on 4 KB
# pages and ``nocache_direct_huge`` on what is now the default; a later ``nocache_direct`` row is the default again.
# The hot set's keys too since wave3_moe25: the default plan changed under ``lfu_direct_r1`` (routed prefills by the
# fused kernels from the slots hold no gather and no stacked decode, so the dense parts stay in VRAM beside a larger
# hot set), and the ``*_fusednorm`` rows of before measured the plan of then.
NEWEST = {key for key, (_, cases) in TARGET_ROWS.items() if cases in (NOCACHE_DEFAULT, HOT_SET_DEFAULT)}
# Keys of the default batch-1 path: they read rows measured with the default norms (engine/norms.py FUSED_RMS_NORM)
# where there are any, and of those the rows on the default rotary embedding (engine/rope.py FUSED_ROPE), then on the
# default router (engine/moe_router.py FUSED_ROUTER), each where there are any (``DEFAULT_KERNELS``, ``ran_with``).
# The fused norms became the default after wave3_moe23: the ``*_fusednorm`` rows measured it, the ``nocache_direct``
# and ``lfu_direct_r1`` rows of before ran transformers' own; the fused rotary embedding after wave3_moe27
# (``*_fusedrope`` rows), likewise; the fused router after wave3_moe29r (``*_fusedrouter`` rows; a row records
# ``router``).
DEFAULT_PATH = {key for key, (_, cases) in TARGET_ROWS.items() if cases in (NOCACHE_DEFAULT, HOT_SET_DEFAULT)}


# The default path's kernels a row records, in the order ``target_row`` prefers them: (its field, the ``SWITCHES``
# setting of the cases that turned the kernel on before it was the default).
DEFAULT_KERNELS = (("norms", "fused_norm"), ("rope", "fused_rope"), ("router", "fused_router"))


def ran_with(row: dict, field: str, setting: str) -> str:
    """Which of a kernel a row ran with, "fused" or "eager": its ``field`` (``norms``, ``rope``, ``router``); a row
    from before that field, the fused one only where its case turned it on by ``setting`` (it was off by default
    then)."""
    return row.get(field) or ("fused" if (row.get("settings") or {}).get(setting) else "eager")


def nocache_like(rows: dict, model: str, cached: dict | None) -> dict | None:
    """The no-cache row to set against ``cached``: the one whose dense parts sit where the cached row's do (in VRAM
    or streamed: the planner keeps them for a fixed cache size, no cache included, and may stream them for the
    hot set), so that the pair differs by the cache alone; ``nocache_direct`` where neither matches."""
    plain = rows.get((model, "nocache_direct"))
    if cached is None or "dense_resident_gb" not in cached:
        return plain
    kept = bool(cached["dense_resident_gb"])
    for case in ("nocache_direct", "nocache_direct_streamdense"):
        row = rows.get((model, case))
        if row and "dense_resident_gb" in row and bool(row["dense_resident_gb"]) == kept and \
                row.get("run") == cached.get("run"):
            return row
    return plain


def cache_speedup(r: dict, prefix: str, nocache: dict | None, cached: dict | None, link: float | None) -> None:
    """``{prefix}_cache_speedup``: the no-cache step over the cache-on step (direct reads, same store), and
    ``_predicted``: what the link model predicts from the bytes each moved (``step = bytes / link + rest``, the
    rest being the no-cache step less its bytes' link time: host and compute, taken as unchanged by hits). Only
    for rows of one invocation (the same link figure: each invocation measures the link once; rows of another
    invocation may come from another machine, whose host differs)."""
    for suffix in ("", "_predicted"):  # a pair no longer in the file, or of two invocations, gets no ratio
        r.pop(f"{prefix}_cache_speedup{suffix}", None)
    if not (nocache and cached and nocache.get("step_s") and cached.get("step_s") and row_link(nocache, link)):
        return
    if not math.isclose(row_link(nocache, link), row_link(cached, link), rel_tol=1e-9):
        return
    gbps = row_link(nocache, link)
    rest = max(nocache["step_s"] - nocache["decode_bytes_per_step"] / GB / gbps, 0.0)
    r[f"{prefix}_cache_speedup"] = nocache["step_s"] / cached["step_s"]
    r[f"{prefix}_cache_speedup_predicted"] = nocache["step_s"] / (cached["decode_bytes_per_step"] / GB / gbps + rest)


def target_row(rows: dict, key: str) -> dict | None:
    """The row a key reads (``TARGET_ROWS``): the first of its cases with a speed (``DEFAULT_PATH``: of those on
    the default norms, then rotary embedding, where any; ``FASTEST``: the fastest; ``NEWEST``: the first of the
    newest run's), else the first that ran."""
    model, cases = TARGET_ROWS[key]
    found = [rows[(model, c)] for c in cases if (model, c) in rows]
    timed = [row for row in found if row.get("tok_s")]
    if key in DEFAULT_PATH:
        for field, setting in DEFAULT_KERNELS:
            default = "fused" if getattr(*SWITCHES[setting]) else "eager"
            timed = [row for row in timed if ran_with(row, field, setting) == default] or timed
    if timed and key in NEWEST:
        newest = max(row.get("run") or "" for row in timed)
        timed = [row for row in timed if (row.get("run") or "") == newest]
    if timed and key in FASTEST:
        return max(timed, key=lambda row: row["tok_s"])
    return timed[0] if timed else (found[0] if found else None)


def unmeasured_why(results: dict, key: str) -> str | None:
    """Why a target has no value: its row's error, AirLLM's error, or that its part has not run."""
    if key == "airllm_over_airquant_mixtral_bs1":
        return results.get("airllm_error") or "the airllm part has not run"
    if key == "host_gemv_over_memcpy":
        return "the host part has not run"
    if key == "qwen3_30b_nf4_bs1_auto_over_best" and results.get("auto_over_best_missing"):
        return results["auto_over_best_missing"]
    if key not in TARGET_ROWS:
        return None
    row = target_row({(x["model"], x["case"]): x for x in results.get("expert_aware", [])}, key)
    return "its case has not run" if row is None else row.get("error")


def check_targets(b: Bench) -> list[str]:
    lines = []
    for key, threshold in list(TARGETS.items()) + list(MAX_TARGETS.items()):
        value, kind = b.results.get(key), "max" if key in MAX_TARGETS else "min"
        if value is None:
            why = unmeasured_why(b.results, key)
            lines.append(f"  {key:<38} not measured" + (f": {why[:90]}" if why else ""))
            b.results.setdefault("targets", {})[key] = {**target(None, threshold, kind), "why": why}
            continue
        entry = b.results.setdefault("targets", {})[key] = target(value, threshold, kind)
        lines.append(f"  {key:<38} {value:8.3f}  target {'<=' if kind == 'max' else '>='} {threshold:g}: "
                     f"{'met' if entry['met'] else 'MISSED'}")
    return lines


def print_table(b: Bench) -> None:
    r = b.results
    fmt = lambda v, f="{:.3f}": "-" if v is None else f.format(v)  # noqa: E731
    print(f"\nmoe_bench on {r.get('device')} ({'QUICK: tiny shapes, not a measurement' if b.quick else 'real shapes'})")
    print(f"  pinned link {fmt(r.get('link_pinned_gbps'), '{:.1f}')} GB/s; every layer streamed, prompt "
          f"{b.args.prompt_len}")
    print(f"  host NF4 GEMV {fmt(r.get('host_gemv_gbps'), '{:.1f}')} GB/s, host copy "
          f"{fmt(r.get('host_memcpy_gbps'), '{:.1f}')} GB/s ({fmt(r.get('host_gemv_over_memcpy'), '{:.2f}')} of it)")
    print(f"  {'model':<22}{'cap GB':>7}{'batch':>6}{'step s':>9}{'GB/step':>9}{'GB/s':>7}{'link':>6}{'peak GB':>8}")
    for row in r.get("whole_layer", []):
        line = (f"  {row['model']:<22}{row['cap_gb']:>7g}{row['batch']:>6}{fmt(row.get('step_s'), '{:.4f}'):>9}"
                f"{fmt(row.get('bytes_per_step') and row['bytes_per_step'] / GB, '{:.2f}'):>9}"
                f"{fmt(row.get('effective_gbps'), '{:.1f}'):>7}{fmt(row.get('link_fraction'), '{:.2f}'):>6}"
                f"{fmt(row.get('peak_allocated_gb'), '{:.2f}'):>8}")
        print(line + (f"  {row['error'][:70]}" if row.get("error") else ""))
    for row in r.get("expert_aware", []):
        ex = row.get("experts") or {}
        moved = row.get("decode_bytes_per_step") or row.get("bytes_per_step")  # routed: measured; whole: the layers
        print(f"  {row.get('experts_mode', 'routed'):<6} {row['model']:<19}{row['cap_gb']:>5g}{row['batch']:>5} "
              f"{row['case']:<12}"
              f"{fmt(row.get('step_s'), '{:.4f}'):>8}s {fmt(row.get('tok_s'), '{:.1f}'):>7} tok/s "
              f"{fmt(moved and moved / GB, '{:.3f}'):>7} GB/step "
              f"hit {fmt(ex.get('hit_rate'), '{:.2f}')} spec {fmt(ex.get('speculation_recall'), '{:.2f}')}"
              + (f"  {row['error'][:60]}" if row.get("error") else ""))
    air = r.get("details", {}).get("airllm")
    if air:
        print(f"  Mixtral-shaped, {air['layers']} layers, batch 1, cap {air['cap_gb']:g} GB: seconds per layer")
        for case, label in (("airllm", "AirLLM 4.0.0"), ("airquant_bf16", "AirQuant bf16"),
                            ("airquant_nf4", "AirQuant NF4")):
            row = air[case]
            print(f"    {label:<15}{fmt(row.get('per_layer_s'), '{:.4f}'):>9}"
                  + (f"  {row['error'][:90]}" if row.get("error") else ""))
        print(f"    AirLLM / AirQuant bf16: x{fmt(r.get('airllm_over_airquant_mixtral'), '{:.1f}')}")
    print("targets:")
    print("\n".join(check_targets(b)))
    r["profiles"] = {**r.get("profiles", {}), **{case: summarize(rows) for case, rows in b.profiles.items()}}


# -- main ------------------------------------------------------------------------------------------
def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--part", choices=["link", "host", "mixtral", "qwen3", "mixtral_routed", "qwen3_routed", "gptoss_routed",
                                      "airllm",
                                      "report", "all"], default="all",
                   help="report: no measurement, the keys and table re-derived from the rows in moe_bench.json")
    p.add_argument("--workdir", default=str(REPO / "bench-work"), help="where the synthetic stores are written")
    p.add_argument("--results", default=None,
                   help="folder of moe_bench.json (default: results/, or WORKDIR/results with --quick)")
    p.add_argument("--quick", action="store_true", help="tiny shapes on the CPU: tests the script")
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    p.add_argument("--keep-stores", action="store_true", help="keep the stores (and reuse them next run)")
    p.add_argument("--steps", type=int, default=4, help="timed decode steps per case (after one warm-up step)")
    p.add_argument("--airllm-steps", type=int, default=2, help="timed AirLLM decode steps")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--batches", default="1,64,256", help="batch sizes of the whole-layer parts")
    p.add_argument("--caps", default="15,4", help="GPU caps (GB) of the whole-layer parts")
    p.add_argument("--layers", type=int, default=None,
                   help="keep the first N layers of both MoE shapes (default: all; Mixtral 32, Qwen3-30B 48)")
    p.add_argument("--max-batch", type=int, default=1024,
                   help="at most this batch for the max-batch row (Mixtral, 15 GB: the largest batch the router "
                        "allows, KV offloaded when that allows more; 0: skip)")
    p.add_argument("--trace-dir", default=None, metavar="DIR",
                   help="also write each traced case's timeline there (gzipped chrome trace, for Perfetto)")
    p.add_argument("--trace", default=None, metavar="CASES",
                   help="expert-aware cases (comma-separated) to also run under torch's profiler: the row gets "
                        "'trace' (device time by kind, top ops by device and host time)")
    p.add_argument("--trace-passes", type=int, default=3, metavar="N",
                   help="--trace: decode passes under the profiler (the first ones of a new loop may capture graphs; "
                        "the summary's last_pass_* figures are the last one's)")
    p.add_argument("--trace-stacks", action="store_true",
                   help="--trace with the Python functions' own spans in the timeline (torch's with_stack)")
    p.add_argument("--cases", default=None,
                   help="expert-aware parts: only these comma-separated cases (" + ",".join(ROUTED_CASES)
                        + ",max_batch,max_batch_device; default all; the whole-layer batch-1 row comes with nocache)")
    p.add_argument("--case-timeout", type=float, default=0, metavar="S",
                   help="a case running longer records 'CaseTimeout' as its error and the part goes on (0: no limit)")
    p.add_argument("--airllm-layers", type=int, default=2, help="layers of the Mixtral-shaped store AirLLM runs")
    p.add_argument("--cap-airllm", type=float, default=15.0,
                   help="GPU cap (GB) of the airllm part (a bf16 Mixtral layer is 2.9 GB, two buffers 5.8 GB)")
    p.add_argument("--experts-dtype", choices=["nf4", "int2", "gptq"], default="nf4",
                   help="routed parts: the store's format (`airquant synth --dtype`); int2 and gptq rows are "
                        "labelled '<shape> int2' / '<shape> gptq' beside the nf4 rows the targets read")
    p.add_argument("--tiered", default=None, metavar="UVA_BENCH_JSON",
                   help="the tiered kernel's launch per projection from uva_bench.py's fastest configs for each "
                        "model (default: the code's); recorded in each row as 'tiered'")
    p.add_argument("--no-fused", action="store_true",
                   help="the per-expert paths everywhere (expert_compute.FUSED off): the baseline of the fused "
                        "kernels, run into another --results folder")
    p.add_argument("--tokenizer", default=str(REPO / "tests" / "data" / "smollm2_tokenizer"),
                   help="tokenizer folder for the stores (default: the SmolLM2 tokenizer shipped in tests/data)")
    args = p.parse_args(argv)
    if args.quick:
        args.prompt_len, args.steps, args.airllm_steps = min(args.prompt_len, 8), min(args.steps, 2), 2
    finish_paths(args)
    if args.results is None:
        args.results = str(Path(args.workdir) / "results") if args.quick else str(REPO / "results")
    return args


def main(argv=None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    args = parse_args(argv)
    device = bench_device(args)
    stream_mod.TRACE_STACKS = args.trace_stacks
    if args.no_fused:
        expert_compute.FUSED = False
    out = Path(args.results) / "moe_bench.json"
    b = Bench(args, device, results=json.loads(out.read_text()) if out.is_file() else {})
    parts = (["link", "mixtral", "qwen3", "mixtral_routed", "qwen3_routed", "airllm"] if args.part == "all"
             else [args.part])
    if args.part == "report":  # the rows keep the machine and versions they were measured with
        derive_keys(b)
        derive_routed_keys(b)
        parts = []
    else:
        b.results.update(device=torch.cuda.get_device_name(0) if device.type == "cuda" else "cpu", synthetic=True,
                         quick=args.quick, versions=versions())
    if any(p.endswith("_routed") for p in parts) and "host" not in parts:
        parts.insert(0, "host")  # the host rows' efficiency and auto's figures, this machine, this session
    if "link" not in parts and parts and parts != ["airllm"]:
        parts.insert(0, "link")  # every link fraction needs it measured on this machine, in this session
    run = {"link": part_link, "host": part_host, "mixtral": lambda b: part_whole_layer(b, "mixtral"),
           "qwen3": lambda b: part_whole_layer(b, "qwen3"), "airllm": part_airllm,
           "mixtral_routed": lambda b: part_routed(b, "mixtral"), "qwen3_routed": lambda b: part_routed(b, "qwen3"),
           "gptoss_routed": lambda b: part_routed(b, "gptoss")}
    for part in parts:
        start = time.perf_counter()
        run[part](b)
        b.results.setdefault("seconds", {})[part] = time.perf_counter() - start
        write_results(b, out)
    print_table(b)
    write_results(b, out)
    print(f"\nwrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
