#!/usr/bin/env python
"""Ray's cost on one GPU: the same batch job through ``airquant batch --ray --engines 1`` and plain ``airquant batch``.

Both runs are the CLI as a user starts it (a fresh process each: imports, engine open, generation, the
records fsynced to OUT.jsonl), on the same prompts, batch size and store, with the store's files read into
the page cache first so that neither pays the cold disk. The Ray run also starts a local Ray, an engine
actor, and streams records back to the driver. ``ray_over_plain_wall`` = Ray wall / plain wall (target
<= 1.05); useful tok/s = new tokens written / wall. Both runs log at INFO (``-v``); the Ray driver's line (dispatch
to last record, the engines' seconds opening the store and generating) splits Ray's wall into generation
(``ray_generation_over_plain`` = the engines' generating seconds / plain's job seconds) and a fixed cost per job
(``ray_fixed_overhead_s``: Ray's start and stop, the actor's process and imports), and gives the plain wall from which
a job meets the target (``plain_wall_for_target_s``).

Parts (results merge into ``results/scale_bench.json``):

* ``store``: an 8B-shaped bf16 store (``airquant synth --shape llama3-8b --dtype bfloat16``, 16 GB, built on the
  GPU) under ``--workdir``; skipped with ``--store PATH`` (reuse one built for another benchmark).
* ``plain``: plain ``airquant batch``.
* ``ray``: ``airquant batch --ray --engines 1``.
* ``multi`` (issue 23, a machine of several GPUs; not in ``all``): the same job through ``--ray --engines 1`` and
  ``--engines N`` (``--engines``, default every GPU), one GPU per engine, each a fresh CLI process. Under
  ``results["multi"]``: each run's wall, job seconds, useful tok/s and the driver's split, ``scaling_efficiency`` =
  tok/s with N / (N x tok/s with 1) against its target (>= 0.9), ``generation_scaling_efficiency`` (tokens per
  engine-second of generation, N against 1: do engines slow each other?), the host RAM N engines' plans pin
  against the machine's (planned, not measured) and the pinned link per GPU with every GPU copying at once
  (``benchmarks/scale_machine.py``).

``--quick`` runs the whole flow on the CPU with a tiny 2-layer store (a test of the script, not a measurement;
``multi`` then runs 2 CPU engines).

    python benchmarks/scale_bench.py --part all            # about 3 minutes on one H200, store included
    python benchmarks/scale_bench.py --store /path/llama3-8b-bf16 --part all
    python benchmarks/scale_bench.py --part store multi    # about 5 minutes on 2 H200s (nvidia-h200-x2)
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from airquant.store.synth import SynthSpec, synth  # noqa: E402

log = logging.getLogger("scale_bench")
TARGET = 1.05  # ray_over_plain_wall, at most
TARGET_EFFICIENCY = 0.9  # scaling_efficiency with N engines, at least (issue 23)
RAY_SPLIT = re.compile(r"ray batch job: ([0-9.]+) s from the first dispatch.*?spent ([0-9.]+) s opening the store "
                       r"and ([0-9.]+) s generating", re.S)
JOB_LINE = re.compile(r"([0-9]+) tokens in ([0-9.]+) s \(([0-9.]+) tok/s\)")  # cli.run_cmds.cmd_batch's last line
QUICK = (("hidden", 256), ("intermediate", 512), ("heads", 4), ("kv_heads", 2), ("vocab", 4096))
WORDS = ("the river carried seven boats past an old mill while the town slept and a lamp burned in one "
         "window where someone wrote letters about the harvest the weather and the long road north").split()


# -- inputs ----------------------------------------------------------------------------------------
def write_prompts(path: Path, n: int) -> Path:
    """``n`` prompts of 8 to 40 words, ids 0..n-1 (lengths vary so batches pad as real ones do)."""
    rows = [{"id": k, "prompt": " ".join(WORDS[(k * 7 + j) % len(WORDS)] for j in range(8 + (k * 13) % 33))}
            for k in range(n)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def build_store(args: argparse.Namespace) -> Path:
    from transformers import AutoTokenizer

    path = Path(args.workdir) / ("llama3-8b-bf16-quick" if args.quick else "llama3-8b-bf16")
    spec = SynthSpec("llama3-8b", "bfloat16", layers=2 if args.quick else None, overrides=QUICK if args.quick else ())
    tok = AutoTokenizer.from_pretrained(args.tokenizer) if Path(args.tokenizer).is_dir() else None
    start = time.perf_counter()
    manifest = synth(spec, path, device="cpu" if args.quick else "cuda", tokenizer=tok, progress=False)
    log.info("store %s: %.2f GB in %.1f s", path, manifest.total_bytes / 1e9, time.perf_counter() - start)
    return path


def warm(store: Path) -> float:
    """Read every file of the store once so both runs find it in the page cache; returns GB read."""
    total = 0
    for path in sorted(store.rglob("*")):
        if path.is_file():
            with open(path, "rb") as f:
                while chunk := f.read(1 << 26):
                    total += len(chunk)
    return total / 1e9


# -- runs ------------------------------------------------------------------------------------------
def run_job(args: argparse.Namespace, store: Path, name: str, extra: list[str]) -> dict:
    """One ``airquant batch`` process on a fresh output; its wall time, job time and tokens."""
    work = Path(args.workdir)
    inp, out = work / "prompts.jsonl", work / f"out-{name}.jsonl"
    write_prompts(inp, args.prompts)
    out.unlink(missing_ok=True)
    cmd = [sys.executable, "-m", "airquant.cli", "-v", "batch", str(store), "--input", str(inp), "--output", str(out),
           "--batch-size", str(args.batch_size), "--max-new-tokens", str(args.max_new_tokens), "--quiet",
           "--device", "cpu" if args.quick else "cuda", *extra]
    log.info("%s: warmed %.1f GB; %s", name, warm(store), " ".join(cmd[2:]))
    start = time.perf_counter()
    done = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    wall = time.perf_counter() - start
    if done.returncode:
        raise RuntimeError(f"{name} run failed ({done.returncode}):\n{done.stderr[-4000:]}")
    records = [json.loads(line) for line in out.read_text().splitlines()]
    ids = [r["id"] for r in records]
    assert sorted(ids) == list(range(args.prompts)), f"{name}: ids missing or written twice"
    job = JOB_LINE.search(done.stdout)
    new = sum(r["new_tokens"] for r in records)
    named = {str(store): "STORE", str(inp): "IN.jsonl", str(out): "OUT.jsonl"}  # no machine paths in results/
    row = {"measured_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
           "wall_s": wall, "job_s": job_seconds(job), "records": len(records),
           "new_tokens": new, "useful_tok_s": new / wall,
           "command": " ".join(["airquant", *[named.get(a, a) for a in cmd[3:]]])}
    split = RAY_SPLIT.search(done.stderr)
    if split:  # the Ray driver's own account: dispatch to last record, engines opening, engines generating
        row.update(dispatch_s=float(split.group(1)), engine_open_s=float(split.group(2)),
                   engine_generate_s=float(split.group(3)))
    return row


def job_seconds(line: re.Match | None) -> float | None:
    """The CLI's job seconds; from its tokens and tok/s when both are there: the seconds print to 0.1 s, which
    rounds a tiny --quick job to 0.0."""
    if line is None:
        return None
    tokens, seconds, rate = int(line.group(1)), float(line.group(2)), float(line.group(3))
    return tokens / rate if tokens and rate else seconds


PAIR_WINDOW_S = 3 * 3600  # the parts run as separate commands; a pair is one device session


def same_run(plain: dict, ray: dict) -> bool:
    """Whether the two rows come from one device session: measured within ``PAIR_WINDOW_S`` of each other
    (rows written before ``measured_at`` existed were always written together, as a pair)."""
    stamps = [r.get("measured_at") for r in (plain, ray)]
    if stamps == [None, None]:
        return True
    if None in stamps:
        return False
    t = [time.mktime(time.strptime(x, "%Y-%m-%dT%H:%M:%SZ")) for x in stamps]
    return abs(t[0] - t[1]) <= PAIR_WINDOW_S


DERIVED = ("ray_over_plain_wall", "ray_over_plain_useful_tok_s", "meets_target", "ray_generation_over_plain",
           "ray_fixed_overhead_s", "plain_wall_for_target_s")


def summarize(results: dict) -> None:
    """The ratios of a plain and a Ray row of one session; rows of different sessions (one part re-run alone)
    are kept but not compared: a ratio across machines would measure the machines."""
    plain, ray = results.get("plain"), results.get("ray")
    for key in DERIVED:
        results.pop(key, None)
    results.pop("unpaired", None)
    if plain and ray and not same_run(plain, ray):
        results["unpaired"] = (f"plain measured {plain.get('measured_at', 'before measured_at was recorded')}, "
                               f"ray {ray.get('measured_at', 'before measured_at was recorded')}: not one session, "
                               "no ratio; run both parts again")
        return
    if plain and ray:
        results["ray_over_plain_wall"] = ray["wall_s"] / plain["wall_s"]
        results["ray_over_plain_useful_tok_s"] = ray["useful_tok_s"] / plain["useful_tok_s"]
        results["meets_target"] = results["ray_over_plain_wall"] <= TARGET
        if ray.get("engine_generate_s") and plain.get("job_s"):
            # Where Ray's time goes: generation through the actor against the plain job's generation, and what
            # is left, a fixed cost per job (Ray's start and stop, the actor's process, its imports). A job whose
            # plain wall is W costs ~ fixed + W * generation ratio through Ray, so the ratio meets the target
            # once W >= fixed / (TARGET - generation ratio).
            ratio = ray["engine_generate_s"] / plain["job_s"]
            fixed = ray["wall_s"] - plain["wall_s"] - (ray["engine_generate_s"] - plain["job_s"])
            results.update(ray_generation_over_plain=ratio, ray_fixed_overhead_s=fixed,
                           plain_wall_for_target_s=fixed / (TARGET - ratio) if ratio < TARGET else None)


# -- several GPUs (issue 23) ---------------------------------------------------------------------
def multi_engines(args: argparse.Namespace) -> int:
    """N of the multi part: ``--engines``, else every GPU (2 CPU engines with --quick); at least 2."""
    gpus = torch.cuda.device_count()
    n = args.engines or (2 if args.quick else gpus)
    if n < 2:
        raise SystemExit(f"--part multi compares 1 engine with N >= 2, and this machine has {gpus} GPU(s): run it on "
                         "a machine of several GPUs (nvidia-h200-x2 or larger), or pass --engines N with --quick.")
    return n


def part_multi(args: argparse.Namespace, store: Path, n: int) -> dict:
    """The same job through 1 and ``n`` Ray engines, then the host RAM n engines pin and the link per GPU."""
    from benchmarks.scale_machine import link_part, planned_host_ram

    gpus = torch.cuda.device_count()
    per_engine = ["--gpus-per-engine", "0"] if args.quick else ["--gpus-per-engine", "1"]
    runs = {str(k): {"engines": k, **run_job(args, store, f"multi-{k}", ["--ray", "--engines", str(k), *per_engine])}
            for k in (1, n)}
    device = "cpu" if args.quick else "cuda"
    multi = {"quick": args.quick, "device": torch.cuda.get_device_name(0) if gpus and not args.quick else "cpu",
             "gpus": gpus, "engines": n, "gpus_per_engine": 0 if args.quick else 1, "prompts": args.prompts,
             "batch_size": args.batch_size, "max_new_tokens": args.max_new_tokens, "shape": "llama3-8b",
             "dtype": "bfloat16", "target_scaling_efficiency": TARGET_EFFICIENCY, "runs": runs,
             # After the runs: the plan reads this machine's free VRAM and RAM, and the link fills every GPU.
             "host_ram": planned_host_ram(store, Path(args.workdir) / "prompts.jsonl", args.batch_size,
                                          args.max_new_tokens, device, n),
             "link": link_part(args.quick)}
    if args.quick:
        multi["note"] = "quick: CPU engines on a tiny store sharing this machine's cores; not a measurement"
    return multi


MULTI_DERIVED = ("scaling_efficiency", "meets_target", "generation_scaling_efficiency", "unpaired")


def summarize_multi(multi: dict) -> None:
    """``scaling_efficiency`` (the issue's figure, from wall time: start-up included) and, from the drivers'
    split, ``generation_scaling_efficiency``: tokens per engine-second of generation with N engines against
    1; below 1 when engines slow each other (a shared link, host cores), whatever the fixed cost per job."""
    for key in MULTI_DERIVED:
        multi.pop(key, None)
    n = multi.get("engines")
    one, many = (multi.get("runs") or {}).get("1"), (multi.get("runs") or {}).get(str(n))
    if not (one and many):
        return
    if not same_run(one, many):
        multi["unpaired"] = f"1 engine measured {one.get('measured_at')}, {n} {many.get('measured_at')}: run again"
        return
    multi["scaling_efficiency"] = many["useful_tok_s"] / (n * one["useful_tok_s"])
    multi["meets_target"] = None if multi.get("quick") else multi["scaling_efficiency"] >= TARGET_EFFICIENCY
    if one.get("engine_generate_s") and many.get("engine_generate_s"):
        multi["generation_scaling_efficiency"] = ((many["new_tokens"] / many["engine_generate_s"])
                                                  / (one["new_tokens"] / one["engine_generate_s"]))


def print_multi(multi: dict) -> None:
    print(f"{'engines':<8} {'wall s':>8} {'job s':>8} {'new tok':>8} {'useful tok/s':>13} {'gen s (sum)':>12}")
    for key, r in multi.get("runs", {}).items():
        print(f"{key:<8} {r['wall_s']:>8.1f} {r['job_s'] or 0:>8.1f} {r['new_tokens']:>8} {r['useful_tok_s']:>13.1f} "
              f"{r.get('engine_generate_s') or 0:>12.1f}")
    if "scaling_efficiency" in multi:
        print(f"scaling_efficiency {multi['scaling_efficiency']:.3f} (target >= {TARGET_EFFICIENCY}"
              + ("; quick: not a measurement)" if multi.get("quick") else ")")
              + (f", generation {multi['generation_scaling_efficiency']:.3f}"
                 if "generation_scaling_efficiency" in multi else ""))
    ram = multi.get("host_ram") or {}
    if ram:
        print(f"host RAM: {ram['engines']} x {ram['per_engine_bytes'] / 1e9:.2f} GB planned per engine of "
              f"{ram['machine_available_bytes'] / 1e9:.1f} GB available: {ram['verdict']} (planned, not measured)")
    link = multi.get("link") or {}
    print(f"link: {link['skipped']}" if "skipped" in link else "link per GPU: " + ", ".join(
        f"{d} {r['alone_gbps']:.1f} alone / {r['together_gbps']:.1f} together GB/s"
        for d, r in link.get("per_device", {}).items()))


def print_table(results: dict) -> None:
    print(f"{'run':<6} {'wall s':>8} {'job s':>8} {'new tok':>8} {'useful tok/s':>13}")
    for name in ("plain", "ray"):
        r = results.get(name)
        if r:
            print(f"{name:<6} {r['wall_s']:>8.1f} {r['job_s'] or 0:>8.1f} {r['new_tokens']:>8} {r['useful_tok_s']:>13.1f}")
    if "unpaired" in results:
        print(results["unpaired"])
    if "ray_over_plain_wall" in results:
        print(f"ray_over_plain_wall {results['ray_over_plain_wall']:.3f} (target <= {TARGET})")
    if "ray_fixed_overhead_s" in results:
        need = results["plain_wall_for_target_s"]
        print(f"ray generation / plain generation {results['ray_generation_over_plain']:.3f}; fixed cost per job "
              f"{results['ray_fixed_overhead_s']:.1f} s; target met for jobs whose plain wall is >= "
              + (f"{need:.0f} s" if need is not None else "never (generation itself slower)"))


# -- main ------------------------------------------------------------------------------------------
def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--part", nargs="+", choices=["store", "plain", "ray", "multi", "all"], default=["all"],
                   help="parts to run, in this order (all: store, plain, ray; multi needs several GPUs)")
    p.add_argument("--store", default=None, help="reuse this 8B-shaped bf16 store (no store part)")
    p.add_argument("--workdir", default=str(REPO / "bench-work"), help="store, prompts and outputs")
    p.add_argument("--results", default=None, help="folder of scale_bench.json (default results/; "
                                                   "WORKDIR/results with --quick)")
    p.add_argument("--quick", action="store_true", help="tiny 2-layer store on the CPU: tests the script")
    p.add_argument("--prompts", type=int, default=512)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--engines", type=int, default=None, help="N of the multi part (default: every GPU; 2 with --quick)")
    p.add_argument("--tokenizer", default=str(REPO / "tests" / "data" / "smollm2_tokenizer"))
    args = p.parse_args(argv)
    if args.quick:
        args.prompts, args.batch_size, args.max_new_tokens = min(args.prompts, 8), min(args.batch_size, 4), 4
    if args.results is None:
        args.results = str(Path(args.workdir) / "results") if args.quick else str(REPO / "results")
    return args


def main(argv=None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    args = parse_args(argv)
    parts = set(args.part) - {"all"} | ({"store", "plain", "ray"} if "all" in args.part else set())
    engines = multi_engines(args) if "multi" in parts else 1  # refused before anything runs
    Path(args.workdir).mkdir(parents=True, exist_ok=True)
    out = Path(args.results) / "scale_bench.json"
    results = json.loads(out.read_text()) if out.is_file() else {}
    try:  # the store and plain parts run without Ray installed
        import ray
        ray_version = ray.__version__
    except ImportError:
        if parts & {"ray", "multi"}:
            raise
        ray_version = results.get("versions", {}).get("ray")

    versions = {"ray": ray_version, "torch": torch.__version__}
    if parts & {"plain", "ray"}:  # the one-GPU comparison's settings; the multi part keeps its own
        gpus = torch.cuda.device_count()
        results.update(device=torch.cuda.get_device_name(0) if gpus and not args.quick else "cpu", gpus=gpus,
                       quick=args.quick, synthetic=True, shape="llama3-8b", dtype="bfloat16", engines=1,
                       prompts=args.prompts, batch_size=args.batch_size, max_new_tokens=args.max_new_tokens,
                       target_ray_over_plain_wall=TARGET, versions=versions)
    store = Path(args.store) if args.store else Path(args.workdir) / (
        "llama3-8b-bf16-quick" if args.quick else "llama3-8b-bf16")
    if not args.store and "store" in parts:
        store = build_store(args)
    if "plain" in parts:
        results["plain"] = run_job(args, store, "plain", [])
    if "ray" in parts:
        results["ray"] = run_job(args, store, "ray", ["--ray", "--engines", "1"])
    if "multi" in parts:
        results["multi"] = {**part_multi(args, store, engines), "versions": versions}
        summarize_multi(results["multi"])
    summarize(results)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=1))
    print_table(results)
    if "multi" in results:
        print_multi(results["multi"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
