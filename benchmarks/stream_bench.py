#!/usr/bin/env python
"""Streaming speed: the pinned link, AirQuant against AirLLM and accelerate, batch amortization on 70B.

One run measures the limit and the systems on the same weights (random, in real shapes: speed does
not depend on values), then prints a short table and merges its numbers into
``results/stream_bench.json`` (and ``results/stream_bench.png``). Parts, each well under 10 minutes
on one H200 (run them as separate commands where a command may not run longer):

* ``link``: pinned host->GPU copy bandwidth (1 GiB copies, median).
* ``8b``: a llama3-8b-shaped bf16 store, GPU capped to 4 GB, every decoder layer streamed
  (``--resident-layers 0``): one decode step (prompt 128, batch 1 and 8) for AirQuant bf16, AirQuant
  NF4, AirLLM 4.0.0 and transformers+accelerate offload on the same weights (a Hugging Face folder
  exported from the store), and the resident transformers model as the compute floor.
* ``70b``: a llama3-70b-shaped NF4 store (NF4 lm_head, embedding in host RAM): decode throughput at
  batch 1/8/32/64 with the GPU capped to 15 GB, and batch-1 peak VRAM under a 4 GB cap.

Caps are decimal GB (4 GB = 4e9 bytes). ``--quick`` runs the whole flow on the CPU with tiny
truncated shapes (a test of the script, not a measurement).

    python benchmarks/stream_bench.py --part link && python benchmarks/stream_bench.py --part 8b \
        && python benchmarks/stream_bench.py --part 70b
"""

from __future__ import annotations

import os

# Fewer, growable segments: a capped card (set_per_process_memory_fraction) is not lost to fragmentation.
os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")

import argparse  # noqa: E402
import gc  # noqa: E402
import gzip  # noqa: E402
import json  # noqa: E402
import logging  # noqa: E402
import re  # noqa: E402
import shutil  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from dataclasses import dataclass, field  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from airquant.config import EngineConfig, GenerateConfig  # noqa: E402
from airquant.engine.decode.fallback import StepClock  # noqa: E402
from airquant.engine.profile import profile_table, summarize  # noqa: E402
from airquant.engine.runner import Engine  # noqa: E402
from airquant.eval.benchtables import target  # noqa: E402
from airquant.store.synth import SynthSpec, synth  # noqa: E402
from airquant.units import GB, GIB  # noqa: E402

log = logging.getLogger("stream_bench")
TARGETS = {  # key: (threshold, "min" | "max")
    "bf16_bs1_link_fraction": (0.85, "min"),
    "airllm_over_airquant_bf16": (30.0, "min"),
    "accelerate_over_airquant_bf16": (4.0, "min"),
    "batch64_over_batch1": (40.0, "min"),
    "vram70b_nf4_bs1_peak_gb": (4.0, "max"),
}
QUICK = (("hidden", 256), ("intermediate", 512), ("heads", 4), ("kv_heads", 2), ("vocab", 4096))


@dataclass
class Bench:
    args: argparse.Namespace
    device: torch.device
    results: dict = field(default_factory=dict)
    profiles: dict = field(default_factory=dict)  # case -> per-layer rows of its last pass

    @property
    def quick(self) -> bool:
        return self.args.quick

    def store_path(self, name: str) -> Path:
        return Path(self.args.workdir) / name

    def drop(self, path: Path) -> None:
        if not self.args.keep_stores:
            shutil.rmtree(path, ignore_errors=True)


# -- helpers ---------------------------------------------------------------------------------------
def free_gpu() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def cap_gpu(gb: float | None) -> None:
    if torch.cuda.is_available():
        total = torch.cuda.get_device_properties(0).total_memory
        torch.cuda.set_per_process_memory_fraction(1.0 if gb is None else min(1.0, gb * GB / total))


def make_store(b: Bench, shape: str, dtype: str, layers: int | None) -> Path:
    from transformers import AutoTokenizer

    spec = SynthSpec(shape, dtype, layers=2 if b.quick else layers, overrides=QUICK if b.quick else ())
    path = b.store_path(f"{shape}-{dtype}")
    tok = AutoTokenizer.from_pretrained(b.args.tokenizer) if b.args.tokenizer else None
    start = time.perf_counter()
    m = synth(spec, path, device=b.device.type, tokenizer=tok, progress=not b.quick)
    log.info("store %s: %.2f GB in %.1f s", path, m.total_bytes / GB, time.perf_counter() - start)
    return path


