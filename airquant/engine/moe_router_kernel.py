"""The Triton kernel of ``engine/moe_router.py`` (imported only where it runs: Triton on CUDA, or its interpreter)."""

from __future__ import annotations

import triton
import triton.language as tl
from triton.language.extra import libdevice


@triton.jit
def router_kernel(logits_ptr, weights_ptr, indices_ptr, E, stride_row,
                  K: tl.constexpr, KB: tl.constexpr, NORM: tl.constexpr, BLOCK: tl.constexpr,
                  LIBDEVICE: tl.constexpr):
    """Program ``row``: the row's softmax in fp32 (its max subtracted; ``LIBDEVICE``, on CUDA: libdevice's
    ``expf``, as torch's softmax kernel calls it, where ``tl.exp`` is an approximation; the interpreter's is
    numpy's), its ``K`` largest probabilities in descending order by ``K`` passes of a max (the lowest expert among
    equal ones), divided by their sum where ``NORM``, stored in the weights' dtype beside their experts."""
    row = tl.program_id(0)
    i = tl.arange(0, BLOCK)
    inside = i < E
    x = tl.load(logits_ptr + row * stride_row + i, mask=inside, other=float("-inf")).to(tl.float32)
    shifted = x - tl.max(x, axis=0)
    if LIBDEVICE:
        e = libdevice.exp(shifted)
    else:
        e = tl.exp(shifted)
    e = tl.where(inside, e, 0.0)
    p = tl.where(inside, e / tl.sum(e, axis=0), -1.0)  # probabilities are >= 0: -1 is never chosen
    k = tl.arange(0, KB)
    values = tl.zeros([KB], dtype=tl.float32)
    experts = tl.zeros([KB], dtype=tl.int64)
    for j in tl.static_range(K):
        best = tl.max(p, axis=0)
        at = tl.min(tl.where(p == best, i, BLOCK), axis=0)
        values = tl.where(k == j, best, values)
        experts = tl.where(k == j, at.to(tl.int64), experts)
        p = tl.where(i == at, -1.0, p)
    if NORM:
        values = values / tl.sum(tl.where(k < K, values, 0.0), axis=0)
    tl.store(weights_ptr + row * K + k, values.to(weights_ptr.dtype.element_ty), mask=k < K)
    tl.store(indices_ptr + row * K + k, experts, mask=k < K)
