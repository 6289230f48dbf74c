"""Fused int2 GEMV bandwidth on a 70B-MLP-sized matrix, as a fraction of measured HBM copy bandwidth.

Self-contained (no hub, no model): random 2-bit codes, fp16 scales/zeros and fp16 outlier columns of
an [out, in] linear are made directly on the GPU (speed does not depend on values; random bits
avoid the zero-data shortcuts of some memory paths). In the same run it measures

* HBM copy bandwidth: a device-to-device copy of a buffer far larger than L2, counting bytes read
  plus bytes written (the ceiling the fraction is taken against);
* the int2 GEMV (batch 1), bytes = every tensor the kernels read + y, through both GEMV kernels: the
  Gluon lookup-table one (the automatic choice from 16M weights where Triton has Gluon; row
  "gemv-gluon" is its automatic path, "gemv-gluon-ldg" its plain-load path forced, and on matrices
  where the automatic path is "ldg" although TMA applies, "gemv-gluon-tma" the TMA path forced) and
  the plain-Triton one;
* the fp16 dense GEMV of the same shape (torch / cuBLAS) as a baseline;
* int2 GEMM at a few batch sizes, for the prefill path;

checks the kernel against the torch reference on the same tensors, prints a table and writes JSON.
Target: int2 GEMV bandwidth >= 0.5 x copy bandwidth.

Two times per call: ``graph`` replays the call's kernels from a CUDA graph with an L2 flush before
each call (the flush-only graph's time subtracted): the GPU time of the kernels, what the bandwidth
fraction is taken on; ``eager`` is triton's do_bench of the Python call, which also counts host launch
overhead whenever that exceeds the GPU time (a model's decode step overlaps it with earlier kernels).

    python benchmarks/quant_int2_gemv.py --shapes 28672x8192 8192x28672 --out results/int2_gemv.json
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", nargs="+", default=["28672x8192", "8192x28672"], help="OUTxIN of the linear")
    p.add_argument("--outliers", type=float, default=0.035, help="fraction of input channels kept fp16")
    p.add_argument("--group", type=int, default=32)
    p.add_argument("--dtype", choices=["float16", "bfloat16"], default="float16")
    p.add_argument("--batches", type=int, nargs="*", default=[4, 16, 64], help="GEMM batch sizes also timed")
    p.add_argument("--copy-gib", type=float, default=2.0, help="size of the copy-bandwidth buffer")
    p.add_argument("--rep-ms", type=int, default=200, help="timing window per measurement (triton do_bench)")
    p.add_argument("--out", default="results/int2_gemv.json")
    return p.parse_args()


def bench_ms(fn, rep_ms: int) -> float:
    """Median ms per call; do_bench flushes L2 between calls, so weights really come from HBM."""
    from triton.testing import do_bench

    return float(do_bench(fn, warmup=25, rep=rep_ms, return_mode="median"))


def graph_ms(fn, n: int = 20) -> float:
    """GPU ms per call of fn's kernels: n calls, each after an L2 flush, captured in one CUDA graph;
    the same graph without the calls is subtracted. Median of 7 replays."""
    import statistics

    flush = torch.empty(2**27, dtype=torch.float32, device="cuda")  # 512 MiB, far above L2
    fn()
    torch.cuda.synchronize()

    def build(with_fn: bool):
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for _ in range(n):
                flush.neg_()
                if with_fn:
                    fn()
        return g

    def replay_ms(g) -> float:
        g.replay()
        times = []
        for _ in range(7):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            g.replay()
            b.record()
            torch.cuda.synchronize()
            times.append(a.elapsed_time(b))
        return statistics.median(times)

    return (replay_ms(build(True)) - replay_ms(build(False))) / n


def copy_bandwidth(gib: float, rep_ms: int) -> float:
    n = int(gib * 2**30) // 4
    src = torch.randint(-(2**31), 2**31 - 1, (n,), dtype=torch.int32, device="cuda")
    dst = torch.empty_like(src)
    ms = bench_ms(lambda: dst.copy_(src), rep_ms)
    return 2 * src.numel() * 4 / (ms * 1e-3)  # bytes read + written per second


def random_int2(out_f: int, in_f: int, group: int, n_out: int, dtype) -> dict[str, torch.Tensor]:
    """Tensors as a store holds them; the outlier rows padded to ``outlier_cols`` columns as written by
    ``airquant shard`` (the [:, :n_out] view is what the module passes to the kernels)."""
    from airquant.quant.int2 import outlier_cols

    g = torch.Generator(device="cuda").manual_seed(0)
    ow = torch.zeros(out_f, outlier_cols(n_out), dtype=torch.float16, device="cuda")
    ow[:, :n_out] = torch.randn(out_f, n_out, device="cuda", generator=g) * 0.05
    return {
        "codes": torch.randint(0, 256, (out_f, in_f // 4), dtype=torch.uint8, device="cuda", generator=g),
        "scales": (torch.rand(out_f, in_f // group, device="cuda", generator=g) * 0.02 + 0.001).half(),
        "zeros": (torch.randn(out_f, in_f // group, device="cuda", generator=g) * 0.002).half(),
        "outlier_weight": ow[:, :n_out],
        "outlier_idx": torch.randperm(in_f, device="cuda", generator=g)[:n_out].sort().values.to(torch.int32),
    }


def reference(x: torch.Tensor, t: dict[str, torch.Tensor], group: int) -> torch.Tensor:
    from airquant.quant.int2 import dequantize_int2

    w = dequantize_int2(t["codes"], t["scales"], t["zeros"], group)
    w[:, t["outlier_idx"].long()] += t["outlier_weight"].float()
    return x.float() @ w.t()


def run_shape(out_f: int, in_f: int, args, copy_bw: float) -> list[dict]:
    from airquant.quant.int2 import n_outlier_channels
    from airquant.quant.kernels.int2_triton import _gluon_gemv, _int2_gemm_kernel, _int2_gemv_kernel, int2_matmul_triton

    dtype = getattr(torch, args.dtype)
    n_out = n_outlier_channels(in_f, args.outliers)
    t = random_int2(out_f, in_f, args.group, n_out, dtype)
    weight_bytes = sum(v.numel() * v.element_size() for v in t.values())  # outlier padding not counted
    dense = torch.randn(out_f, in_f, device="cuda", dtype=dtype) * 0.02
    rows = []
    gemvs = ["gluon", "gluon-ldg", "triton"]
    auto = None  # the Gluon GEMV's automatic path ("tma" / "ldg")
    if _gluon_gemv() is not None:
        from airquant.quant.kernels import int2_gluon as gk

        auto = gk.auto_path(t["codes"].view(torch.int32), t["scales"], t["zeros"], args.group)
        if auto == "ldg" and gk.tma_ok(t["codes"].view(torch.int32), t["scales"], t["zeros"], args.group):
            gemvs.insert(1, "gluon-tma")  # time the TMA path too where the automatic choice leaves it out
    for m, gemv in [(1, g) for g in gemvs] + [(b, None) for b in args.batches]:
        if gemv and gemv.startswith("gluon") and _gluon_gemv() is None:
            print("no triton.experimental.gluon here: Gluon GEMV rows skipped")
            continue
        x = torch.randn(m, in_f, device="cuda", dtype=dtype)
        if gemv in ("gluon-ldg", "gluon-tma"):  # one Gluon path forced ("ldg": what other GPUs get)
            path = gemv.split("-")[1]
            call = lambda: gk.int2_gemv(x[0], t["codes"].view(torch.int32), t["scales"], t["zeros"],  # noqa: E731
                                        t["outlier_weight"], t["outlier_idx"], args.group, path=path)[None]
        else:
            call = lambda: int2_matmul_triton(x, t["codes"], t["scales"], t["zeros"], t["outlier_weight"],  # noqa: E731
                                       t["outlier_idx"], args.group, gemv=gemv)
        ref = reference(x, t, args.group).double()
        err = ((call().double() - ref).norm() / ref.norm()).item()
        ms_eager = bench_ms(call, args.rep_ms)
        ms = graph_ms(call)
        ms_dense = graph_ms(lambda: torch.nn.functional.linear(x, dense))
        io_bytes = weight_bytes + x.numel() * x.element_size() + m * out_f * x.element_size()
        bw = io_bytes / (ms * 1e-3)
        kernel = "gemm" if m > 1 else f"gemv-{gemv}"
        if kernel.startswith("gemv-gluon"):
            tma = kernel == "gemv-gluon-tma" or (kernel == "gemv-gluon" and auto == "tma")
            cfg = (f"Gluon lookup tables + warp shuffles (int2_gluon), TMA ring: R={gk.TR} rows per lane, "
                   f"{gk.TNW} warps, {gk.TSTAGES} stages, ~{gk.TPROG} programs per SM" if tma else
                   f"Gluon lookup tables + warp shuffles (int2_gluon), plain loads: R={gk.R} rows per lane, "
                   f"{gk.NW} warps, {2 * gk.D} chunks of 64 inputs per stage, "
                   f"{gk.SPAN_SMALL if in_f <= 8192 else gk.SPAN_LARGE} inputs per program")
        else:
            cfg = str((_int2_gemm_kernel if m > 1 else _int2_gemv_kernel).best_config)
        rows.append({
            "out_features": out_f, "in_features": in_f, "batch": m, "kernel": kernel,
            "n_outliers": n_out, "weight_bytes": weight_bytes,
            "bits_per_weight": weight_bytes * 8 / (out_f * in_f), "int2_ms": ms, "int2_eager_ms": ms_eager,
            "fp16_dense_ms": ms_dense, "speedup_vs_fp16": ms_dense / ms, "achieved_GBps": bw / 1e9,
            "fraction_of_copy_bw": bw / copy_bw, "eager_fraction_of_copy_bw": io_bytes / (ms_eager * 1e-3) / copy_bw,
            "rel_err_vs_torch_fp32": err, "triton_config": cfg,
        })
    return rows


def main() -> None:
    args = parse_args()
    import triton

    assert torch.cuda.is_available(), "this benchmark needs a CUDA GPU"
    copy_bw = copy_bandwidth(args.copy_gib, args.rep_ms)
    rows = []
    for shape in args.shapes:
        out_f, in_f = (int(v) for v in shape.lower().split("x"))
        rows += run_shape(out_f, in_f, args, copy_bw)
        # The shape's weights were freed when run_shape returned (its timed lambdas close over them, so deleting
        # the names inside it left closures pointing at emptied cells); hand the blocks back before the next shape.
        torch.cuda.empty_cache()
    result = {
        "benchmark": "int2_gemv", "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
        "python": platform.python_version(), "dtype": args.dtype, "group": args.group,
        "outlier_fraction": args.outliers, "copy_bandwidth_GBps": copy_bw / 1e9,
        "target_fraction": 0.5, "timing": "graph: CUDA-graph kernel time with L2 flushed before each call; "
        "eager: do_bench of the Python call (includes host launch overhead when it dominates)", "rows": rows,
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    print(f"HBM copy bandwidth (read+write): {copy_bw / 1e9:.0f} GB/s on {result['gpu']}")
    print(f"{'out x in':>13} {'batch':>5} {'kernel':>11} {'bpw':>5} {'int2 us':>8} {'eager us':>8} {'fp16 us':>8} "
          f"{'x fp16':>6} {'GB/s':>6} {'of copy':>7} {'rel err':>8}")
    for r in rows:
        print(f"{r['out_features']:>6}x{r['in_features']:<6} {r['batch']:>5} {r['kernel']:>11} "
              f"{r['bits_per_weight']:>5.2f} {r['int2_ms'] * 1e3:>8.1f} {r['int2_eager_ms'] * 1e3:>8.1f} "
              f"{r['fp16_dense_ms'] * 1e3:>8.1f} {r['speedup_vs_fp16']:>6.2f} {r['achieved_GBps']:>6.0f} "
              f"{r['fraction_of_copy_bw']:>7.2f} {r['rel_err_vs_torch_fp32']:>8.1e}")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