def prompt_ids(vocab: int, batch: int, length: int, seed: int = 0) -> torch.Tensor:
    """Random token ids (never zeros), past the tokenizer's special tokens, valid rows of the embedding."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(17, vocab, (batch, length), generator=gen)  # [B, S]


def open_engine(b: Bench, store: Path, cap_gb: float | None, **kw) -> Engine:
    free_gpu()
    cfg = EngineConfig(device=b.device.type, max_vram_gb=None if cap_gb is None else cap_gb * GB / GIB,
                       profile=b.device.type == "cuda", **kw)
    engine = Engine.open(store, cfg)
    log.info("%s: plan %s", store.name, engine.plan.describe(engine.manifest.layer_bytes).replace("\n", " | "))
    return engine


def decode_step(b: Bench, engine: Engine, batch: int, case: str) -> dict:
    """Median seconds of one decode step after warm-up steps, with the tokens/s and memory it took."""
    steps, warm = b.args.steps, 1
    vocab = min(engine.config.vocab_size, len(engine.tokenizer))
    ids = prompt_ids(vocab, batch, b.args.prompt_len)
    engine.generate_requests([engine.request(row, GenerateConfig(max_new_tokens=2, ignore_eos=True))
                              for row in ids.tolist()])  # fills the RAM tier
    engine.layer_profile()
    engine.reset_stats()
    gen = GenerateConfig(max_new_tokens=1 + warm + steps, ignore_eos=True)
    out = engine.generate_requests([engine.request(row, gen) for row in ids.tolist()])
    assert all(c.new_tokens == 1 + warm + steps for c in out)
    step = statistics.median(engine.last_timings["step_s"][warm:])
    host = engine.last_timings.get("host_s", [])[warm:]
    rows = engine.layer_profile()
    if rows:
        b.profiles[case] = rows[-len(engine.streamer.streamed):]  # the last pass
    stats = engine.stats()
    row = {"batch": batch, "step_s": step, "tok_s": batch / step, "steps_s": engine.last_timings["step_s"],
           # the host's share: a step whose host_s is close to step_s is bound by the host, not by the device
           "host_s": statistics.median(host) if host else None,
           # passes queued before the pass before's tokens were read (engine/decode/loop.py QUEUE_AHEAD)
           "ahead_passes": engine.last_timings.get("ahead_passes"),
           "prefill_s": engine.last_timings["prefill_s"], "bytes_per_step": engine.describe()["bytes_per_decode_step"],
           "peak_allocated_gb": stats.get("peak_vram_allocated_gb"), "peak_reserved_gb": stats.get("peak_vram_reserved_gb"),
           "resident_layers": len(engine.plan.vram_layers)}
    log.info("%s batch %d: %.4f s/step (host queued it in %s s), %.1f tok/s, peak %s GB", case, batch, step,
             f"{row['host_s']:.4f}" if host else "-", row["tok_s"], row["peak_allocated_gb"])
    return row


def trace_steps(b: Bench, engine, ids: torch.Tensor, name: str, kv=None, new: int = 3, top: int = 20) -> dict:
    """Where a decode step's time goes (moe_bench and kv_bench ``--trace``): the prompts ``ids`` prefilled outside
    the profiler, then ``new`` decode passes (cache ``kv``) under it: the ops with the most device and host time,
    and the device's busy time by kind (kernels, host-to-device copies, other copies) against the wall; a step far
    over its bytes' floor shows here whether the device computed, copied or waited for the host. A stack the decode
    loop does not run (transformers' generate) is traced whole, its prefill included (``prefill_included``)."""
    from benchmarks.batch_window import trace_loop

    requests = [engine.request(row, GenerateConfig(max_new_tokens=1 + new, ignore_eos=True)) for row in ids.tolist()]
    if engine.loop_supported and (kv is None or kv.backend != "turboquant"):
        loop = engine.loop_for(requests, kv=kv)  # the loop the timed generation runs (its prefill budget too)
        for r in requests:
            loop.submit(r)
        while loop.waiting or any(s.prefilling for s in loop.running.values()):  # the prompts, untraced
            loop.step()
        start = time.perf_counter()
        traced = trace_loop(loop, new, b.args.trace_dir, name)
        wall = time.perf_counter() - start
        while not loop.idle:
            loop.step()
        return {"new_tokens": traced["passes"], "prefill_included": False, "wall_ms": wall * 1e3,
                **{k: v for k, v in traced.items() if k != "passes"}}
    start = time.perf_counter()
    with profiler(b.device) as prof:
        engine.generate_requests(requests, kv=kv)
    wall = time.perf_counter() - start
    return {"new_tokens": new, "prefill_included": True, "wall_ms": wall * 1e3,
            **trace_summary(prof, b.args.trace_dir, name, top)}


# torch's profiler leaves CUPTI attached after it stops (Kineto finalizes it only with TEARDOWN_CUPTI=1:
# pytorch/pytorch#144455), and every later CUDA call of the process may pay for it: a
# host-bound moe_bench case timed after a traced case of the same invocation ran 0.0228 s a step against 0.0168-0.0186
# s alone (Qwen3-30B-A3B hot set, H100, wave3_moe22/23). Rows record whether a profile ran before them
# (``after_profiler``); moe_bench traces after every case is timed.
PROFILED = False
# Traces with the Python functions' own spans (``with_stack``; moe_bench --trace-stacks): where the host's time goes
# between ops, as in a host-bound step (the Qwen3 hot set's replayed pass: ~16 ms of Python between 891 host ops).
TRACE_STACKS = False


def profiler(device):
    """torch's profiler over the host and (CUDA) the GPU's kernels and copies (``TRACE_STACKS``: and the Python
    functions); marks the process ``PROFILED``."""
    global PROFILED
    from torch.profiler import profile

    PROFILED = True
    return profile(activities=profiler_activities(device), with_stack=TRACE_STACKS)


def profiler_activities(device) -> list:
    """What torch's profiler records on ``device``: the host, and the GPU's kernels and copies on CUDA."""
    from torch.profiler import ProfilerActivity

    return [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])


