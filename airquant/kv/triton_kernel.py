"""Triton kernels: the whole compressed-cache attention of one layer in two launches (CUDA only).

``attention`` replaces the ~60 small torch ops of :func:`airquant.kv.attention.compressed_attention`
(each a kernel launch: at decode time launches, not bytes, were the cost) with

1. ``_split_kernel``, one program per (batch x kv-head, split, block of query rows). A split is a
   range of either the unquantized tokens (sink + recent, read as stored) or of the packed history.
   History programs read the queries rotated once for the call (``<q, Pi^T c> = <Pi q, c>``,
   ``rotated``), unpack codes in registers (the layouts of :mod:`airquant.kv.pack`), gather
   centroids from a 2**bits-entry table, score ``<Pi q, c> * norm`` (+ the key mean's ``<q, mean>``),
   run an online softmax and accumulate ``p * norm_v * c_v`` (+ the value mean, rotated) in the value
   rotation's space. Every program writes a softmax state ``(m, l, acc)``: a window split's ``acc`` in the
   original space, a history split's in the rotated one.
2. ``_merge_kernel``: flash-decoding reduction of the split states (the window's and the history's
   ``acc`` apart, with the same rescaling), the history's rotated back once (``acc @ Pi``),
   normalization, and the store in the ``[B, L, Hq, D]`` layout and dtype the model expects.

History tiles come in variants (``VARIANTS``): codes unpacked in dimension order through a reshape; read in the
packed bytes' column order (no reshape; the queries, value mean and stored sum take the same order); or each
packed byte one gather of its codes' centroids from a 256-row byte table. The autotuner tries ``AUTOTUNED``
only; a variant joins it once its compiled output and speed are measured on a GPU
(benchmarks/kv_attention_speed.py --paged, tests/kv/test_triton_gpu.py).

No split program holds a rotation matrix: a [D, D] fp32 matrix through shared memory (64 KB at D 128)
held an H100's SM to three programs; the merge, one program per (row block, head), holds it once.

Masks: without an attention mask the kernel applies the causal rule itself (query ``i`` of ``L``
sits at absolute position ``kv_len - L + i``), so a decode step reads no mask at all; a boolean
``[B, 1|Hq, L, kv_len]`` mask (padding, custom) is read in place through its strides.

``exact`` (float32 models, tests): products in IEEE fp32. Otherwise (bf16/fp16 models) the two
attention products take the model's own dtype on tensor cores, as sdpa does with a plain cache.
Importing this module never requires triton or CUDA: ``applicable`` says whether it can run.
"""

from __future__ import annotations

import math
import os

import torch

from airquant.kv.cache import CompressedContext
from airquant.kv.codec import LOG_NORM_LEVELS, LOG_NORM_SPAN
from airquant.kv.masks import keep_mask
from airquant.kv.paging import SPLIT_QUANTUM, Paged
from airquant.quant.kernels import device_capability, dtype_supported, shared_per_block

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU installs: the torch path is used
    triton = None

