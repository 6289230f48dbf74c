"""Streamed decode speed of compressed layer files: a 7B-shaped store as GPTQ-4bit, NF4 and bf16.

What users of pre-quantized checkpoints ask: how fast does a 7B GPTQ model run on an 8 GB card
(an RTX 4070's memory) when the layers that do not fit stream from host RAM? One run on the GPU
machine, the GPU capped to ``--cap`` GB, the engine's automatic plan (layers resident in VRAM as far
as the cap allows, the rest pinned in RAM and streamed on the copy stream):

* the pinned host->GPU link, measured first;
* for each store (synthetic weights in the real layouts: ``airquant synth --dtype gptq|nf4|bfloat16``;
  GPTQ is the hub's 4-bit g128 symmetric v1 packing, computed from as it is stored) and two plans,
  ``auto`` (what a user gets: a 4-bit 7B fits 8 GB whole) and ``streamed`` (no layer resident: every
  layer crosses the link each step, as on a smaller card or a bigger model): per-token latency at
  batch 1 and 16 (median decode step, prompt ``--prompt-len`` tokens), tokens/s, peak VRAM allocated
  and reserved, layers resident, bytes streamed per step and their share of the link.

Writes ``results/quant_speed.json``; synthetic weights: speed and memory figures only.

    python benchmarks/quant_speed.py                 # GPU: about 3 minutes, ~20 GB of disk at a time
    python benchmarks/quant_speed.py --quick         # tiny shapes on the CPU: tests the script
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # run from a checkout without installing

from benchmarks.stream_bench import (  # noqa: E402
    GB,
    Bench,
    bench_device,
    decode_step,
    finish_paths,
    make_store,
    open_engine,
    part_link,
    versions,
    write_results,
)

log = logging.getLogger("quant_speed")
SCHEMES = ("gptq", "nf4", "bfloat16")
PLANS = {"auto": None, "streamed": 0}  # plan name -> resident layers (None: the planner decides)


def run_scheme(b: Bench, dtype: str, batches: tuple[int, ...]) -> dict:
    store = make_store(b, b.args.shape, dtype, b.args.layers)
    out = {name: run_plan(b, store, dtype, batches, resident) for name, resident in PLANS.items()}
    b.drop(store)
    return out


def run_plan(b: Bench, store: Path, dtype: str, batches: tuple[int, ...], resident: int | None) -> dict:
    a = b.args
    context = a.prompt_len + a.steps + 3
    engine = open_engine(b, store, a.cap, batch_size=max(batches), context=context, resident_layers=resident)
    plan = engine.plan
    rows = {}
    for n in batches:
        try:
            rows[str(n)] = decode_step(b, engine, n, f"{dtype}-{'auto' if resident is None else 'streamed'}-bs{n}")
        except torch.OutOfMemoryError as exc:  # a cap too small for this batch: recorded, not fatal
            log.warning("%s batch %d: out of memory (%s)", dtype, n, str(exc).splitlines()[0])
            rows[str(n)] = {"batch": n, "error": "out of memory"}
    out = {"store_gb": engine.manifest.total_bytes / GB, "layer_gb": max(engine.manifest.layer_bytes) / GB,
           "vram_layers": len(plan.vram_layers), "ram_layers": len(plan.ram_layers),
           "disk_layers": len(plan.disk_layers), "batches": rows}
    engine.close()
    del engine
    link = b.results.get("link_pinned_gbps")
    for row in rows.values():
        if "step_s" in row:
            row["ms_per_token"] = 1000 * row["step_s"]  # per decode step: one token for each sequence
            row["link_fraction"] = row["bytes_per_step"] / row["step_s"] / GB / link if link and row["bytes_per_step"] else None
    return out


def print_table(b: Bench) -> None:
    r = b.results
    print(f"\nquant_speed on {r['device']}: {r['shape']}, GPU capped to {r['cap_gb']} GB "
          f"({'QUICK: tiny shapes, not a measurement' if b.quick else 'synthetic weights, real shapes'})")
    print(f"  pinned link {r['link_pinned_gbps']:.1f} GB/s")
    print(f"  {'scheme':<9} {'plan':<9} {'store GB':>8} {'in VRAM':>8} {'batch':>5} {'ms/token':>9} {'tok/s':>8} "
          f"{'peak GB':>8} {'link':>5}")
    for dtype, plans in r["schemes"].items():
        for name, s in plans.items():
            for n, row in s["batches"].items():
                head = f"  {dtype:<9} {name:<9} {s['store_gb']:8.2f} {s['vram_layers']:8d} {n:>5}"
                if "step_s" not in row:
                    print(f"{head} {row['error']}")
                    continue
                peak, frac = row["peak_allocated_gb"], row["link_fraction"]
                print(f"{head} {row['ms_per_token']:9.1f} {row['tok_s']:8.1f} {'-' if peak is None else f'{peak:.2f}':>8} "
                      f"{'-' if frac is None else f'{frac:.2f}':>5}")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="llama2-7b", help="synthetic shape (airquant synth --shape)")
    p.add_argument("--schemes", default=",".join(SCHEMES), help="comma list of gptq,nf4,bfloat16")
    p.add_argument("--cap", type=float, default=8.0, help="GPU cap in GB (8: an RTX 4070)")
    p.add_argument("--batches", default="1,16")
    p.add_argument("--steps", type=int, default=4, help="timed decode steps per case (after one warm-up)")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--layers", type=int, default=None, help="truncate the shape (default: all layers)")
    p.add_argument("--workdir", default=str(REPO / "bench-work"), help="where the synthetic stores are written")
    p.add_argument("--keep-stores", action="store_true")
    p.add_argument("--out", default=None, help="JSON path (default: results/quant_speed.json; "
                                               "WORKDIR/results/quant_speed.json with --quick)")
    p.add_argument("--quick", action="store_true", help="tiny truncated shapes on the CPU: tests the script")
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    p.add_argument("--tokenizer", default=str(REPO / "tests" / "data" / "smollm2_tokenizer"))
    args = p.parse_args(argv)
    args.schemes = [s for s in args.schemes.split(",") if s]
    unknown = set(args.schemes) - set(SCHEMES)
    if unknown:
        p.error(f"--schemes: {', '.join(sorted(unknown))} not among {', '.join(SCHEMES)}")
    args.batches = tuple(int(x) for x in args.batches.split(","))
    if args.quick:
        args.prompt_len, args.steps, args.batches = min(args.prompt_len, 32), min(args.steps, 2), (1, 2)
    finish_paths(args, "quant_speed.json")
    return args


def main(argv=None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    args = parse_args(argv)
    device = bench_device(args)
    b = Bench(args, device)
    b.results.update(benchmark="quant_speed", device=torch.cuda.get_device_name(0) if device.type == "cuda" else "cpu",
                     synthetic=True, quick=args.quick, shape=args.shape, cap_gb=args.cap,
                     prompt_len=args.prompt_len, steps=args.steps, versions=versions(),
                     time=time.strftime("%Y-%m-%dT%H:%M:%S"), schemes={})
    part_link(b)
    out = Path(args.out)
    for dtype in args.schemes:
        b.results["schemes"][dtype] = run_scheme(b, dtype, args.batches)
        write_results(b, out)
    print_table(b)
    write_results(b, out)
    print(f"\nwrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