def device_us(event) -> float:
    """A profiler event's own device microseconds (torch's name for it changed from ``self_cuda_time_total``)."""
    return getattr(event, "self_device_time_total", getattr(event, "self_cuda_time_total", 0))


def trace_summary(prof, trace_dir: str | None, name: str, top: int = 20) -> dict:
    """A finished profile (``torch.profiler.profile``) as a row: the device's busy time by kind, the last decode
    pass's breakdown, where the host waited for the device, and the ops with the most device and host time; the
    timeline itself goes to ``trace_dir``/``name``.json.gz (chrome://tracing, Perfetto: gaps show what waited on
    what) when given."""
    if trace_dir:
        os.makedirs(trace_dir, exist_ok=True)
        path = os.path.join(trace_dir, f"{name}.json")
        prof.export_chrome_trace(path)
        with open(path, "rb") as f, gzip.open(path + ".gz", "wb") as g:
            shutil.copyfileobj(f, g)
        os.remove(path)
    events = prof.key_averages()
    busy = {"kernel_ms": 0.0, "memcpy_htod_ms": 0.0, "memcpy_other_ms": 0.0}
    for e in events:
        busy[f"{device_kind(e.key)}_ms"] += device_us(e) / 1e3
    rank = lambda f: [{"op": e.key[:80], "count": e.count, "device_ms": device_us(e) / 1e3,  # noqa: E731
                       "host_ms": e.self_cpu_time_total / 1e3} for e in sorted(events, key=f, reverse=True)[:top]]
    kineto = prof.profiler.kineto_results.events()
    last = pass_breakdown(kineto)
    if trace_dir and last and last.get("last_pass_memcpy_htod_gb") is None:
        # torch's events do not carry a device copy's bytes (torch 2.11); the exported timeline does
        with gzip.open(path + ".gz", "rt") as f:
            last.update(chrome_copy_bytes(json.load(f), last.get("last_pass_memcpy_htod_ms")))
    return {**busy, **last, "syncs": sync_sources(kineto),
            "top_device": rank(device_us), "top_host": rank(lambda e: e.self_cpu_time_total)}


def chrome_copy_bytes(trace: dict, htod_ms: float | None) -> dict:
    """The last decode pass's copies' bytes from an exported timeline (chrome trace: CUPTI's ``"bytes"`` in each
    copy's args, times in microseconds): ``last_pass_memcpy_htod_gb``, ``last_pass_memcpy_other_gb`` (a copy cut at
    the pass's edge counts its share) and the host-to-device rate over ``htod_ms`` (their busy time). {} without a
    pass."""
    from airquant.engine.decode.loop import PASS_MARK

    events = trace.get("traceEvents", [])
    marks = [e for e in events if e.get("name") == PASS_MARK and e.get("cat") == "user_annotation"]
    if not marks:
        return {}
    last = max(marks, key=lambda e: e["ts"])
    a, b = float(last["ts"]), float(last["ts"]) + float(last.get("dur", 0))
    moved = {"memcpy_htod": 0.0, "memcpy_other": 0.0}
    for e in events:
        nbytes = (e.get("args") or {}).get("bytes")
        if "memcpy" not in str(e.get("name", "")).lower() or not isinstance(nbytes, (int, float)):
            continue
        s, dur = float(e["ts"]), float(e.get("dur", 0))
        cut = min(s + dur, b) - max(s, a)
        if cut > 0:
            moved[device_kind(e["name"])] += nbytes * (cut / dur if dur else 1.0)
    gb = moved["memcpy_htod"] / 1e9
    return {"last_pass_memcpy_htod_gb": gb, "last_pass_memcpy_other_gb": moved["memcpy_other"] / 1e9,
            "last_pass_memcpy_htod_gbps": gb / (htod_ms / 1e3) if htod_ms else None}


