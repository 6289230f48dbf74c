"""Routed int2 experts multiplied straight from their packed bytes: two launches a MoE layer call of a few tokens.

The int2 counterpart of ``nf4_moe``'s GEMV: every (token, expert) pair of a call is a row, its expert found by
index in the operand (the expert pool's slots or a whole layer's stacked buffers), the 2-bit codes decoded in
registers, the fp16 outlier residuals added, fp32 sums; no per-expert Python and no dense weight. Up to
``GEMV_ROWS`` tokens a call (decode); larger calls keep the per-expert path (``compute.run_fused``' callers
route only few-token calls here).

Layout (quant/int2.py): ``codes`` uint8 ``[n, k/4]``, input channel c of row r in byte c // 4 at bits
2 * (c % 4), the code the rank of its Lloyd-Max centroid (``LLOYD_MAX_4``); ``scales``/``zeros`` fp16
``[n, k/group]``: w = scale * centroid + zero; ``outlier_weight`` fp16 ``[n, cols]`` (the first ``n_out``
columns used) and ``outlier_idx`` int32 ``[n_out]``: w[:, idx[j]] += outlier_weight[:, j].
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from airquant.quant.int2_levels import LLOYD_MAX_4
from airquant.quant.kernels.expert_operands import Buffers, in_slots, pairs_up, slot_bias, stacked, tokens_down
from airquant.quant.kernels.tiered import ImageBuffers, add_bias, expert_image, launch_args

BUFFERS = ("codes", "scales", "zeros", "outlier_weight", "outlier_idx")
GEMV_ROWS = 8  # tokens a call may have (the routed pool's and a whole layer's few-token calls)
OUTLIER_BLOCK = 64  # outlier channels a program adds per step


@dataclass(frozen=True)
class Operand(Buffers):
    """One ``[n, k]`` int2 matrix of every expert (``expert_operands.Buffers``: a base tensor and the elements
    from one expert's copy to the next per buffer of ``BUFFERS``; no outliers: the codes, stride 0, never read;
    the experts' dense bias rows ``[experts, n]`` if any), the group, the outlier count and the stored outlier
    row width."""

    n: int
    k: int
    group: int
    n_out: int
    cols: int
    bases: tuple[torch.Tensor, ...]
    strides: tuple[int, ...]
    bias: torch.Tensor | None = None


def _used(names, n_out: int) -> set[str]:
    """The buffers a matrix's kernel reads: the outlier ones only where it has outlier channels."""
    return {name for name in names if n_out or not name.startswith("outlier")}


def pool_operand_int2(pool: torch.Tensor, offsets: dict[str, int], dtypes: dict[str, torch.dtype], n: int, k: int,
                      group: int, n_out: int, cols: int, bias: tuple[int, torch.dtype] | None = None) -> Operand:
    """A matrix whose buffers sit at ``offsets`` (bytes) inside every slot of ``pool`` ``[slots, slot_bytes]``."""
    bases, strides = in_slots(pool, offsets, dtypes, BUFFERS, _used(offsets, n_out), "codes")
    return Operand(n, k, group, n_out, cols, bases, strides, slot_bias(pool, bias, n))


def stacked_operand_int2(buffers: dict[str, torch.Tensor], n: int, k: int, group: int, n_out: int, cols: int,
                         bias: torch.Tensor | None = None) -> Operand:
    """A matrix whose buffers are stacked ``[E, ...]`` tensors (a quantized experts module's)."""
    bases, strides = stacked(buffers, BUFFERS, _used(buffers, n_out), "codes")
    return Operand(n, k, group, n_out, cols, bases, strides, bias)


@functools.cache
def _levels(device: torch.device) -> torch.Tensor:
    """The four centroids on ``device``, made once (from pinned memory on CUDA: no sync, so a layer graph's
    warm-up call that makes them is not taken for a synchronizing one)."""
    levels = torch.tensor(LLOYD_MAX_4, dtype=torch.float32)
    return levels.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else levels.to(device)


@triton.jit
def _gemv_kernel(x_ptr, out_ptr, bias_ptr, weights_ptr, ids_ptr, lv_ptr,
                 c_ptr, c_st, s_ptr, s_st, z_ptr, z_st, ow_ptr, ow_st, oi_ptr, oi_st,
                 N, K: tl.constexpr, G: tl.constexpr, NOUT: tl.constexpr, COLS: tl.constexpr,
                 TOP_K: tl.constexpr, DOWN: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr,
                 BLOCK_K: tl.constexpr, BLOCK_O: tl.constexpr):
    """up (``DOWN`` False): ``out[p] = W[ids[p]] @ x[p // TOP_K] (+ bias[p])``, one program per pair and block of
    outputs; down: ``out[t] = sum_j weights[t, j] * (W[ids[t, j]] @ x[t * TOP_K + j] (+ bias))``."""
    row = tl.program_id(0).to(tl.int64)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    rows = offs_n.to(tl.int64)
    offs_k = tl.arange(0, BLOCK_K)
    total = tl.zeros([BLOCK_N], dtype=tl.float32)
    for j in range(0, TOP_K if DOWN else 1):
        p = row * TOP_K + j if DOWN else row
        e = tl.load(ids_ptr + p).to(tl.int64)
        x_row = x_ptr + (p if DOWN else p // TOP_K) * K
        codes = c_ptr + e * c_st + rows[:, None] * (K // 4)
        scales = s_ptr + e * s_st + rows[:, None] * (K // G)
        zeros = z_ptr + e * z_st + rows[:, None] * (K // G)
        acc = tl.zeros([BLOCK_N], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            kk = k0 + offs_k
            k_mask = kk < K
            mask = n_mask[:, None] & k_mask[None, :]
            byte = tl.load(codes + (kk // 4)[None, :], mask=mask, other=0).to(tl.int32)
            code = (byte >> (2 * (kk % 4))[None, :]) & 3
            level = tl.load(lv_ptr + code)
            scale = tl.load(scales + (kk // G)[None, :], mask=mask, other=0.0).to(tl.float32)
            zero = tl.load(zeros + (kk // G)[None, :], mask=mask, other=0.0).to(tl.float32)
            xk = tl.load(x_row + kk, mask=k_mask, other=0.0).to(tl.float32)
            acc += tl.sum((level * scale + zero) * xk[None, :], axis=1)
        if NOUT > 0:  # the outlier channels' residuals: w[:, idx[o]] += ow[:, o]
            for o0 in range(0, NOUT, BLOCK_O):
                oc = o0 + tl.arange(0, BLOCK_O)
                o_mask = oc < NOUT
                idx = tl.load(oi_ptr + e * oi_st + oc, mask=o_mask, other=0)
                xo = tl.load(x_row + idx, mask=o_mask, other=0.0).to(tl.float32)
                ow = tl.load(ow_ptr + e * ow_st + rows[:, None] * COLS + oc[None, :],
                             mask=n_mask[:, None] & o_mask[None, :], other=0.0).to(tl.float32)
                acc += tl.sum(ow * xo[None, :], axis=1)
        if HAS_BIAS:
            acc += tl.load(bias_ptr + p * N + offs_n, mask=n_mask, other=0.0).to(tl.float32)
        if DOWN:
            total += tl.load(weights_ptr + p).to(tl.float32) * acc
        else:
            total = acc
    tl.store(out_ptr + row * N + offs_n, total.to(out_ptr.dtype.element_ty), mask=n_mask)


def up_int2(x: torch.Tensor, ids: torch.Tensor, op: Operand) -> torch.Tensor:
    """``[P, n]``: pair p (``ids`` ``[T, k]``, flat) is ``x[p // k]`` times its expert's matrix (+ bias)."""
    return pairs_up(_launch, x, ids, op, op.n)


def down_int2(h: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, op: Operand, out_dtype: torch.dtype
         ) -> torch.Tensor:
    """``[T, n]``: each token's ``k`` rows of ``h`` ``[T * k, K]`` through their experts' matrices (+ bias),
    weighted by ``weights`` ``[T, k]`` and summed in fp32."""
    return tokens_down(_launch, h, ids, weights, op, op.n, out_dtype)


def _launch(x, out, ids, weights, op: Operand, top_k: int, down: bool) -> torch.Tensor:
    tokens = ids.shape[0] if ids.dim() > 1 else ids.numel() // top_k
    if tokens > GEMV_ROWS:
        raise ValueError(f"int2 fused experts run calls of at most {GEMV_ROWS} tokens, not {tokens}")
    if op.k % op.group or op.k % 4:
        raise ValueError(f"int2 fused experts need in_features ({op.k}) a multiple of the group ({op.group}) and 4")
    block_n = min(32, triton.next_power_of_2(op.n))
    block_k = min(128, max(triton.next_power_of_2(op.k), 16))
    bias = op.bias_rows(ids)
    grid = (out.shape[0], triton.cdiv(op.n, block_n))
    _gemv_kernel[grid](x, out, bias if bias is not None else out, weights if weights is not None else out,
                       ids.reshape(-1).contiguous(), _levels(x.device), *op.args(), op.n, op.k, op.group, op.n_out,
                       op.cols, top_k, DOWN=down, HAS_BIAS=bias is not None, BLOCK_N=block_n, BLOCK_K=block_k,
                       BLOCK_O=min(OUTLIER_BLOCK, max(triton.next_power_of_2(op.n_out), 16)), num_warps=4)
    return out


# -- direct reads: each pair's expert read where it is (engine/moe/direct.py) ---------------------------------
@dataclass(frozen=True)
class ImageMatrixInt2(ImageBuffers):
    """One ``[n, k]`` int2 matrix inside an expert's image (the RAM tier's arranged bytes, or a hot-set slot
    holding the same bytes): the byte offset of each of its buffers (``BUFFERS``; no outlier channels: None), its
    group, outlier count and stored outlier row width, and its bias row ``[n]`` (offset, dtype) if any."""

    n: int
    k: int
    group: int
    n_out: int
    cols: int
    offsets: tuple[int | None, ...]
    bias: tuple[int, torch.dtype] | None = None


def tiered_int2_applies(n: int, k: int, group: int) -> bool:
    """Whether the tiered kernel takes a matrix: its rows in whole 16-code words (``k`` a multiple of 16, so
    every row starts on a word) and its groups in whole words (int2 groups are multiples of 16 anyway)."""
    return n > 0 and k % 16 == 0 and group % 16 == 0


@triton.jit
def _tiered_kernel(x_ptr, out_ptr, weights_ptr, ids_ptr, lv_ptr, table_ptr, counts_ptr, hits_ptr,
                   host_ptr, host_start, host_stride, pool_ptr, slot_bytes,
                   off_c, off_s, off_z, off_ow, off_oi, off_bias,
                   N, K: tl.constexpr, G: tl.constexpr, NOUT: tl.constexpr, COLS: tl.constexpr,
                   TOP_K: tl.constexpr, DOWN: tl.constexpr, COUNT: tl.constexpr, BIAS: tl.constexpr,
                   BLOCK_N: tl.constexpr, BLOCK_W: tl.constexpr, BLOCK_O: tl.constexpr):
    """As ``_gemv_kernel`` (up: one program per pair and block of outputs; down: per token, its ``TOP_K`` pairs
    weighted and summed), each pair's expert image found by ``table``: a pool slot or the RAM tier, read in
    int32 words of 16 codes (a group holds whole words: one scale and zero a word, ``w = scale * level + zero``
    summed as ``scale * sum(level * x) + zero * sum(x)``). ``COUNT``: the programs of the first output block
    also count each pair's expert and pool hits. ``BIAS`` (``tiered.BIAS_KINDS``, 0: none): the expert's bias
    row, added to its product before the routing weight."""
    row = tl.program_id(0).to(tl.int64)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    rows = offs_n.to(tl.int64)
    offs_w = tl.arange(0, BLOCK_W)
    l0 = tl.load(lv_ptr)
    l1 = tl.load(lv_ptr + 1)
    l2 = tl.load(lv_ptr + 2)
    l3 = tl.load(lv_ptr + 3)
    total = tl.zeros([BLOCK_N], dtype=tl.float32)
    for j in range(0, TOP_K if DOWN else 1):
        p = row * TOP_K + j if DOWN else row
        base = expert_image(ids_ptr, p, table_ptr, counts_ptr, hits_ptr, host_ptr, host_start, host_stride, pool_ptr,
                            slot_bytes, COUNT)
        words_ptr = (base + off_c).to(tl.pointer_type(tl.int32)) + rows[:, None] * (K // 16)
        scales = (base + off_s).to(tl.pointer_type(tl.float16)) + rows[:, None] * (K // G)
        zeros = (base + off_z).to(tl.pointer_type(tl.float16)) + rows[:, None] * (K // G)
        x_row = x_ptr + (p if DOWN else p // TOP_K) * K
        acc = tl.zeros([BLOCK_N], dtype=tl.float32)
        for k0 in range(0, K, 16 * BLOCK_W):
            cols = k0 + 16 * offs_w  # the first element of each word
            k_mask = cols < K
            mask = n_mask[:, None] & k_mask[None, :]
            words = tl.load(words_ptr + (k0 // 16 + offs_w)[None, :], mask=mask, other=0)
            dot = tl.zeros([BLOCK_N, BLOCK_W], dtype=tl.float32)
            xsum = tl.zeros([BLOCK_W], dtype=tl.float32)
            for m in tl.static_range(16):
                code = (words >> (2 * m)) & 3  # channel 4 * b + c at bits 2 * c of byte b: bits 2 * m of the word
                level = tl.where(code == 0, l0, tl.where(code == 1, l1, tl.where(code == 2, l2, l3)))
                xm = tl.load(x_row + cols + m, mask=k_mask, other=0.0).to(tl.float32)
                dot += level * xm[None, :]
                xsum += xm
            scale = tl.load(scales + (cols // G)[None, :], mask=mask, other=0.0).to(tl.float32)
            zero = tl.load(zeros + (cols // G)[None, :], mask=mask, other=0.0).to(tl.float32)
            acc += tl.sum(scale * dot + zero * xsum[None, :], axis=1)
        if NOUT > 0:  # the outlier channels' residuals: w[:, idx[o]] += ow[:, o]
            idx_ptr = (base + off_oi).to(tl.pointer_type(tl.int32))
            ow_ptr = (base + off_ow).to(tl.pointer_type(tl.float16))
            for o0 in range(0, NOUT, BLOCK_O):
                oc = o0 + tl.arange(0, BLOCK_O)
                o_mask = oc < NOUT
                idx = tl.load(idx_ptr + oc, mask=o_mask, other=0)
                xo = tl.load(x_row + idx, mask=o_mask, other=0.0).to(tl.float32)
                ow = tl.load(ow_ptr + rows[:, None] * COLS + oc[None, :], mask=n_mask[:, None] & o_mask[None, :],
                             other=0.0).to(tl.float32)
                acc += tl.sum(ow * xo[None, :], axis=1)
        acc = add_bias(acc, base, off_bias, offs_n, n_mask, BIAS)
        if DOWN:
            total += tl.load(weights_ptr + p).to(tl.float32) * acc
        else:
            total = acc
    tl.store(out_ptr + row * N + offs_n, total.to(out_ptr.dtype.element_ty), mask=n_mask)


def tiered_up_int2(x: torch.Tensor, ids: torch.Tensor, m: ImageMatrixInt2, tiers) -> torch.Tensor:
    """``[P, n]``: pair p (``ids`` ``[T, k]``, flat) is ``x[p // k]`` times its expert's matrix (+ bias), the
    expert read where ``tiers`` (``tiered.Tiers``) has it; counts each pair's expert and pool hit."""
    return pairs_up(functools.partial(_launch_tiered, tiers=tiers), x, ids, m, m.n)


def tiered_down_int2(h: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, m: ImageMatrixInt2, tiers,
                     out_dtype: torch.dtype) -> torch.Tensor:
    """``[T, n]``: each token's ``k`` rows of ``h`` ``[T * k, K]`` through their experts' matrices (+ bias),
    weighted by ``weights`` ``[T, k]`` and summed in fp32."""
    return tokens_down(functools.partial(_launch_tiered, tiers=tiers), h, ids, weights, m, m.n, out_dtype)


def _launch_tiered(x, out, ids, weights, m: ImageMatrixInt2, top_k: int, down: bool, *, tiers) -> torch.Tensor:
    if not tiered_int2_applies(m.n, m.k, m.group):
        raise ValueError(f"tiered int2 GEMV needs in_features ({m.k}) and the group ({m.group}) multiples of 16")
    # 32 words a K step: 512 codes, 128 bytes of a row (one line of the link), as the NF4 tiered kernel reads
    block_w = min(32, max(triton.next_power_of_2(m.k // 16), 1))
    block_n = min(16 if down else 32, triton.next_power_of_2(m.n))
    grid = (out.shape[0], triton.cdiv(m.n, block_n))
    _tiered_kernel[grid](x, out, weights if weights is not None else out, ids.reshape(-1).contiguous(),
                         _levels(x.device), *launch_args(tiers), *m.args(), m.n, m.k, m.group,
                         m.n_out, m.cols, top_k, DOWN=down, COUNT=not down, BIAS=m.bias_kind, BLOCK_N=block_n,
                         BLOCK_W=block_w, BLOCK_O=min(OUTLIER_BLOCK, max(triton.next_power_of_2(m.n_out), 16)),
                         num_warps=4)
    return out
