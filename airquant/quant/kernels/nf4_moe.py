"""Routed NF4 experts multiplied straight from the expert pool's slots: two launches a MoE layer call.

At decode batch sizes a routed call multiplies a few rows by each of its top-k experts. Run expert by expert,
that is two ``matmul_4bit`` calls per expert, each decoding its nested absmax (Qwen3-30B-A3B: ~120 launches
and ~7 ms of host time a layer, the GPU idle 88 % of a step). Here every (token, expert) pair of the call is
one program row of a GEMV that reads its expert's 4-bit bytes, absmax codes and nested absmax where the pool
copied them (slot base + the tensor's offset inside a slot), decodes in registers and accumulates in fp32:

* ``gate_up``: ``h[p] = W1[slot[p]] @ x[p // k]`` (+ bias) for every pair p, ``[P, N1]``;
* the module's own gating runs on ``h`` (one torch op: transformers' activation code, unchanged);
* ``down``: ``out[t] = sum_j w[t, j] * (W2[slot[t, j]] @ g[t * k + j] (+ bias))``, the top-k weighting and the
  sum over a token's experts fused, ``[T, H]`` in the compute dtype.

NF4 layout (bitsandbytes): element i of the flat ``[out, in]`` matrix is nibble ``i % 2`` of byte ``i // 2``
(the even element in the high nibble), scaled by ``absmax[i // blocksize]``; with double quant that absmax
is ``nested_code[absmax_u8] * nested_absmax[block // 256] + offset``. Callers guarantee ``in % blocksize == 0``
(no block straddles two rows) and 4-byte-aligned fp32 buffers inside a slot (the pool aligns to 64).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

NESTED_BLOCKSIZE = 256  # bitsandbytes' double-quant block (quant/nf4.py)


@triton.jit
def _nf4_row_dot(x_ptr, pool_u8, pool_f32, base, w_off, a_off, na_off, nqm_off, noff_off, qm_off,
                 offs_n, n_mask, K: tl.constexpr, DOUBLE: tl.constexpr, BS: tl.constexpr, BLOCK_N: tl.constexpr,
                 BLOCK_K: tl.constexpr):
    """``W[offs_n, :] @ x`` for the NF4 ``[N, K]`` matrix whose buffers start at byte ``base`` of the pool."""
    HALF: tl.constexpr = BLOCK_K // 2
    offs_j = tl.arange(0, HALF)
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    rows = offs_n.to(tl.int64)[:, None] * K
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + 2 * offs_j  # the even element of each byte
        k_mask = kk < K
        mask = n_mask[:, None] & k_mask[None, :]
        flat = rows + kk[None, :]
        byte = tl.load(pool_u8 + base + w_off + flat // 2, mask=mask, other=0).to(tl.int32)
        hi = tl.load(pool_f32 + (base + qm_off) // 4 + (byte >> 4), mask=mask, other=0.0)
        lo = tl.load(pool_f32 + (base + qm_off) // 4 + (byte & 15), mask=mask, other=0.0)
        block = flat // BS
        if DOUBLE:
            code = tl.load(pool_u8 + base + a_off + block, mask=mask, other=0).to(tl.int32)
            nested = tl.load(pool_f32 + (base + na_off) // 4 + block // 256, mask=mask, other=0.0)
            scale = tl.load(pool_f32 + (base + nqm_off) // 4 + code, mask=mask, other=0.0) * nested \
                + tl.load(pool_f32 + (base + noff_off) // 4)
        else:
            scale = tl.load(pool_f32 + (base + a_off) // 4 + block, mask=mask, other=0.0)
        xe = tl.load(x_ptr + kk, mask=k_mask, other=0.0).to(tl.float32)
        xo = tl.load(x_ptr + kk + 1, mask=k_mask, other=0.0).to(tl.float32)
        acc += tl.sum((hi * xe[None, :] + lo * xo[None, :]) * scale, axis=1)
    return acc


@triton.jit
def _pairs_kernel(x_ptr, out_ptr, bias_ptr, slots_ptr, pool_u8, pool_f32, slot_bytes,
                  w_off, a_off, na_off, nqm_off, noff_off, qm_off, N, K: tl.constexpr,
                  TOP_K: tl.constexpr, HAS_BIAS: tl.constexpr, DOUBLE: tl.constexpr, BS: tl.constexpr,
                  BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """``out[p] = W[slot[p]] @ x[p // TOP_K] (+ bias[p])`` for the pair p of this program."""
    p = tl.program_id(0)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    base = tl.load(slots_ptr + p).to(tl.int64) * slot_bytes
    acc = _nf4_row_dot(x_ptr + (p // TOP_K).to(tl.int64) * K, pool_u8, pool_f32, base, w_off, a_off, na_off,
                       nqm_off, noff_off, qm_off, offs_n, n_mask, K, DOUBLE, BS, BLOCK_N, BLOCK_K)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + p.to(tl.int64) * N + offs_n, mask=n_mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + p.to(tl.int64) * N + offs_n, acc.to(out_ptr.dtype.element_ty), mask=n_mask)


@triton.jit
def _combine_kernel(h_ptr, out_ptr, bias_ptr, weights_ptr, slots_ptr, pool_u8, pool_f32, slot_bytes,
                    w_off, a_off, na_off, nqm_off, noff_off, qm_off, N, K: tl.constexpr,
                    TOP_K: tl.constexpr, HAS_BIAS: tl.constexpr, DOUBLE: tl.constexpr, BS: tl.constexpr,
                    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """``out[t] = sum_j weights[t, j] * (W[slot[t, j]] @ h[t * TOP_K + j] (+ bias))``: the down projection of a
    token's experts, weighted and summed in fp32."""
    t = tl.program_id(0)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    total = tl.zeros([BLOCK_N], dtype=tl.float32)
    for j in range(0, TOP_K):
        p = t.to(tl.int64) * TOP_K + j
        base = tl.load(slots_ptr + p).to(tl.int64) * slot_bytes
        acc = _nf4_row_dot(h_ptr + p * K, pool_u8, pool_f32, base, w_off, a_off, na_off, nqm_off, noff_off,
                           qm_off, offs_n, n_mask, K, DOUBLE, BS, BLOCK_N, BLOCK_K)
        if HAS_BIAS:
            acc += tl.load(bias_ptr + p * N + offs_n, mask=n_mask, other=0.0).to(tl.float32)
        total += tl.load(weights_ptr + p).to(tl.float32) * acc
    tl.store(out_ptr + t.to(tl.int64) * N + offs_n, total.to(out_ptr.dtype.element_ty), mask=n_mask)


def _args(pool: torch.Tensor, offsets: dict[str, int], double: bool) -> tuple:
    """The pool as bytes and as fp32 words (one storage), its slot stride, and a matrix's buffer offsets
    (missing double-quant buffers: 0, unread)."""
    u8 = pool.reshape(-1)
    f32 = u8.view(torch.float32)
    names = ("weight_packed", "absmax", "nested_absmax", "nested_quant_map", "nested_offset", "quant_map")
    return (u8, f32, pool.shape[1], *(offsets.get(n, 0) if double or not n.startswith("nested") else 0
                                       for n in names))


def _blocks(n: int, k: int) -> tuple[int, int]:
    """Output rows per program and elements per K step: small tiles, so that a batch-1 call of a few experts
    still spreads over every SM (Qwen3-30B-A3B's down projection: 8 pairs x 2048 rows)."""
    return 32 if n >= 32 else triton.next_power_of_2(n), 256 if k >= 256 else max(triton.next_power_of_2(k), 16)


def nf4_pairs(x: torch.Tensor, pool: torch.Tensor, slots: torch.Tensor, offsets: dict[str, int], n: int,
              top_k: int, blocksize: int, double: bool, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``[P, n]``: row p is expert ``slots[p]``'s ``[n, K]`` NF4 matrix times ``x[p // top_k]`` (``x`` ``[T, K]``)."""
    pairs, k = slots.numel(), x.shape[1]
    out = torch.empty((pairs, n), dtype=x.dtype, device=x.device)
    block_n, block_k = _blocks(n, k)
    grid = (pairs, triton.cdiv(n, block_n))
    _pairs_kernel[grid](x.contiguous(), out, bias if bias is not None else out, slots, *_args(pool, offsets, double),
                        n, k, top_k, HAS_BIAS=bias is not None, DOUBLE=double, BS=blocksize, BLOCK_N=block_n,
                        BLOCK_K=block_k, num_warps=4)
    return out


def nf4_combine(h: torch.Tensor, weights: torch.Tensor, pool: torch.Tensor, slots: torch.Tensor,
                offsets: dict[str, int], n: int, blocksize: int, double: bool, out_dtype: torch.dtype,
                bias: torch.Tensor | None = None) -> torch.Tensor:
    """``[T, n]``: each token's ``top_k`` rows of ``h`` ``[T * top_k, K]`` through their experts' NF4 matrices,
    weighted by ``weights`` ``[T, top_k]`` and summed."""
    tokens, top_k = weights.shape
    k = h.shape[1]
    out = torch.empty((tokens, n), dtype=out_dtype, device=h.device)
    block_n, block_k = _blocks(n, k)
    grid = (tokens, triton.cdiv(n, block_n))
    _combine_kernel[grid](h.contiguous(), out, bias if bias is not None else out, weights.contiguous(), slots,
                          *_args(pool, offsets, double), n, k, top_k, HAS_BIAS=bias is not None, DOUBLE=double,
                          BS=blocksize, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=4)
    return out
