"""The host NF4 kernel's builds, thread counts and call shapes side by side, on this host, in one run: what
``host_gemv_over_memcpy`` (moe_bench ``--part host``) is bound by.

Builds: the shipped one, AVX2 (``-mno-avx512f``), the block index by division (``NF4_DIVIDE``, the kernel before
its shift) and the wide pass's software prefetch off or 1 or 4 KB ahead (``NF4_PREFETCH``; shipped: 2 KB).
Each build's products are checked against the shipped build's first (same values within fp32 rounding), then
timed: ``nf4_cpu.measure``'s 4096 x 4096 matrices over 64 MB, and the calls the host-experts path makes for
Qwen3-30B-A3B at batch 1 (8 experts' gate/up [1536, 2048] in one call, their down [2048, 768] in another: packed
bytes a second through ``matmul_experts``, Python included).
A plain copy on the same threads beside them.

Measured on the H100 host (16 vCPUs, Xeon, 14 threads; results/host_gemv_sweep.json, 2026-12-05): shipped 41-44
GB/s against a 74-80 GB/s copy, 31 GB/s on 7 threads (0.78 of its copy): 1.34x from 7 to 14 threads where the
copy gains 1.85x, as if the 16 vCPUs were 8 cores with two threads each (the VM hides siblings) and the kernel
compute-bound per core; AVX2 24.6. Two more builds were tried in that run
and dropped (a row's scales decoded before its pass: 37.9; two rows a pass at batch 1: 41.9).

    python benchmarks/host_gemv_sweep.py --results results [--seconds 0.5] [--threads 1,7,14]

Writes ``host_gemv_sweep.json`` under ``--results``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing
from airquant.eval.rows import hardware_info  # noqa: E402
from airquant.quant.kernels import nf4_cpu  # noqa: E402
from airquant.units import GB  # noqa: E402

BUILDS = {"shipped": [], "avx2": ["-mno-avx512f"],
          # the wide pass's block index by a 64-bit division a step, as before nf4_cpu.c's wide_shape (the
          # shift's baseline in the same run)
          "divide": ["-DNF4_DIVIDE"],
          # software prefetch of the wide path's bytes this far ahead (crosses the 4 KB pages where the
          # hardware's stream prefetch stops): one thread on a Xeon reads at ~0.7 of its copy
          "noprefetch": ["-DNF4_PREFETCH=0"], "prefetch1k": ["-DNF4_PREFETCH=1024"],
          "prefetch4k": ["-DNF4_PREFETCH=4096"]}
BASE_FLAGS = list(nf4_cpu.FLAGS)


def use_build(extra: list[str]) -> str:
    nf4_cpu.FLAGS[:] = BASE_FLAGS + extra
    nf4_cpu.library.cache_clear()
    return nf4_cpu.host_kernel()


def expert_calls(experts: int = 8, seed: int = 0) -> list[tuple]:
    """(x, Matrices, experts index, rows, n, k, packed bytes) of the two calls of one Qwen3 layer at batch 1."""
    calls = []
    for n, k in ((1536, 2048), (2048, 768)):
        mats = nf4_cpu.Matrices.of([nf4_cpu.random_nf4(n, k, 64, True, seed=seed + e) for e in range(experts)])
        per = sum(b["weight_packed"].numel() + b["absmax"].numel() for b in mats.bufs)
        calls.append((torch.randn(experts, k), mats, torch.arange(experts), torch.arange(experts + 1), n, k, per))
    return calls


def layer_rate(layers: list[list[tuple]], threads: int, seconds: float) -> float:
    """Packed bytes a second over the layers' calls in turn (distinct layers so caches do not hold them)."""
    flat = [c for layer in layers for c in layer]
    nbytes = sum(c[-1] for c in flat)

    def once():
        for x, mats, e, rows, n, k, _ in flat:
            nf4_cpu.matmul_experts(x, mats, e, rows, n, k, 64, True, threads)

    return nf4_cpu._rate([once], nbytes, seconds)  # as nf4_cpu.measure times its products


def check(layers: list[list[tuple]], reference: list[torch.Tensor]) -> float:
    """Largest difference from the shipped build's products, relative to their scale."""
    worst = 0.0
    for (x, mats, e, rows, n, k, _), ref in zip(layers[0], reference):
        got = nf4_cpu.matmul_experts(x, mats, e, rows, n, k, 64, True, 1)
        worst = max(worst, float((got - ref).abs().max() / ref.abs().max()))
    return worst


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--results", type=Path, default=Path("results"))
    p.add_argument("--seconds", type=float, default=0.5)
    p.add_argument("--threads", default="", help="comma-separated thread counts (default: 1, half, nf4_cpu's)")
    p.add_argument("--builds", default=",".join(BUILDS))
    a = p.parse_args()
    default = nf4_cpu.threads()
    counts = [int(t) for t in a.threads.split(",") if t] or sorted({1, max(1, default // 2), default})
    layers = [expert_calls(seed=100 * i) for i in range(12)]  # ~0.23 GB: past the host's caches
    use_build([])
    reference = [nf4_cpu.matmul_experts(x, m, e, r, n, k, 64, True, 1) for x, m, e, r, n, k, _ in layers[0]]
    rows = []
    for name in a.builds.split(","):
        kernel = use_build(BUILDS[name])
        err = check(layers, reference)
        for t in counts:
            bw = nf4_cpu.measure(a.seconds, n_threads=t)
            lay = layer_rate(layers, t, a.seconds) / GB
            row = {"build": name, "flags": BUILDS[name], "kernel": kernel, "threads": t, "gemv_gbps": bw.gemv_gbps,
                   "memcpy_gbps": bw.copy_gbps, "over_memcpy": bw.efficiency, "qwen3_layer_gbps": lay,
                   "qwen3_layer_over_memcpy": lay / bw.copy_gbps, "max_rel_diff": err}
            rows.append(row)
            print(f"{name:16s} {kernel:22s} threads {t:3d}: GEMV {bw.gemv_gbps:6.1f} GB/s, Qwen3 layer calls "
                  f"{lay:6.1f}, copy {bw.copy_gbps:6.1f} ({bw.efficiency:.2f}, {lay / bw.copy_gbps:.2f}); "
                  f"max rel diff {err:.1e}", flush=True)
    use_build([])
    a.results.mkdir(parents=True, exist_ok=True)
    out = a.results / "host_gemv_sweep.json"
    out.write_text(json.dumps({"run": time.strftime("%Y-%m-%dT%H:%M:%S"), **hardware_info("cpu"),
                               "rows": rows}, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
