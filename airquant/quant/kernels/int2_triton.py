"""Fused 2-bit Lloyd-Max matmuls: codes are decoded in registers, the dense weight never exists.

Layout (see airquant.quant.int2): codes uint8 [N, K/4] read here as int32 words [N, K/16], input
channel 16*w + j of row n at bits 2j of word w (little-endian, so byte and word views agree);
scales/zeros fp16 [N, K/GROUP]; outlier residuals fp16 [N, n_out] at channels outlier_idx, rows ow_stride
apart (int2.outlier_cols pads them to 16 columns from 128 outliers up, so the loads can be vectorized).

Decode without lookups or int->float conversions (the GEMV is bound by instruction issue once
bytes stream at full rate, so every op per weight counts):
* the levels are an odd cubic of u = code - 1.5:  c = a*u + b*u^3 with a = 0.89293333,
  b = 0.05066667 gives exactly -1.5104, -0.4528, 0.4528, 1.5104;
* a 2-bit field placed at bits 2p..2p+1 of a float's mantissa and OR'ed with the bits of 2^23
  reads as 2^23 + code*4^p, so one AND/OR (LOP3) and one FADD give U = u*4^p exactly (p >= 1 keeps
  2^23 + 1.5*4^p representable); the powers 4^-p are folded into per-column constants;
* c*x = U*(x*a*4^-p + x*b*4^-3p * U^2): FMUL + 2 FFMA per weight, the x-side factors being
  computed once per column and shared by all rows of the tile.
Word bits 2j for j < 10 are read from ``words << 2`` (p = j + 1) and for j >= 10 from
``words >> 18`` (p = j - 9). Summation order is permuted (by j within each word), which a dot product
does not care about. Accumulation is fp32 throughout.

GEMV (decode, M == 1): per word, P = sum_j c_j x_j, then acc += scale*P + zero*sum_j x_j.
GEMM (prefill / batches): for each j, the [BLOCK_N, BLOCK_W] slice of dequantized weights of
channels 16w + j goes to tl.dot with the matching stride-16 slice of x.
"""

from __future__ import annotations

import os
import warnings

import torch
import triton
import triton.language as tl

from airquant.quant.int2_levels import CUBIC_A, CUBIC_B
from airquant.quant.kernels import outlier_read_cols

_CUBIC_A = tl.constexpr(CUBIC_A)
_CUBIC_B = tl.constexpr(CUBIC_B)

@triton.jit
def _field(lo, hi, J: tl.constexpr):
    """U = (code_J - 1.5) * 4^P as fp32, and P, for code J of each word (see module docstring)."""
    P: tl.constexpr = J + 1 if J < 10 else J - 9
    src = lo if J < 10 else hi
    f = ((src & (3 << (2 * P))) | 0x4B000000).to(tl.float32, bitcast=True)
    return f - (8388608.0 + 1.5 * (1 << (2 * P)))


@triton.jit
def _scale_a(J: tl.constexpr):
    P: tl.constexpr = J + 1 if J < 10 else J - 9
    return _CUBIC_A / (1 << (2 * P))


@triton.jit
def _scale_b(J: tl.constexpr):
    P: tl.constexpr = J + 1 if J < 10 else J - 9
    return _CUBIC_B / (1 << (6 * P))


def _gemv_configs():
    # Long contiguous spans per row (4 * BLOCK_W bytes of codes) keep DRAM streaming; SPLIT_K keeps
    # enough programs in flight when N / BLOCK_N alone would not fill the GPU.
    return [
        triton.Config({"BLOCK_N": bn, "BLOCK_W": bw, "SPLIT_K": sk}, num_warps=w)
        for bn, bw, w, sk in [(16, 64, 4, 1), (16, 128, 4, 1), (8, 128, 4, 1), (4, 256, 4, 1), (8, 256, 8, 1),
                              (4, 512, 8, 1), (8, 512, 8, 1), (2, 512, 4, 1), (4, 256, 4, 2), (8, 128, 4, 2)]
    ]


