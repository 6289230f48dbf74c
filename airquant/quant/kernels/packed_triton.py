"""One dequantize-in-kernel GEMM for GPTQ, AWQ (GEMM layout) and GGUF Q4_0/Q4_1/Q8_0 blocks.

Each program computes a [BLOCK_M, BLOCK_N] tile of y = x @ W.T; per K step it gathers the packed
words/bytes of a [BLOCK_K, BLOCK_N] weight tile, dequantizes it in registers (a constexpr FMT picks
the layout) and feeds tl.dot with fp32 accumulation. Addressing is per element: repeated words are
served from L1, which keeps one readable kernel for five layouts; these formats are for fidelity
with published checkpoints, the bandwidth-tuned path is the int2 kernel.
Layouts are documented in airquant.quant.gptq and airquant.quant.gguf_keep.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

FMT_GPTQ, FMT_AWQ, FMT_Q4_0, FMT_Q4_1, FMT_Q8_0 = 0, 1, 2, 3, 4
_GGUF_FMT = {"Q4_0": (FMT_Q4_0, 18), "Q4_1": (FMT_Q4_1, 20), "Q8_0": (FMT_Q8_0, 34)}


@triton.jit
def _gptq_tile(w_ptr, z_ptr, s_ptr, g_ptr, offs_k, offs_n, mask, k_mask, N,
               BITS: tl.constexpr, ZERO_OFFSET: tl.constexpr):
    PER: tl.constexpr = 32 // BITS
    MAXQ: tl.constexpr = (1 << BITS) - 1
    words = tl.load(w_ptr + (offs_k[:, None] // PER) * N + offs_n[None, :], mask=mask, other=0)
    q = (words >> ((offs_k[:, None] % PER) * BITS)) & MAXQ
    g = tl.load(g_ptr + offs_k, mask=k_mask, other=0)
    zw = tl.load(z_ptr + g[:, None] * (N // PER) + offs_n[None, :] // PER, mask=mask, other=0)
    z = ((zw >> ((offs_n[None, :] % PER) * BITS)) & MAXQ) + ZERO_OFFSET
    s = tl.load(s_ptr + g[:, None] * N + offs_n[None, :], mask=mask, other=0.0).to(tl.float32)
    return (q - z).to(tl.float32) * s


@triton.jit
def _awq_tile(w_ptr, z_ptr, s_ptr, offs_k, offs_n, mask, N, group_size):
    j = offs_n % 8
    shift = ((j // 2) + 4 * (j % 2)) * 4  # column j of a group of 8 sits in nibble AWQ_REVERSE_ORDER[j]
    words = tl.load(w_ptr + offs_k[:, None] * (N // 8) + offs_n[None, :] // 8, mask=mask, other=0)
    q = (words >> shift[None, :]) & 15
    g = offs_k // group_size
    zw = tl.load(z_ptr + g[:, None] * (N // 8) + offs_n[None, :] // 8, mask=mask, other=0)
    z = (zw >> shift[None, :]) & 15
    s = tl.load(s_ptr + g[:, None] * N + offs_n[None, :], mask=mask, other=0.0).to(tl.float32)
    return (q - z).to(tl.float32) * s


@triton.jit
def _f16_at(ptr, mask):
    lo = tl.load(ptr, mask=mask, other=0).to(tl.uint16)
    hi = tl.load(ptr + 1, mask=mask, other=0).to(tl.uint16)
    return (lo | (hi << 8)).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _gguf_tile(w_ptr, offs_k, offs_n, mask, K, FMT: tl.constexpr, TS: tl.constexpr):
    j = offs_k % 32
    base = w_ptr + offs_n[None, :] * ((K // 32) * TS) + (offs_k // 32)[:, None] * TS  # [BK, BN] block starts
    d = _f16_at(base, mask)
    if FMT == 4:  # Q8_0: d, int8 qs[32]
        qb = tl.load(base + 2 + j[:, None], mask=mask, other=0)
        return qb.to(tl.int8, bitcast=True).to(tl.float32) * d
    else:
        qs_off: tl.constexpr = 2 if FMT == 2 else 4
        qb = tl.load(base + qs_off + (j % 16)[:, None], mask=mask, other=0).to(tl.int32)
        q = (qb >> ((j // 16) * 4)[:, None]) & 15  # weights 0..15 in low nibbles, 16..31 in high
        if FMT == 2:  # Q4_0: d, qs[16]
            return d * (q - 8).to(tl.float32)
        else:  # Q4_1: d, m, qs[16]
            return d * q.to(tl.float32) + _f16_at(base + 2, mask)


def _configs():
    return [
        triton.Config({"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "SPLIT_K": 1}, num_warps=w, num_stages=3)
        for bm, bn, bk, w in [(16, 64, 64, 4), (32, 64, 32, 4), (64, 128, 32, 8)]
    ]


def _small_m_configs():
    # Decode (M <= 16): N / BLOCK_N programs alone leave most SMs idle (a 4096-wide output is 64 tiles),
    # so K is split too and the partial tiles are added into an fp32 output.
    return [
        triton.Config({"BLOCK_M": 16, "BLOCK_N": bn, "BLOCK_K": bk, "SPLIT_K": sk}, num_warps=w, num_stages=3)
        for bn, bk, sk, w in [(64, 64, 8, 4), (64, 128, 8, 4), (32, 128, 16, 4), (64, 64, 16, 4),
                              (128, 64, 8, 4), (32, 64, 32, 4), (64, 128, 4, 4)]
    ]


@triton.jit
def _packed_gemm_kernel(
    x_ptr, y_ptr, w_ptr, z_ptr, s_ptr, g_ptr,
    M, N, K, stride_xm, stride_ym, group_size,
    FMT: tl.constexpr, BITS: tl.constexpr, ZERO_OFFSET: tl.constexpr, TS: tl.constexpr, IEEE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
):
    """y = x @ W.T; with SPLIT_K > 1 each program adds its K slice into y (fp32, zeroed)."""
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask, n_mask = offs_m < M, offs_n < N
    per_split = tl.cdiv(tl.cdiv(K, SPLIT_K), BLOCK_K) * BLOCK_K
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(tl.program_id(2) * per_split, tl.minimum((tl.program_id(2) + 1) * per_split, K), BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_mask = offs_k < K
        mask = k_mask[:, None] & n_mask[None, :]
        if FMT == 0:
            w = _gptq_tile(w_ptr, z_ptr, s_ptr, g_ptr, offs_k, offs_n, mask, k_mask, N, BITS, ZERO_OFFSET)
        elif FMT == 1:
            w = _awq_tile(w_ptr, z_ptr, s_ptr, offs_k, offs_n, mask, N, group_size)
        else:
            w = _gguf_tile(w_ptr, offs_k, offs_n, mask, K, FMT, TS)
        x = tl.load(x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :],
                    mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        if IEEE:
            acc = tl.dot(x, w.to(x.dtype), acc, input_precision="ieee")
        else:
            acc = tl.dot(x, w.to(x.dtype), acc)
    y_ptrs = y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :]
    out_mask = m_mask[:, None] & n_mask[None, :]
    if SPLIT_K == 1:
        tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=out_mask)
    else:
        tl.atomic_add(y_ptrs, acc, mask=out_mask)


_gemm = triton.autotune(configs=_configs(), key=["N", "K", "FMT"])(_packed_gemm_kernel)
_gemm_small_m = triton.autotune(configs=_small_m_configs(), key=["N", "K", "FMT"],
                                reset_to_zero=["y_ptr"])(_packed_gemm_kernel)
SMALL_M = 16  # rows up to which the split-K configurations are used


def _launch(x, n, k, w, z, s, g, *, fmt, bits=4, zero_offset=0, ts=0, group_size=0):
    x2 = x.reshape(-1, k).contiguous()
    m = x2.shape[0]
    small = m <= SMALL_M
    y = torch.zeros((m, n), dtype=torch.float32, device=x.device) if small else \
        torch.empty((m, n), dtype=x.dtype, device=x.device)
    grid = lambda meta: (triton.cdiv(m, meta["BLOCK_M"]), triton.cdiv(n, meta["BLOCK_N"]), meta["SPLIT_K"])  # noqa: E731
    (_gemm_small_m if small else _gemm)[grid](
        x2, y, w, z, s, g, m, n, k, x2.stride(0), y.stride(0), group_size,
        FMT=fmt, BITS=bits, ZERO_OFFSET=zero_offset, TS=ts, IEEE=x.dtype == torch.float32,
    )
    return y.to(x.dtype).reshape(*x.shape[:-1], n)


def gptq_matmul_triton(x, qweight, qzeros, scales, g_idx, bits: int, zero_offset: int) -> torch.Tensor:
    n, k = scales.shape[1], g_idx.shape[0]
    return _launch(x, n, k, qweight.contiguous(), qzeros.contiguous(), scales.contiguous(), g_idx.contiguous(),
                   fmt=FMT_GPTQ, bits=bits, zero_offset=zero_offset)


def awq_matmul_triton(x, qweight, qzeros, scales, group_size: int) -> torch.Tensor:
    n, k = scales.shape[1], qweight.shape[0]
    return _launch(x, n, k, qweight.contiguous(), qzeros.contiguous(), scales.contiguous(), qweight,
                   fmt=FMT_AWQ, group_size=group_size)


def gguf_matmul_triton(x, weight_blocks, ggml_type: str) -> torch.Tensor:
    fmt, ts = _GGUF_FMT[ggml_type]
    n, k = weight_blocks.shape[0], weight_blocks.shape[1] // ts * 32
    wb = weight_blocks.contiguous()
    return _launch(x, n, k, wb, wb, wb, wb, fmt=fmt, ts=ts)
