"""Triton kernel: attention of rotated queries over the packed, quantized history (CUDA only).

One program per (batch x kv-head, split of the history, block of query rows). It unpacks codes in
registers (the layouts of :mod:`airquant.kv.pack`), gathers centroids from a 2**bits-entry table,
scores ``<Pi q, c> * norm``, runs an online softmax and accumulates ``p * norm_v * c_v`` in the
value rotation's space. Splits are merged afterwards (flash-decoding), so a single decode query
still spreads over all SMs. Importing this module never requires triton or CUDA: ``applicable``
says whether the kernel can run, and ``attention.history_state`` falls back to torch otherwise.
"""

from __future__ import annotations

import math

import torch

from airquant.kv.cache import CompressedContext

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU installs: the torch path is used
    triton = None

BLOCK_N = 64
NUM_WARPS = 4
# Enough programs to fill ~2 waves of a 132-SM H100/H200 even for one decode query.
TARGET_PROGRAMS = 264


def applicable(q: torch.Tensor, ctx: CompressedContext) -> bool:
    dim = q.shape[-1]
    return (
        triton is not None
        and q.is_cuda
        and 16 <= dim <= 256
        and dim & (dim - 1) == 0
        and ctx.history.length > 0
    )


if triton is not None:

    @triton.jit
    def _unpack(row_ptr, d, BITS: tl.constexpr, row_mask):
        """Codes of dims ``d`` [1, D] for rows at ``row_ptr`` [BN, 1] (uint8 pointers)."""
        if BITS == 3:
            bit = (d // 8) * 24 + (d % 8) * 3
            byte = bit // 8
            shift = bit % 8
            lo = tl.load(row_ptr + byte, mask=row_mask, other=0).to(tl.int32)
            # Codes 2 and 5 of each 8-code group straddle a byte boundary (shift 6 or 7).
            hi = tl.load(row_ptr + byte + 1, mask=row_mask & (shift > 5), other=0).to(tl.int32)
            code = ((lo | (hi << 8)) >> shift) & 7
        else:
            byte = d // (8 // BITS)
            shift = (d % (8 // BITS)) * BITS
            raw = tl.load(row_ptr + byte, mask=row_mask, other=0).to(tl.int32)
            code = (raw >> shift) & ((1 << BITS) - 1)
        return code

    @triton.jit
    def _history_kernel(
        Q, Bias, KC, KN, VC, VN, KCent, VCent, Keep, OutM, OutL, OutAcc,
        s_qb, s_qh, s_qm, s_kcb, s_kch, s_kcn, s_knb, s_knh, s_vcb, s_vch, s_vcn, s_vnb, s_vnh,
        s_eb, s_eh, s_em, H, M, N, per_split, scale,
        D: tl.constexpr, BITS_K: tl.constexpr, BITS_V: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HAS_BIAS: tl.constexpr, IEEE: tl.constexpr,
    ):  # fmt: skip
        pid_bh, pid_s, pid_m = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        b, h = pid_bh // H, pid_bh % H
        n_splits = tl.num_programs(1)
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_d = tl.arange(0, D)
        row_ok = offs_m < M
        q = tl.load(Q + b * s_qb + h * s_qh + offs_m[:, None] * s_qm + offs_d[None, :], mask=row_ok[:, None], other=0.0)
        if HAS_BIAS:
            bias = tl.load(Bias + (b * H + h) * M + offs_m, mask=row_ok, other=0.0)
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, D], tl.float32)
        n_start = pid_s * per_split
        n_end = tl.minimum(n_start + per_split, N)
        for n0 in range(n_start, n_end, BLOCK_N):
            offs_n = n0 + tl.arange(0, BLOCK_N)
            n_ok = offs_n < n_end
            kc = _unpack(KC + b * s_kcb + h * s_kch + offs_n[:, None] * s_kcn, offs_d[None, :], BITS_K, n_ok[:, None])
            k = tl.load(KCent + kc)  # [BN, D] rotated unit keys
            kn = tl.load(KN + b * s_knb + h * s_knh + offs_n, mask=n_ok, other=0.0).to(tl.float32)
            if IEEE:
                s = tl.dot(q, tl.trans(k), input_precision="ieee")
            else:
                s = tl.dot(q, tl.trans(k), input_precision="tf32")
            s = s * (kn[None, :] * scale)
            if HAS_BIAS:
                s += bias[:, None]
            keep_ptr = Keep + b * s_eb + h * s_eh + offs_m[:, None] * s_em + offs_n[None, :]
            keep = tl.load(keep_ptr, mask=row_ok[:, None] & n_ok[None, :], other=0)
            s = tl.where(keep != 0, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            # Rows with nothing visible yet keep m = -inf; shift by 0 so exp() gives 0, not NaN.
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.exp(m_i - m_safe)
            p = tl.exp(s - m_safe[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            vc = _unpack(VC + b * s_vcb + h * s_vch + offs_n[:, None] * s_vcn, offs_d[None, :], BITS_V, n_ok[:, None])
            v = tl.load(VCent + vc)
            vn = tl.load(VN + b * s_vnb + h * s_vnh + offs_n, mask=n_ok, other=0.0).to(tl.float32)
            if IEEE:
                pv = tl.dot(p * vn[None, :], v, input_precision="ieee")
            else:
                pv = tl.dot(p * vn[None, :], v, input_precision="tf32")
            acc = acc * alpha[:, None] + pv
            m_i = m_new
        out = ((b * H + h) * n_splits + pid_s) * M + offs_m
        tl.store(OutM + out, m_i, mask=row_ok)
        tl.store(OutL + out, l_i, mask=row_ok)
        tl.store(OutAcc + out[:, None] * D + offs_d[None, :], acc, mask=row_ok[:, None])


    # Tile shapes are tuned once per (head_dim, bits, row block); splits are multiples of 64 tokens,
    # so every BLOCK_N here divides them.
    _history_tuned = triton.autotune(
        configs=[triton.Config({"BLOCK_N": bn}, num_warps=w, num_stages=st)
                 for bn in (32, 64) for w in (4, 8) for st in (1, 2)],
        key=["D", "BITS_K", "BITS_V", "BLOCK_M", "HAS_BIAS", "IEEE"],
    )(_history_kernel)


def _splits(batch_heads: int, m_blocks: int, n: int, block_n: int) -> tuple[int, int]:
    """(number of splits, tokens per split, a multiple of block_n)."""
    max_splits = max(1, math.ceil(n / block_n))
    splits = min(max_splits, max(1, math.ceil(TARGET_PROGRAMS / (batch_heads * m_blocks))))
    per_split = math.ceil(n / splits / block_n) * block_n
    return math.ceil(n / per_split), per_split


def history_state(
    q: torch.Tensor,
    ctx: CompressedContext,
    keep: torch.Tensor,
    scale: float,
    block_n: int | None = None,
    num_warps: int = NUM_WARPS,
    exact: bool = True,
):
    """Same contract as ``attention.history_state_torch``: ``(m, l, acc)`` over the history.

    ``block_n`` None: tile shape autotuned; else that tile and ``num_warps``. ``exact`` False lets
    the two products use TF32 tensor cores (10-bit mantissa: below the bf16/fp16 rounding the
    model's own activations carry); True keeps IEEE fp32 products (float32 models, tests)."""
    hist = ctx.history
    batch, heads, rows, dim = q.shape
    q_rot = ctx.k_codec.rotation.forward(q).contiguous()
    bias = None
    if hist.k_mean is not None:
        bias = ((q @ hist.k_mean.transpose(-1, -2)) * scale).squeeze(-1).contiguous()  # [B, Hkv, M]
    # int8, dense, last dim contiguous: the kernel indexes keys with unit stride.
    keep8 = keep.expand(batch, keep.shape[1], rows, hist.length).to(torch.int8).contiguous()
    block_m = 16 if rows <= 16 else (32 if rows <= 32 else 64)
    m_blocks = math.ceil(rows / block_m)
    n_splits, per_split = _splits(batch * heads, m_blocks, hist.length, block_n or BLOCK_N)
    out_m = torch.empty(batch, heads, n_splits, rows, device=q.device, dtype=torch.float32)
    out_l = torch.empty_like(out_m)
    out_acc = torch.empty(batch, heads, n_splits, rows, dim, device=q.device, dtype=torch.float32)
    k_cent, _ = ctx.k_codec.tables(q.device)
    v_cent, _ = ctx.v_codec.tables(q.device)
    kc, vc = hist.k.codes, hist.v.codes
    # 8-bit log-coded norms are expanded to a small fp32 [B, H, N] here (4 bytes/token/head), so the
    # kernel only ever reads float norms; fp16 norms go in as stored.
    kn = hist.k.norms if hist.k_ref is None else ctx.k_codec.load_norms(hist.k.norms, hist.k_ref)
    vn = hist.v.norms if hist.v_ref is None else ctx.v_codec.load_norms(hist.v.norms, hist.v_ref)
    s_eh = 0 if keep8.shape[1] == 1 else keep8.stride(1)
    tiles = {} if block_n is None else {"BLOCK_N": block_n, "num_warps": num_warps}
    (_history_tuned if block_n is None else _history_kernel)[(batch * heads, n_splits, m_blocks)](
        q_rot, bias if bias is not None else q_rot, kc, kn, vc, vn, k_cent, v_cent, keep8, out_m, out_l, out_acc,
        q_rot.stride(0), q_rot.stride(1), q_rot.stride(2),
        kc.stride(0), kc.stride(1), kc.stride(2), kn.stride(0), kn.stride(1),
        vc.stride(0), vc.stride(1), vc.stride(2), vn.stride(0), vn.stride(1),
        keep8.stride(0), s_eh, keep8.stride(2), heads, rows, hist.length, per_split, scale,
        D=dim, BITS_K=ctx.k_codec.bits, BITS_V=ctx.v_codec.bits,
        BLOCK_M=block_m, HAS_BIAS=bias is not None, IEEE=exact, **tiles,
    )  # fmt: skip
    return _merge_splits(out_m, out_l, out_acc)


def _merge_splits(m: torch.Tensor, l: torch.Tensor, acc: torch.Tensor):
    """Reduce ``[B, H, S, M(, D)]`` split states to ``[B, H, M, 1]``/``[B, H, M, D]``."""
    m_all = m.amax(dim=2, keepdim=True)
    shift = torch.where(torch.isfinite(m_all), m_all, torch.zeros_like(m_all))
    w = torch.exp(m - shift)  # [B, H, S, M]
    l_all = (l * w).sum(dim=2)
    acc_all = (acc * w.unsqueeze(-1)).sum(dim=2)
    return m_all.squeeze(2).unsqueeze(-1), l_all.unsqueeze(-1), acc_all