# Host calls that wait for the device: a stream or device sync, and the blocking copy of pageable memory.
SYNC_CALLS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy")


def sync_sources(events, top: int = 12) -> list[dict]:
    """Where the host waited for the device in a trace (``events``: the profiler's kineto events): each sync call
    (``SYNC_CALLS``) under the innermost three host ops around it (``"aten::item < aten::_local_scalar_dense <
    cudaStreamSynchronize"`` reads innermost first), counted with the host time they took, most time first. A
    sync a layer in a decode step names its op here (the stream syncs of a whole step are few: the sampling's
    read and the pass's end)."""
    threads: dict[int, list] = {}
    for e in events:
        if e.device_type() == torch.autograd.DeviceType.CPU and not e.is_user_annotation():
            threads.setdefault(e.start_thread_id(), []).append(e)
    found: dict[str, list] = {}
    for evs in threads.values():
        stack: list = []  # host ops open at the current event, outermost first (one thread's ops nest)
        for e in sorted(evs, key=lambda e: (e.start_ns(), -e.duration_ns())):
            while stack and stack[-1].start_ns() + stack[-1].duration_ns() <= e.start_ns():
                stack.pop()
            if e.name() in SYNC_CALLS:
                where = " < ".join([o.name()[:60] for o in reversed(stack[-3:])] + [e.name()])
                row = found.setdefault(where, [0, 0])
                row[0] += 1
                row[1] += e.duration_ns()
            stack.append(e)
    rows = [{"where": w, "count": c, "host_ms": ns / 1e6} for w, (c, ns) in found.items()]
    return sorted(rows, key=lambda r: r["host_ms"], reverse=True)[:top]


def device_kind(name: str) -> str:
    """A device event's kind by its name: "memcpy_htod", "memcpy_other" or "kernel"."""
    name = name.lower()
    return ("memcpy_htod" if "htod" in name else "memcpy_other") if "memcpy" in name else "kernel"


def pass_breakdown(events) -> dict:
    """The last decode-loop pass of a trace (``events``: the profiler's kineto events), marked by
    ``DecodeLoop.step`` (``PASS_MARK``). The pass ends in a device sync, so its device work lies inside its host
    window. Returns its wall, the device's busy time in it (the union of kernels and copies: overlapping ones
    count once), that busy time over the wall, and the busy time by kind (kernels, host-to-device copies, other
    copies), with the copies' bytes and the host-to-device copies' rate: a pass bound by the link has its wall
    near those bytes over the link. A pass whose device is busy a small part of its wall waited for the host. {}
    without a pass."""
    from airquant.engine.decode.loop import PASS_MARK

    marks = [e for e in events if e.name() == PASS_MARK and e.device_type() == torch.autograd.DeviceType.CPU]
    if not marks:
        return {}
    last = max(marks, key=lambda e: e.start_ns())
    a, b = last.start_ns(), last.start_ns() + last.duration_ns()
    spans: dict[str, list] = {"kernel": [], "memcpy_htod": [], "memcpy_other": []}
    moved = {"memcpy_htod": 0, "memcpy_other": 0}
    for e in events:
        if e.device_type() == torch.autograd.DeviceType.CPU or e.is_user_annotation() or e.name() == PASS_MARK:
            continue
        s, f = max(e.start_ns(), a), min(e.start_ns() + e.duration_ns(), b)
        if f > s:
            kind = device_kind(e.name())
            spans[kind].append((s, f))
            if kind in moved:  # a copy cut at the pass's edge counts its share of bytes
                moved[kind] += copy_bytes(e) * (f - s) / max(e.duration_ns(), 1)
    busy = _union_ns([x for v in spans.values() for x in v])
    htod_ms = _union_ns(spans["memcpy_htod"]) / 1e6
    known = any(moved.values())
    return {"last_pass_wall_ms": (b - a) / 1e6, "last_pass_device_busy_ms": busy / 1e6,
            "last_pass_busy_fraction": busy / (b - a) if b > a else None,
            **{f"last_pass_{k}_ms": _union_ns(v) / 1e6 for k, v in spans.items()},
            # None where the events carry no bytes (torch's own do not: trace_summary reads the exported timeline)
            **{f"last_pass_{k}_gb": n / 1e9 if known else None for k, n in moved.items()},
            # the host-to-device copies' rate while one ran (the link's, when they queue back to back)
            "last_pass_memcpy_htod_gbps": moved["memcpy_htod"] / 1e9 / (htod_ms / 1e3) if htod_ms and known else None}


