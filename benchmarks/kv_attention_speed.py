"""Decode-attention time over a long compressed history (CUDA): Triton kernels vs torch ops vs dequantize + sdpa.

    python benchmarks/kv_attention_speed.py [--tokens 32768] [--kv-heads 8] [--groups 4] [--head-dim 128]

Prints one row per method: milliseconds per decode step for one layer, and bytes read per step.
"""

from __future__ import annotations

import argparse
import json

import torch

from airquant.kv import KVConfig
from airquant.kv.attention import compressed_attention
from airquant.kv.cache import TQLayer, context_of


def _time_ms(fn, iters: int = 50) -> float:
    for _ in range(5):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


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


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=32768)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--groups", type=int, default=4)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--batch", type=int, default=1)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA GPU")
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
