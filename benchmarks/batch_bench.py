#!/usr/bin/env python
"""Continuous batching against static batching on a streamed 70B, and the batch-1 step against the link.

Parts (each one device command under 10 minutes; ``results/batch_bench.json`` is merged part by part):

* ``build``: a llama3-70b-shaped NF4 store (``airquant synth --device cuda``), ~39 GB on disk, ~4 min.
* ``static``: today's static batching: the requests in length-sorted batches of ``--slots``; a batch
  holds its slots until its longest sequence ends and the next batch waits for it. Only the first
  ``--static-batches`` batches run (recorded as ``static_batches_run``): the figure is the rate of
  those batches, never an extrapolation to the whole job.
* ``continuous``: the same requests through one decode loop of ``--slots`` slots.
* ``bs1_8b``: a llama3-8b-shaped bf16 store under a 4 GB cap (built here if absent, ~16 GB), batch-1
  decode step against the pinned host->GPU link: ``bs1_link_fraction`` = (bytes per step / step) / link.
* ``cpu_mixed``: the default model on CPU, 48 mixed prompts, 16 slots, max 256 new tokens, greedy,
  chat: static vs continuous utilization and wall time (the README figures).
* ``report``: the table from the JSON.

Requests: ``--requests`` (512) with prompt lengths uniform in 128..1024 tokens and ``max_new_tokens``
drawn (seed 0) from a geometric distribution with mean 150 (p = 1/150), clipped to 1..512: random
weights never stop by themselves, so a request's own ``max_new_tokens`` stands in for its EOS. The
KV cache and the slots are what the router allows under the cap (``--kv``, ``--kv-offload``, ``--slots``
override); the slots used are recorded. ``--quick`` runs every part on CPU on a tiny random model.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")

import torch  # noqa: E402

from airquant.engine.decode import Request  # noqa: E402
from airquant.engine.runner import Engine  # noqa: E402
from airquant.kv import KVConfig  # noqa: E402

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


def run_static(engine, requests, slots, kv, max_batches):
    """Length-sorted batches of ``slots``; each runs until its longest sequence ends."""
    order = sorted(requests, key=lambda r: -len(r.prompt_ids))
    batches = [order[i:i + slots] for i in range(0, len(order), slots)][:max_batches]
    useful = passes = 0
    start = time.perf_counter()
    for batch in batches:
        useful += sum(c.new_tokens for c in engine.generate_requests(batch, kv=kv))
        passes += engine.last_timings["passes"]
    wall = time.perf_counter() - start
    return {"static_useful_tok_s": useful / wall, "static_wall_s": wall, "static_passes": passes,
            "static_useful_tokens": useful, "static_batches_run": len(batches),
            "static_batches_total": -(-len(requests) // slots),
            "static_slot_utilization": useful / (slots * passes), "static_requests_run": sum(map(len, batches))}


def run_continuous(engine, requests, slots, kv, context):
    loop = engine.decode_loop(slots, context=context, kv=kv)
    start = time.perf_counter()
    seqs = loop.run(requests)
    wall = time.perf_counter() - start
    useful = sum(len(s.out) for s in seqs)
    ttft = sorted(s.ttft_s for s in seqs)
    return {"continuous_useful_tok_s": useful / wall, "continuous_wall_s": wall, "continuous_passes": loop.stats.passes,
            "continuous_useful_tokens": useful, "slot_utilization": loop.stats.utilization(slots),
            "continuous_requests_run": len(seqs), "ttft_median_s": statistics.median(ttft),
            "decode_pass_median_s": statistics.median(loop.stats.decode_pass_s or [0.0])}


def plan_slots(store: Path, cap_gb: float | None, context: int, kv: str, offload: bool | None, limit: int):
    """Slots and KV cache the router allows under the cap (CPU: ``limit``)."""
    from airquant.engine.router import Candidate, Hardware, Workload, route

    if cap_gb is None:
        return limit, kv if kv != "auto" else "none", False
    hw = Hardware.detect("cuda", max_vram_gb=cap_gb * 1e9 / (1 << 30))
    schemes = ("none", "tq") if kv == "auto" else (kv,)
    r = route([Candidate.open(store)], hw, Workload(batch_size=1, context=context, mode="streamed",
                                                   kv_schemes=schemes, kv_offload=offload, host_embedding=True))
    return min(limit, r.max_batch), r.kv, r.kv_offload


def open_engine(store: Path, args, slots: int, context: int, offload: bool):
    from airquant.config import EngineConfig

    cfg = EngineConfig(device="cpu" if args.quick else "cuda", max_vram_gb=None if args.quick else args.cap_gb * 1e9
                       / (1 << 30), batch_size=slots, context=context, host_embedding=not args.quick,
                       kv_offload=offload)
    return Engine.open(store, cfg)


def part_batch(args, which: str, results: dict) -> None:
    store = Path(args.store)
    engine_probe = json.loads((store / "config.json").read_text())
    requests = workload(args.requests, engine_probe["vocab_size"], prompt_range=args.prompt_range,
                        mean_new=args.mean_new, max_new=args.max_new)
    context = max(len(r.prompt_ids) + r.max_new_tokens for r in requests)
    slots, kv_name, offload = plan_slots(store, None if args.quick else args.cap_gb, context, args.kv,
                                         args.kv_offload, args.slots)
    kv = KVConfig(backend="tq", bits_k=4, bits_v=2, window=128) if kv_name == "tq" else None
    engine = open_engine(store, args, slots, context, offload)
    results.update({"slots": slots, "kv": kv_name, "kv_offload": offload, "requests": len(requests),
                    "context": context, "distribution": f"prompt uniform {args.prompt_range}, new tokens geometric "
                    f"mean {args.mean_new} clipped to 1..{args.max_new}, seed 0"})
    try:
        if which == "static":
            results.update(run_static(engine, requests, slots, kv, args.static_batches))
        else:
            results.update(run_continuous(engine, requests, slots, kv, context))
    finally:
        engine.close()
    if "static_useful_tok_s" in results and "continuous_useful_tok_s" in results:
        results["continuous_over_static"] = results["continuous_useful_tok_s"] / results["static_useful_tok_s"]


def part_bs1_8b(args, results: dict) -> None:
    """Batch-1 streamed decode step of a bf16 8B under a 4 GB cap, against the pinned link."""
    from airquant.config import EngineConfig, GenerateConfig

    store = Path(args.store_8b)
    if not (store / "manifest.json").exists():
        synth(store, "llama3-8b", "bfloat16", args.quick)
    dev = "cpu" if args.quick else "cuda"
    engine = Engine.open(store, EngineConfig(device=dev, max_vram_gb=None if args.quick else 4e9 / (1 << 30),
                                             resident_layers=0))
    try:
        ids = torch.randint(100, 1000, (1, 128))
        engine.generate_ids(ids, torch.ones_like(ids), GenerateConfig(max_new_tokens=2, ignore_eos=True))  # warm
        engine.generate_ids(ids, torch.ones_like(ids), GenerateConfig(max_new_tokens=12, ignore_eos=True))
        step = statistics.median(engine.last_timings["step_s"][2:])
        moved = engine.describe()["bytes_per_decode_step"]
    finally:
        engine.close()
    link = pinned_link_gbps(args.quick)
    results.update({"bs1_8b_step_s": step, "bs1_8b_bytes_per_step": moved, "link_pinned_gbps": link,
                    "bs1_link_fraction": moved / step / 1e9 / link})


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
        static = run_static(engine, reqs, args.mixed_slots, None, 1 << 30)
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


def synth(store: Path, shape: str, dtype: str, quick: bool) -> None:
    cmd = [sys.executable, "-m", "airquant.cli", "synth", "--shape", shape, "--dtype", dtype, "--store", str(store),
           "--quiet"] + (["--layers", "2"] if quick else ["--device", "cuda"])
    subprocess.run(cmd, check=True)


def report(results: dict) -> None:
    keys = ["slots", "kv", "kv_offload", "requests", "static_batches_run", "static_useful_tok_s",
            "continuous_useful_tok_s", "continuous_over_static", "slot_utilization", "static_slot_utilization",
            "bs1_8b_step_s", "link_pinned_gbps", "bs1_link_fraction", "cpu_mixed_static_utilization",
            "cpu_mixed_continuous_utilization", "cpu_mixed_static_wall_s", "cpu_mixed_continuous_wall_s"]
    for k in keys:
        if k in results:
            v = results[k]
            print(f"  {k:<34} {v:.3f}" if isinstance(v, float) else f"  {k:<34} {v}")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--part", required=True, choices=["build", "static", "continuous", "bs1_8b", "cpu_mixed", "report"])
    p.add_argument("--store", default="/tmp/bb/llama3-70b-nf4")
    p.add_argument("--store-8b", default="/tmp/bb/llama3-8b-bf16")
    p.add_argument("--store-default", default="/tmp/bb/default")
    p.add_argument("--requests", type=int, default=512)
    p.add_argument("--slots", type=int, default=64, help="upper bound; the router may allow fewer under the cap")
    p.add_argument("--static-batches", type=int, default=1, help="static batches to run (the rest are not run)")
    p.add_argument("--cap-gb", type=float, default=15.0, help="GPU cap, decimal GB")
    p.add_argument("--kv", choices=["auto", "none", "tq"], default="auto")
    p.add_argument("--kv-offload", action=argparse.BooleanOptionalAction, default=None)
    p.add_argument("--mixed-prompts", type=int, default=48)
    p.add_argument("--mixed-slots", type=int, default=16)
    p.add_argument("--mixed-new", type=int, default=256)
    p.add_argument("--quick", action="store_true", help="CPU, tiny shapes: a test of the script")
    p.add_argument("--out", default="results/batch_bench.json")
    args = p.parse_args(argv)
    args.prompt_range, args.mean_new, args.max_new = PROMPT_RANGE, MEAN_NEW, MAX_NEW
    if args.quick:
        args.prompt_range, args.mean_new, args.max_new = (8, 24), 6, 12
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    out = Path(args.out)
    results = json.loads(out.read_text()) if out.exists() else {}
    if args.part == "build":
        synth(Path(args.store), "llama3-70b", "nf4", args.quick)
    elif args.part in ("static", "continuous"):
        part_batch(args, args.part, results)
    elif args.part == "bs1_8b":
        part_bs1_8b(args, results)
    elif args.part == "cpu_mixed":
        part_cpu_mixed(args, results)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=1, sort_keys=True) + "\n")
    report(results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