def copy_bytes(e) -> int:
    """A device copy's bytes in a trace: its ``nbytes`` where the profiler filled it, else the ``"bytes"`` field
    CUPTI's copy record carries in the event's metadata (0 when neither says)."""
    n = getattr(e, "nbytes", lambda: 0)() or 0
    if n:
        return int(n)
    found = re.search(r'"bytes"\s*:\s*(\d+)', getattr(e, "metadata_json", lambda: "")() or "")
    return int(found.group(1)) if found else 0


def _union_ns(spans: list[tuple[int, int]]) -> int:
    total, end = 0, None
    for s, f in sorted(spans):
        if end is None or s > end:
            total += f - s
            end = f
        elif f > end:
            total += f - end
            end = f
    return total


def hf_decode_step(generate, ids: torch.Tensor, new: int, device: str) -> dict:
    """Median step of a transformers-style ``generate`` (AirLLM and accelerate use this path too)."""
    from transformers import LogitsProcessorList

    from airquant.engine.runner import attention_backends

    clock = StepClock(torch.cuda.synchronize if torch.cuda.is_available() else lambda: None)
    with attention_backends():  # the same attention kernels as AirQuant's (no per-length cuDNN plans)
        generate(input_ids=ids.to(device), attention_mask=torch.ones_like(ids).to(device), max_new_tokens=new,
                 min_new_tokens=new, do_sample=False, use_cache=True, pad_token_id=0,
                 logits_processor=LogitsProcessorList([clock]))
    steps = [b - a for a, b in zip(clock.times, clock.times[1:])]
    return {"step_s": statistics.median(steps[1:] if len(steps) > 2 else steps), "steps_s": steps,
            "prefill_s": None}


# -- parts -----------------------------------------------------------------------------------------
def part_link(b: Bench) -> None:
    from airquant.eval.perf import measure_link_bandwidth

    kind = "h2d_pinned" if b.device.type == "cuda" else "cpu_memcpy"
    m = measure_link_bandwidth(b.device, kind=kind, nbytes=(64 << 20) if b.quick else (1 << 30), repeats=10)
    b.results["link_pinned_gbps"] = m.gb_per_s
    b.results.setdefault("details", {})["link"] = {"kind": m.kind, "nbytes": m.nbytes, "seconds": m.seconds}
    log.info("link %s: %.1f GB/s", m.kind, m.gb_per_s)


def part_8b(b: Bench) -> None:
    a, details = b.args, {}
    batches = (1, 2) if b.quick else (1, 8)
    context = a.prompt_len + a.steps + 3
    for dtype in ("bfloat16", "nf4"):
        store = make_store(b, "llama3-8b", dtype, a.layers_8b)
        engine = open_engine(b, store, a.cap_8b, resident_layers=0, batch_size=max(batches), context=context)
        details[dtype] = {str(n): decode_step(b, engine, n, f"8b-{dtype}-bs{n}") for n in batches}
        engine.close()
        del engine
        if dtype == "bfloat16" and {"airllm", "accelerate", "resident"} - a.skip:
            from airquant.store.export import export_hf

            folder = export_hf(store, b.store_path("llama3-8b-hf"))
            details.update(baselines_8b(b, folder))
            b.drop(folder)
        b.drop(store)
    bf16, nf4 = details["bfloat16"]["1"], details["nf4"]["1"]
    link = b.results.get("link_pinned_gbps")
    r = b.results
    r["bf16_bs1_step_s"], r["nf4_bs1_step_s"] = bf16["step_s"], nf4["step_s"]
    r["bf16_bs1_link_fraction"] = bf16["bytes_per_step"] / bf16["step_s"] / GB / link if link else None
    r["nf4_bs1_link_fraction"] = nf4["bytes_per_step"] / nf4["step_s"] / GB / link if link else None
    for name in ("airllm", "accelerate", "resident"):
        if name not in a.skip:  # a skipped baseline keeps the value of an earlier run
            r[f"{name}_bs1_step_s"] = details[name]["step_s"] if details.get(name) else None
        r.setdefault(f"{name}_bs1_step_s", None)
    r["airllm_over_airquant_bf16"] = _ratio(r["airllm_bs1_step_s"], bf16["step_s"])
    r["accelerate_over_airquant_bf16"] = _ratio(r["accelerate_bs1_step_s"], bf16["step_s"])
    r["airquant_bf16_over_resident"] = _ratio(bf16["step_s"], r["resident_bs1_step_s"])
    r.setdefault("details", {})["8b"] = details


