"""The packed history of a decode call on tensor cores with explicit layouts (Gluon; CUDA, sm_80+).

The Triton split kernel (:mod:`airquant.kv.triton_kernel`) spends most of a history tile moving data between
layouts: the gathered key and value tiles into the MMA's operand layouts, the scores into the softmax's and back,
each through shared memory (27 barriers a 32-token tile compiled for sm_90; 671 instructions a warp a tile, four
warps a tile). Here each operand is gathered straight into the register layout ``mma.m16n8k16`` reads, so a tile
needs no shared memory and no barrier:

* a program is one warp over one split of one (sequence, kv-head): its query rows (``G * QLEN <= 16``) are the
  MMA's 16 rows, its history tokens the columns of the scores, ``BLOCK_N`` a tile;
* keys: ``K^T [D, BLOCK_N]`` is operand B. Lane ``c = lane % 4`` holds the dimension pairs ``P = c + 4 j``; the
  dimensions are renumbered (``_key_dims``) so that its pairs are the packed bytes ``c * W / 4 + j``, which it
  reads from the codes of its tokens (contiguous bytes) and gathers each dimension's centroid from the byte table
  (``Codec.byte_table``: byte ``b``'s centroids at ``b * PER``). The rotated queries (operand A) are read in the
  same renumbering; a score is a sum over dimensions, so it is unchanged;
* values: ``V [BLOCK_N, D]`` is operand B of ``P @ V``. Lane ``r = lane // 4`` holds the columns ``r + 8 j``,
  renumbered (``_value_dims``) so that they are ``D / 8`` consecutive dimensions (whole packed bytes); the
  accumulator's columns follow, and the store puts each where it belongs;
* the scores stay in the accumulator's layout through the online softmax; the probabilities (scaled by the value
  norms) become operand A in registers (``mma`` to ``dot_op`` of the same parent needs no shared memory).

Each program writes the softmax state ``(m, l, acc)`` of its split where the Triton kernel's history splits write
theirs; the Triton kernel runs the window's splits and the merge (:func:`airquant.kv.triton_kernel.attention`).
Gluon has no interpreter: the kernel is checked against the Triton kernel on a GPU (tests/kv/test_gluon_gpu.py) and
compiled offline for sm_90 by benchmarks/kernel_sass.py (no shared memory, no barrier, 1 291 instructions a
32-token tile for the whole program, 255 registers). Measured on an H100 (batch 32, 8K a slot, CUDA graphs): 205 us
a call against the Triton kernel's 537 at its best; the call with window and merge 0.278 ms against sdpa's 0.342
over the bf16 cache. The default history kernel since stop 68 (``triton_kernel.HISTORY_KERNEL``: its tests and the
decode step on an H200).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import mma_v2

from airquant.kv.codec import LOG_NORM_LEVELS, LOG_NORM_SPAN
from airquant.kv.paging import SPLIT_QUANTUM

_HALF_SPAN = tl.constexpr(LOG_NORM_SPAN / 2)
_NORM_STEP = tl.constexpr(LOG_NORM_SPAN / LOG_NORM_LEVELS)
_MMA_LAYOUT = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[1, 1], instr_shape=[16, 8])
_MMA = gl.constexpr(_MMA_LAYOUT)
_A = gl.constexpr(gl.DotOperandLayout(operand_index=0, parent=_MMA_LAYOUT, k_width=2))
_B = gl.constexpr(gl.DotOperandLayout(operand_index=1, parent=_MMA_LAYOUT, k_width=2))
_ROW = gl.constexpr(gl.SliceLayout(1, _MMA_LAYOUT))  # [16] per query row, as the scores' rows
_COL = gl.constexpr(gl.SliceLayout(0, _MMA_LAYOUT))  # [BLOCK_N] or [D] per column of the scores or accumulator


@triton.constexpr_function
def _key_words_layout(BLOCK_N):
    """A key chunk's words ``[4 (c), BLOCK_N]``: word ``4 c + w`` of chunk ``w`` of each token in lane ``c`` of
    a quad, for the tokens ``lane // 4 + 8 t``; after the table gathers, splits and reshape (``_key_operand``) this
    is operand B's own layout."""
    return gl.DistributedLinearLayout(
        reg_bases=[[0, 8 << k] for k in range((BLOCK_N // 8).bit_length() - 1)],
        lane_bases=[[1, 0], [2, 0], [0, 1], [0, 2], [0, 4]],
        warp_bases=[], block_bases=[], shape=[4, BLOCK_N])


@triton.constexpr_function
def _value_words_layout(BLOCK_N):
    """The values' words ``[BLOCK_N, 8 (r)]`` (2-bit codes, head size 128: a token's 32 bytes): word ``r`` of each
    token (dimensions ``16 r ...``) in lane ``r = lane // 4``, for the tokens operand B gives lane ``lane % 4``."""
    return gl.DistributedLinearLayout(
        reg_bases=[[1, 0]] + [[8 << k, 0] for k in range((BLOCK_N // 8).bit_length() - 1)],
        lane_bases=[[2, 0], [4, 0], [0, 1], [0, 2], [0, 4]],
        warp_bases=[], block_bases=[], shape=[BLOCK_N, 8])


@triton.constexpr_function
def _product_dtype(DT):
    """The operands' dtype: 1 bf16, 2 fp16 (the Triton kernel's ``DOT`` codes)."""
    return gl.bfloat16 if DT == 1 else gl.float16


@triton.constexpr_function
def _repeated(dt, n):
    """``n`` times ``dt`` (an inline assembly's output dtypes)."""
    return (dt,) * n


@gluon.jit
def _key_dims(kappa):
    """The dimension operand index ``kappa`` of the keys stands for (head size 128): index
    ``32 w + 8 q + 2 c + h`` is centroid ``h`` of byte ``q`` of word ``4 c + w`` of the token's 64 bytes, so the
    lane ``c`` of a quad reads one word a chunk ``w``."""
    w, q, c, h = kappa // 32, (kappa // 8) % 4, (kappa // 2) % 4, kappa % 2
    return 2 * (4 * (4 * c + w) + q) + h


@gluon.jit
def _value_dims(n):
    """The dimension column ``n`` of the values and of the accumulator stands for (head size 128): lane ``r`` of
    the MMA holds columns ``r + 8 j``, renumbered to its word's 16 dimensions ``16 r + j``."""
    return (n % 8) * 16 + n // 8


@gluon.jit
def _norms(stored, ref_ptr, NORM8: gl.constexpr):
    """A tile's norms from their stored values (fp16, or with ``NORM8`` a log2 code against the per-head
    reference: Codec.load_norms)."""
    if NORM8:
        return gl.exp2(gl.load(ref_ptr) - _HALF_SPAN + stored.to(gl.float32) * _NORM_STEP)
    return stored.to(gl.float32)


@gluon.jit
def _tile(KC, KN, VC, VN, Table, slot, b, h, n0, s_tb, s_kcb, s_kch, s_kcn, s_knb, s_knh, s_vcb, s_vch, s_vcn,
          s_vnb, s_vnh, ok, PAGED: gl.constexpr, PAGE: gl.constexpr):
    """Where kv-head ``h``'s history token ``n0`` (a tile's first) sits: its key codes, key norms, value codes and
    value norms. Paged: page ``Table[slot, n0 // PAGE]`` (read where ``ok``; a tile never crosses a page)."""
    if PAGED:
        page = gl.load(Table + slot * s_tb + n0 // PAGE, mask=ok, other=0)
        t0 = n0 % PAGE
        return (KC + page * s_kcb + h * s_kch + t0 * s_kcn, KN + page * s_knb + h * s_knh + t0,
                VC + page * s_vcb + h * s_vch + t0 * s_vcn, VN + page * s_vnb + h * s_vnh + t0)
    return (KC + b * s_kcb + h * s_kch + n0 * s_kcn, KN + b * s_knb + h * s_knh + n0,
            VC + b * s_vcb + h * s_vch + n0 * s_vcn, VN + b * s_vnb + h * s_vnh + n0)


@gluon.jit
def _key_words(codes, left, s_n, w: gl.constexpr, BLOCK_N: gl.constexpr):
    """Chunk ``w``'s key words of a tile (``_key_words_layout``; 0 past ``left`` tokens), token ``t`` at
    ``codes + t * s_n`` (words)."""
    L: gl.constexpr = _key_words_layout(BLOCK_N)
    c = gl.expand_dims(gl.arange(0, 4, layout=gl.SliceLayout(1, L)), 1)
    t = gl.expand_dims(gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, L)), 0)
    return gl.load(codes + t * s_n + 4 * c + w, mask=t < left, other=0)


@gluon.jit
def _pairs(word, Byte, q: gl.constexpr, dt: gl.constexpr):
    """Byte ``q`` of each key word's two centroids (one 32-bit word of the byte table), ``[..., 2]``."""
    lo, hi = gl.inline_asm_elementwise("mov.b32 {$0, $1}, $2;", "=h,=h,r", [gl.load(Byte + ((word >> 8 * q) & 255))],
                                       dtype=_repeated(dt, 2), is_pure=True, pack=1)
    return gl.join(lo, hi)


@gluon.jit
def _key_operand(words, Byte, dt: gl.constexpr, BLOCK_N: gl.constexpr):
    """Operand B ``K^T [32, BLOCK_N]`` of a chunk's key words: operand index ``8 q + 2 c + h`` (``_key_dims``)."""
    quad = gl.join(gl.join(_pairs(words, Byte, 0, dt), _pairs(words, Byte, 1, dt)),
                   gl.join(_pairs(words, Byte, 2, dt), _pairs(words, Byte, 3, dt)))
    # [4 (c), BLOCK_N, 2 (h), 2 (q bit 0), 2 (q bit 1)] -> [q bit 1, q bit 0, c, h, BLOCK_N]
    return gl.convert_layout(gl.reshape(gl.permute(quad, [4, 3, 0, 2, 1]), [32, BLOCK_N]), _B)


@gluon.jit
def _value_words(codes, left, s_n, BLOCK_N: gl.constexpr):
    """A tile's value words (``_value_words_layout``; 0 past ``left`` tokens)."""
    L: gl.constexpr = _value_words_layout(BLOCK_N)
    t = gl.expand_dims(gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, L)), 1)
    r = gl.expand_dims(gl.arange(0, 8, layout=gl.SliceLayout(0, L)), 0)
    return gl.load(codes + t * s_n + r, mask=t < left, other=0)


@gluon.jit
def _value_operand(words, Byte, q: gl.constexpr, dt: gl.constexpr, BLOCK_N: gl.constexpr):
    """Operand B ``V [BLOCK_N, 32]`` of byte ``q`` of the value words (columns ``32 q ...`` of the accumulator):
    each byte's four centroids gathered as one 64-bit word of the byte table and split; column
    ``8 (2 b + a) + r`` is centroid ``2 b + a`` of lane ``r``'s byte."""
    c0, c1, c2, c3 = gl.inline_asm_elementwise("mov.b64 {$0, $1, $2, $3}, $4;", "=h,=h,=h,=h,l",
                                               [gl.load(Byte + ((words >> 8 * q) & 255))], dtype=_repeated(dt, 4),
                                               is_pure=True, pack=1)
    v = gl.join(gl.join(c0, c1), gl.join(c2, c3))  # [BLOCK_N, 8 (r), 2 (a), 2 (b)]
    return gl.convert_layout(gl.reshape(gl.permute(v, [0, 3, 2, 1]), [BLOCK_N, 32]), _B)


@gluon.jit
def _query_chunk(QR, base, ok_a, w: gl.constexpr, dt: gl.constexpr):
    """Operand A ``[16, 32]``: the rotated queries' dimensions of key chunk ``w`` (``_key_dims``)."""
    k_a = gl.arange(0, 32, layout=gl.SliceLayout(0, _A)) + 32 * w
    return gl.load(QR + base + gl.expand_dims(_key_dims(k_a), 0), mask=ok_a, other=0.0).to(dt)


@gluon.jit
def _store_chunk(OutAcc, VMeanRot, acc, out, row_ok, l_i, sh, q: gl.constexpr, HAS_VMEAN: gl.constexpr):
    """Columns ``32 q ...`` of a split's accumulator (+ ``l * v_mean``'s rotated image), each where it belongs."""
    cols = _value_dims(gl.arange(0, 32, layout=_COL) + 32 * q)
    if HAS_VMEAN:  # every history value is v_mean + its quantized residual
        acc += gl.expand_dims(gl.load(VMeanRot + sh * 128 + cols), 0) * gl.expand_dims(l_i, 1)
    gl.store(OutAcc + gl.expand_dims(out, 1) * 128 + gl.expand_dims(cols, 0), acc, mask=gl.expand_dims(row_ok, 1))


@gluon.jit(do_not_specialize=("s_eb", "s_eh", "s_el", "KV_LEN", "N_HIST", "full_splits", "n_splits"))
def _history_kernel(
    Q, QR, KC, KN, KR, VC, VN, VR, KByte, VByte, KMean, VMeanRot, Keep, OutM, OutL, OutAcc,
    Slots, Table, s_tb, HistLen,
    s_qb, s_qh, s_ql, s_rb, s_rh, s_rl,
    s_kcb, s_kch, s_kcn, s_knb, s_knh, s_vcb, s_vch, s_vcn, s_vnb, s_vnh,
    s_eb, s_eh, s_el, s_ec,
    HKV, G, QLEN, KV_LEN, SINK, N_HIST, full_splits, n_splits, per_split, scale,
    DT: gl.constexpr, BLOCK_N: gl.constexpr,
    NORM8_K: gl.constexpr, NORM8_V: gl.constexpr, HAS_KMEAN: gl.constexpr, HAS_VMEAN: gl.constexpr,
    HAS_KEEP: gl.constexpr, PAGED: gl.constexpr, PAGE: gl.constexpr, ROW_HIST: gl.constexpr,
):  # fmt: skip
    """grid (B * Hkv, history splits), one warp each: history split ``pid_s`` of (row b, kv-head h) into split
    ``full_splits + pid_s`` of the state arrays (layout as the Triton split kernel's). Head size 128: the keys'
    products in four chunks of 32 dimensions, the accumulator in four of 32 columns (registers: one chunk's
    operand live at a time)."""
    pid_bh, pid_s = gl.program_id(0), gl.program_id(1)
    b, h = pid_bh // HKV, pid_bh % HKV
    if PAGED:
        slot = gl.load(Slots + b)
    else:
        slot = b
    sh = slot * HKV + h
    rows = G * QLEN
    dt: gl.constexpr = _product_dtype(DT)

    # Rotated queries as operand A, four chunks [16, 32] in the keys' dimension order.
    m_a = gl.arange(0, 16, layout=gl.SliceLayout(1, _A))
    ok_a = gl.expand_dims(m_a < rows, 1)
    q_base = b * s_rb + gl.expand_dims((h * G + m_a // QLEN) * s_rh + (m_a % QLEN) * s_rl, 1)
    q0 = _query_chunk(QR, q_base, ok_a, 0, dt)
    q1 = _query_chunk(QR, q_base, ok_a, 1, dt)
    q2 = _query_chunk(QR, q_base, ok_a, 2, dt)
    q3 = _query_chunk(QR, q_base, ok_a, 3, dt)

    offs_m = gl.arange(0, 16, layout=_ROW)
    row_ok = offs_m < rows
    g, i = offs_m // QLEN, offs_m % QLEN
    pos = KV_LEN - QLEN + i  # absolute column of each query row
    keep_row = Keep + b * s_eb + (h * G + g) * s_eh + i * s_el
    if HAS_KMEAN:  # <q, k_mean> (the keys' mean left out of their codes), fp32 from the unrotated query
        LQ: gl.constexpr = gl.BlockedLayout([1, 4], [4, 8], [1, 1], [1, 0])
        m_q = gl.arange(0, 16, layout=gl.SliceLayout(1, LQ))
        d_q = gl.arange(0, 128, layout=gl.SliceLayout(0, LQ))
        q = gl.load(Q + b * s_qb + gl.expand_dims((h * G + m_q // QLEN) * s_qh + (m_q % QLEN) * s_ql, 1)
                    + gl.expand_dims(d_q, 0), mask=gl.expand_dims(m_q < rows, 1), other=0.0).to(gl.float32)
        km = gl.load(KMean + sh * 128 + d_q)
        bias = gl.convert_layout(gl.sum(q * gl.expand_dims(km, 0), axis=1), _ROW) * scale

    offs_c = gl.arange(0, BLOCK_N, layout=_COL)
    m_i = gl.full([16], float("-inf"), gl.float32, layout=_ROW)
    l_i = gl.zeros([16], gl.float32, layout=_ROW)
    acc0 = gl.zeros([16, 32], gl.float32, layout=_MMA)
    acc1 = gl.zeros([16, 32], gl.float32, layout=_MMA)
    acc2 = gl.zeros([16, 32], gl.float32, layout=_MMA)
    acc3 = gl.zeros([16, 32], gl.float32, layout=_MMA)
    n_start = pid_s * per_split
    n_end = gl.minimum(n_start + per_split, N_HIST)
    if ROW_HIST:
        n_end = gl.minimum(n_end, gl.load(HistLen + b).to(gl.int32))
    # The next tile's words and norms are read while this one is computed (one warp a program: nothing else
    # hides a tile's reads).
    kc, kn_at, vc, vn_at = _tile(KC, KN, VC, VN, Table, slot, b, h, n_start, s_tb, s_kcb, s_kch, s_kcn, s_knb,
                                 s_knh, s_vcb, s_vch, s_vcn, s_vnb, s_vnh, n_start < n_end, PAGED, PAGE)
    left = n_end - n_start
    k0 = _key_words(kc, left, s_kcn, 0, BLOCK_N)
    k1 = _key_words(kc, left, s_kcn, 1, BLOCK_N)
    k2 = _key_words(kc, left, s_kcn, 2, BLOCK_N)
    k3 = _key_words(kc, left, s_kcn, 3, BLOCK_N)
    vw = _value_words(vc, left, s_vcn, BLOCK_N)
    kn_raw = gl.load(kn_at + offs_c, mask=offs_c < left, other=0)
    vn_raw = gl.load(vn_at + offs_c, mask=offs_c < left, other=0)
    for n0 in range(n_start, n_end, BLOCK_N):
        left = n_end - n0  # tokens of this tile inside the split
        nx = n0 + BLOCK_N
        kc, kn_at, vc, vn_at = _tile(KC, KN, VC, VN, Table, slot, b, h, nx, s_tb, s_kcb, s_kch, s_kcn, s_knb, s_knh,
                                     s_vcb, s_vch, s_vcn, s_vnb, s_vnh, nx < n_end, PAGED, PAGE)
        k0_next = _key_words(kc, n_end - nx, s_kcn, 0, BLOCK_N)
        k1_next = _key_words(kc, n_end - nx, s_kcn, 1, BLOCK_N)
        k2_next = _key_words(kc, n_end - nx, s_kcn, 2, BLOCK_N)
        k3_next = _key_words(kc, n_end - nx, s_kcn, 3, BLOCK_N)
        vw_next = _value_words(vc, n_end - nx, s_vcn, BLOCK_N)
        kn_next = gl.load(kn_at + offs_c, mask=offs_c < n_end - nx, other=0)
        vn_next = gl.load(vn_at + offs_c, mask=offs_c < n_end - nx, other=0)

        # scores [16, BLOCK_N] = q_rot @ K^T, a chunk of 32 dimensions at a time
        s = mma_v2(q0, _key_operand(k0, KByte, dt, BLOCK_N), gl.zeros([16, BLOCK_N], gl.float32, layout=_MMA))
        s = mma_v2(q1, _key_operand(k1, KByte, dt, BLOCK_N), s)
        s = mma_v2(q2, _key_operand(k2, KByte, dt, BLOCK_N), s)
        s = mma_v2(q3, _key_operand(k3, KByte, dt, BLOCK_N), s)
        n_ok = offs_c < left
        s = s * gl.expand_dims(_norms(kn_raw, KR + sh, NORM8_K) * scale, 0)
        if HAS_KMEAN:
            s += gl.expand_dims(bias, 1)
        col = SINK + n0 + offs_c
        ok = gl.expand_dims(row_ok, 1) & gl.expand_dims(n_ok, 0)
        if HAS_KEEP:
            ok = ok & (gl.load(gl.expand_dims(keep_row, 1) + gl.expand_dims(col, 0) * s_ec, mask=ok, other=0) != 0)
        else:
            ok = ok & (gl.expand_dims(col, 0) <= gl.expand_dims(pos, 1))
        s = gl.where(ok, s, float("-inf"))

        # online softmax in the accumulator's layout
        m_new = gl.maximum(m_i, gl.max(s, axis=1))
        m_safe = gl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = gl.exp(m_i - m_safe)
        p = gl.exp(s - gl.expand_dims(m_safe, 1))
        l_i = l_i * alpha + gl.sum(p, axis=1)
        alpha = gl.expand_dims(alpha, 1)
        m_i = m_new
        p_op = gl.convert_layout((p * gl.expand_dims(_norms(vn_raw, VR + sh, NORM8_V), 0)).to(dt), _A)

        # acc [16, 128] += (p * norm_v) @ V, a chunk of 32 columns at a time
        acc0 = mma_v2(p_op, _value_operand(vw, VByte, 0, dt, BLOCK_N), acc0 * alpha)
        acc1 = mma_v2(p_op, _value_operand(vw, VByte, 1, dt, BLOCK_N), acc1 * alpha)
        acc2 = mma_v2(p_op, _value_operand(vw, VByte, 2, dt, BLOCK_N), acc2 * alpha)
        acc3 = mma_v2(p_op, _value_operand(vw, VByte, 3, dt, BLOCK_N), acc3 * alpha)
        k0, k1, k2, k3, vw, kn_raw, vn_raw = k0_next, k1_next, k2_next, k3_next, vw_next, kn_next, vn_next

    out = (pid_bh * n_splits + full_splits + pid_s) * rows + offs_m
    gl.store(OutM + out, m_i, mask=row_ok)
    gl.store(OutL + out, l_i, mask=row_ok)
    _store_chunk(OutAcc, VMeanRot, acc0, out, row_ok, l_i, sh, 0, HAS_VMEAN)
    _store_chunk(OutAcc, VMeanRot, acc1, out, row_ok, l_i, sh, 1, HAS_VMEAN)
    _store_chunk(OutAcc, VMeanRot, acc2, out, row_ok, l_i, sh, 2, HAS_VMEAN)
    _store_chunk(OutAcc, VMeanRot, acc3, out, row_ok, l_i, sh, 3, HAS_VMEAN)


def launch(query, q_rot, ctx, paged, keep8, s_e, k_mean, v_mean, k_ref, v_ref, out_m, out_l, out_acc, shape, scale,
           block_n, maxnreg=None):
    """The history splits of :func:`airquant.kv.triton_kernel.attention`'s call into its state arrays. ``shape``:
    (kv-heads, query heads a kv-head, query length, attended length, window splits, all splits, history splits,
    tokens a split); ``k_mean``/``v_mean``/``k_ref``/``v_ref`` as the Triton kernel takes them (stand-ins where
    absent), ``keep8``/``s_e`` its mask view and strides; ``maxnreg``: a cap on registers a thread (None: none)."""
    hkv, groups, q_len, kv_len, full_splits, n_splits, hist_splits, per_split = shape
    hist = ctx.history
    kn, vn = hist.k.norms, hist.v.norms
    if hist.k.codes.stride(-1) != 1 or hist.v.codes.stride(-1) != 1 or kn.stride(-1) != 1 or vn.stride(-1) != 1:
        raise ValueError("the Gluon history kernel reads codes and norms with unit stride along the tokens' bytes")
    kc, vc = hist.k.codes.view(torch.int32), hist.v.codes.view(torch.int32)  # read a word at a time
    k_byte = ctx.k_codec.byte_table(query.device, query.dtype).view(torch.int32)  # two centroids a word
    v_byte = ctx.v_codec.byte_table(query.device, query.dtype).view(torch.int64)  # four
    lengths = paged.lengths if paged is not None else None
    _history_kernel[(query.shape[0] * hkv, hist_splits)](
        query, q_rot, kc, kn, k_ref, vc, vn, v_ref, k_byte, v_byte, k_mean, v_mean,
        keep8 if keep8 is not None else out_m, out_m, out_l, out_acc,
        paged.slots if paged else out_m, paged.table if paged else out_m, paged.table.stride(0) if paged else 0,
        lengths if lengths is not None else out_m,
        query.stride(0), query.stride(1), query.stride(2), q_rot.stride(0), q_rot.stride(1), q_rot.stride(2),
        kc.stride(0), kc.stride(1), kc.stride(2), kn.stride(0), kn.stride(1),
        vc.stride(0), vc.stride(1), vc.stride(2), vn.stride(0), vn.stride(1), *s_e,
        hkv, groups, q_len, kv_len, ctx.sink, hist.length, full_splits, n_splits, per_split, scale,
        DT=1 if query.dtype == torch.bfloat16 else 2, BLOCK_N=block_n,
        NORM8_K=hist.k_ref is not None, NORM8_V=hist.v_ref is not None,
        HAS_KMEAN=hist.k_mean is not None, HAS_VMEAN=hist.v_mean is not None, HAS_KEEP=keep8 is not None,
        PAGED=paged is not None, PAGE=paged.page if paged else SPLIT_QUANTUM, ROW_HIST=lengths is not None,
        num_warps=1, **({"maxnreg": maxnreg} if maxnreg else {}),
    )  # fmt: skip