@triton.autotune(configs=_gemv_configs(), key=["N", "K"], reset_to_zero=["y_ptr"])
@triton.heuristics({"EVEN_K": lambda a: (a["K"] // 16) % (a["BLOCK_W"] * a["SPLIT_K"]) == 0})
@triton.jit
def _int2_gemv_kernel(
    x_ptr, words_ptr, scales_ptr, zeros_ptr, ow_ptr, oi_ptr, y_ptr,
    N, K, n_out, n_cols, ow_stride,
    GROUP: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_W: tl.constexpr, BLOCK_O: tl.constexpr,
    SPLIT_K: tl.constexpr, EVEN_K: tl.constexpr,
):
    """y_ptr: fp32 [N], zeroed; each of the SPLIT_K programs of a row block adds its K slice."""
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    pid_k = tl.program_id(1)
    n_mask = offs_n < N
    KW = K // 16
    G = K // GROUP
    WPG: tl.constexpr = GROUP // 16  # words per group
    per_split = tl.cdiv(tl.cdiv(KW, SPLIT_K), BLOCK_W) * BLOCK_W
    acc = tl.zeros((BLOCK_N, BLOCK_W), dtype=tl.float32)
    for w0 in range(pid_k * per_split, tl.minimum((pid_k + 1) * per_split, KW), BLOCK_W):
        offs_w = w0 + tl.arange(0, BLOCK_W)
        # A mask that varies along a row defeats 16-byte vector loads: only partial K tiles get one.
        w_mask = (offs_w < KW) if not EVEN_K else tl.full((BLOCK_W,), 1, tl.int1)
        mask = n_mask[:, None] & w_mask[None, :]
        words = tl.load(words_ptr + offs_n[:, None] * KW + offs_w[None, :], mask=mask, other=0)
        lo, hi = words << 2, words >> 18
        part = tl.zeros((BLOCK_N, BLOCK_W), dtype=tl.float32)
        xs = tl.zeros((BLOCK_W,), dtype=tl.float32)
        for j in tl.static_range(16):
            xj = tl.load(x_ptr + offs_w * 16 + j, mask=w_mask, other=0.0).to(tl.float32)
            xs += xj
            u = _field(lo, hi, j)
            q = tl.fma((xj * _scale_b(j))[None, :], u * u, (xj * _scale_a(j))[None, :])
            part = tl.fma(u, q, part)
        g_off = offs_n[:, None] * G + (offs_w // WPG)[None, :]
        s = tl.load(scales_ptr + g_off, mask=mask, other=0.0).to(tl.float32)
        z = tl.load(zeros_ptr + g_off, mask=mask, other=0.0).to(tl.float32)
        acc = tl.fma(s, part, tl.fma(z, xs[None, :], acc))
    out = tl.sum(acc, axis=1)
    if pid_k == 0:
        for o0 in range(0, n_cols, BLOCK_O):  # columns n_out..n_cols: zero row padding (outlier_read_cols)
            offs_o = o0 + tl.arange(0, BLOCK_O)
            o_mask = offs_o < n_cols
            i_mask = offs_o < n_out
            idx = tl.load(oi_ptr + offs_o, mask=i_mask, other=0)
            xo = tl.load(x_ptr + idx, mask=i_mask, other=0.0).to(tl.float32)
            wo = tl.load(ow_ptr + offs_n[:, None] * ow_stride + offs_o[None, :],
                         mask=n_mask[:, None] & o_mask[None, :], other=0.0).to(tl.float32)
            out += tl.sum(wo * xo[None, :], axis=1)
    tl.atomic_add(y_ptr + offs_n, out, mask=n_mask)


def _gemm_configs():
    return [
        triton.Config({"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_W": bw}, num_warps=w, num_stages=s)
        for bm, bn, bw, w, s in [(16, 64, 16, 4, 2), (32, 64, 32, 4, 2), (64, 64, 32, 4, 2),
                                 (64, 128, 16, 8, 2), (128, 128, 16, 8, 2), (128, 64, 32, 8, 2)]
    ]


# Tuned per (N, K) and batch bucket (gemm_bucket): keyed on (N, K) alone, the tile tuned at the first batch
# served every later one. H200, 28672x8192 at batch 64: 1.56 ms with the batch-4 tile (BLOCK_M 16), 1.09 ms
# with its own (BLOCK_M 128); 8192x28672 keeps BLOCK_M 16 either way (1.59 ms; fp16 dense: 0.12 ms).
@triton.autotune(configs=_gemm_configs(), key=["N", "K", "M_BUCKET"])
@triton.jit
def _int2_gemm_kernel(
    x_ptr, words_ptr, scales_ptr, zeros_ptr, ow_ptr, oi_ptr, y_ptr,
    M, N, K, n_out, n_cols, ow_stride, stride_xm, stride_ym, M_BUCKET,
    GROUP: tl.constexpr, IEEE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_W: tl.constexpr, BLOCK_O: tl.constexpr,
):
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask, n_mask = offs_m < M, offs_n < N
    KW = K // 16
    G = K // GROUP
    WPG: tl.constexpr = GROUP // 16
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for w0 in range(0, KW, BLOCK_W):
        offs_w = w0 + tl.arange(0, BLOCK_W)
        w_mask = offs_w < KW
        mask = n_mask[:, None] & w_mask[None, :]
        words = tl.load(words_ptr + offs_n[:, None] * KW + offs_w[None, :], mask=mask, other=0)
        lo, hi = words << 2, words >> 18
        g_off = offs_n[:, None] * G + (offs_w // WPG)[None, :]
        s = tl.load(scales_ptr + g_off, mask=mask, other=0.0).to(tl.float32)
        z = tl.load(zeros_ptr + g_off, mask=mask, other=0.0).to(tl.float32)
        x_mask = m_mask[:, None] & w_mask[None, :]
        for j in tl.static_range(16):
            u = _field(lo, hi, j)
            c = u * tl.fma(u * u, _scale_b(j), _scale_a(j))
            w = tl.fma(s, c, z)  # [BN, BW] weights of channels 16 * offs_w + j
            xj = tl.load(x_ptr + offs_m[:, None] * stride_xm + (offs_w * 16 + j)[None, :], mask=x_mask, other=0.0)
            if IEEE:
                acc = tl.dot(xj, tl.trans(w.to(xj.dtype)), acc, input_precision="ieee")
            else:
                acc = tl.dot(xj, tl.trans(w.to(xj.dtype)), acc)
    for o0 in range(0, n_cols, BLOCK_O):  # columns n_out..n_cols: zero row padding (outlier_read_cols)
        offs_o = o0 + tl.arange(0, BLOCK_O)
        o_mask = offs_o < n_cols
        i_mask = offs_o < n_out
        idx = tl.load(oi_ptr + offs_o, mask=i_mask, other=0)
        xo = tl.load(x_ptr + offs_m[:, None] * stride_xm + idx[None, :],
                     mask=m_mask[:, None] & i_mask[None, :], other=0.0)
        wo = tl.load(ow_ptr + offs_n[:, None] * ow_stride + offs_o[None, :],
                     mask=n_mask[:, None] & o_mask[None, :], other=0.0)
        if IEEE:
            acc = tl.dot(xo, tl.trans(wo.to(xo.dtype)), acc, input_precision="ieee")
        else:
            acc = tl.dot(xo, tl.trans(wo.to(xo.dtype)), acc)
    y_ptrs = y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :]
    tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


def gemm_bucket(m: int) -> int:
    """Autotuning bucket of a GEMM batch: decode batches (<= 16), larger batches (<= 64), prefill."""
    return 16 if m <= 16 else 64 if m <= 64 else 256


_GLUON: dict = {}
# The automatic choice takes the Gluon GEMV from this many weights up. H200, GPU time per call with L2
# flushed (Gluon lookup-table GEMV / Triton GEMV), when this was set: 2048x2048 10.2 / 8.9 us (Gluon with 2
# warps per program), 4096x4096 12.7 / 13.8, 14336x4096 22.9 / 32.3, 4096x14336 22.3 / 37.9: below ~16M
# weights its three launches cost more than they save. With the current kernels (results/int2_gemv.json):
# 4096x4096 11.6 / 13.5, 14336x4096 23.3 / 31.0, 4096x14336 21.4 / 38.4, 28672x8192 46.4 / 102.8.
GLUON_MIN_WEIGHTS = 1 << 24


def _gluon_gemv():
    """The Gluon GEMV (int2_gluon.int2_gemv), or None where this Triton has no Gluon."""
    if "impl" not in _GLUON:
        _GLUON["impl"] = None
        try:
            from airquant.quant.kernels.int2_gluon import int2_gemv

            _GLUON["impl"] = int2_gemv
        except ImportError:
            pass
    return _GLUON["impl"]


def int2_matmul_triton(
    x: torch.Tensor,
    codes: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor,
    outlier_weight: torch.Tensor | None,
    outlier_idx: torch.Tensor | None,
    group: int,
    *,
    gemv: str | None = None,
) -> torch.Tensor:
    """x [..., K] @ W.T -> [..., N] in x's dtype; M == 1 takes a GEMV kernel (the Gluon one for matrices
    of GLUON_MIN_WEIGHTS or more where this Triton has Gluon, else _int2_gemv_kernel; ``gemv="gluon"|
    "triton"`` or AIRQUANT_INT2_GEMV picks one), larger M the GEMM kernel."""
    if gemv is None and os.environ.get("AIRQUANT_INT2_GEMV"):
        gemv = os.environ["AIRQUANT_INT2_GEMV"]
        if gemv not in ("gluon", "triton"):
            raise ValueError(f"AIRQUANT_INT2_GEMV={gemv!r}: expected 'gluon' or 'triton' (or unset: automatic)")
    elif gemv not in (None, "gluon", "triton"):
        raise ValueError(f"gemv={gemv!r}: expected 'gluon', 'triton' or None (automatic)")
    n, k = codes.shape[0], codes.shape[1] * 4
    # A word (16 codes) never straddles a group, and tiles are whole words.
    assert k % 16 == 0 and group % 16 == 0 and k % group == 0, (k, group)
    words = codes.contiguous().view(torch.int32)  # [N, K/16]
    x2 = x.reshape(-1, k).contiguous()
    scales, zeros = scales.contiguous(), zeros.contiguous()  # the kernels index them as dense [N, K/group]
    m = x2.shape[0]
    # The stored outlier rows may be padded ([N, outlier_cols], see int2.outlier_cols): the first
    # len(outlier_idx) columns are the outliers, and the kernels keep the row stride.
    n_out = 0 if outlier_weight is None else outlier_idx.numel()
    # With no outliers the loops never run; any valid pointer stands in for the absent tensors.
    if n_out:
        outlier_weight = outlier_weight[:, :n_out]
    ow = (outlier_weight if outlier_weight.stride(1) == 1 else outlier_weight.contiguous()) if n_out else scales
    ow_stride, n_cols = outlier_read_cols(ow, n_out)
    oi = outlier_idx.contiguous() if n_out else words
    wpg = group // 16  # words per group: a tile dimension of the Gluon kernel, so a power of two
    if gemv == "gluon" and _gluon_gemv() is None:
        raise RuntimeError("the Gluon int2 GEMV needs triton.experimental.gluon (Triton >= 3.5); "
                           "use gemv='triton' (or AIRQUANT_INT2_GEMV=triton) on this Triton")
    if gemv == "gluon" and wpg & (wpg - 1):
        raise ValueError(f"the Gluon int2 GEMV takes groups of 16 * 2^i inputs, not {group}; use gemv='triton'")
    auto_gluon = gemv is None and n * k >= GLUON_MIN_WEIGHTS
    if m == 1 and (gemv == "gluon" or auto_gluon) and not wpg & (wpg - 1) and _gluon_gemv() is not None:
        try:
            return _gluon_gemv()(x2[0], words, scales, zeros, ow if n_out else None, oi if n_out else None,
                                 group).reshape(*x.shape[:-1], n)
        except torch.cuda.OutOfMemoryError:
            raise
        except Exception as e:  # a Triton without this Gluon API level: the Triton kernel below serves
            if gemv == "gluon":
                raise
            _GLUON["impl"] = None
            warnings.warn(f"Gluon int2 GEMV unavailable ({type(e).__name__}: {e}); using the Triton kernel",
                          stacklevel=2)
    if m == 1:
        # Split-K programs add into fp32; the cast to x's dtype is one tiny extra kernel.
        y32 = torch.zeros(n, dtype=torch.float32, device=x.device)
        grid = lambda meta: (triton.cdiv(n, meta["BLOCK_N"]), meta["SPLIT_K"])  # noqa: E731
        _int2_gemv_kernel[grid](x2, words, scales, zeros, ow, oi, y32, n, k, n_out, n_cols, ow_stride, GROUP=group,
                                BLOCK_O=32)
        y = y32.to(x.dtype)[None, :]
    else:
        y = torch.empty((m, n), dtype=x.dtype, device=x.device)
        grid = lambda meta: (triton.cdiv(m, meta["BLOCK_M"]), triton.cdiv(n, meta["BLOCK_N"]))  # noqa: E731
        _int2_gemm_kernel[grid](
            x2, words, scales, zeros, ow, oi, y, m, n, k, n_out, n_cols, ow_stride, x2.stride(0), y.stride(0),
            gemm_bucket(m),
            GROUP=group, IEEE=x.dtype == torch.float32, BLOCK_O=32,
        )
    return y.reshape(*x.shape[:-1], n)
