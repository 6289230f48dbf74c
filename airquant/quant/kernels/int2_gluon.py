"""Int2 GEMV (decode, M == 1) in Gluon: lookup tables over the input, read with warp shuffles.

The 2-bit codes of two neighbouring inputs (one nibble of a code word, see int2_triton for the layout)
take 16 values, so their contribution to a row's dot product,
``level(c0) * x[2p] + level(c1) * x[2p+1]``, is one of 16 numbers that depend on x alone. A prep kernel
computes that 16-entry fp32 table for every input pair once per call. In the GEMV, lane ``e`` of each
half-warp holds entry ``e`` of a pair's table in a register, and a lane looks its row's nibble up with
one ``shfl.sync.idx`` (width 16: the hardware uses the low 4 bits of the index, so the word shifted
right by 4*j is the index; no mask). Per two weights: a shift, a shuffle and an FADD, against ~10
instructions for decoding and multiplying them one by one (the previous kernel here, 5 per weight,
was issue-bound). Every operation is fp32 on exact table entries, so one kernel serves fp16, bf16 and
fp32 inputs (measured 1.8e-7 relative error against the fp32 reference).

Layout of the work: lane ``16*h + i`` of warp ``v`` works on row ``r*16*NW + 16*v + i`` of the row block
(``r < R``), and on chunk ``2*d + h`` (``SW = max(4, group/16)`` code words; ``d < D``) of each stage
of ``2*D`` chunks, so the two half-warps use their own tables. Words, scales and zeros are read
row-contiguously (coalesced: 8 lanes per row, 16 bytes each, for groups of 32) and moved to that
layout by a ``convert_layout`` (through shared memory); reading them straight in the lane-per-row
layout touched 16-32 cache lines per load and left the kernel L1-bound (110-270 us). Tables are
stored so that the 16 lanes' 16-byte loads are contiguous. Each program covers SPAN_SMALL or
SPAN_LARGE inputs of its row block and writes one fp32 partial per row and half-warp; extra programs
do the fp16 outlier columns, 128 at a time; ``_reduce_kernel`` sums the partials into y in x's dtype.

Measured on the H200 (benchmarks/quant_int2_gemv.py -> results/int2_gemv.json; GPU time of the three
launches with L2 flushed): 28672x8192 61.9 us, 8192x28672 62.9 us = 0.40 / 0.39 of HBM copy bandwidth
(the previous bit-plane Gluon kernel: 65.8 / 80.1 us; the Triton GEMV: 105 / 112 us; cuBLAS fp16 dense:
120 / 120 us for 4.5x the bytes). ~2 instructions per weight (SASS, sm_90) against 5 before; what
bounds it now (ncu) is the L1 data pipe, which the shuffles (one per two weights per row), the
shared-memory layout conversion and the table loads share, and memory latency at the occupancy its
registers allow, not instruction issue.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.experimental import gluon
from triton.experimental.gluon import language as gl

from airquant.quant.int2 import LLOYD_MAX_4

# Rows per lane, warps per program, double chunks per stage, measured on the H200 (GPU us for 28672x8192 /
# 8192x28672, +-2 us between runs): R=2, NW=1, D=4 60-62; NW=2 61-63; NW=4 72-75; R=4, D=2 68-75;
# R=1 68-74; R=2, D=2 61-68 (a program's warps share no data, so NW only sets the program size). A
# cp.async ring for words and tables instead of plain loads was slower (74-106 us): it needs
# per-element addresses in registers and adds the tables' shared-memory traffic; so was loading the next
# stage's words/scales/zeros into registers before computing this one (65-89 us).
R, NW, D = 2, 1, 4
# Inputs per program: 1024 for K <= 8192, 2048 above (4096x4096: 12.7 / 15.4 us; 8192x28672: 64.5 / 62.0).
SPAN_SMALL, SPAN_LARGE = 1024, 2048
OSC = 128  # outlier columns per program (a run-time argument: as a constexpr its loop unrolls, 249 registers)
_L0, _L1, _L2, _L3 = (tl.constexpr(v) for v in LLOYD_MAX_4)


@triton.jit
def _level(v):
    return tl.where(v == 0, _L0, tl.where(v == 1, _L1, tl.where(v == 2, _L2, _L3)))


@triton.jit
def _prep_kernel(x_ptr, tab_ptr, xs_ptr, K, NG, NP, GS: tl.constexpr, PS: tl.constexpr, BP: tl.constexpr):
    """Pair p (inputs 2p, 2p+1) of chunk c = p // PS, q = p % PS:
    tab[c, q // 4, e, q % 4] = level(e & 3) * x[2p] + level(e >> 2) * x[2p+1] (a lane's 4 pairs are 16 bytes
    and the 16 lanes' are contiguous); xs[g] = sum of group g's inputs.
    Inputs past K read as 0, so padded chunks and groups are zeros."""
    p = tl.program_id(0) * BP + tl.arange(0, BP)
    x0 = tl.load(x_ptr + 2 * p, mask=2 * p < K, other=0.0).to(tl.float32)
    x1 = tl.load(x_ptr + 2 * p + 1, mask=2 * p < K, other=0.0).to(tl.float32)
    e = tl.arange(0, 16)
    t = _level(e & 3)[None, :] * x0[:, None] + _level(e >> 2)[None, :] * x1[:, None]
    q = p % PS
    off = (p // PS) * (16 * PS) + (q // 4) * 64 + q % 4
    tl.store(tab_ptr + off[:, None] + e[None, :] * 4, t, mask=(p < NP)[:, None])
    HG: tl.constexpr = GS // 2
    g = tl.program_id(0) * (BP // HG) + tl.arange(0, BP // HG)
    tl.store(xs_ptr + g, tl.sum(tl.reshape(x0 + x1, [BP // HG, HG]), axis=1), mask=g < NG)


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
def _shfl16(tab, idx):
    """Each lane reads ``tab`` from lane (its half-warp's first lane + idx & 15)."""
    return gl.inline_asm_elementwise("shfl.sync.idx.b32 $0, $1, $2, 0x101f, -1;", "=f,f,r", [tab, idx],
                                     dtype=gl.float32, is_pure=True, pack=1)


@gluon.jit
def _groups_to_lanes(c, R: gl.constexpr, NW: gl.constexpr, D: gl.constexpr, GPS: gl.constexpr, L4: gl.constexpr):
    """[BN rows, 2*D*GPS groups] as loaded -> [D, R, 32*NW lanes, GPS] of the lanes that use them."""
    c = gl.permute(gl.reshape(c, [R, NW, 16, D, 2, GPS]), [3, 0, 1, 4, 2, 5])
    return gl.convert_layout(gl.reshape(c, [D, R, 32 * NW, GPS]), L4)


@gluon.jit
def _outlier_part(x_ptr, ow_ptr, oi_ptr, part_ptr, N, n_out, row0, c_lo, c_hi, slot, BN: gl.constexpr,
                  NW: gl.constexpr):
    """part[slot, rows] = outlier_weight[rows, c_lo:c_hi] @ x[outlier_idx[c_lo:c_hi]], 16*NW rows at a time
    (32 accumulators per thread: these programs' registers would otherwise set the whole kernel's)."""
    LO: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [NW, 1], [1, 0])
    BO: gl.constexpr = 64
    oo = gl.arange(0, BO, layout=gl.SliceLayout(0, LO))
    for rb in gl.static_range(0, BN, 16 * NW):
        rows = row0 + rb + gl.arange(0, 16 * NW, layout=gl.SliceLayout(1, LO))
        rm = gl.expand_dims(rows < N, 1)
        acc = gl.zeros([16 * NW, BO], gl.float32, LO)
        for o0 in range(c_lo, c_hi, BO):
            om = (o0 + oo) < c_hi
            idx = gl.load(oi_ptr + o0 + oo, mask=om, other=0)
            xo = gl.load(x_ptr + idx, mask=om, other=0.0).to(gl.float32)
            wo = gl.load(ow_ptr + gl.expand_dims(rows, 1) * n_out + o0 + gl.expand_dims(oo, 0),
                         mask=rm & gl.expand_dims(om, 0), other=0.0).to(gl.float32)
            acc = gl.fma(wo, gl.expand_dims(xo, 0), acc)
        gl.store(part_ptr + slot * N + rows, gl.sum(acc, axis=1), mask=rows < N)


@gluon.jit
def _gemv_kernel(tab_ptr, xs_ptr, words_ptr, scales_ptr, zeros_ptr, part_ptr, x_ptr, ow_ptr, oi_ptr,
                 N, KW, G, stages, SPP, KS, n_out, OSC,
                 WPG: gl.constexpr, GPS: gl.constexpr, R: gl.constexpr, NW: gl.constexpr, D: gl.constexpr,
                 EVEN: gl.constexpr):
    """grid (row blocks, KS + outlier programs). Program k < KS covers stages [k*SPP, (k+1)*SPP) and writes
    part[2k + h, rows] for its two half-warps h; program KS + j the outlier columns [j*OSC, (j+1)*OSC)."""
    SW: gl.constexpr = GPS * WPG  # words per chunk
    PS: gl.constexpr = 8 * SW  # input pairs per chunk
    BNW: gl.constexpr = 32 * NW  # lanes per program
    RH: gl.constexpr = 16 * NW  # rows per repetition
    BN: gl.constexpr = R * RH
    CW: gl.constexpr = 2 * D * SW  # words per row per stage
    CG: gl.constexpr = 2 * D * GPS  # groups per row per stage
    L6: gl.constexpr = gl.BlockedLayout([1, 1, 1, GPS, WPG, 8], [1, 1, 32, 1, 1, 1], [1, 1, NW, 1, 1, 1],
                                        [5, 4, 3, 2, 1, 0])  # [D, R, BNW, GPS, WPG, nibble]
    L5: gl.constexpr = gl.SliceLayout(5, L6)  # words [D, R, BNW, GPS, WPG]
    L4: gl.constexpr = gl.SliceLayout(4, L5)  # [D, R, BNW, GPS]
    L3: gl.constexpr = gl.SliceLayout(0, L4)  # [R, BNW, GPS]
    L2: gl.constexpr = gl.SliceLayout(2, L3)  # [R, BNW]
    LCW: gl.constexpr = gl.BlockedLayout([1, 4], [32 // (CW // 4), CW // 4], [NW, 1], [1, 0])
    LCS: gl.constexpr = gl.BlockedLayout([1, 4], [32 // (CG // 4), CG // 4], [NW, 1], [1, 0])
    pid_n = gl.program_id(0)
    pid_k = gl.program_id(1)
    if pid_k >= KS:
        c_lo = (pid_k - KS) * OSC
        _outlier_part(x_ptr, ow_ptr, oi_ptr, part_ptr, N, n_out, pid_n * BN, c_lo, gl.minimum(c_lo + OSC, n_out),
                      KS + pid_k, BN, NW)
        return
    # coalesced copies: [BN rows, CW words] and [BN rows, CG groups] of the stage
    rw = pid_n * BN + gl.expand_dims(gl.arange(0, BN, layout=gl.SliceLayout(1, LCW)), 1)
    cw = gl.expand_dims(gl.arange(0, CW, layout=gl.SliceLayout(0, LCW)), 0)
    rs = pid_n * BN + gl.expand_dims(gl.arange(0, BN, layout=gl.SliceLayout(1, LCS)), 1)
    cs = gl.expand_dims(gl.arange(0, CG, layout=gl.SliceLayout(0, LCS)), 0)
    wofs = rw * KW + cw
    sofs = rs * G + cs
    # table offsets [D, 1, BNW, GPS, WPG, 8]: chunk 2d + h, entry lane & 15, pair q of the chunk
    L6_0: gl.constexpr = gl.SliceLayout(1, gl.SliceLayout(2, gl.SliceLayout(3, gl.SliceLayout(4, gl.SliceLayout(5, L6)))))
    L6_2: gl.constexpr = gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(3, gl.SliceLayout(4, gl.SliceLayout(5, L6)))))
    L6_3: gl.constexpr = gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(2, gl.SliceLayout(4, gl.SliceLayout(5, L6)))))
    L6_4: gl.constexpr = gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(2, gl.SliceLayout(3, gl.SliceLayout(5, L6)))))
    L6_5: gl.constexpr = gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(2, gl.SliceLayout(3, gl.SliceLayout(4, L6)))))
    d6 = gl.expand_dims(gl.expand_dims(gl.expand_dims(gl.expand_dims(gl.expand_dims(
        gl.arange(0, D, layout=L6_0), 1), 2), 3), 4), 5)
    l6 = gl.expand_dims(gl.expand_dims(gl.expand_dims(gl.expand_dims(gl.expand_dims(
        gl.arange(0, BNW, layout=L6_2), 0), 1), 3), 4), 5)
    g6 = gl.expand_dims(gl.expand_dims(gl.expand_dims(gl.expand_dims(gl.expand_dims(
        gl.arange(0, GPS, layout=L6_3), 0), 1), 2), 4), 5)
    w6 = gl.expand_dims(gl.expand_dims(gl.expand_dims(gl.expand_dims(gl.expand_dims(
        gl.arange(0, WPG, layout=L6_4), 0), 1), 2), 3), 5)
    n6 = gl.expand_dims(gl.expand_dims(gl.expand_dims(gl.expand_dims(gl.expand_dims(
        gl.arange(0, 8, layout=L6_5), 0), 1), 2), 3), 4)
    q6 = g6 * (8 * WPG) + w6 * 8 + n6
    tofs = (d6 * 2 + (l6 // 16) % 2) * (16 * PS) + (q6 // 4) * 64 + (l6 % 16) * 4 + q6 % 4
    # group of (d, lane, g) within the stage, for the group sums of x: (2d + h) * GPS + g, [D, 1, BNW, GPS]
    xd = gl.arange(0, D, layout=gl.SliceLayout(1, gl.SliceLayout(2, gl.SliceLayout(3, L4))))
    xl = gl.arange(0, BNW, layout=gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(3, L4))))
    xg = gl.arange(0, GPS, layout=gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(2, L4))))
    xofs = ((gl.expand_dims(gl.expand_dims(gl.expand_dims(xd, 1), 2), 3) * 2
             + gl.expand_dims(gl.expand_dims(gl.expand_dims((xl // 16) % 2, 0), 1), 3)) * GPS
            + gl.expand_dims(gl.expand_dims(gl.expand_dims(xg, 0), 1), 2))
    acc = gl.zeros([R, BNW, GPS], gl.float32, L3)
    for st in range(pid_k * SPP, gl.minimum(pid_k * SPP + SPP, stages)):
        g0 = st * CG
        if EVEN:
            wc = gl.load(words_ptr + g0 * WPG + wofs)
            sc = gl.load(scales_ptr + g0 + sofs)
            zc = gl.load(zeros_ptr + g0 + sofs)
        else:
            mw = (rw < N) & (g0 + cw // WPG < G)
            ms = (rs < N) & (g0 + cs < G)
            wc = gl.load(words_ptr + g0 * WPG + wofs, mask=mw, other=0)
            sc = gl.load(scales_ptr + g0 + sofs, mask=ms, other=0.0)
            zc = gl.load(zeros_ptr + g0 + sofs, mask=ms, other=0.0)
        # [BN, CW] -> [R, NW, 16, D, 2, GPS, WPG] -> [D, R, NW, 2, 16, GPS, WPG] = [D, R, BNW, GPS, WPG]
        words = gl.convert_layout(gl.reshape(gl.permute(gl.reshape(wc, [R, NW, 16, D, 2, GPS, WPG]),
                                                        [3, 0, 1, 4, 2, 5, 6]), [D, R, BNW, GPS, WPG]), L5)
        s = _groups_to_lanes(sc, R, NW, D, GPS, L4)
        z = _groups_to_lanes(zc, R, NW, D, GPS, L4)
        xs = gl.load(xs_ptr + g0 + xofs)  # padded to whole stages
        tab = gl.load(tab_ptr + st * (2 * D * 16 * PS) + tofs)  # [D, 1, BNW, GPS, WPG, 8], padded likewise
        v = _shfl16(tab, gl.expand_dims(words, 5) >> (n6 * 4))
        gs = gl.sum(gl.sum(v, axis=5), axis=4)  # [D, R, BNW, GPS]: sum of code level * x per group
        acc += gl.sum(gl.fma(s.to(gl.float32), gs, z.to(gl.float32) * xs), axis=0)
    li = gl.arange(0, BNW, layout=gl.SliceLayout(0, L2))
    rows = (pid_n * BN + gl.expand_dims(gl.arange(0, R, layout=gl.SliceLayout(1, L2)), 1) * RH
            + gl.expand_dims((li // 32) * 16 + li % 16, 0))
    half = gl.expand_dims((li // 16) % 2, 0)
    gl.store(part_ptr + (2 * pid_k + half) * N + rows, gl.sum(acc, axis=2), mask=rows < N)


def int2_gemv(x: torch.Tensor, words: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
              outlier_weight: torch.Tensor | None, outlier_idx: torch.Tensor | None, group: int) -> torch.Tensor:
    """x [K] (fp16/bf16/fp32, contiguous) @ W.T -> [N] in x's dtype. words int32 [N, K/16]; scales, zeros
    [N, K/group] contiguous; group = 16 * 2^i."""
    n, kw = words.shape
    k = kw * 16
    G, WPG = k // group, group // 16
    GPS = max(1, 4 // WPG)  # groups per chunk of max(4, WPG) words
    PS = 8 * GPS * WPG
    CG = 2 * D * GPS
    stages = triton.cdiv(G, CG)
    BN = R * 16 * NW
    spp = max(1, (SPAN_SMALL if k <= 8192 else SPAN_LARGE) // (CG * group))
    ks = triton.cdiv(stages, spp)
    n_out = 0 if outlier_weight is None else outlier_weight.shape[1]
    os_ = triton.cdiv(n_out, OSC)
    slots = 2 * ks + os_
    npairs = stages * 2 * D * PS  # padded to whole stages; tables and group sums of the padding are zeros
    # One scratch allocation: tables, group sums, per-slot partials.
    sizes = [npairs * 16, stages * CG, slots * n]
    tab, xs, part = torch.empty(sum(sizes), dtype=torch.float32, device=x.device).split(sizes)
    bp = max(256, group // 2)
    _prep_kernel[(triton.cdiv(npairs, bp),)](x, tab, xs, k, stages * CG, npairs, GS=group, PS=PS, BP=bp, num_warps=4)
    # With no outliers their programs do not exist; any valid pointer stands in.
    ow = outlier_weight if n_out else scales
    oi = outlier_idx if n_out else words
    _gemv_kernel[(triton.cdiv(n, BN), ks + os_)](
        tab, xs, words, scales, zeros, part, x, ow, oi, n, kw, G, stages, spp, ks, n_out, OSC,
        WPG=WPG, GPS=GPS, R=R, NW=NW, D=D, EVEN=n % BN == 0 and G % CG == 0, num_warps=NW)
    y = torch.empty(n, dtype=x.dtype, device=x.device)
    bs = min(32, triton.next_power_of_2(slots))
    bn = max(64, 4096 // bs)
    _reduce_kernel[(triton.cdiv(n, bn),)](part, y, n, slots, BLOCK_N=bn, BLOCK_S=bs, num_warps=4)
    return y
