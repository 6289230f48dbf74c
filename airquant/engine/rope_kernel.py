"""The Triton kernel of ``engine/rope.py`` (imported only where it runs: Triton on CUDA, or its interpreter)."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def rope_kernel(q_ptr, k_ptr, qo_ptr, ko_ptr, cos_ptr, sin_ptr, HQ, T,
                sqb, sqh, sqt, skb, skh, skt, sob, soh, sot, spb, sph, spt, scb, sct, ssb, sst,
                D: tl.constexpr, BLOCK: tl.constexpr):
    """Program (b * T + t, h): row (b, h, t) of the query (h < HQ) or of the key (h - HQ), rotated:
    ``x * cos + rotate_half(x) * sin`` with each product rounded to the dtype before the sum, as the eager ops do
    (launched without fused multiply-adds, so fp32 rounds the same way too). Triton's interpreter casts fp32 to
    bfloat16 by truncation where the GPU rounds to nearest even: bfloat16 is checked on the GPU only."""
    bt = tl.program_id(0)
    h = tl.program_id(1)
    b = bt // T
    t = bt % T
    if h < HQ:
        src = q_ptr + b * sqb + h * sqh + t * sqt
        dst = qo_ptr + b * sob + h * soh + t * sot
    else:
        src = k_ptr + b * skb + (h - HQ) * skh + t * skt
        dst = ko_ptr + b * spb + (h - HQ) * sph + t * spt
    i = tl.arange(0, BLOCK)
    mask = i < D
    half = D // 2
    x = tl.load(src + i, mask=mask, other=0.0)
    partner = tl.load(src + tl.where(i < half, i + half, i - half), mask=mask, other=0.0).to(tl.float32)
    rot = tl.where(i < half, -partner, partner)  # negated in fp32: exact, as in the dtype (and the interpreter's
    # bfloat16, raw 16-bit integers, would negate the integer)
    c = tl.load(cos_ptr + b * scb + t * sct + i, mask=mask, other=0.0)
    s = tl.load(sin_ptr + b * ssb + t * sst + i, mask=mask, other=0.0)
    dtype = x.dtype
    first = (x.to(tl.float32) * c.to(tl.float32)).to(dtype)
    second = (rot * s.to(tl.float32)).to(dtype)
    tl.store(dst + i, (first.to(tl.float32) + second.to(tl.float32)).to(dtype), mask=mask)