def baselines_8b(b: Bench, folder: Path) -> dict:
    a, out = b.args, {}
    dev = "cuda:0" if b.device.type == "cuda" else "cpu"
    ids = prompt_ids(len_vocab(folder), 1, a.prompt_len)
    if "airllm" not in a.skip:
        out["airllm"] = run_airllm(b, folder, ids, dev)
    if "accelerate" not in a.skip:
        out["accelerate"] = run_accelerate(b, folder, ids, dev)
    if "resident" not in a.skip:
        out["resident"] = run_resident(b, folder, ids, dev)
    return out


def len_vocab(folder: Path) -> int:
    from transformers import AutoTokenizer

    config = json.loads((folder / "config.json").read_text())
    return min(config["vocab_size"], len(AutoTokenizer.from_pretrained(folder)))


def run_airllm(b: Bench, folder: Path, ids: torch.Tensor, dev: str) -> dict | None:
    try:
        from airllm import AutoModel
    except ImportError:
        log.warning("airllm is not installed (pip install airllm==4.0.0): its row is null")
        return None
    free_gpu()
    cap_gpu(b.args.cap_8b)
    split_dir = b.store_path("airllm-split")
    model = AutoModel.from_pretrained(str(folder), compression=None, layer_shards_saving_path=str(split_dir),
                                      device=dev)
    row = hf_decode_step(model.generate, ids, 1 + b.args.airllm_steps, dev)
    row["peak_allocated_gb"] = torch.cuda.max_memory_allocated() / GB if torch.cuda.is_available() else None
    log.info("airllm: %.2f s/step", row["step_s"])
    del model
    free_gpu()
    b.drop(split_dir)
    return row


def run_accelerate(b: Bench, folder: Path, ids: torch.Tensor, dev: str) -> dict:
    from transformers import AutoModelForCausalLM

    free_gpu()
    cap_gpu(b.args.cap_8b)
    if b.device.type == "cuda":
        kw = {"device_map": "auto", "max_memory": {0: f"{b.args.cap_8b * GB / GIB:.2f}GiB", "cpu": "100GiB"}}
    else:
        kw = {"device_map": {"": "cpu"}}
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16, **kw).eval()
    with torch.inference_mode():
        row = hf_decode_step(model.generate, ids, 2 + b.args.steps, dev)
    row["peak_allocated_gb"] = torch.cuda.max_memory_allocated() / GB if torch.cuda.is_available() else None
    log.info("accelerate offload: %.3f s/step", row["step_s"])
    del model
    free_gpu()
    return row


def run_resident(b: Bench, folder: Path, ids: torch.Tensor, dev: str) -> dict:
    from transformers import AutoModelForCausalLM

    free_gpu()
    cap_gpu(None)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16, device_map={"": dev}).eval()
    with torch.inference_mode():
        row = hf_decode_step(model.generate, ids, 2 + 2 * b.args.steps, dev)
    log.info("resident transformers: %.4f s/step", row["step_s"])
    del model
    free_gpu()
    return row


def part_70b(b: Bench) -> None:
    a = b.args
    batches = (1, 2, 4) if b.quick else tuple(int(x) for x in a.batches.split(","))
    context = a.prompt_len + a.steps + 3
    store = make_store(b, "llama3-70b", "nf4", a.layers_70b)
    engine = open_engine(b, store, a.cap_70b, host_embedding=True, batch_size=max(batches), context=context)
    rows = {str(n): decode_step(b, engine, n, f"70b-nf4-bs{n}") for n in batches}
    engine.close()
    del engine
    engine = open_engine(b, store, a.cap_70b_small, host_embedding=True, batch_size=1, context=context)
    small = decode_step(b, engine, 1, "70b-nf4-bs1-small-cap")
    engine.close()
    del engine
    b.drop(store)
    tok_s = {k: v["tok_s"] for k, v in rows.items()}
    b.results["tok_s_by_batch"] = tok_s
    top = str(max(batches))
    b.results[f"batch{top}_over_batch1"] = tok_s[top] / tok_s["1"]
    if top != "64":
        b.results.pop("batch64_over_batch1", None)
    b.results["vram70b_nf4_bs1_peak_gb"] = small["peak_allocated_gb"]
    b.results["vram70b_nf4_bs1_peak_reserved_gb"] = small["peak_reserved_gb"]
    b.results["nf4_70b_bs1_step_s"] = rows["1"]["step_s"]
    b.results.setdefault("details", {})["70b"] = {"cap_gb": a.cap_70b, "by_batch": rows,
                                                  "small_cap_gb": a.cap_70b_small, "small_cap": small}


