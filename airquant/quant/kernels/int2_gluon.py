"""Int2 GEMV (decode, M == 1) in Gluon: Triton with explicit register layouts.

Why Gluon: the plain-Triton GEMV (int2_triton._int2_gemv_kernel) lets the compiler pick layouts, and
it picks ones that move every x slice and the partial sums through shared memory each tile; profiled
on the H200, L1 was 77 % busy and the kernel took ~106 us for a 28672x8192 matrix (0.23 of HBM copy
bandwidth). Here every tensor's layout is stated, so nothing is converted inside the loop:

* a tile is [BN rows, BG groups, WPG words] of int32 code words, layout L3: each thread owns R rows x
  one group (WPG consecutive words, one vector load per row); lanes run along groups (TG) and rows (TR);
* the x side is prepared once per call by ``_prep_kernel`` as fp32 factors per (field j, group, word),
  stored tile by tile so each factor load is a constant offset from one base, shared by the R rows;
* scales/zeros are loaded per (row, group) in the tile's row-group layout and applied once per group;
* when the shape is whole tiles, words/scales/zeros go through a cp.async double buffer (STAGES=2), so
  the next tile is in flight while one is decoded.

Two decodes of the 2-bit fields (both fp32 accumulation, see int2_triton for the layout of codes):

* ``DECODE=0`` (exact, used for fp32 inputs): the cubic of int2_triton, c*x = U*(xa_j + xb_j*U^2);
* ``DECODE=1`` (fp16/bf16 inputs): the levels are linear in the code's two bits,
  c = -1.5104 + 1.0576*v - 0.152*b1 (v = b0 + 2*b1; exact for +-0.4528, +-1.5104). A field placed at
  mantissa bits q, q+1 (q in 14..20) of 1.0f reads as F = 1 + v*2^(q-23), and the high bit alone as
  1 + b1*2^(q-22); so c*x costs one LOP3 + one FFMA per bit plane: acc += Fv*XV_j + Fb*XB_j, and the
  constant parts (sum of XV_j + XB_j, and -1.5104*sum x) are one per-group constant from the prep
  kernel. Cancelling the 1.0 parts costs about 2^-13 relative per group: ~2e-4 on the output, below
  fp16's own rounding of it (measured equal to the exact decode's 2.1e-4 on the H200), not fp32's.

Each program covers TPI tiles of one row block and writes one fp32 partial per row; an extra slot per
row block does the fp16 outlier columns; ``_reduce_kernel`` sums the slots into y (x's dtype).

Measured on the H200 (benchmarks/quant_int2_gemv.py -> results/int2_gemv.json; GPU time of the three
launches, L2 flushed): 28672x8192 65.8 us, 8192x28672 80.1 us = 0.37 / 0.31 of HBM copy bandwidth
(the Triton GEMV: 106 / 112 us; cuBLAS fp16 dense: 118 / 116 us for 4.5x the bytes). What bounds it is
instruction issue, not DRAM: ~5 instructions per weight (SASS, sm_90) at ~55 % issue efficiency; the
cp.async pipeline bought 7 %. Host cost of one eager call is ~180 us (three JIT launches), more than
the GPU time; a decode step overlaps it with earlier kernels. Below ~32M weights the three launches
cost more than they save, so int2_matmul only picks this kernel from GLUON_MIN_WEIGHTS up.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy

from airquant.quant.int2 import BIT_BETA, BIT_DELTA, CUBIC_A, CUBIC_B, LLOYD_MAX_4

# 2^23 (exact decode) and 1.0f (bit-plane decode) as bits; passed at run time so ptxas keeps them in a
# register and fuses the AND and OR of the field extraction into one LOP3.
_MAGIC = {0: 0x4B000000, 1: 0x3F800000}
# Tile shape measured best on the H200 for 28672x8192 and 8192x28672 (R=4, TG=32, NW=8, persistent
# grids, prefetching the next tile and register caps were all slower): 64 rows x 16 groups per tile.
R, TR, TG, NW, TPI = 8, 2, 16, 4, 8
STAGES = 2  # cp.async double buffer for whole tiles (0: plain loads; 3 and 4 measured slower)
BO = 64  # outlier columns per step
_CA, _CB = tl.constexpr(CUBIC_A), tl.constexpr(CUBIC_B)
_BETA, _HALF_DELTA, _L0 = tl.constexpr(BIT_BETA), tl.constexpr(BIT_DELTA / 2), tl.constexpr(LLOYD_MAX_4[0])


@triton.jit
def _prep_kernel(x_ptr, fa_ptr, fb_ptr, xs_ptr, kg_ptr, G, WPG: tl.constexpr, BGP: tl.constexpr,
                 BG: tl.constexpr, DECODE: tl.constexpr):
    """Per group g (GS = 16*WPG inputs): xs = sum of x; fa/fb [tiles, 16, BG, WPG] fp32 x-side factors
    of field j of word w; kg = the bit-plane decode's per-group constant."""
    GS: tl.constexpr = WPG * 16
    g = tl.program_id(0) * BGP + tl.arange(0, BGP)
    gm = g < G
    t = tl.arange(0, GS)
    xv = tl.load(x_ptr + g[:, None] * GS + t[None, :], mask=gm[:, None], other=0.0).to(tl.float32)
    tl.store(xs_ptr + g, tl.sum(xv, axis=1), mask=gm)
    j = t % 16
    w = t // 16
    off = ((g // BG) * (16 * BG) + (g % BG))[:, None] * WPG + (j * (BG * WPG) + w)[None, :]
    if DECODE == 0:
        p = tl.where(j < 10, j + 1, j - 9)
        pa = ((127 - 2 * p) << 23).to(tl.float32, bitcast=True)  # 4^-P, exactly
        pb = ((127 - 6 * p) << 23).to(tl.float32, bitcast=True)  # 4^-3P
        tl.store(fa_ptr + off, xv * (_CA * pa)[None, :], mask=gm[:, None])
        tl.store(fb_ptr + off, xv * (_CB * pb)[None, :], mask=gm[:, None])
    else:
        q = tl.where(j < 4, 14 + 2 * j, tl.where(j < 8, 2 * j + 6, tl.where(j < 12, 2 * j - 2, 2 * j - 10)))
        sv = ((127 + 23 - q) << 23).to(tl.float32, bitcast=True)  # 2^(23-q)
        xvv = xv * (_BETA * sv)[None, :]  # BIT_BETA * 2^(23-q)
        xbb = xv * (_HALF_DELTA * sv)[None, :]  # BIT_DELTA * 2^(22-q)
        tl.store(fa_ptr + off, xvv, mask=gm[:, None])
        tl.store(fb_ptr + off, xbb, mask=gm[:, None])
        tl.store(kg_ptr + g, _L0 * tl.sum(xv, axis=1) - tl.sum(xvv + xbb, axis=1), mask=gm)


@triton.jit
def _reduce_kernel(part_ptr, y_ptr, N, S, BLOCK_N: tl.constexpr, BLOCK_S: tl.constexpr):
    """y[n] = sum over the S slots of part[s, n] (fp32), cast to y's dtype."""
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    acc = tl.zeros((BLOCK_S, BLOCK_N), dtype=tl.float32)
    for s0 in range(0, S, BLOCK_S):
        offs_s = s0 + tl.arange(0, BLOCK_S)
        acc += tl.load(part_ptr + offs_s[:, None] * N + offs_n[None, :],
                       mask=(offs_s < S)[:, None] & n_mask[None, :], other=0.0)
    tl.store(y_ptr + offs_n, tl.sum(acc, axis=0).to(y_ptr.dtype.element_ty), mask=n_mask)


@gluon.jit
def _field_cubic(lo, hi, magic, J: gl.constexpr):
    """U = (code_J - 1.5) * 4^P (see int2_triton._field)."""
    P: gl.constexpr = J + 1 if J < 10 else J - 9
    src = lo if J < 10 else hi
    f = ((src & (3 << (2 * P))) | magic).to(gl.float32, bitcast=True)
    return f - (8388608.0 + 1.5 * (1 << (2 * P)))


@gluon.jit
def _bit_planes(c0, c1, c2, c3, one, xv, xb, part, J: gl.constexpr):
    """part += Fv*xv + Fb*xb for field J, taken from the shifted copy that puts it at bits Q, Q+1."""
    Q: gl.constexpr = 14 + 2 * J if J < 4 else (2 * J + 6 if J < 8 else (2 * J - 2 if J < 12 else 2 * J - 10))
    src = c0 if J < 4 else (c1 if J < 8 else (c2 if J < 12 else c3))
    fv = ((src & (3 << Q)) | one).to(gl.float32, bitcast=True)
    fb = ((src & (2 << Q)) | one).to(gl.float32, bitcast=True)
    return gl.fma(fb, xb, gl.fma(fv, xv, part))


@gluon.jit
def _issue_tile(words_s, s_s, z_s, stage, words_ptr, scales_ptr, zeros_ptr, wofs, cofs, g2, gc2, g0, g_hi,
                WPG: gl.constexpr):
    """cp.async of one tile's words (each thread its own rows x words) and scales/zeros (16-byte rows
    of 8 groups) into pipeline stage ``stage``; groups at or past g_hi are zero-filled."""
    async_copy.async_copy_global_to_shared(words_s.index(stage), words_ptr + g0 * WPG + wofs,
                                           mask=gl.expand_dims(g2 + g0 < g_hi, 2))
    cm = gc2 + g0 < g_hi
    async_copy.async_copy_global_to_shared(s_s.index(stage), scales_ptr + g0 + cofs, mask=cm)
    async_copy.async_copy_global_to_shared(z_s.index(stage), zeros_ptr + g0 + cofs, mask=cm)
    async_copy.commit_group()


@gluon.jit
def _gemv_kernel(fa_ptr, fb_ptr, xs_ptr, kg_ptr, x_ptr, words_ptr, scales_ptr, zeros_ptr, ow_ptr, oi_ptr, part_ptr,
                 N, KW, G, n_out, KS, magic,
                 WPG: gl.constexpr, R: gl.constexpr, TR: gl.constexpr, TG: gl.constexpr, NW: gl.constexpr,
                 TPI: gl.constexpr, BO: gl.constexpr, EVEN: gl.constexpr, DECODE: gl.constexpr,
                 STAGES: gl.constexpr):
    """grid (row blocks, KS + has_outliers); slot k < KS covers tiles [k*TPI, (k+1)*TPI) of the row
    block, slot KS its outlier columns; each writes part[slot, rows]."""
    L3: gl.constexpr = gl.BlockedLayout([R, 1, WPG], [TR, TG, 1], [NW, 1, 1], [2, 1, 0])
    LNG: gl.constexpr = gl.SliceLayout(2, L3)  # [rows, groups]
    LGW: gl.constexpr = gl.SliceLayout(0, L3)  # [groups, words]
    BN: gl.constexpr = R * TR * NW
    BG: gl.constexpr = TG
    FT: gl.constexpr = 16 * BG * WPG  # factors per tile
    pid_n = gl.program_id(0)
    pid_k = gl.program_id(1)
    if pid_k < KS:
        rows = pid_n * BN + gl.arange(0, BN, layout=gl.SliceLayout(1, LNG))
        ga = gl.arange(0, BG, layout=gl.SliceLayout(0, LNG))
        n2 = gl.expand_dims(rows, 1)
        g2 = gl.expand_dims(ga, 0)
        w3 = gl.expand_dims(gl.expand_dims(gl.arange(0, WPG, layout=gl.SliceLayout(0, LGW)), 0), 0)
        wofs = gl.expand_dims(n2, 2) * KW + gl.expand_dims(g2, 2) * WPG + w3
        sofs = n2 * G + g2
        fofs = (gl.expand_dims(gl.arange(0, BG, layout=gl.SliceLayout(1, LGW)), 1) * WPG
                + gl.expand_dims(gl.arange(0, WPG, layout=gl.SliceLayout(0, LGW)), 0))
        g_lo = pid_k * (TPI * BG)
        g_hi = gl.minimum(g_lo + TPI * BG, G)
        acc = gl.zeros([BN, BG], gl.float32, LNG)
        if STAGES > 0:  # cp.async ring: the next STAGES-1 tiles are in flight while one is decoded
            SH3: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [2, 1, 0])
            SH2: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [1, 0])
            LC: gl.constexpr = gl.BlockedLayout([1, 8], [32 * 8 // BG, BG // 8], [NW, 1], [1, 0])
            words_s = gl.allocate_shared_memory(gl.int32, [STAGES, BN, BG, WPG], SH3)
            s_s = gl.allocate_shared_memory(scales_ptr.dtype.element_ty, [STAGES, BN, BG], SH2)
            z_s = gl.allocate_shared_memory(zeros_ptr.dtype.element_ty, [STAGES, BN, BG], SH2)
            rc = gl.expand_dims(pid_n * BN + gl.arange(0, BN, layout=gl.SliceLayout(1, LC)), 1)
            gc2 = gl.expand_dims(gl.arange(0, BG, layout=gl.SliceLayout(0, LC)), 0)
            cofs = rc * G + gc2
            for i in gl.static_range(STAGES - 1):
                _issue_tile(words_s, s_s, z_s, i, words_ptr, scales_ptr, zeros_ptr, wofs, cofs,
                            g2, gc2, g_lo + i * BG, g_hi, WPG)
        for g0 in range(g_lo, g_hi, BG):
            if STAGES > 0:
                it = (g0 - g_lo) // BG
                async_copy.wait_group(STAGES - 2)
                gl.thread_barrier()  # tile `it` visible to all; every thread is done with tile it-1's stage
                _issue_tile(words_s, s_s, z_s, (it + STAGES - 1) % STAGES, words_ptr, scales_ptr, zeros_ptr, wofs,
                            cofs, g2, gc2, g0 + (STAGES - 1) * BG, g_hi, WPG)
                words = words_s.index(it % STAGES).load(L3)
                s = s_s.index(it % STAGES).load(LNG)
                z = z_s.index(it % STAGES).load(LNG)
                xs = gl.load(xs_ptr + g0 + ga)
            elif EVEN:
                words = gl.load(words_ptr + g0 * WPG + wofs)
                s = gl.load(scales_ptr + g0 + sofs)
                z = gl.load(zeros_ptr + g0 + sofs)
                xs = gl.load(xs_ptr + g0 + ga)
            else:
                m2 = (n2 < N) & (g2 + g0 < G)
                words = gl.load(words_ptr + g0 * WPG + wofs, mask=gl.expand_dims(m2, 2), other=0)
                s = gl.load(scales_ptr + g0 + sofs, mask=m2, other=0.0)
                z = gl.load(zeros_ptr + g0 + sofs, mask=m2, other=0.0)
                xs = gl.load(xs_ptr + g0 + ga, mask=ga + g0 < G, other=0.0)
            fbase = (g0 // BG) * FT + fofs  # factors are padded to whole tiles (zeros): no mask
            part = gl.zeros([BN, BG, WPG], gl.float32, L3)
            if DECODE == 0:
                lo = words << 2
                hi = words >> 18
                for j in gl.static_range(16):
                    xa = gl.expand_dims(gl.load(fa_ptr + fbase + j * (BG * WPG)), 0)
                    xb = gl.expand_dims(gl.load(fb_ptr + fbase + j * (BG * WPG)), 0)
                    u = _field_cubic(lo, hi, magic, j)
                    part = gl.fma(u, gl.fma(xb, u * u, xa), part)
                ps = gl.sum(part, axis=2)
            else:
                c0 = words << 14
                c1 = words << 6
                c2 = words >> 2
                c3 = words >> 10
                for j in gl.static_range(16):
                    xv = gl.expand_dims(gl.load(fa_ptr + fbase + j * (BG * WPG)), 0)
                    xb = gl.expand_dims(gl.load(fb_ptr + fbase + j * (BG * WPG)), 0)
                    part = _bit_planes(c0, c1, c2, c3, magic, xv, xb, part, j)
                if EVEN:
                    kg = gl.load(kg_ptr + g0 + ga)
                else:
                    kg = gl.load(kg_ptr + g0 + ga, mask=ga + g0 < G, other=0.0)
                ps = gl.sum(part, axis=2) + gl.expand_dims(kg, 0)
            acc = gl.fma(s.to(gl.float32), ps, gl.fma(z.to(gl.float32), gl.expand_dims(xs, 0), acc))
        gl.store(part_ptr + pid_k * N + rows, gl.sum(acc, axis=1), mask=rows < N)
    else:
        LO: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [NW, 1], [1, 0])
        rows_o = pid_n * BN + gl.arange(0, BN, layout=gl.SliceLayout(1, LO))
        oo = gl.arange(0, BO, layout=gl.SliceLayout(0, LO))
        rm = gl.expand_dims(rows_o < N, 1)
        acc_o = gl.zeros([BN, BO], gl.float32, LO)
        for o0 in range(0, n_out, BO):
            om = (o0 + oo) < n_out
            idx = gl.load(oi_ptr + o0 + oo, mask=om, other=0)
            xo = gl.load(x_ptr + idx, mask=om, other=0.0).to(gl.float32)
            wo = gl.load(ow_ptr + gl.expand_dims(rows_o, 1) * n_out + o0 + gl.expand_dims(oo, 0),
                         mask=rm & gl.expand_dims(om, 0), other=0.0).to(gl.float32)
            acc_o = gl.fma(wo, gl.expand_dims(xo, 0), acc_o)
        gl.store(part_ptr + pid_k * N + rows_o, gl.sum(acc_o, axis=1), mask=rows_o < N)


def int2_gemv(x: torch.Tensor, words: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
              outlier_weight: torch.Tensor | None, outlier_idx: torch.Tensor | None, group: int,
              stages: int = STAGES) -> torch.Tensor:
    """x [K] (fp16/bf16/fp32, contiguous) @ W.T -> [N] in x's dtype. words int32 [N, K/16]."""
    n, kw = words.shape
    G, WPG = kw * 16 // group, group // 16
    decode = 0 if x.dtype == torch.float32 else 1
    n_out = 0 if outlier_weight is None else outlier_weight.shape[1]
    ow = outlier_weight if n_out else scales  # any valid pointer stands in when there are none
    oi = outlier_idx if n_out else words
    BN, BG = R * TR * NW, TG
    tiles = triton.cdiv(G, BG)
    even = n % BN == 0 and G % BG == 0
    # cp.async moves 4-16 bytes per thread: scales/zeros rows of 8 groups need 16-byte aligned bases
    # (a view into a larger tensor may not be); without them the tiles take plain loads.
    aligned = all(t.data_ptr() % 16 == 0 for t in (words, scales, zeros))
    ks = triton.cdiv(tiles, TPI)
    slots = ks + (1 if n_out else 0)
    # One scratch allocation: factors fa, fb (whole tiles; padded groups must read as zeros), group sums
    # xs, group constants kg, per-slot partials.
    nf = tiles * 16 * BG * WPG
    sizes = [nf, nf, G, G, slots * n]
    scratch = (torch.empty if G % BG == 0 else torch.zeros)(sum(sizes), dtype=torch.float32, device=x.device)
    fa, fb, xs, kg, part = scratch.split(sizes)
    _prep_kernel[(triton.cdiv(G, 64),)](x, fa, fb, xs, kg, G, WPG=WPG, BGP=64, BG=BG, DECODE=decode, num_warps=4)
    _gemv_kernel[(triton.cdiv(n, BN), slots)](
        fa, fb, xs, kg, x, words, scales, zeros, ow, oi, part, n, kw, G, n_out, ks, _MAGIC[decode],
        WPG=WPG, R=R, TR=TR, TG=TG, NW=NW, TPI=TPI, BO=BO, EVEN=even, DECODE=decode,
        STAGES=stages if even and aligned else 0, num_warps=NW)
    y = torch.empty(n, dtype=x.dtype, device=x.device)
    bs = min(32, triton.next_power_of_2(slots))
    bn = max(64, 4096 // bs)
    _reduce_kernel[(triton.cdiv(n, bn),)](part, y, n, slots, BLOCK_N=bn, BLOCK_S=bs, num_warps=4)
    return y
