"""Cost of the per-read checksum: streamed passes over a store with ``verify_reads`` on and off.

Two placements, each measured both ways, passes interleaved (off, on, off, on ...) so drift in the page
cache or clocks falls on both: the disk tier (``max_ram_gb=0``: every pass reads every layer from the
file and checks it) and the RAM tier (the first pass fills it and checks; later passes copy from RAM).
The issue's target is an overhead of at most 2 % on both.

    python -m benchmarks.verify_bench                 # H200: 8B-shaped bf16 store, 16 layers (~7 GB)
    python -m benchmarks.verify_bench --quick         # CPU: a tiny random Llama, tests the script

Writes ``results/verify_bench.json``.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
import xxhash

from airquant.config import EngineConfig
from airquant.engine.runner import Engine

REPO = Path(__file__).resolve().parent.parent


def hash_gbps(nbytes: int = 512 << 20) -> float:
    buf = torch.ones(nbytes, dtype=torch.uint8).numpy()  # touched: no page faults inside the timing
    xxhash.xxh3_128_hexdigest(memoryview(buf[: 1 << 20]))
    start = time.perf_counter()
    xxhash.xxh3_128_hexdigest(memoryview(buf))
    return nbytes / (time.perf_counter() - start) / 1e9


def drop_caches() -> bool:
    """Drop the page cache (root only) so disk-tier passes read the disk, not RAM."""
    try:
        subprocess.run(["sync"], check=True)
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        return True
    except OSError:
        return False


def timed_pass(engine: Engine, ids: torch.Tensor) -> float:
    sync = torch.cuda.synchronize if engine.device.type == "cuda" else (lambda: None)
    sync()
    start = time.perf_counter()
    engine.forward(ids)
    sync()
    return time.perf_counter() - start


def measure(store: Path, tier: str, device: str, passes: int, cap_gb: float | None, cold: bool) -> dict:
    """Seconds per streamed pass, checks off and on, for one tier."""
    ram = 0.0 if tier == "disk" else None
    engines = {v: Engine.open(store, EngineConfig(device=device, max_ram_gb=ram, max_vram_gb=cap_gb,
                                                  resident_layers=0, verify_reads=v)) for v in (False, True)}
    try:
        assert all(t == tier for t in engines[True].plan.tiers), engines[True].plan.tiers
        ids = torch.randint(0, 1000, (1, 8))
        first, dropped = {}, []
        for v in (False, True):  # the RAM tier's fill pass (checked when on); a warm-up for the disk tier
            if cold:
                dropped.append(drop_caches())
            first[v] = timed_pass(engines[v], ids)
        times = {False: [], True: []}
        for _ in range(passes):
            for v in (False, True):
                if cold:
                    dropped.append(drop_caches())
                times[v].append(timed_pass(engines[v], ids))
        gb = sum(engines[True].manifest.layer_bytes) / 1e9
        off, on = statistics.median(times[False]), statistics.median(times[True])
        return {"tier": tier, "layer_gb": round(gb, 3), "passes": passes,
                "first_pass_s": {"off": round(first[False], 4), "on": round(first[True], 4)},
                "pass_s": {"off": round(off, 4), "on": round(on, 4)},
                "pass_gbps": {"off": round(gb / off, 2), "on": round(gb / on, 2)},
                "overhead_pct": round(100 * (on / off - 1), 2),
                "first_pass_overhead_pct": round(100 * (first[True] / first[False] - 1), 2),
                "checked_gb": round(engines[True].streamer.checks.checked_bytes / 1e9, 3),
                "page_cache_dropped": all(dropped) if dropped else None}
    finally:
        for e in engines.values():
            e.close()


def build_store(args, work: Path) -> Path:
    store = Path(args.store) if args.store else work / ("tiny" if args.quick else f"llama3-8b-{args.layers}L")
    if (store / "manifest.json").is_file():
        return store
    if args.quick:
        from benchmarks.fault_tools import tiny_model

        cmd = ["shard", tiny_model(work / "tiny_model", layers=4), "--store", store, "--dtype", "float32"]
    else:
        cmd = ["synth", "--shape", "llama3-8b", "--layers", args.layers, "--store", store, "--device", args.device,
               "--tokenizer", REPO / "tests" / "data" / "smollm2_tokenizer"]  # no default model needed
    subprocess.run([sys.executable, "-m", "airquant.cli", *map(str, cmd), "--quiet"], cwd=REPO, check=True)
    return store


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="a tiny store on the CPU (tests the script)")
    p.add_argument("--store", default=None, help="an existing store to measure (default: build one in --workdir)")
    p.add_argument("--workdir", default=str(REPO / "bench-work"))
    p.add_argument("--layers", type=int, default=16, help="layers of the 8B-shaped store (16: ~7 GB)")
    p.add_argument("--passes", type=int, default=5, help="timed passes per setting and tier")
    p.add_argument("--part", choices=["disk", "ram", "all"], default="all")
    p.add_argument("--cold", action="store_true", help="drop the page cache before each disk-tier pass (root)")
    p.add_argument("--device", choices=["cpu", "cuda"], default=None)
    p.add_argument("--out", default=str(REPO / "results" / "verify_bench.json"))
    args = p.parse_args(argv)
    args.device = args.device or ("cpu" if args.quick or not torch.cuda.is_available() else "cuda")
    work = Path(args.workdir)
    work.mkdir(parents=True, exist_ok=True)
    store = build_store(args, work)
    # GiB, shared by the two engines measure() opens at once (checks off and on), each holding its own
    # embeddings/lm_head (~2.1 GB for the 8B shape) and layer slots; resident_layers=0 streams every layer.
    cap = 10.0 if args.device == "cuda" else None
    rows = [measure(store, tier, args.device, args.passes, cap, args.cold and tier == "disk")
            for tier in (("disk", "ram") if args.part == "all" else (args.part,))]
    body = {"benchmark": "verify_bench", "quick": args.quick, "store": store.name, "device": args.device,
            "gpu": torch.cuda.get_device_name() if args.device == "cuda" else None, "cpu": platform.processor(),
            "xxh3_128_gbps_one_core": round(hash_gbps(), 1), "cold_disk": args.cold, "tiers": rows}
    Path(args.out).write_text(json.dumps(body, indent=1) + "\n")
    print(f"{'tier':<5} {'GB':>6} {'off s':>8} {'on s':>8} {'GB/s off':>9} {'GB/s on':>8} {'overhead':>9} {'fill':>7}")
    for r in rows:
        print(f"{r['tier']:<5} {r['layer_gb']:>6.2f} {r['pass_s']['off']:>8.3f} {r['pass_s']['on']:>8.3f} "
              f"{r['pass_gbps']['off']:>9.2f} {r['pass_gbps']['on']:>8.2f} {r['overhead_pct']:>8.2f}% "
              f"{r['first_pass_overhead_pct']:>6.1f}%")
    print(f"xxh3_128 on one core: {body['xxh3_128_gbps_one_core']} GB/s; wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