def _ratio(num: float | None, den: float | None) -> float | None:
    return num / den if num is not None and den else None


# -- reporting -------------------------------------------------------------------------------------
def versions() -> dict:
    from airquant.eval.rows import package_versions

    out = package_versions(("accelerate", "bitsandbytes", "airllm", "safetensors"))
    out["cuda"] = torch.version.cuda
    return out


def check_targets(b: Bench) -> list[str]:
    lines = []
    for key, (threshold, kind) in TARGETS.items():
        value = b.results.get(key)
        if value is None:
            lines.append(f"  {key:<32} not measured")
            continue
        entry = b.results.setdefault("targets", {})[key] = target(value, threshold, kind)
        lines.append(f"  {key:<32} {value:10.3f}  target {'>=' if kind == 'min' else '<='} {threshold:g}: "
                     f"{'met' if entry['met'] else 'MISSED'}")
    return lines


def print_table(b: Bench) -> None:
    r = b.results
    fmt = lambda v, f="{:.4f}": "-" if v is None else f.format(v)  # noqa: E731
    print(f"\nstream_bench on {r.get('device')} ({'QUICK: tiny shapes, not a measurement' if b.quick else 'real shapes'})")
    print(f"  pinned link                     {fmt(r.get('link_pinned_gbps'), '{:.1f}')} GB/s")
    print(f"  8B bf16 step (batch 1)          {fmt(r.get('bf16_bs1_step_s'))} s  "
          f"({fmt(r.get('bf16_bs1_link_fraction'), '{:.2f}')} of the link)")
    print(f"  8B NF4 step (batch 1)           {fmt(r.get('nf4_bs1_step_s'))} s")
    print(f"  AirLLM step (batch 1)           {fmt(r.get('airllm_bs1_step_s'))} s  "
          f"(x{fmt(r.get('airllm_over_airquant_bf16'), '{:.1f}')} AirQuant bf16)")
    print(f"  accelerate offload step         {fmt(r.get('accelerate_bs1_step_s'))} s  "
          f"(x{fmt(r.get('accelerate_over_airquant_bf16'), '{:.1f}')} AirQuant bf16)")
    print(f"  resident transformers step      {fmt(r.get('resident_bs1_step_s'))} s (compute floor)")
    for k, v in (r.get("tok_s_by_batch") or {}).items():
        print(f"  70B NF4 batch {k:<4} tok/s        {v:.2f}")
    print(f"  70B NF4 batch-1 peak VRAM       {fmt(r.get('vram70b_nf4_bs1_peak_gb'), '{:.2f}')} GB allocated")
    print("targets:")
    lines = check_targets(b)
    print("\n".join(lines))
    if any("MISSED" in line for line in lines) and b.profiles:
        for case, rows in b.profiles.items():
            print(f"\nper-layer profile, {case} (last pass):\n{profile_table(rows)}")
    r["profiles"] = {case: summarize(rows) for case, rows in b.profiles.items()}


