"""Decode-attention time over a long compressed history (CUDA): Triton kernels vs torch ops vs dequantize + sdpa.

    python benchmarks/kv_attention_speed.py [--tokens 32768] [--kv-heads 8] [--groups 4] [--head-dim 128]
    python benchmarks/kv_attention_speed.py --paged [--batches 8,32] [--group-sizes 4,8] [--out FILE]

Prints one row per method: milliseconds per decode step for one layer, and bytes read per step.

``--paged``: the decode loop's arena (``SlotArena``, K4/V2, window 128, block 32: kv_bench's settings), every
slot ``--tokens`` long, read in place by the paged kernel as a bucket of the loop reads it, at each batch and
query-group size: the kernel's launch settings swept (history-tile variant ``triton_kernel.VARIANTS``, split
programs aimed at, tiles, pipeline stages and, on CUDA, a cap on registers a thread; the centroid tables in the
products' dtype, which beat fp32 ones by 1.6-2.4x on an H100 and H200), beside the same batch's fp16 cache
through sdpa and the bytes floor (the packed history and windows read once at the device-to-device copy
bandwidth measured in the same run), the setting the autotuner usually picked before (``before``: dimension
order, 1 056 programs, BLOCK_N 32, no cap) and, on CUDA, what the autotuner picks at ``TARGET_PROGRAMS`` (the
engine's call; chosen at the first row and kept for the others, as a process keeps it), and the Gluon history
kernel's launches (kv/gluon_kernel.py, where it applies). ``--sweep short`` times the byte-table tiles and the old
pick of the Triton kernel only, and for those and the Gluon rows also each call replayed as a CUDA graph (no host
time between launches, as the decode loop's static passes run) and each kernel's device time. Writes ``--out``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks.stream_bench, run as a script

import torch  # noqa: E402

from airquant.kv import KVConfig  # noqa: E402
from airquant.kv.attention import compressed_attention  # noqa: E402
from airquant.kv.cache import TQLayer, context_of  # noqa: E402


def _time_ms(fn, iters: int = 50) -> float:
    for _ in range(5):
        fn()
    if not torch.cuda.is_available():  # a dry run of the script (Triton's interpreter): no meaningful time
        start = time.perf_counter()
        fn()
        return (time.perf_counter() - start) * 1e3
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


def _graph_ms(fn, iters: int = 50) -> float | None:
    """GPU time of ``fn`` captured in a CUDA graph and replayed (no host time between launches: how the decode
    loop's static passes run it); None off CUDA."""
    if not torch.cuda.is_available():
        return None
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return _time_ms(graph.replay, iters)


def _kernel_us(fn, calls: int = 10) -> dict | None:
    """Device microseconds a call of ``fn`` spends in each kernel (torch's profiler, ``calls`` calls); None off
    CUDA."""
    if not torch.cuda.is_available():
        return None
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    from benchmarks.stream_bench import device_us

    return {e.key[:60]: round(device_us(e) / calls, 2) for e in prof.key_averages() if device_us(e) > 0}


def _component_rows(q, keys, values, ctx, scale) -> dict:
    """The torch path (ops the kernels replace) and the Triton kernels at fixed tile shapes."""
    from airquant.kv import triton_kernel

    rows = {"torch_ops": {"ms": _time_ms(lambda: compressed_attention(q, keys, values, ctx, None, scale, kernel=False), 10)}}
    # block_n=128 with head_dim 128 needs more shared memory than an H200 SM has.
    for block_n in (16, 32, 64):
        for warps in (4, 8):
            fn = lambda: triton_kernel.attention(q, keys, values, ctx, None, scale, block_n=block_n, num_warps=warps)  # noqa: E731
            rows[f"triton_n{block_n}_w{warps}"] = {"ms": _time_ms(fn)}
    return rows


def _copy_gbps(device) -> float:
    """Device memory bandwidth: a 1 GiB device-to-device copy (read + write bytes over its time)."""
    size = 1 << 30 if torch.device(device).type == "cuda" else 1 << 20
    src = torch.empty(size, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    ms = _time_ms(lambda: dst.copy_(src), 20)
    return 2 * size / ms / 1e6


PROGRAMS = (1056, 2112)  # H100 sweeps, 2026-12-05: 264, 528 behind 1 056 (BLOCK_N 32); 2 112 best at batch 32
# BLOCK_N, warps, stages (64, 8 warps, 2 stages and BLOCK_N 16 lost every H100 row). 2 warps: compiled for sm_90
# (kernel_sass.py) a byte-table tile took 2 x 1 000 warp-instructions against 4 x 594, at 162 registers, with the
# per-row launch's mask read off (put back since: 4 x 671).
TILES = ((32, 4, 1), (32, 2, 1))
# Registers a thread (ptxas' cap; None: none). sm_90 compiles BLOCK_N 32 to 128 already (four programs an SM);
# an H100 (wave3_kv27): 128 within 1 % with byte tables, 2.5 % ahead without; 168 lost. The CPU's interpreter
# has no registers: None only.
REGS = (None, 128)
BEFORE = "v00_p1056_n32_w4_s1_r0"  # the autotuner's usual pick before the byte tables
SHORT = (BEFORE, "v01_p1056_n32_w4_s1_r0", "v01_p2112_n32_w4_s1_r0")  # --sweep short: the Triton rows timed
# The Gluon history kernel's launches: (split programs, one warp each; BLOCK_N; a register cap or None). Compiled
# for sm_90 (kernel_sass.py): BLOCK_N 32 takes 255 registers a thread, 16 232. An H100 at batch 32 (CUDA graphs,
# kv_attention_speed_gluon.json of stop 67): 0.299 / 0.278 / 0.310 / 0.309 / 0.355 ms for the last five in this
# order. An H200 at batch 8 (stop 68): 2 112 programs 0.113 ms against 4 224's 0.136, so 1 056 is timed too.
GLUON_ROWS = ((1056, 32, None), (2112, 32, None), (4224, 32, None), (8448, 32, None), (4224, 16, None),
              (4224, 32, 168))


def paged_sweep(args, device="cuda", dtype=torch.bfloat16) -> dict:
    """The ``--paged`` rows (see the module docstring); ``device`` cpu with ``TRITON_INTERPRET=1`` and fp16: a dry
    run of the script (tests)."""
    from airquant.engine.decode.tqslots import SlotArena, decode_plan
    from airquant.kv import triton_kernel

    kv = KVConfig(backend="tq", bits_k=4, bits_v=2, window=128, block=32)
    hkv, d, n = args.kv_heads, args.head_dim, args.tokens
    gbps = _copy_gbps(device)
    name = torch.cuda.get_device_name() if torch.device(device).type == "cuda" else "cpu (dry run)"
    out = {"settings": {"tokens": n, "kv_heads": hkv, "head_dim": d, "dtype": str(dtype).removeprefix("torch."),
                        "kv": "K4/V2 window 128 block 32", "copy_gbps": gbps, "device": name}, "rows": {}}
    for batch in args.batches:
        arena = SlotArena(kv, 0, batch, hkv, d, device, dtype, cap=n + 1)
        gen = torch.Generator(device=device).manual_seed(batch)
        for slot in range(batch):
            arena.reserve(slot, kv.schedule.quantized_count(n + 1))
            arena.prefill(slot, torch.randn(1, hkv, n, d, device=device, dtype=dtype, generator=gen),
                          torch.randn(1, hkv, n, d, device=device, dtype=dtype, generator=gen))
        plan = decode_plan(kv, batch, [(slot, n, slot) for slot in range(batch)], device)
        bucket = plan.buckets[-1]
        win_k, win_v, ctx, paged = arena.paged(plan, bucket)
        hist = ctx.history.length
        read = batch * hkv * (hist * (arena.k_codec.bytes_per_vector() + arena.v_codec.bytes_per_vector())
                              + plan.win_len * d * 2 * 2)
        plain_k = torch.randn(batch, hkv, n + 1, d, device=device, dtype=dtype, generator=gen)
        plain_v = torch.randn_like(plain_k)
        for g in args.group_sizes:
            q = torch.randn(batch, hkv * g, 1, d, device=device, dtype=dtype, generator=gen)
            key = f"b{batch}_g{g}"
            sdpa = _time_ms(lambda: torch.nn.functional.scaled_dot_product_attention(
                q, plain_k, plain_v, enable_gqa=True))
            rows = {"fp16_cache_sdpa_ms": sdpa, "fp16_cache_bytes": 2 * plain_k.numel() * 2,
                    "tq_bytes": read, "tq_floor_ms": read / gbps / 1e6, "kernels": {}}
            ref = None

            def timed(call, detail: bool = False) -> dict:
                """The call's time from the host (``ms``) and, ``detail``: replayed as a CUDA graph
                (``graph_ms``) and each kernel's device time (``kernel_us``)."""
                nonlocal ref
                got = call()
                ref = got if ref is None else ref
                ms = _time_ms(call)
                row = {"ms": ms, "gbps": read / ms / 1e6, "over_floor": ms / rows["tq_floor_ms"],
                       "over_fp16_sdpa": ms / sdpa, "max_abs_diff": (got.float() - ref.float()).abs().max().item()}
                if detail:
                    row.update(graph_ms=_graph_ms(call), kernel_us=_kernel_us(call))
                return row
            regs = REGS if torch.device(device).type == "cuda" else (None,)
            for cols, tab in triton_kernel.VARIANTS:
                for programs in PROGRAMS:
                    for block_n, warps, stages in TILES:
                        for reg in regs:
                            name = f"v{cols}{tab}_p{programs}_n{block_n}_w{warps}_s{stages}_r{reg or 0}"
                            if args.sweep == "short" and name not in SHORT:
                                continue
                            rows["kernels"][name] = timed(lambda: triton_kernel.attention(
                                q, win_k, win_v, ctx, bucket.keep, d**-0.5, block_n=block_n, num_warps=warps,
                                num_stages=stages, variant=(cols, tab), paged=paged, programs=programs, maxnreg=reg,
                                history="triton"), detail=args.sweep == "short")
            if triton_kernel.gluon_history(q, ctx, triton_kernel._DOT.get(dtype, 0), g):
                for programs, block_n, reg in GLUON_ROWS:
                    rows["kernels"][f"gluon_p{programs}_n{block_n}_r{reg or 0}"] = timed(
                        lambda: triton_kernel.attention(q, win_k, win_v, ctx, bucket.keep, d**-0.5, paged=paged,
                                                        programs=programs, history="gluon", block_n=block_n,
                                                        maxnreg=reg), detail=True)
            sdpa_graph = _graph_ms(lambda: torch.nn.functional.scaled_dot_product_attention(
                q, plain_k, plain_v, enable_gqa=True))
            if sdpa_graph is not None:
                rows["fp16_cache_sdpa_graph_ms"] = sdpa_graph
            best = min(rows["kernels"].items(), key=lambda kv_: kv_[1]["ms"])
            before = rows["kernels"][BEFORE]
            rows.update(best=best[0], best_ms=best[1]["ms"], before_ms=before["ms"],
                        best_over_fp16_sdpa=best[1]["over_fp16_sdpa"], before_over_fp16_sdpa=before["over_fp16_sdpa"])
            if torch.device(device).type == "cuda":  # the engine's own call: autotuned tiles and variant
                rows["autotuned"] = timed(lambda: triton_kernel.attention(q, win_k, win_v, ctx, bucket.keep, d**-0.5,
                                                                          paged=paged, history="triton"))
                chosen = [v for k, v in triton_kernel._CHOSEN.items() if k[6]]  # the paged launches' choices
                rows["autotuned"]["config"] = {k: v for k, v in chosen[-1].items() if not callable(v)}
            out["rows"][key] = rows
            auto = f", autotuned {rows['autotuned']['ms']:.3f} ms" if "autotuned" in rows else ""
            print(f"{key}: sdpa {sdpa:.3f} ms, floor {rows['tq_floor_ms']:.3f} ms, before {before['ms']:.3f} ms, "
                  f"best {best[0]} {best[1]['ms']:.3f} ms{auto}", flush=True)
            for kname, k in rows["kernels"].items():
                if k.get("graph_ms") is not None:
                    print(f"  {kname}: graph {k['graph_ms']:.3f} ms (sdpa {rows['fp16_cache_sdpa_graph_ms']:.3f}); "
                          f"kernels {k['kernel_us']}", flush=True)
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=32768)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--groups", type=int, default=4)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--paged", action="store_true", help="the decode loop's paged arena, launch settings swept")
    parser.add_argument("--batches", default="8,32", help="--paged: batch sizes (comma-separated)")
    parser.add_argument("--group-sizes", default="4,8", help="--paged: query heads per KV head (8B: 4, 70B: 8)")
    parser.add_argument("--out", default=None, help="--paged: where the JSON goes (printed besides)")
    parser.add_argument("--sweep", choices=("full", "short"), default="full",
                        help="--paged: every Triton launch setting, or the byte-table tiles and the old pick only")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA GPU")
    if args.paged:
        args.batches = [int(b) for b in args.batches.split(",")]
        args.group_sizes = [int(g) for g in args.group_sizes.split(",")]
        if args.tokens == 32768:  # kv_bench's context unless given
            args.tokens = 8192
        result = paged_sweep(args)
        if args.out:
            with open(args.out, "w") as f:
                json.dump(result, f, indent=1)
        return 0
    b, h, d, n = args.batch, args.kv_heads, args.head_dim, args.tokens
    dtype = torch.float16
    kv = KVConfig(backend="tq", bits_k=4, bits_v=2)
    layer = TQLayer(kv, 0, d)
    k = torch.randn(b, h, n, d, device="cuda", dtype=dtype)
    v = torch.randn(b, h, n, d, device="cuda", dtype=dtype)
    layer.update(k, v)
    keys, values = layer.update(k[:, :, :1], v[:, :, :1])
    ctx = context_of(keys)
    plain = keys.as_subclass(torch.Tensor)
    q = torch.randn(b, h * args.groups, 1, d, device="cuda", dtype=dtype)
    scale = d**-0.5

    def tq_kernel():
        return compressed_attention(q, plain, values, ctx, None, scale)

    def dequant_sdpa():
        hist = ctx.history
        k_hat = ctx.k_codec.decode(hist.k, hist.k_mean, hist.k_ref).to(dtype)
        v_hat = ctx.v_codec.decode(hist.v, hist.v_mean, hist.v_ref).to(dtype)
        kk, vv = torch.cat([k_hat, plain], 2), torch.cat([v_hat, values], 2)
        return torch.nn.functional.scaled_dot_product_attention(q, kk, vv, scale=scale, enable_gqa=True)

    def fp16_sdpa():
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, scale=scale, enable_gqa=True)

    rows_extra = _component_rows(q, plain, values, ctx, scale)
    packed = sum(t.numel() * t.element_size() for t in (ctx.history.k.codes, ctx.history.k.norms, ctx.history.v.codes, ctx.history.v.norms))
    rows = {
        "tq_triton": {"ms": _time_ms(tq_kernel), "bytes": packed},
        "dequantize_then_sdpa": {"ms": _time_ms(dequant_sdpa), "bytes": packed},
        "fp16_cache_sdpa": {"ms": _time_ms(fp16_sdpa), "bytes": 2 * k.numel() * 2},
        **rows_extra,
    }
    ref = dequant_sdpa().float()
    err = (tq_kernel().transpose(1, 2).float() - ref).abs().max().item()
    print(json.dumps({"settings": vars(args), "rows": rows, "max_abs_diff_vs_dequant": err}, indent=1))
    for name, row in rows.items():
        size = f"{row['bytes'] / 2**20:>8.1f} MiB" if "bytes" in row else ""
        print(f"{name:<28}{row['ms']:>9.3f} ms  {size}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
