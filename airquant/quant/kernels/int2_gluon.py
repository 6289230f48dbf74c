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

Layout of the work ("ldg" path below; the "tma" kernel's is in its docstring): lane ``16*h + i`` of warp
``v`` works on row ``r*16*NW + 16*v + i`` of the row block (``r < R``), and on chunk ``2*d + h``
(``SW = max(4, group/16)`` code words; ``d < D``) of each stage of ``2*D`` chunks, so the two half-warps
use their own tables. Tables are stored so that the 16 lanes' 16-byte loads are contiguous. Each
program covers SPAN_SMALL or SPAN_LARGE inputs of its row block and writes one fp32 partial per row and
half-warp; in both paths extra programs do the fp16 outlier columns, 128 at a time.

Two ways to bring the weights in (``int2_gemv(path=...)``):

* "tma" (Hopper, groups of 16/32, the default from TMA_MIN_WEIGHTS): words, scales and zeros of a
  [16*R*NW rows, 256 inputs] tile, and the k-tile's 8 KB of tables, stream through a 2-slot
  shared-memory ring that the tensor memory accelerator fills. Each lane reads its row's 32 bytes of
  words straight from the 64-byte-swizzled tile (the register layout after the read is already the
  lane-per-row one: no conversion) and its half's table entries from the shared table, which a
  program's warps all use: the tables cross from L2 once per program instead of once per warp (they
  were 2.7x the weights' bytes in L2-to-SM traffic), and no thread spends load instructions or
  registers on addresses. The partials of a row block are summed by the last of its programs to finish
  (an arrival counter that the prep kernel zeroes), and the GEMV is launched as a programmatic dependent
  of the prep kernel, so its weight copies start while the tables are built: two launches, one of them
  hidden, instead of three.
* "ldg" (any GPU Gluon runs on, any group 16*2^i): the words are read row-contiguously (coalesced: 8
  lanes per row, 16 bytes each, for groups of 32) and moved to the lane-per-row layout by a
  ``convert_layout`` (through shared memory); reading them straight in the lane-per-row layout touched
  16-32 cache lines per load and left the kernel L1-bound (110-270 us). A third kernel sums the partials.

Measured on the H200 (benchmarks/quant_int2_gemv.py -> results/int2_gemv.json; GPU time of a call's
launches with L2 flushed): 28672x8192 / 8192x28672 with 3.5 % outliers, "tma" 46.4 / 45.3 us = 0.53 /
0.54 of HBM copy bandwidth, "ldg" 58.5 / 62.5 us = 0.42 / 0.39 (the bit-plane kernel before the tables:
65.8 / 80.1 us; the Triton GEMV: 103 / 111 us; cuBLAS fp16 dense: 120 / 119 us for 4.5x the bytes).
~2 instructions per weight (SASS, sm_90). ncu of "ldg": issue 30 %, L1 68 %, DRAM 38 % busy, the top
stall waiting on loads at ~11 warps per SM, i.e. latency-bound, which is what the TMA ring addresses;
of "tma": DRAM 49 %, L2 66 %, issue 48 %, ~19 warps per SM (5 programs: shared memory bounds them).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
from triton.language.extra.cuda.gdc import gdc_launch_dependents

from airquant.quant.int2_levels import LLOYD_MAX_4
from airquant.quant.kernels import HOPPER_MIN, device_capability, outlier_read_cols

# Rows per lane, warps per program, double chunks per stage, measured on the H200 (GPU us for 28672x8192 /
# 8192x28672, +-2 us between runs): R=2, NW=1, D=4 60-62; NW=2 61-63; NW=4 72-75; R=4, D=2 68-75;
# R=1 68-74; R=2, D=2 61-68 (a program's warps share no data, so NW only sets the program size). A
# cp.async ring for words and tables instead of plain loads was slower (74-106 us): it needs
# per-element addresses in registers and adds the tables' shared-memory traffic; so was loading the next
# stage's words/scales/zeros into registers before computing this one (65-89 us).
R, NW, D = 2, 1, 4
# Inputs per program: 1024 for K <= 8192, 2048 above (4096x4096: 12.7 / 15.4 us; 8192x28672: 64.5 / 62.0).
SPAN_SMALL, SPAN_LARGE = 1024, 2048
# TMA path: rows per lane, warps per program, ring slots, programs per SM. H200, GPU us for 28672x8192 /
# 8192x28672 (+-1.5 us between runs), with the tables through the ring (20 KB per slot): 2, 4, 2, 12
# 46.7-46.8 / 47.2-47.8; 2, 4, 3, 12 51.2 / 51.1 (3 programs per SM fit instead of 5); 2, 4, 2, 8 48.2 /
# 49.2; 2, 4, 2, 16 47.5 / 47.5; 2, 4, 2, 20 49.7 / 50.7; 2, 2, 2, 16 49.2 / 50.5; 4, 2, 2, 12 53.5 /
# 55.1; 2, 8, 2, 12 56.2 / 56.7; 2, 8, 3, 8 58.5 / 59.0; 1, 8, 3, 12 60.3 / 59.1. With the tables loaded
# by every warp from L2 instead (3 slots, 2, 4, 3, 12): 49.7-50.2 / 50.3-51.2; they were 2.7x the weights'
# bytes in L2-to-SM traffic. Before the partials were summed in-kernel and the launch overlapped the prep:
# 58.2 / 58.4 at best (a separate reduce kernel took 4.4-5.6 us, the prep 1.7-3). Dropped: keeping a
# k-tile's tables in registers while T row tiles pass by (75-125 us): a row's 64-byte pieces are then
# fetched far apart in time and DRAM read twice the bytes (ncu: 209 MB for 105 MB).
TR, TNW, TSTAGES, TPROG = 2, 4, 2, 12
# Input pairs per prep program: 128 (the TMA kernel waits for the prep; 256 -> 128: 46.6 / 47.1 ->
# 46.2 / 45.0 us; 64: 46.2 / 45.2).
PREP_BP = 128
# The automatic choice takes the TMA path from this many weights. Below it the TMA kernel's GPU time is
# at most a little better (H200, us, "tma" / "ldg": 4096x4096 9.9 / 11.6, 8192x8192 23.2 / 24.6,
# 14336x4096 21.0 / 22.8, 4096x14336 21.5 / 20.6) while its host time per call is ~60 us more (four
# tensor-map descriptors encoded per launch): a call made from Python, as in an eager decode step,
# costs 143-164 us against 81-89 us for the first three (do_bench of the call on the GPU machine's host).
TMA_MIN_WEIGHTS = 1 << 27
OSC = 128  # outlier columns per program (a run-time argument: as a constexpr its loop unrolls, 249 registers)
_L0, _L1, _L2, _L3 = (tl.constexpr(v) for v in LLOYD_MAX_4)


@triton.jit
def _level(v):
    return tl.where(v == 0, _L0, tl.where(v == 1, _L1, tl.where(v == 2, _L2, _L3)))


@triton.jit
def _prep_kernel(x_ptr, tab_ptr, xs_ptr, cnt_ptr, K, NG, NP, NC, GS: tl.constexpr, PS: tl.constexpr,
                 BP: tl.constexpr, PDL: tl.constexpr):
    """Pair p (inputs 2p, 2p+1) of chunk c = p // PS, q = p % PS:
    tab[c, q // 4, e, q % 4] = level(e & 3) * x[2p] + level(e >> 2) * x[2p+1] (a lane's 4 pairs are 16 bytes
    and the 16 lanes' are contiguous); xs[g] = sum of group g's inputs; cnt[:NC] = 0 (the GEMV's arrival
    counters). Inputs past K read as 0, so padded chunks and groups are zeros. PDL (the TMA path, Hopper only:
    griddepcontrol does not assemble before sm_90) lets the dependent GEMV start early."""
    if PDL:
        gdc_launch_dependents()  # the GEMV (launched as a programmatic dependent) may start its weight copies
    c = tl.program_id(0) * BP + tl.arange(0, BP)
    tl.store(cnt_ptr + c, tl.zeros([BP], tl.int32), mask=c < NC)
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
def _outlier_part(x_ptr, ow_ptr, oi_ptr, part_ptr, N, n_out, ow_stride, row0, c_lo, c_hi, slot, BN: gl.constexpr,
                  NW: gl.constexpr):
    """part[slot, rows] = outlier_weight[rows, c_lo:c_hi] @ x[outlier_idx[c_lo:c_hi]] for the BN rows at
    once, 64 columns at a time (BN*64 / (32*NW) weights in flight per thread, summed per row as they come:
    one row accumulator per 4*NW rows instead of a [rows, 64] tile, so these programs do not set the
    kernel's register count; the TMA kernel went from 92 to 72 registers with this, 47.3 / 47.6 ->
    46.6 / 47.1 us). Columns from n_out up to c_hi are row padding (zeros; see int2.outlier_cols), read so
    that the weight mask bound stays a multiple of 16 and the loads vectorize, and multiplied by 0."""
    LO: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [NW, 1], [1, 0])
    BO: gl.constexpr = 64
    oo = gl.arange(0, BO, layout=gl.SliceLayout(0, LO))
    rows = row0 + gl.arange(0, BN, layout=gl.SliceLayout(1, LO))
    rm = gl.expand_dims(rows < N, 1)
    acc = gl.zeros([BN], gl.float32, gl.SliceLayout(1, LO))
    for o0 in range(c_lo, c_hi, BO):
        om = (o0 + oo) < c_hi
        im = (o0 + oo) < n_out
        idx = gl.load(oi_ptr + o0 + oo, mask=im, other=0)
        xo = gl.load(x_ptr + idx, mask=im, other=0.0).to(gl.float32)
        wo = gl.load(ow_ptr + gl.expand_dims(rows, 1) * ow_stride + o0 + gl.expand_dims(oo, 0),
                     mask=rm & gl.expand_dims(om, 0), other=0.0).to(gl.float32)
        acc += gl.sum(wo * gl.expand_dims(xo, 0), axis=1)
    gl.store(part_ptr + slot * N + rows, acc, mask=rows < N)