def plot(b: Bench, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    r = b.results
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    names = ["AirQuant bf16", "AirQuant NF4", "accelerate", "AirLLM", "resident"]
    keys = ["bf16_bs1_step_s", "nf4_bs1_step_s", "accelerate_bs1_step_s", "airllm_bs1_step_s", "resident_bs1_step_s"]
    values = [r.get(k) or 0.0 for k in keys]
    left.bar(names, values, color=["#1f77b4", "#17becf", "#ff7f0e", "#d62728", "#7f7f7f"])
    left.set_yscale("log")
    left.set_ylabel("seconds per decode step (batch 1)")
    left.set_title("8B-shaped, GPU capped to 4 GB, every layer streamed")
    left.tick_params(axis="x", rotation=20)
    floor = (r.get("details", {}).get("8b", {}).get("bfloat16", {}).get("1", {}).get("bytes_per_step"))
    if floor and r.get("link_pinned_gbps"):
        left.axhline(floor / GB / r["link_pinned_gbps"], color="k", ls="--", lw=1, label="bf16 bytes / pinned link")
        left.legend(loc="upper left", fontsize=8)
    tok = r.get("tok_s_by_batch") or {}
    if tok:
        xs = sorted(int(k) for k in tok)
        right.plot(xs, [tok[str(x)] for x in xs], "o-")
        right.set_xscale("log", base=2)
        right.set_xlabel("batch size")
        right.set_ylabel("tokens / s")
    right.set_title("70B-shaped NF4, GPU capped to 15 GB")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def write_results(b: Bench, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(b.results, indent=1, default=float))
    tmp.replace(path)


# -- main ------------------------------------------------------------------------------------------
def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--part", choices=["link", "8b", "70b", "all"], default="all")
    p.add_argument("--workdir", default=str(REPO / "bench-work"), help="where the synthetic stores are written")
    p.add_argument("--results", default=None,
                   help="folder of stream_bench.json/.png (default: results/, or WORKDIR/results with --quick)")
    p.add_argument("--quick", action="store_true", help="tiny truncated shapes on the CPU: tests the script")
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    p.add_argument("--skip", default="", help="comma list of baselines to skip: airllm,accelerate,resident")
    p.add_argument("--keep-stores", action="store_true", help="keep the stores (and reuse them next run)")
    p.add_argument("--steps", type=int, default=4, help="timed decode steps per case (after one warm-up step)")
    p.add_argument("--airllm-steps", type=int, default=2, help="timed AirLLM decode steps (about 10 s each)")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--batches", default="1,8,32,64", help="70B batch sizes")
    p.add_argument("--cap-8b", type=float, default=4.0, help="GPU cap (GB) of the 8B part")
    p.add_argument("--cap-70b", type=float, default=15.0, help="GPU cap (GB) of the 70B throughput sweep")
    p.add_argument("--cap-70b-small", type=float, default=4.0, help="GPU cap (GB) of the 70B batch-1 memory check")
    p.add_argument("--layers-8b", type=int, default=None, help="truncate the 8B shape (default: all 32 layers)")
    p.add_argument("--layers-70b", type=int, default=None, help="truncate the 70B shape (default: all 80 layers)")
    p.add_argument("--tokenizer", default=str(REPO / "tests" / "data" / "smollm2_tokenizer"),
                   help="tokenizer folder for the stores (default: the SmolLM2 tokenizer shipped in tests/data)")
    args = p.parse_args(argv)
    args.skip = {s for s in args.skip.split(",") if s}
    if args.quick:
        args.prompt_len, args.steps, args.airllm_steps = min(args.prompt_len, 32), min(args.steps, 3), 2
    finish_paths(args)
    if args.results is None:
        args.results = str(Path(args.workdir) / "results") if args.quick else str(REPO / "results")
    return args


def bench_device(args: argparse.Namespace) -> torch.device:
    """``--device``; ``auto`` is the GPU when there is one, and the CPU for ``--quick`` runs."""
    wanted = "cpu" if args.quick and args.device == "auto" else args.device
    return torch.device("cuda" if wanted == "auto" and torch.cuda.is_available() else
                        (wanted if wanted != "auto" else "cpu"))


def finish_paths(args: argparse.Namespace, name: str | None = None) -> None:
    """A missing tokenizer folder means the default model's; with ``name``, ``--out`` defaults to
    results/NAME (or WORKDIR/results/NAME for ``--quick``, so a test run never overwrites measured figures)."""
    if not Path(args.tokenizer).is_dir():
        args.tokenizer = None
    if name is not None and args.out is None:
        args.out = str((Path(args.workdir) / "results" if args.quick else REPO / "results") / name)


def main(argv=None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    args = parse_args(argv)
    device = bench_device(args)
    out = Path(args.results) / "stream_bench.json"
    b = Bench(args, device, results=json.loads(out.read_text()) if out.is_file() else {})
    b.results.update(device=torch.cuda.get_device_name(0) if device.type == "cuda" else "cpu", synthetic=True,
                     quick=args.quick, versions=versions())
    parts = ["link", "8b", "70b"] if args.part == "all" else [args.part]
    if "link" not in parts and "link_pinned_gbps" not in b.results:
        parts.insert(0, "link")  # every ratio to the link needs it measured on this machine
    for part in parts:
        start = time.perf_counter()
        {"link": part_link, "8b": part_8b, "70b": part_70b}[part](b)
        b.results.setdefault("seconds", {})[part] = time.perf_counter() - start
        write_results(b, out)
    print_table(b)
    write_results(b, out)
    plot(b, out.with_suffix(".png"))
    print(f"\nwrote {out} and {out.with_suffix('.png')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
