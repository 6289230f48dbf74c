"""Attention over [sink | quantized history | recent] without dequantizing the history.

History scores use ``<q, mean + norm * Pi^T c> = <q, mean> + norm * <Pi q, c>``: the query is rotated
once, then scored against centroids gathered from the packed codes. History values are accumulated
in rotated space (``sum_j p_j norm_j c_j``) and rotated back once per query. The history is walked in
chunks with an online softmax (flash-decoding style), so the only temporaries are one chunk of
centroids; on CUDA the Triton kernels in :mod:`airquant.kv.triton_kernel` do the same in registers.

Softmax states are ``(m, l, acc)``: running max ``[.., 1]``, normalizer ``[.., 1]``, weighted sum
``[.., D]``; :func:`combine` merges the unquantized part's state with the history's.
"""

from __future__ import annotations

import torch

from airquant.kv.cache import CompressedContext
from airquant.kv.masks import keep_mask

# 1024 tokens per chunk: a [B, H, 1024, D] fp32 temporary, small next to the weights being streamed.
HISTORY_CHUNK = 1024

State = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


def group_rows(x: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """``[B, Hq, L, X]`` (Hq = kv_heads * G) to ``[B, kv_heads, G * L, X]``, rows g-major."""
    b, hq, length, last = x.shape
    return x.reshape(b, kv_heads, hq // kv_heads * length, last)


def _mask_rows(keep: torch.Tensor, kv_heads: int, groups: int) -> torch.Tensor:
    """Mask ``[B, 1|Hq, L, K]`` to ``[B, 1|Hkv, G*L, K]`` matching :func:`group_rows` of the query."""
    if keep.shape[1] == 1:
        return keep.repeat(1, 1, groups, 1)
    return group_rows(keep, kv_heads)


def _online_update(state: State | None, scores: torch.Tensor, values_fn) -> State:
    """Fold one chunk of scores ``[.., M, C]`` into a softmax state; ``values_fn(p)`` -> ``[.., M, D]``."""
    chunk_max = scores.amax(dim=-1, keepdim=True)
    new_m = chunk_max if state is None else torch.maximum(state[0], chunk_max)
    # Rows with nothing visible so far keep m = -inf; shift by 0 there so exp() gives 0, not NaN.
    shift = torch.where(torch.isfinite(new_m), new_m, torch.zeros_like(new_m))
    p = torch.exp(scores - shift)
    l_chunk, acc_chunk = p.sum(dim=-1, keepdim=True), values_fn(p)
    if state is None:
        return new_m, l_chunk, acc_chunk
    alpha = torch.exp(state[0] - shift)
    return new_m, state[1] * alpha + l_chunk, state[2] * alpha + acc_chunk


def unquantized_state(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, keep: torch.Tensor, scale: float) -> State:
    """Softmax state of grouped queries ``[B, Hkv, M, D]`` over unquantized ``[B, Hkv, F, D]``."""
    scores = (q @ k.float().transpose(-1, -2)) * scale
    scores = scores.masked_fill(~keep, float("-inf"))
    return _online_update(None, scores, lambda p: p @ v.float())


def history_state_torch(q: torch.Tensor, ctx: CompressedContext, keep: torch.Tensor, scale: float) -> State:
    """Softmax state over the quantized history; ``acc`` is in the value rotation's space."""
    hist = ctx.history
    q_rot = ctx.k_codec.rotation.forward(q)  # [B, Hkv, M, D]
    bias = None if hist.k_mean is None else (q @ hist.k_mean.transpose(-1, -2)) * scale  # [B, Hkv, M, 1]
    state = None
    for c0 in range(0, hist.length, HISTORY_CHUNK):
        c1 = min(c0 + HISTORY_CHUNK, hist.length)
        k_cent = ctx.k_codec.centroids_of(hist.k.codes[:, :, c0:c1])  # [B, Hkv, C, D]
        k_norm = ctx.k_codec.load_norms(hist.k.norms[:, :, c0:c1], hist.k_ref).unsqueeze(-2)  # [B, Hkv, 1, C]
        scores = (q_rot @ k_cent.transpose(-1, -2)) * (k_norm * scale)
        if bias is not None:
            scores = scores + bias
        scores = scores.masked_fill(~keep[..., c0:c1], float("-inf"))
        v_cent = ctx.v_codec.centroids_of(hist.v.codes[:, :, c0:c1])
        v_norm = ctx.v_codec.load_norms(hist.v.norms[:, :, c0:c1], hist.v_ref).unsqueeze(-2)
        state = _online_update(state, scores, lambda p: (p * v_norm) @ v_cent)
    return state


def combine(full: State, hist: State, v_rotation, v_mean: torch.Tensor | None = None) -> torch.Tensor:
    """Normalized output from the unquantized state and the (rotated-space) history state."""
    m = torch.maximum(full[0], hist[0])
    shift = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    a_full, a_hist = torch.exp(full[0] - shift), torch.exp(hist[0] - shift)
    acc = full[2] * a_full + v_rotation.inverse(hist[2] * a_hist)
    if v_mean is not None:  # every history value is v_mean + its quantized residual
        acc = acc + v_mean * (hist[1] * a_hist)
    denom = full[1] * a_full + hist[1] * a_hist
    # Fully masked rows (left padding queries) have denom 0: return 0 there, as sdpa's fix does.
    return acc / denom.clamp_min(torch.finfo(torch.float32).tiny)


def compressed_attention(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    ctx: CompressedContext,
    mask: torch.Tensor | None,
    scale: float,
    kernel: bool = True,
) -> torch.Tensor:
    """``query`` ``[B, Hq, L, D]``; unquantized ``keys``/``values`` ``[B, Hkv, F, D]`` whose first
    ``ctx.sink`` tokens precede the history. Returns ``[B, L, Hq, D]`` like the sdpa integration.
    On CUDA the Triton kernels of :mod:`airquant.kv.triton_kernel` do all of it in two launches; the
    torch ops below are the CPU path and the reference the kernels are tested against (``kernel``
    False forces them)."""
    if kernel and query.is_cuda:
        from airquant.kv import triton_kernel

        if triton_kernel.applicable(query, ctx):
            return triton_kernel.attention(query, keys, values, ctx, mask, scale)
    batch, hq, q_len, dim = query.shape
    hkv, n_full, n_hist, s = keys.shape[1], keys.shape[2], ctx.history.length, ctx.sink
    groups = hq // hkv
    keep = _mask_rows(keep_mask(mask, batch, q_len, n_full + n_hist, query.device), hkv, groups)
    keep_full = torch.cat([keep[..., :s], keep[..., s + n_hist :]], dim=-1)
    keep_hist = keep[..., s : s + n_hist]
    q = group_rows(query.float(), hkv)  # [B, Hkv, G*L, D]
    full = unquantized_state(q, keys, values, keep_full, scale)
    hist = history_state_torch(q, ctx, keep_hist, scale)
    out = combine(full, hist, ctx.v_codec.rotation, ctx.history.v_mean)  # [B, Hkv, G*L, D]
    out = out.reshape(batch, hkv, groups, q_len, dim).reshape(batch, hq, q_len, dim)
    return out.transpose(1, 2).to(query.dtype)