# Split programs aimed at per call. The H200 (BLOCK_N 64) measured 264 best; an H100 (2026-12-05, 8K a slot,
# BLOCK_N 32) 1056: batch 8 0.193 ms against 0.249 at 264, batch 32 within 3 % of each other.
TARGET_PROGRAMS = 1056
# History-tile variants, (COLS, BYTES): codes unpacked through a reshape in dimension order; or read in the packed
# bytes' column order with no reshape (``_columns``); or (BYTES, 1-, 2- and 4-bit codes) each packed byte one gather
# of its codes' centroids from a 256-row table (``Codec.byte_table``), in dimension order. Value centroids picked
# by selects instead of gathered (an H100, 2026-12-05: 0.94 ms at batch 32 against 0.66) are gone.
VARIANTS = ((0, 0), (1, 0), (0, 1))
# What the autotuner tries, (BLOCK_N, stages, COLS, BYTES, MAXNREG), 4 warps each: each entry is a compile per
# launch key, so the list stays short. The H200 (8K x batch 8, K4/V2, D 128) had BLOCK_N 64 / 1 stage win every
# sweep of 12 configs (before byte tables). An H100 (wave3_kv27, 2026-12-05, 8K a slot, 4 query heads a KV head):
# byte tables at BLOCK_N 32 best at batch 8 (0.173 ms against 0.196 for the dimension-order tile) and 32 (0.617
# against 0.684; sdpa over the bf16 cache 0.354); BLOCK_N 16 lost everywhere (0.652-0.99 at batch 32); a cap of
# 128 registers a thread changed little (0.620 / 0.667 at batch 32: compiled for sm_90 with the launch's stride
# alignment, BLOCK_N 32 already takes 128, four programs an SM) and 168 lost; the byte-column order ties; 8 warps
# and 2 stages lost earlier. Compiled for sm_90 (benchmarks/kernel_sass.py), byte tables cut the history loop from
# 1 008 instructions a 32-token tile to 671; what remains is mostly layout conversions through shared memory (27
# barriers a tile: the bytes to the gather's layout, the gathered tiles to the products' operands, the scores to
# the softmax's layout and back).
AUTOTUNED = ((64, 1, 0, 0, None), (64, 1, 0, 1, None), (32, 1, 0, 0, None), (32, 1, 0, 1, None))
assert all(entry[2:4] in VARIANTS for entry in AUTOTUNED)  # COLS and BYTES never together: their column orders differ
# Which kernel reads the packed history of a call it can take (``gluon_history``): "gluon" (kv/gluon_kernel.py,
# operands gathered into the tensor cores' register layouts, one warp a split) or "triton" (the split kernel's
# history tiles). An H200 (2026-12-06, benchmarks/chains/wave3_kv33.sh, one machine and store for both kernels):
# * its GPU tests: 14 of 14 (bf16 and fp16; 3, 4 and 8 query heads a KV head; centred, 8-bit-norm and sink
#   caches; flat, paged, per-row), and the Triton kernel's own 21 of 21;
# * the decode step, kv_bench at 8K (llama3-8b bf16, 32 layers): batch 8 TQ 0.0142 s against plain 0.0179 (0.79x;
#   0.0158 with the Triton history, 0.87x); batch 32 0.0228 against 0.0233 (0.98x; Triton 0.0364, 1.57x);
# * one layer's call (kv_attention_speed --paged --sweep short, CUDA graphs, results/kv_attention_speed_gluon.json):
#   batch 32, 4 query heads a KV head 0.274 ms (its kernel 207 us) against the Triton kernel's best 0.589 and
#   sdpa's 0.244 over the bf16 cache; batch 8 0.136 ms (0.113 at 2 112 programs) against 0.165 and 0.070.
# An H100 (2026-12-06, the same sweep at batch 32): 0.278 ms against 0.588 and sdpa's 0.342.
HISTORY_KERNEL = "gluon"
# Split programs the Gluon history kernel aims at (one warp each; the Triton kernel's are four). The H100 at batch
# 32: 2 112 0.299 ms, 4 224 0.278, 8 448 0.310; the H200 at batch 32 0.293 / 0.274 / 0.303, at batch 8 0.113 /
# 0.136 / 0.183 (fewer history tiles a program at batch 8: 4 against 16; not tuned per call, two points a shape).
GLUON_PROGRAMS = 4224
# Tiles of the Gluon history kernel: 32 (255 registers compiled for sm_90, 1 291 instructions a tile, no barrier);
# 16 took 0.309 ms in that run and a cap of 168 registers 0.355.
GLUON_BLOCK_N = 32
# The window's splits beside a Gluon history (a few hundred unquantized tokens): one tile config, not tuned.
WINDOW_TILES = {"BLOCK_N": 32, "num_warps": 4, "num_stages": 1, "COLS": 0, "BYTES": 0}
# Centroid tables in the products' dtype where the products are half precision (False: fp32 tables converted
# in the kernel, as before; benchmarks/kv_attention_speed.py compares both in one run).
TABLES_IN_PRODUCT_DTYPE = True


def preferred_history() -> str:
    """The history kernel a call takes where both can: AIRQUANT_TQ_HISTORY ("gluon" or "triton") if set, else
    ``HISTORY_KERNEL``."""
    chosen = os.environ.get("AIRQUANT_TQ_HISTORY") or HISTORY_KERNEL
    if chosen not in ("gluon", "triton"):
        raise ValueError(f"AIRQUANT_TQ_HISTORY={chosen!r}: expected 'gluon' or 'triton' (or unset: {HISTORY_KERNEL})")
    return chosen


def gluon_fits(dim: int, capability: tuple[int, int] | None) -> bool:
    """Whether the Gluon history kernel is built for head size ``dim`` on a GPU of ``capability``: 128, Ampere or
    later (its MMA is sm_80's)."""
    return dim == 128 and capability is not None and capability >= (8, 0)


def history_reader(dim: int, capability: tuple[int, int] | None) -> str:
    """What reads a half-precision K4/V2 decode call's packed history (a few query rows a KV head) for head size
    ``dim`` on a GPU of ``capability``: "gluon" where ``gluon_fits`` and it is preferred (``preferred_history``),
    "triton" where the split kernel ``fits``, else "torch" (no GPU, or a head the kernels do not take)."""
    if not fits(dim, capability):
        return "torch"
    return preferred_history() if gluon_fits(dim, capability) else "triton"


def gluon_history(query: torch.Tensor, ctx: CompressedContext, dot: int, rows: int) -> bool:
    """Whether the Gluon history kernel can read this call's history: half-precision products, K4/V2 codes, at
    most 16 query rows a kv-head (``G * QLEN``), ``gluon_fits``, a Triton with Gluon."""
    if dot not in (1, 2) or rows > 16 or (ctx.k_codec.bits, ctx.v_codec.bits) != (4, 2):
        return False
    if not gluon_fits(query.shape[-1], device_capability(query.device)):
        return False
    try:
        from airquant.kv import gluon_kernel  # noqa: F401  (Triton >= 3.5)
    except ImportError:
        return False
    return True


def shared_bytes(dim: int) -> int:
    """Shared memory the kernels need at head size ``dim`` (an upper bound): the merge's fp32 value rotation
    [D, D] goes through shared memory for its tl.dot, plus the small tiles (compiled sm_75..sm_90: merge D 64
    20480 B, 128 73728 B; a split program, which holds no rotation, 22528 B at D 128 where it took 74240 with
    one; tests/quant/test_kernel_compile.py checks the bound)."""
    return 4 * dim * dim + 80 * dim