@gluon.jit
def _gemv_kernel(tab_ptr, xs_ptr, words_ptr, scales_ptr, zeros_ptr, part_ptr, x_ptr, ow_ptr, oi_ptr,
                 N, KW, G, stages, SPP, KS, n_out, n_cols, ow_stride, OSC,
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
        _outlier_part(x_ptr, ow_ptr, oi_ptr, part_ptr, N, n_out, ow_stride, pid_n * BN, c_lo,
                      gl.minimum(c_lo + OSC, n_cols),
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


def tma_ok(words: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group: int) -> bool:
    """Whether the TMA path takes this matrix: Hopper or newer, groups of 16 or 32 (a k-tile's scales are at
    least the 16 bytes a TMA box row needs), rows of scales a multiple of 16 bytes (K % (8 * group) == 0),
    16-byte aligned bases."""
    k = words.shape[1] * 16
    cap = device_capability(words.device) if words.is_cuda else None  # AIRQUANT_FORCE_CAPABILITY may say older
    return (cap is not None and cap >= HOPPER_MIN and group in (16, 32)
            and k % (8 * group) == 0 and all(t.data_ptr() % 16 == 0 for t in (words, scales, zeros)))


def auto_path(words: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group: int) -> str:
    """The path int2_gemv takes when none is asked for: "tma" where it applies, for matrices of
    TMA_MIN_WEIGHTS or more; "ldg" otherwise."""
    big = words.shape[0] * words.shape[1] * 16 >= TMA_MIN_WEIGHTS
    return "tma" if big and tma_ok(words, scales, zeros, group) else "ldg"


def int2_gemv(x: torch.Tensor, words: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
              outlier_weight: torch.Tensor | None, outlier_idx: torch.Tensor | None, group: int,
              path: str | None = None) -> torch.Tensor:
    """x [K] (fp16/bf16/fp32, contiguous) @ W.T -> [N] in x's dtype. words int32 [N, K/16]; scales, zeros
    [N, K/group] contiguous; group = 16 * 2^i; outlier_weight [N, n_out] with unit column stride (rows may
    be padded). ``path``: "tma" (weights through a TMA ring, one launch after the table prep; where
    ``tma_ok``), "ldg" (plain loads, partials summed by a third kernel) or None (tma where it can, for
    matrices of TMA_MIN_WEIGHTS or more)."""
    if outlier_weight is not None:  # stored rows may be padded past the outliers (int2.outlier_cols)
        outlier_weight = outlier_weight[:, : outlier_idx.numel()]
    if path is None:
        path = auto_path(words, scales, zeros, group)
    elif path == "tma" and not tma_ok(words, scales, zeros, group):
        raise ValueError("the TMA int2 GEMV needs a Hopper GPU, group 16 or 32, K % (8 * group) == 0 and "
                         "16-byte aligned words/scales/zeros; use path='ldg'")
    if path == "tma":
        return _int2_gemv_tma(x, words, scales, zeros, outlier_weight, outlier_idx, group)
    if path != "ldg":
        raise ValueError(f"path={path!r}: expected 'tma', 'ldg' or None")
    return _int2_gemv_ldg(x, words, scales, zeros, outlier_weight, outlier_idx, group)


def _int2_gemv_ldg(x, words, scales, zeros, outlier_weight, outlier_idx, group):
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
    bp = max(PREP_BP, group // 2)
    _prep_kernel[(triton.cdiv(npairs, bp),)](x, tab, xs, xs, k, stages * CG, npairs, 0, GS=group, PS=PS, BP=bp,
                                             PDL=False, num_warps=4)  # no counters: a separate kernel sums the partials
    ow, oi, ow_stride, n_cols = _outlier_args(outlier_weight, outlier_idx, n_out, scales, words)
    _gemv_kernel[(triton.cdiv(n, BN), ks + os_)](
        tab, xs, words, scales, zeros, part, x, ow, oi, n, kw, G, stages, spp, ks, n_out, n_cols, ow_stride, OSC,
        WPG=WPG, GPS=GPS, R=R, NW=NW, D=D, EVEN=n % BN == 0 and G % CG == 0, num_warps=NW)
    return _reduce(part, n, slots, x.dtype)


def _outlier_args(outlier_weight, outlier_idx, n_out, stand_in_w, stand_in_i):
    """(weights, indices, row stride, columns read) for the kernels; with no outliers their programs do not
    exist and any valid pointers stand in."""
    ow = outlier_weight if n_out else stand_in_w
    return (ow, outlier_idx if n_out else stand_in_i, *outlier_read_cols(ow, n_out))


def _reduce(part, n, slots, dtype):
    """y [n] in dtype = the sum of part's ``slots`` rows."""
    y = torch.empty(n, dtype=dtype, device=part.device)
    bs = min(32, triton.next_power_of_2(slots))
    bn = max(64, 4096 // bs)
    _reduce_kernel[(triton.cdiv(n, bn),)](part, y, n, slots, BLOCK_N=bn, BLOCK_S=bs, num_warps=4)
    return y


# ---- TMA path: words, scales and zeros stream through a shared-memory ring that the tensor memory
# accelerator fills, so no thread spends load instructions, registers or layout conversions on them.
TW_ = 16  # code words per row per k-tile (256 inputs; each half-warp takes 8 words = 64 input pairs)
TW = gl.constexpr(TW_)


@gluon.jit
def _tma_issue(i, kb, n_it, row0, w_desc, s_desc, z_desc, t_desc, w_smem, s_smem, z_smem, t_smem, bars,
               GT: gl.constexpr, STAGES: gl.constexpr, WEIGHTS: gl.constexpr, TABLE: gl.constexpr):
    """Start the copies of the program's k-tile kb + i into ring slot i % STAGES (nothing past n_it): the
    weights' (words, scales, zeros; WEIGHTS) and/or the table's (TABLE). The slot's barrier expects both's
    bytes when the weights' copies are issued."""
    live = i < n_it
    b = i % STAGES
    kt = kb + i
    bar = bars.index(b)
    if WEIGHTS:
        mbarrier.expect(bar, w_desc.block_type.nbytes + 2 * s_desc.block_type.nbytes + t_desc.block_type.nbytes,
                        pred=live)
        tma.async_copy_global_to_shared(w_desc, [row0, kt * TW], bar, w_smem.index(b), pred=live)
        tma.async_copy_global_to_shared(s_desc, [row0, kt * GT], bar, s_smem.index(b), pred=live)
        tma.async_copy_global_to_shared(z_desc, [row0, kt * GT], bar, z_smem.index(b), pred=live)
    if TABLE:
        tma.async_copy_global_to_shared(t_desc, [kt * 32, 0], bar, t_smem.index(b), pred=live)


@gluon.jit
def _to_lanes(c, R: gl.constexpr, NW: gl.constexpr, shape: gl.constexpr, layout: gl.constexpr):
    """[BN rows, 2 halves x C] as loaded with [16, 2] lanes per warp -> ``shape`` = [R, NW, 32, ...] with lane
    16h + i of warp v on row (r*NW + v)*16 + i: the same registers, so the conversion is free."""
    c = gl.permute(gl.reshape(c, [R, NW, 16, 2, c.shape[1] // 2]), [0, 1, 3, 2, 4])
    return gl.convert_layout(gl.reshape(c, shape), layout)


@gluon.jit
def _gemv_tma_kernel(t_desc, xs_ptr, w_desc, s_desc, z_desc, part_ptr, cnt_ptr, y_ptr, x_ptr, ow_ptr, oi_ptr,
                     N, ktiles, KPP, KS, n_out, n_cols, ow_stride, OSC, S,
                     WPG: gl.constexpr, R: gl.constexpr, NW: gl.constexpr, STAGES: gl.constexpr):
    """grid (KS + outlier programs, row blocks of BN = 16*R*NW rows). Program k < KS takes k-tiles
    [k*KPP, (k+1)*KPP) of its row block; lane 16h + i of warp v works on rows r*16*NW + 16*v + i (r < R)
    and on words [8h, 8h + 8) of each k-tile, with that half's 64 table entries in registers (the k-tile's
    8 KB table comes through the ring with the weights, once per program, and every warp reads it from
    shared memory). It writes part[2k + h, rows]; program KS + j the outlier columns [j*OSC, (j+1)*OSC)
    into part[2*KS + j]. The last program of a row block to finish sums the block's partials into y
    (_finish)."""
    GT: gl.constexpr = TW // WPG  # groups per k-tile
    GPH: gl.constexpr = GT // 2  # groups per half-warp
    BN: gl.constexpr = R * 16 * NW
    L6: gl.constexpr = gl.BlockedLayout([1, 1, 1, GPH, WPG, 8], [1, 1, 32, 1, 1, 1], [1, NW, 1, 1, 1, 1],
                                        [5, 4, 3, 2, 1, 0])  # [R, NW, 32 lanes, GPH, WPG, nibble]
    L5: gl.constexpr = gl.SliceLayout(5, L6)  # words [R, NW, 32, GPH, WPG]
    L4: gl.constexpr = gl.SliceLayout(4, L5)  # [R, NW, 32, GPH]
    L3: gl.constexpr = gl.SliceLayout(3, L4)  # [R, NW, 32]
    # shared memory -> registers, lane 16h + i of warp v: row (r*NW + v)*16 + i, words [8h, 8h + 8),
    # groups [GPH*h, GPH*h + GPH); 16-byte loads, conflict-free on the 64-byte-swizzled words
    LW: gl.constexpr = gl.BlockedLayout([1, 8], [16, 2], [NW, 1], [0, 1])
    LS: gl.constexpr = gl.BlockedLayout([1, GPH], [16, 2], [NW, 1], [0, 1])
    # the table tile [2 halves * 16 pair quads, 16 entries * 4 pairs]: lane 16h + e reads rows 16h.., columns
    # 4e.. (a quarter-warp's 16-byte loads are one contiguous 128-byte row piece); every warp reads it all
    LT: gl.constexpr = gl.BlockedLayout([16, 4], [2, 16], [NW, 1], [1, 0])
    pid_k = gl.program_id(0)
    row0 = gl.program_id(1) * BN
    if pid_k >= KS:
        c_lo = (pid_k - KS) * OSC
        _outlier_part(x_ptr, ow_ptr, oi_ptr, part_ptr, N, n_out, ow_stride, row0, c_lo,
                      gl.minimum(c_lo + OSC, n_cols), KS + pid_k, BN, NW)
    else:
        kb = pid_k * KPP
        n_it = gl.minimum(kb + KPP, ktiles) - kb
        w_smem = gl.allocate_shared_memory(w_desc.dtype, [STAGES, BN, TW], w_desc.layout)
        s_smem = gl.allocate_shared_memory(s_desc.dtype, [STAGES, BN, GT], s_desc.layout)
        z_smem = gl.allocate_shared_memory(z_desc.dtype, [STAGES, BN, GT], z_desc.layout)
        t_smem = gl.allocate_shared_memory(t_desc.dtype, [STAGES, 32, 64], t_desc.layout)
        bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for b in gl.static_range(STAGES):
            mbarrier.init(bars.index(b), count=1)
        for i in gl.static_range(STAGES - 1):
            _tma_issue(i, kb, n_it, row0, w_desc, s_desc, z_desc, t_desc, w_smem, s_smem, z_smem, t_smem, bars,
                       GT, STAGES, True, False)
        # group of (lane, g) in a k-tile, for the group sums of x: GPH*h + g, [1, 1, 32, GPH]
        xl = gl.arange(0, 32, layout=gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(3, L4))))
        xg = gl.arange(0, GPH, layout=gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(2, L4))))
        xofs = gl.expand_dims(gl.expand_dims(gl.expand_dims(xl // 16, 0), 1), 3) * GPH + gl.expand_dims(
            gl.expand_dims(gl.expand_dims(xg, 0), 1), 2)
        n6 = gl.arange(0, 8, layout=gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(2, gl.SliceLayout(
            3, gl.SliceLayout(4, L6))))))
        n6 = gl.expand_dims(gl.expand_dims(gl.expand_dims(gl.expand_dims(gl.expand_dims(n6, 0), 1), 2), 3), 4)
        acc = gl.zeros([R, NW, 32], gl.float32, L3)
        _gdc_wait()  # tables and group sums come from the prep kernel, which may still be running
        for i in gl.static_range(STAGES - 1):
            _tma_issue(i, kb, n_it, row0, w_desc, s_desc, z_desc, t_desc, w_smem, s_smem, z_smem, t_smem, bars,
                       GT, STAGES, False, True)
        xs = gl.load(xs_ptr + kb * GT + xofs)  # [1, 1, 32, GPH]
        for i in range(n_it):
            # slot (i - 1) % STAGES was read last iteration: every warp is done with it before it is refilled
            gl.thread_barrier()
            fence_async_shared()
            _tma_issue(i + STAGES - 1, kb, n_it, row0, w_desc, s_desc, z_desc, t_desc, w_smem, s_smem, z_smem,
                       t_smem, bars, GT, STAGES, True, True)
            xs_next = gl.load(xs_ptr + (kb + gl.minimum(i + 1, n_it - 1)) * GT + xofs)
            slot = i % STAGES
            mbarrier.wait(bars.index(slot), (i // STAGES) & 1)
            tab = gl.permute(gl.reshape(t_smem.index(slot).load(LT), [2, 16, 16, 4]), [0, 2, 1, 3])
            tab = gl.convert_layout(gl.reshape(tab, [1, 1, 32, GPH, WPG, 8]), L6)
            words = _to_lanes(w_smem.index(slot).load(LW), R, NW, [R, NW, 32, GPH, WPG], L5)
            s = _to_lanes(s_smem.index(slot).load(LS), R, NW, [R, NW, 32, GPH], L4)
            z = _to_lanes(z_smem.index(slot).load(LS), R, NW, [R, NW, 32, GPH], L4)
            v = _shfl16(tab, gl.expand_dims(words, 5) >> (n6 * 4))
            gs = gl.sum(gl.sum(v, axis=5), axis=4)  # [R, NW, 32, GPH]: sum of code level * x per group
            acc += gl.sum(gl.fma(s.to(gl.float32), gs, z.to(gl.float32) * xs), axis=3)
            xs = xs_next
        for b in gl.static_range(STAGES):
            mbarrier.invalidate(bars.index(b))
        ri = gl.arange(0, R, layout=gl.SliceLayout(1, gl.SliceLayout(2, L3)))
        vi = gl.arange(0, NW, layout=gl.SliceLayout(0, gl.SliceLayout(2, L3)))
        li = gl.arange(0, 32, layout=gl.SliceLayout(0, gl.SliceLayout(1, L3)))
        rows = (row0 + gl.expand_dims(gl.expand_dims(ri, 1), 2) * (16 * NW)
                + gl.expand_dims(gl.expand_dims(vi, 0), 2) * 16 + gl.expand_dims(gl.expand_dims(li % 16, 0), 1))
        half = gl.expand_dims(gl.expand_dims(li // 16, 0), 1)
        gl.store(part_ptr + (2 * pid_k + half) * N + rows, acc, mask=rows < N)
    _finish(part_ptr, cnt_ptr, y_ptr, N, S, gl.num_programs(0), gl.program_id(1), row0, BN, NW)


@gluon.jit
def _gdc_wait():
    """Wait until the grid this one was launched as a programmatic dependent of has finished (and its writes
    are visible); a no-op for a normal launch."""
    gl.inline_asm_elementwise("griddepcontrol.wait; // $0", "=r", [], dtype=gl.int32, is_pure=False, pack=1)


@gluon.jit
def _finish(part_ptr, cnt_ptr, y_ptr, N, S, P, pid_n, row0, BR: gl.constexpr, NW: gl.constexpr):
    """Count this program in for its row block; the last of the block's P programs to arrive sums the S
    partial slots of its BR rows into y (x's dtype). The CTA barrier plus the release of the count make
    every thread's partials visible to the program that acquires the final count."""
    _gdc_wait()  # the counters are zeroed by the prep kernel
    gl.thread_barrier()
    if gl.atomic_add(cnt_ptr + pid_n, 1, sem="acq_rel", scope="gpu") == P - 1:
        BS: gl.constexpr = 8
        LR: gl.constexpr = gl.BlockedLayout([1, 4], [1, 32], [NW, 1], [1, 0])  # [BS, BR]
        rows = row0 + gl.arange(0, BR, layout=gl.SliceLayout(0, LR))
        ss = gl.arange(0, BS, layout=gl.SliceLayout(1, LR))
        acc = gl.zeros([BS, BR], gl.float32, LR)
        for s0 in range(0, S, BS):
            sl = gl.expand_dims(s0 + ss, 1)
            acc += gl.load(part_ptr + sl * N + gl.expand_dims(rows, 0),
                           mask=(sl < S) & gl.expand_dims(rows < N, 0), other=0.0, cache_modifier=".cg")
        gl.store(y_ptr + rows, gl.sum(acc, axis=0).to(y_ptr.dtype.element_ty), mask=rows < N)


def _int2_gemv_tma(x, words, scales, zeros, outlier_weight, outlier_idx, group):
    n, kw = words.shape
    k = kw * 16
    WPG = group // 16
    GT = TW_ // WPG
    ktiles = triton.cdiv(kw, TW_)
    BN = TR * 16 * TNW
    row_blocks = triton.cdiv(n, BN)
    # k-tiles per program: enough programs to fill the GPU a few times over
    sms = torch.cuda.get_device_properties(x.device).multi_processor_count
    kpp = max(1, min(ktiles, (ktiles * row_blocks) // (TPROG * sms)))
    ks = triton.cdiv(ktiles, kpp)
    n_out = 0 if outlier_weight is None else outlier_weight.shape[1]
    os_ = triton.cdiv(n_out, OSC)
    slots = 2 * ks + os_
    npairs = ktiles * 2 * 64
    sizes = [npairs * 16, ktiles * GT, slots * n]
    tab, xs, part = torch.empty(sum(sizes), dtype=torch.float32, device=x.device).split(sizes)
    bp = max(PREP_BP, group // 2)
    cnt = torch.empty(row_blocks, dtype=torch.int32, device=x.device)
    _prep_kernel[(triton.cdiv(max(npairs, row_blocks), bp),)](x, tab, xs, cnt, k, ktiles * GT, npairs, row_blocks,
                                                              GS=group, PS=64, BP=bp, PDL=True, num_warps=4)
    wl = gl.NVMMASharedLayout(swizzle_byte_width=64, element_bitwidth=32, rank=2)
    tabl = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=2)
    t_desc = TensorDescriptor.from_tensor(tab.view(ktiles * 32, 64), [32, 64], tabl)
    sl = gl.NVMMASharedLayout(swizzle_byte_width=0 if GT * 2 < 32 else 32, element_bitwidth=16, rank=2)
    w_desc = TensorDescriptor.from_tensor(words, [BN, TW_], wl)
    s_desc = TensorDescriptor.from_tensor(scales, [BN, GT], sl)
    z_desc = TensorDescriptor.from_tensor(zeros, [BN, GT], sl)
    ow, oi, ow_stride, n_cols = _outlier_args(outlier_weight, outlier_idx, n_out, scales, words)
    y = torch.empty(n, dtype=x.dtype, device=x.device)
    _gemv_tma_kernel[(ks + os_, row_blocks)](
        t_desc, xs, w_desc, s_desc, z_desc, part, cnt, y, x, ow, oi, n, ktiles, kpp, ks, n_out, n_cols, ow_stride, OSC,
        slots,
        WPG=WPG, R=TR, NW=TNW, STAGES=TSTAGES, num_warps=TNW, launch_pdl=True)
    return y