def fits(dim: int, capability: tuple[int, int] | None) -> bool:
    """Whether the kernel can launch for head size ``dim`` on a GPU of ``capability``: a T4 (64 KB per block)
    takes D <= 64, Ampere and Hopper D <= 128; larger heads use the torch ops of kv.attention."""
    return capability is not None and shared_bytes(dim) <= shared_per_block(capability)


def applicable(query: torch.Tensor, ctx: CompressedContext) -> bool:
    dim = query.shape[-1]
    return (
        triton is not None
        and query.is_cuda
        and 16 <= dim <= 256
        and dim & (dim - 1) == 0
        and ctx.history.length > 0
        and fits(dim, device_capability(query.device))
        and dtype_supported(query.dtype, device_capability(query.device))
    )


if triton is not None:
    _HALF_SPAN = tl.constexpr(LOG_NORM_SPAN / 2)
    _NORM_STEP = tl.constexpr(LOG_NORM_SPAN / LOG_NORM_LEVELS)

    @triton.jit
    def _packed_rows(base, offs_n, n_ok, W: tl.constexpr, stride_n):
        """The packed bytes ``[BN, W]`` (uint8) of rows ``offs_n`` starting at ``base``; 0 past ``n_ok``."""
        return tl.load(base + offs_n[:, None] * stride_n + tl.arange(0, W)[None, :], mask=n_ok[:, None], other=0)

    @triton.jit
    def _codes(base, offs_n, n_ok, BN: tl.constexpr, D: tl.constexpr, BITS: tl.constexpr, stride_n):
        """Codes ``[BN, D]`` (int32) of the packed rows ``offs_n`` starting at ``base`` (uint8)."""
        if BITS == 3:
            # 8 codes in 3 bytes: gather each code's (possibly straddling) byte pair; L1 serves repeats.
            d = tl.arange(0, D)[None, :]
            bit = (d // 8) * 24 + (d % 8) * 3
            ptr = base + offs_n[:, None] * stride_n + bit // 8
            shift = bit % 8
            lo = tl.load(ptr, mask=n_ok[:, None], other=0).to(tl.int32)
            hi = tl.load(ptr + 1, mask=n_ok[:, None] & (shift > 5), other=0).to(tl.int32)
            return ((lo | (hi << 8)) >> shift) & 7
        PER: tl.constexpr = 8 // BITS  # codes per byte, code i of a byte at bits BITS*i
        raw = _packed_rows(base, offs_n, n_ok, D // PER, stride_n)
        shifts = tl.arange(0, PER) * BITS
        codes = (raw.to(tl.int32)[:, :, None] >> shifts[None, None, :]) & ((1 << BITS) - 1)
        return tl.reshape(codes, (BN, D))

    @triton.jit
    def _columns(D: tl.constexpr, BITS: tl.constexpr, COLS: tl.constexpr):
        """Which dimension each column of a history tile holds: ``arange(D)``, or with ``COLS`` (and not 3 bits) the
        packed bytes' own order: column ``c`` is code ``c // W`` of byte ``c % W`` (``W = D * BITS / 8``), which is
        dimension ``(c % W) * (8 // BITS) + c // W``. A score is a sum over dimensions and the history's value sum
        is put back in order at its store, so a tile may hold its columns in any order; in this one each column is
        one byte's shift (``_code_columns``) and the tile needs no reshape of a [BN, W, 8 // BITS] unpack."""
        d = tl.arange(0, D)
        if COLS:
            if BITS != 3:
                PER: tl.constexpr = 8 // BITS
                W: tl.constexpr = D // PER
                return (d % W) * PER + d // W
        return d

    @triton.jit
    def _code_columns(base, offs_n, n_ok, D: tl.constexpr, BITS: tl.constexpr, stride_n):
        """``_codes`` in ``_columns``' order (``COLS``): each column reads its byte (L1 serves the repeats) and
        shifts it; no reshape."""
        PER: tl.constexpr = 8 // BITS
        W: tl.constexpr = D // PER
        c = tl.arange(0, D)
        raw = tl.load(base + offs_n[:, None] * stride_n + (c % W)[None, :], mask=n_ok[:, None], other=0)
        return (raw.to(tl.int32) >> ((c // W) * BITS)[None, :]) & ((1 << BITS) - 1)

    @triton.jit
    def _history_codes(base, offs_n, n_ok, BN: tl.constexpr, D: tl.constexpr, BITS: tl.constexpr, stride_n,
                       COLS: tl.constexpr):
        """A history tile's codes in ``_columns``' order."""
        if COLS:
            if BITS != 3:
                return _code_columns(base, offs_n, n_ok, D, BITS, stride_n)
        return _codes(base, offs_n, n_ok, BN, D, BITS, stride_n)

    @triton.jit
    def _history_tile(Cent, Byte, base, offs_n, n_ok, BN: tl.constexpr, D: tl.constexpr, BITS: tl.constexpr,
                      stride_n, COLS: tl.constexpr, BYTES: tl.constexpr):
        """A history tile's centroids ``[BN, D]`` in ``_columns``' order. ``BYTES`` (not 3 bits): each packed byte
        is one gather of its codes' centroids together from ``Byte`` (``Codec.byte_table``: row ``b`` holds byte
        ``b``'s ``8 // BITS`` centroids), in dimension order; otherwise codes are unpacked and each gathered from
        the ``2**BITS``-entry ``Cent``."""
        if BYTES:
            if BITS != 3:
                PER: tl.constexpr = 8 // BITS
                raw = _packed_rows(base, offs_n, n_ok, D // PER, stride_n)
                idx = raw.to(tl.int32)[:, :, None] * PER + tl.arange(0, PER)[None, None, :]
                return tl.reshape(tl.load(Byte + idx), (BN, D))
        return tl.load(Cent + _history_codes(base, offs_n, n_ok, BN, D, BITS, stride_n, COLS))

    @triton.jit
    def _norms(ptr, ref_ptr, offs_n, n_ok, NORM8: tl.constexpr):
        stored = tl.load(ptr + offs_n, mask=n_ok, other=0).to(tl.float32)
        if NORM8:  # log2 code against the per-head reference (Codec.load_norms)
            return tl.exp2(tl.load(ref_ptr) - _HALF_SPAN + stored * _NORM_STEP)
        return stored

    @triton.jit
    def _product(a, b, DOT: tl.constexpr):
        """``a @ b``, fp32 accumulation; operands IEEE fp32 (DOT 0), bf16 (1) or fp16 (2) on tensor cores."""
        if DOT == 1:
            return tl.dot(a.to(tl.bfloat16), b.to(tl.bfloat16))
        if DOT == 2:
            return tl.dot(a.to(tl.float16), b.to(tl.float16))
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")

    @triton.jit
    def _visible(keep_row_ptr, s_ec, col, pos, row_ok, n_ok, HAS_KEEP: tl.constexpr):
        """[BM, BN]: which (query row, absolute column) pairs attend."""
        ok = row_ok[:, None] & n_ok[None, :]
        if HAS_KEEP:
            return ok & (tl.load(keep_row_ptr + col[None, :] * s_ec, mask=ok, other=0) != 0)
        return ok & (col[None, :] <= pos[:, None])

    @triton.jit
    def _online(s, m_i, l_i, acc):
        """Fold scores ``s`` (-inf where hidden) into (m, l) and rescale acc; returns p too."""
        m_new = tl.maximum(m_i, tl.max(s, 1))
        # Rows with nothing visible yet keep m = -inf; shift by 0 so exp() gives 0, not NaN.
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp(m_i - m_safe)
        p = tl.exp(s - m_safe[:, None])
        return p, m_new, l_i * alpha + tl.sum(p, 1), acc * alpha[:, None]

    # Integer arguments that follow the lengths of a call (history, window, mask row, split counts) are not
    # specialized: Triton otherwise compiles a variant per combination of "equal to 1" / "divisible by 16" of
    # them, and a decode loop whose lengths grow by one token a step met a new one every few steps (seconds of
    # compile each, measured as a 28 s longer prefill ramp of the first TurboQuant run on the H200). Strides of
    # the packed tensors stay specialized: they are multiples of a page and keep the loads aligned.
    LENGTH_ARGS = ("s_eb", "s_eh", "s_el", "KV_LEN", "F", "N_HIST", "full_splits", "n_splits")

    @triton.jit(do_not_specialize=LENGTH_ARGS)
    def _split_kernel(
        Q, QR, KF, VF, KC, KN, KR, VC, VN, VR, KCent, VCent, KByte, VByte, KMean, VMeanRot, Keep, OutM, OutL, OutAcc,
        Slots, Table, s_tb, HistLen,
        s_qb, s_qh, s_ql, s_rb, s_rh, s_rl, s_kfb, s_kfh, s_kfn, s_vfb, s_vfh, s_vfn,
        s_kcb, s_kch, s_kcn, s_knb, s_knh, s_vcb, s_vch, s_vcn, s_vnb, s_vnh,
        s_eb, s_eh, s_el, s_ec,
        HKV, G, QLEN, KV_LEN, F, SINK, N_HIST, full_splits, n_splits, per_split, scale,
        D: tl.constexpr, BITS_K: tl.constexpr, BITS_V: tl.constexpr, DOT: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
        NORM8_K: tl.constexpr, NORM8_V: tl.constexpr, HAS_KMEAN: tl.constexpr, HAS_VMEAN: tl.constexpr,
        HAS_KEEP: tl.constexpr, PAGED: tl.constexpr, PAGE: tl.constexpr, ROW_HIST: tl.constexpr,
        COLS: tl.constexpr, BYTES: tl.constexpr,
    ):  # fmt: skip
        pid_bh, pid_s, pid_m = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        b, h = pid_bh // HKV, pid_bh % HKV
        # Paged (the decode loop's arena): batch row b reads slot Slots[b]'s window, statistics and pages;
        # history token t of it sits in page Table[slot, t // PAGE] at row t % PAGE. Otherwise slot = b.
        if PAGED:
            slot = tl.load(Slots + b)
        else:
            slot = b
        sh = slot * HKV + h  # row of the per-(sequence, head) statistics
        rows = G * QLEN
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # grouped rows: r = g * QLEN + i
        offs_d = tl.arange(0, D)
        row_ok = offs_m < rows
        g, i = offs_m // QLEN, offs_m % QLEN
        q_ptr = Q + b * s_qb + (h * G + g)[:, None] * s_qh + i[:, None] * s_ql + offs_d[None, :]
        q = tl.load(q_ptr, mask=row_ok[:, None], other=0.0).to(tl.float32)
        pos = KV_LEN - QLEN + i  # absolute column of each query row (causal rule without a mask)
        keep_row = Keep + b * s_eb + (h * G + g)[:, None] * s_eh + i[:, None] * s_el
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, D], tl.float32)
        cols = offs_d  # the dimension each column of acc holds (a history split's: its values' tile order)
        if pid_s < full_splits:
            # Unquantized tokens [sink | recent]: column f is absolute f (sink) or f + N_HIST.
            n_start = pid_s * per_split
            n_end = tl.minimum(n_start + per_split, F)
            for n0 in range(n_start, n_end, BLOCK_N):
                offs_n = n0 + tl.arange(0, BLOCK_N)
                n_ok = offs_n < n_end
                k = tl.load(KF + slot * s_kfb + h * s_kfh + offs_n[:, None] * s_kfn + offs_d[None, :],
                            mask=n_ok[:, None], other=0.0)
                s = _product(q, tl.trans(k), DOT) * scale
                col = tl.where(offs_n < SINK, offs_n, offs_n + N_HIST)
                s = tl.where(_visible(keep_row, s_ec, col, pos, row_ok, n_ok, HAS_KEEP), s, float("-inf"))
                p, m_i, l_i, acc = _online(s, m_i, l_i, acc)
                v = tl.load(VF + slot * s_vfb + h * s_vfh + offs_n[:, None] * s_vfn + offs_d[None, :],
                            mask=n_ok[:, None], other=0.0)
                acc += _product(p, v, DOT)
        else:
            # Packed history: history token t is absolute column SINK + t; the queries rotated once for the call.
            cols_k = _columns(D, BITS_K, COLS)  # the queries' columns in the keys' tile order
            cols = _columns(D, BITS_V, COLS)
            q_rot = tl.load(QR + b * s_rb + (h * G + g)[:, None] * s_rh + i[:, None] * s_rl + cols_k[None, :],
                            mask=row_ok[:, None], other=0.0)
            if HAS_KMEAN:
                km = tl.load(KMean + sh * D + offs_d)
                bias = tl.sum(q * km[None, :], 1) * scale
            n_start = (pid_s - full_splits) * per_split
            n_end = tl.minimum(n_start + per_split, N_HIST)
            if ROW_HIST:  # this row's own history: no tile past it is read (its mask hides those columns anyway)
                n_end = tl.minimum(n_end, tl.load(HistLen + b).to(tl.int32))
            for n0 in range(n_start, n_end, BLOCK_N):
                offs_n = n0 + tl.arange(0, BLOCK_N)
                n_ok = offs_n < n_end
                if PAGED:  # a tile never crosses a page: splits start at multiples of PAGE, BLOCK_N divides it
                    page = tl.load(Table + slot * s_tb + n0 // PAGE)
                    back = n0 % PAGE - n0  # offs_n stays absolute: shift the bases back by the tile's start
                    kc_row, kn_row = KC + page * s_kcb + back * s_kcn, KN + page * s_knb + back
                    vc_row, vn_row = VC + page * s_vcb + back * s_vcn, VN + page * s_vnb + back
                else:
                    kc_row, kn_row, vc_row, vn_row = KC + b * s_kcb, KN + b * s_knb, VC + b * s_vcb, VN + b * s_vnb
                k = _history_tile(KCent, KByte, kc_row + h * s_kch, offs_n, n_ok, BLOCK_N, D, BITS_K, s_kcn, COLS,
                                  BYTES)  # [BN, D] rotated unit keys
                kn = _norms(kn_row + h * s_knh, KR + sh, offs_n, n_ok, NORM8_K)
                s = _product(q_rot, tl.trans(k), DOT) * (kn[None, :] * scale)
                if HAS_KMEAN:
                    s += bias[:, None]
                # The mask is read here too where a row reads only its own history (Paged.lengths), though it shows
                # the row all of it: without the read, sm_90 compiles the per-row launch to other arithmetic than
                # the padded one (the softmax in another layout), and a row's result then depends on its batch
                # neighbours' lengths in the last bits (test_triton_gpu's static_own_same failed on an H200,
                # 2026-12-06; 942 -> 594 instructions a tile, its speed unmeasured).
                s = tl.where(_visible(keep_row, s_ec, SINK + offs_n, pos, row_ok, n_ok, HAS_KEEP), s, float("-inf"))
                p, m_i, l_i, acc = _online(s, m_i, l_i, acc)
                v = _history_tile(VCent, VByte, vc_row + h * s_vch, offs_n, n_ok, BLOCK_N, D, BITS_V, s_vcn, COLS,
                                  BYTES)
                vn = _norms(vn_row + h * s_vnh, VR + sh, offs_n, n_ok, NORM8_V)
                acc += _product(p * vn[None, :], v, DOT)
            if HAS_VMEAN:  # every history value is v_mean + its quantized residual: v_mean's rotated image here
                acc += tl.load(VMeanRot + sh * D + cols)[None, :] * l_i[:, None]
            # acc stays in the value rotation's space: the merge rotates the history's sum back once
        out = (pid_bh * n_splits + pid_s) * rows + offs_m  # the grid may hold only the window's splits
        tl.store(OutM + out, m_i, mask=row_ok)
        tl.store(OutL + out, l_i, mask=row_ok)
        tl.store(OutAcc + out[:, None] * D + cols[None, :], acc, mask=row_ok[:, None])  # each column where it belongs

    _split_tuned = triton.autotune(
        configs=[triton.Config({"BLOCK_N": bn, "COLS": cols, "BYTES": tab}, num_warps=4, num_stages=st, maxnreg=reg)
                 for bn, st, cols, tab, reg in AUTOTUNED],
        key=["D", "BITS_K", "BITS_V", "DOT", "BLOCK_M", "HAS_KEEP", "PAGED", "ROW_HIST"],
    )(_split_kernel)

    @triton.jit(do_not_specialize=("n_splits", "full_splits"))
    def _merge_kernel(
        OutM, OutL, OutAcc, Out, RotV, s_ob, s_ol, s_oh, HKV, G, QLEN, n_splits, full_splits,
        D: tl.constexpr, BLOCK_M: tl.constexpr,
    ):  # fmt: skip
        pid_bh, pid_m = tl.program_id(0), tl.program_id(1)
        b, h = pid_bh // HKV, pid_bh % HKV
        rows = G * QLEN
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_d = tl.arange(0, D)
        row_ok = offs_m < rows
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, D], tl.float32)  # the window splits' (original space)
        acc_h = tl.zeros([BLOCK_M, D], tl.float32)  # the history splits' (the value rotation's space)
        for s in range(0, n_splits):
            idx = (pid_bh * n_splits + s) * rows + offs_m
            m_s = tl.load(OutM + idx, mask=row_ok, other=float("-inf"))
            m_new = tl.maximum(m_i, m_s)
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha, w = tl.exp(m_i - m_safe), tl.exp(m_s - m_safe)
            l_i = l_i * alpha + w * tl.load(OutL + idx, mask=row_ok, other=0.0)
            acc_s = tl.load(OutAcc + idx[:, None] * D + offs_d[None, :], mask=row_ok[:, None], other=0.0)
            hist = (s >= full_splits).to(tl.float32)
            acc = acc * alpha[:, None] + ((1.0 - hist) * w)[:, None] * acc_s
            acc_h = acc_h * alpha[:, None] + (hist * w)[:, None] * acc_s
            m_i = m_new
        if n_splits > full_splits:  # back from the value rotation's space (Pi^T y = y @ Pi), once
            acc += _product(acc_h, tl.load(RotV + offs_d[:, None] * D + offs_d[None, :]), 0)
        # Fully masked rows (left-padding queries) have l = 0: output 0 there, as sdpa's fix does.
        out = acc / tl.maximum(l_i, 1.1754943508222875e-38)[:, None]
        g, i = offs_m // QLEN, offs_m % QLEN
        ptr = Out + b * s_ob + i[:, None] * s_ol + (h * G + g)[:, None] * s_oh + offs_d[None, :]
        tl.store(ptr, out.to(Out.dtype.element_ty), mask=row_ok[:, None])


_DOT = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}  # _product's operand codes
_CHOSEN: dict[tuple, dict] = {}  # attention()'s launch key -> the autotuned tile config


# What each entry of ``_CHOSEN``'s launch key is, in ``attention``'s order.
_KEY_FIELDS = ("dim", "bits_k", "bits_v", "dot", "block_m", "keep", "paged", "row_hist", "k_ref", "v_ref", "k_mean",
               "v_mean", "query_dtype", "keys_dtype", "values_dtype", "k_norms_dtype", "v_norms_dtype", "device")


def chosen_tiles() -> list[dict]:
    """The autotuner's tile config for each launch key so far (``_CHOSEN``; the key leaves the batch out, so a
    process's first batch picks the tiles its later batches run): which tiles a benchmark's steps ran."""
    def plain(v):
        return v if isinstance(v, (int, float, bool, str, type(None))) else str(v)

    return [{**{name: plain(v) for name, v in zip(_KEY_FIELDS, key, strict=True)},
             "config": {k: plain(v) for k, v in config.items()}}
            for key, config in _CHOSEN.items()]


def rotated(x: torch.Tensor, rotation) -> torch.Tensor:
    """``Pi x`` along the last dim as contiguous fp32, computed in fp64 (whatever TF32 setting the process has):
    the queries a history split scores, and the value mean a history split adds in the rotated space (``Pi`` is
    orthogonal: the merge's ``y @ Pi`` turns ``Pi v`` back into ``v``)."""
    return (x.double() @ rotation.matrix(x.device, torch.float64).T).float().contiguous()


def _byte_table(codec, device, dtype: torch.dtype) -> torch.Tensor:
    """A ``BYTES`` tile's table: the codec's byte table, or (3-bit codes: such tiles gather each code) its centroids
    as a stand-in the kernel does not read."""
    return codec.byte_table(device, dtype) if 8 % codec.bits == 0 else codec.centroids(device, dtype)


def _keep_view(mask: torch.Tensor, batch: int, q_len: int, kv_len: int) -> torch.Tensor:
    """``[B|1, 1|Hq, L, kv_len]`` int8 view of the mask (no copy for boolean masks)."""
    keep = keep_mask(mask, batch, q_len, kv_len, mask.device)
    return keep.view(torch.int8)


def _splits(n: int, programs_per_split: int, target: int) -> tuple[int, int]:
    """(number of splits, tokens per split: a multiple of SPLIT_QUANTUM) for ``n`` tokens, ``target`` programs."""
    max_splits = max(1, math.ceil(n / SPLIT_QUANTUM))
    splits = min(max_splits, max(1, math.ceil(target / programs_per_split)))
    per_split = math.ceil(n / splits / SPLIT_QUANTUM) * SPLIT_QUANTUM
    return math.ceil(n / per_split), per_split


def attention(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    ctx: CompressedContext,
    mask: torch.Tensor | None,
    scale: float,
    exact: bool | None = None,
    block_n: int | None = None,
    num_warps: int = 4,
    paged: Paged | None = None,
    programs: int | None = None,
    variant: tuple[int, int] = (0, 0),
    num_stages: int = 1,
    maxnreg: int | None = None,
    history: str | None = None,
) -> torch.Tensor:
    """Same contract as :func:`airquant.kv.attention.compressed_attention`: ``[B, L, Hq, D]``.

    ``exact`` None: IEEE fp32 products for float32 queries, the query's dtype otherwise.
    ``block_n`` None: autotuned among ``AUTOTUNED``; else that tile, ``num_warps``, ``num_stages``, ``variant``
    (one of ``VARIANTS``: (COLS, BYTES)) and ``maxnreg`` (registers a thread, None: no cap; benchmarks, tests).
    ``paged``: the tensors are the decode loop's arena, read through its page table (``Paged``).
    ``programs``: the split programs aimed at (None: ``TARGET_PROGRAMS``, or ``GLUON_PROGRAMS``; benchmarks).
    ``history``: which kernel reads the packed history, "gluon" or "triton" (None: ``preferred_history()`` where
    ``gluon_history`` allows and no Triton tile is named by ``block_n``, else "triton"); with "gluon", ``block_n``
    is the Gluon kernel's tile (None: ``GLUON_BLOCK_N``) and the window's splits run ``WINDOW_TILES``."""
    if variant not in VARIANTS:
        raise ValueError(f"history-tile variant {variant}: one of {VARIANTS} ((COLS, BYTES))")
    if history not in (None, "gluon", "triton"):
        raise ValueError(f"history={history!r}: 'gluon', 'triton' or None (HISTORY_KERNEL where it applies)")
    hist = ctx.history
    # The kernel reads feature vectors with unit stride; anything else is copied once here.
    query, keys, values = (t if t.stride(-1) == 1 else t.contiguous() for t in (query, keys, values))
    batch, hq, q_len, dim = query.shape
    hkv, n_full = keys.shape[1], keys.shape[2] if paged is None else paged.window
    if paged is not None and paged.page % SPLIT_QUANTUM:
        raise ValueError(f"pages of {paged.page} tokens: the kernel's splits need a multiple of {SPLIT_QUANTUM}")
    groups, rows = hq // hkv, hq // hkv * q_len
    kv_len = n_full + hist.length
    exact = query.dtype == torch.float32 if exact is None else exact
    dot = 0 if exact else _DOT[query.dtype]
    block_m = 16 if rows <= 16 else (32 if rows <= 32 else 64)
    m_blocks = math.ceil(rows / block_m)
    can_gluon = gluon_history(query, ctx, dot, rows)
    if history == "gluon" and not can_gluon:
        raise ValueError("the Gluon history kernel takes half-precision K4/V2 calls of head size 128 and at most 16 "
                         "query rows a kv-head, on Ampere or later: use history='triton'")
    # A tile named without a kernel is the Triton split kernel's (the tests and sweeps of its tiles).
    gluon = history == "gluon" or (history is None and block_n is None and can_gluon
                                   and preferred_history() == "gluon")
    if gluon and block_n is not None and (block_n < 16 or SPLIT_QUANTUM % block_n):
        raise ValueError(f"block_n={block_n} for the Gluon history kernel: 16, 32 or 64 (a tile stays within a "
                         f"split of {SPLIT_QUANTUM}-token multiples and holds the MMA's 16 tokens)")
    # Histories and unquantized parts are split alike; the split count aims at the history kernel's programs.
    target = programs or (GLUON_PROGRAMS if gluon else TARGET_PROGRAMS)
    n_hist_splits, per_split = _splits(hist.length, batch * hkv * (1 if gluon else m_blocks), target)
    full_splits = math.ceil(n_full / per_split)
    n_splits = full_splits + n_hist_splits
    out_m = torch.empty(batch * hkv * n_splits * rows, device=query.device, dtype=torch.float32)
    out_l = torch.empty_like(out_m)
    out_acc = torch.empty(batch * hkv * n_splits * rows, dim, device=query.device, dtype=torch.float32)
    # Half-precision products gather their key/value operands from tables in that dtype: the same values as
    # gathering fp32 and converting (round to nearest, both), at half the registers and gathered bytes a tile.
    table = query.dtype if dot and TABLES_IN_PRODUCT_DTYPE else torch.float32
    k_cent, v_cent = ctx.k_codec.centroids(query.device, table), ctx.v_codec.centroids(query.device, table)
    k_byte, v_byte = (_byte_table(c, query.device, table) for c in (ctx.k_codec, ctx.v_codec))
    q_rot = rotated(query, ctx.k_codec.rotation)
    rot_v = ctx.v_codec.rotation.matrix(query.device, torch.float32)
    keep8 = None if mask is None else _keep_view(mask, batch, q_len, kv_len)
    kc, vc, kn, vn = hist.k.codes, hist.v.codes, hist.k.norms, hist.v.norms
    # Per-(sequence, head) vectors: contiguous [B*Hkv, D] / [B*Hkv] (a few KiB; any stand-in when absent).
    k_mean = hist.k_mean.float().reshape(-1, dim).contiguous() if hist.k_mean is not None else rot_v
    v_mean = rotated(hist.v_mean.reshape(-1, dim), ctx.v_codec.rotation) if hist.v_mean is not None else rot_v
    k_ref = hist.k_ref.float().reshape(-1).contiguous() if hist.k_ref is not None else rot_v
    v_ref = hist.v_ref.float().reshape(-1).contiguous() if hist.v_ref is not None else rot_v
    keep_arg = keep8 if keep8 is not None else out_m
    s_e = [0, 0, 0, 0] if keep8 is None else [keep8.stride(i) if keep8.shape[i] > 1 else 0 for i in range(4)]
    # The autotuner's choice per key is kept here: its own lookup builds a dict of the 60-odd arguments and the
    # dtype names of every tensor at each launch, host time a decode step pays once per layer.
    lengths = paged.lengths if paged is not None else None
    # the fields in _KEY_FIELDS' order
    chosen = (dim, ctx.k_codec.bits, ctx.v_codec.bits, dot, block_m, keep8 is not None, paged is not None,
              lengths is not None,
              hist.k_ref is not None, hist.v_ref is not None, hist.k_mean is not None, hist.v_mean is not None,
              query.dtype, keys.dtype, values.dtype, kn.dtype, vn.dtype, query.device)
    if gluon:
        split, tiles = _split_kernel, WINDOW_TILES
    elif block_n is not None:
        split, tiles = _split_kernel, {"BLOCK_N": block_n, "num_warps": num_warps, "num_stages": num_stages,
                                       "COLS": variant[0], "BYTES": variant[1]}
        if maxnreg is not None:
            tiles["maxnreg"] = maxnreg
    elif chosen in _CHOSEN:
        split, tiles = _split_kernel, _CHOSEN[chosen]
    else:
        split, tiles = _split_tuned, {}
    grid = (batch * hkv, full_splits if gluon else n_splits, m_blocks)
    if grid[1]:  # none where a Gluon history has no window beside it
        split[grid](
            query, q_rot, keys, values, kc, kn, k_ref, vc, vn, v_ref, k_cent, v_cent, k_byte, v_byte, k_mean, v_mean,
            keep_arg, out_m, out_l, out_acc,
            paged.slots if paged else out_m, paged.table if paged else out_m, paged.table.stride(0) if paged else 0,
            lengths if lengths is not None else out_m,
            query.stride(0), query.stride(1), query.stride(2), q_rot.stride(0), q_rot.stride(1), q_rot.stride(2),
            keys.stride(0), keys.stride(1), keys.stride(2), values.stride(0), values.stride(1), values.stride(2),
            kc.stride(0), kc.stride(1), kc.stride(2), kn.stride(0), kn.stride(1),
            vc.stride(0), vc.stride(1), vc.stride(2), vn.stride(0), vn.stride(1), *s_e,
            hkv, groups, q_len, kv_len, n_full, ctx.sink, hist.length, full_splits, n_splits, per_split, scale,
            D=dim, BITS_K=ctx.k_codec.bits, BITS_V=ctx.v_codec.bits, DOT=dot,
            BLOCK_M=block_m, NORM8_K=hist.k_ref is not None, NORM8_V=hist.v_ref is not None,
            HAS_KMEAN=hist.k_mean is not None, HAS_VMEAN=hist.v_mean is not None, HAS_KEEP=keep8 is not None,
            PAGED=paged is not None, PAGE=paged.page if paged else SPLIT_QUANTUM, ROW_HIST=lengths is not None,
            **tiles,
        )  # fmt: skip
        if split is _split_tuned:
            _CHOSEN[chosen] = _split_tuned.best_config.all_kwargs()  # leaves out what the config does not set
    if gluon:
        from airquant.kv import gluon_kernel

        gluon_kernel.launch(query, q_rot, ctx, paged, keep8, s_e, k_mean, v_mean, k_ref, v_ref, out_m, out_l, out_acc,
                            (hkv, groups, q_len, kv_len, full_splits, n_splits, n_hist_splits, per_split), scale,
                            block_n or GLUON_BLOCK_N, maxnreg)
    out = torch.empty(batch, q_len, hq, dim, device=query.device, dtype=query.dtype)
    _merge_kernel[(batch * hkv, m_blocks)](
        out_m, out_l, out_acc, out, rot_v, out.stride(0), out.stride(1), out.stride(2), hkv, groups, q_len, n_splits,
        full_splits, D=dim, BLOCK_M=block_m,
    )
    return out
