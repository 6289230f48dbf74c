"""Routed GPTQ experts multiplied straight from their packed bytes: two launches a MoE layer call of a few tokens.

The GPTQ counterpart of ``int2_moe``'s GEMV (pre-quantized MoE checkpoints: ``models.merge_expert_parts`` stacks
each expert's linears): every (token, expert) pair of a call is a row, its expert found by index in the operand
(the expert pool's slots or a whole layer's stacked buffers), the codes unpacked in registers, fp32 sums; no
per-expert Python and no dense weight (the per-expert path decodes every routed expert to a dense matrix a
call). Up to ``GEMV_ROWS`` tokens a call (decode); larger calls keep the per-expert path.

Layout (quant/gptq.py ``GPTQLinear``, ``bits`` in 2/4/8, ``per = 32 / bits`` codes a word): ``qweight`` int32
``[k / per, n]``, input channel c of output o at bits ``bits * (c % per)`` of word ``[c // per, o]``; ``qzeros``
int32 ``[groups, n / per]`` packed along the outputs the same way, stored as zero - ``zero_offset``; ``scales``
fp16 ``[groups, n]``; ``g_idx`` int32 ``[k]``: input channel c's group (act-order when not ``c // group``).
``w[o, c] = scales[g, o] * (q - (zero[g, o] + zero_offset))`` with ``g = g_idx[c]``.

AWQ (GEMM layout, ``AWQLinear``; ``awq_group`` > 0 on an operand): 4-bit ``qweight`` int32 ``[k, n / 8]`` packed
along the outputs, column o in nibble ``AWQ_REVERSE_ORDER[o % 8]`` of word ``[c, o // 8]``; ``qzeros`` the same
way; no ``g_idx`` (channel c's group is ``c // group``) and no zero offset.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from airquant.quant.kernels.expert_operands import Buffers, in_slots, pairs_up, slot_bias, stacked, tokens_down
from airquant.quant.kernels.tiered import ImageBuffers, add_bias, expert_image, launch_args

BUFFERS = ("qweight", "qzeros", "scales", "g_idx")
GEMV_ROWS = 8  # tokens a call may have (the routed pool's and a whole layer's few-token calls)


@dataclass(frozen=True)
class Operand(Buffers):
    """One ``[n, k]`` GPTQ matrix of every expert (``expert_operands.Buffers``: a base tensor and the elements from
    one expert's copy to the next per buffer of ``BUFFERS``; the experts' dense bias rows ``[experts, n]`` if any),
    its bits and the zero offset of its stored zeros."""

    n: int
    k: int
    bits: int
    zero_offset: int
    bases: tuple[torch.Tensor, ...]
    strides: tuple[int, ...]
    bias: torch.Tensor | None = None
    awq_group: int = 0  # AWQ: input channels a group (the whole row for a group size <= 0); 0: GPTQ


def awq_group(group_size: int, k: int) -> int:
    """The AWQ kernels' group: ``group_size``, or the whole row for a checkpoint's -1 / 0."""
    return k if group_size <= 0 else group_size


def _used(awq: int) -> set[str]:
    return set(BUFFERS) - {"g_idx"} if awq else set(BUFFERS)


def pool_operand_gptq(pool: torch.Tensor, offsets: dict[str, int], dtypes: dict[str, torch.dtype], n: int, k: int,
                      bits: int, zero_offset: int, bias: tuple[int, torch.dtype] | None = None,
                      awq: int = 0) -> Operand:
    """A matrix whose buffers sit at ``offsets`` (bytes) inside every slot of ``pool`` ``[slots, slot_bytes]``
    (``awq``: an AWQ matrix's group, its ``g_idx`` absent)."""
    bases, strides = in_slots(pool, offsets, dtypes, BUFFERS, _used(awq), "qweight")
    return Operand(n, k, bits, zero_offset, bases, strides, slot_bias(pool, bias, n), awq)


def stacked_operand_gptq(buffers: dict[str, torch.Tensor], n: int, k: int, bits: int, zero_offset: int,
                         bias: torch.Tensor | None = None, awq: int = 0) -> Operand:
    """A matrix whose buffers are stacked ``[E, ...]`` tensors (a quantized experts module's)."""
    bases, strides = stacked(buffers, BUFFERS, _used(awq), "qweight")
    return Operand(n, k, bits, zero_offset, bases, strides, bias, awq)


@triton.jit
def _dot(qw, qz, sc, gi, x_row, offs_n, n_mask, N, K: tl.constexpr, BITS: tl.constexpr, ZOFF: tl.constexpr,
         AWQ: tl.constexpr, BLOCK_K: tl.constexpr):
    """One expert's outputs ``offs_n`` times ``x_row`` (fp32). GPTQ: a K step loads ``BLOCK_K / per`` words of
    each output's column (contiguous along the outputs), the act-order groups of its channels, their zeros and
    scales. AWQ (``AWQ``: its group): the words of ``BLOCK_K`` channels, eight outputs each."""
    PER: tl.constexpr = 32 // BITS
    MASK: tl.constexpr = (1 << BITS) - 1
    cols = offs_n.to(tl.int64)
    offs_k = tl.arange(0, BLOCK_K)
    nibble = 4 * ((offs_n % 8) // 2 + 4 * (offs_n % 2))  # AWQ: output o's nibble, AWQ_REVERSE_ORDER[o % 8]
    acc = tl.zeros(offs_n.shape, dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + offs_k
        k_mask = kk < K
        mask = k_mask[:, None] & n_mask[None, :]
        if AWQ > 0:
            words = tl.load(qw + kk.to(tl.int64)[:, None] * (N // 8) + (cols // 8)[None, :], mask=mask, other=0)
            q = (words >> nibble[None, :]) & 15
            g = (kk // AWQ).to(tl.int64)
            zw = tl.load(qz + g[:, None] * (N // 8) + (cols // 8)[None, :], mask=mask, other=0)
            z = (zw >> nibble[None, :]) & 15
        else:
            words = tl.load(qw + (kk // PER).to(tl.int64)[:, None] * N + cols[None, :], mask=mask, other=0)
            q = (words >> ((kk % PER) * BITS)[:, None]) & MASK
            g = tl.load(gi + kk, mask=k_mask, other=0).to(tl.int64)
            zw = tl.load(qz + g[:, None] * (N // PER) + (cols // PER)[None, :], mask=mask, other=0)
            z = ((zw >> ((offs_n % PER) * BITS)[None, :]) & MASK) + ZOFF
        s = tl.load(sc + g[:, None] * N + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        xk = tl.load(x_row + kk, mask=k_mask, other=0.0).to(tl.float32)
        acc += tl.sum((q - z).to(tl.float32) * s * xk[:, None], axis=0)
    return acc


@triton.jit
def _gemv_kernel(x_ptr, out_ptr, bias_ptr, weights_ptr, ids_ptr,
                 qw_ptr, qw_st, qz_ptr, qz_st, s_ptr, s_st, g_ptr, g_st,
                 N, K: tl.constexpr, BITS: tl.constexpr, ZOFF: tl.constexpr, AWQ: tl.constexpr, TOP_K: tl.constexpr,
                 DOWN: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """up (``DOWN`` False): ``out[p] = W[ids[p]] @ x[p // TOP_K] (+ bias[p])``, one program per pair and block of
    outputs; down: ``out[t] = sum_j weights[t, j] * (W[ids[t, j]] @ x[t * TOP_K + j] (+ bias))``."""
    row = tl.program_id(0).to(tl.int64)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    total = tl.zeros([BLOCK_N], dtype=tl.float32)
    for j in range(0, TOP_K if DOWN else 1):
        p = row * TOP_K + j if DOWN else row
        e = tl.load(ids_ptr + p).to(tl.int64)
        x_row = x_ptr + (p if DOWN else p // TOP_K) * K
        qw = qw_ptr + e * qw_st
        qz = qz_ptr + e * qz_st
        sc = s_ptr + e * s_st
        gi = g_ptr + e * g_st
        acc = _dot(qw, qz, sc, gi, x_row, offs_n, n_mask, N, K, BITS, ZOFF, AWQ, BLOCK_K)
        if HAS_BIAS:
            acc += tl.load(bias_ptr + p * N + offs_n, mask=n_mask, other=0.0).to(tl.float32)
        if DOWN:
            total += tl.load(weights_ptr + p).to(tl.float32) * acc
        else:
            total = acc
    tl.store(out_ptr + row * N + offs_n, total.to(out_ptr.dtype.element_ty), mask=n_mask)


def up_gptq(x: torch.Tensor, ids: torch.Tensor, op: Operand) -> torch.Tensor:
    """``[P, n]``: pair p (``ids`` ``[T, k]``, flat) is ``x[p // k]`` times its expert's matrix (+ bias)."""
    return pairs_up(_launch, x, ids, op, op.n)


def down_gptq(h: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, op: Operand, out_dtype: torch.dtype
              ) -> torch.Tensor:
    """``[T, n]``: each token's ``k`` rows of ``h`` ``[T * k, K]`` through their experts' matrices (+ bias),
    weighted by ``weights`` ``[T, k]`` and summed in fp32."""
    return tokens_down(_launch, h, ids, weights, op, op.n, out_dtype)


def _launch(x, out, ids, weights, op: Operand, top_k: int, down: bool) -> torch.Tensor:
    tokens = ids.shape[0] if ids.dim() > 1 else ids.numel() // top_k
    if tokens > GEMV_ROWS:
        raise ValueError(f"GPTQ fused experts run calls of at most {GEMV_ROWS} tokens, not {tokens}")
    block_n, block_k = _tiles(op.n, op.k, op.bits, "the fused GPTQ/AWQ GEMV")
    bias = op.bias_rows(ids)
    grid = (out.shape[0], triton.cdiv(op.n, block_n))
    _gemv_kernel[grid](x, out, bias if bias is not None else out, weights if weights is not None else out,
                       ids.reshape(-1).contiguous(), *op.args(), op.n, op.k, op.bits, op.zero_offset, op.awq_group,
                       top_k, DOWN=down, HAS_BIAS=bias is not None, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=4)
    return out


# -- direct reads: each pair's expert read where it is (engine/moe/direct.py) ---------------------------------
@dataclass(frozen=True)
class ImageMatrixGPTQ(ImageBuffers):
    """One ``[n, k]`` GPTQ matrix inside an expert's image (the RAM tier's arranged bytes, or a hot-set slot
    holding the same bytes): the byte offset of each of its buffers (``BUFFERS``), its bits and zero offset, and
    its bias row ``[n]`` (offset, dtype) if any."""

    n: int
    k: int
    bits: int
    zero_offset: int
    offsets: tuple[int | None, ...]  # AWQ: no g_idx (None)
    bias: tuple[int, torch.dtype] | None = None
    awq_group: int = 0  # as ``Operand``'s


@triton.jit
def _tiered_kernel(x_ptr, out_ptr, weights_ptr, ids_ptr, table_ptr, counts_ptr, hits_ptr,
                   host_ptr, host_start, host_stride, pool_ptr, slot_bytes,
                   off_qw, off_qz, off_s, off_g, off_bias,
                   N, K: tl.constexpr, BITS: tl.constexpr, ZOFF: tl.constexpr, AWQ: tl.constexpr,
                   TOP_K: tl.constexpr, DOWN: tl.constexpr, COUNT: tl.constexpr, BIAS: tl.constexpr,
                   BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """As ``_gemv_kernel``, each pair's expert image found by ``table``: a pool slot or the RAM tier.
    ``COUNT``: the programs of the first output block also count each pair's expert and pool hits. ``BIAS``
    (``tiered.BIAS_KINDS``, 0: none): the expert's bias row, added to its product before the routing weight."""
    row = tl.program_id(0).to(tl.int64)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    total = tl.zeros([BLOCK_N], dtype=tl.float32)
    for j in range(0, TOP_K if DOWN else 1):
        p = row * TOP_K + j if DOWN else row
        base = expert_image(ids_ptr, p, table_ptr, counts_ptr, hits_ptr, host_ptr, host_start, host_stride, pool_ptr,
                            slot_bytes, COUNT)
        qw = (base + off_qw).to(tl.pointer_type(tl.int32))
        qz = (base + off_qz).to(tl.pointer_type(tl.int32))
        sc = (base + off_s).to(tl.pointer_type(tl.float16))
        gi = (base + off_g).to(tl.pointer_type(tl.int32))
        x_row = x_ptr + (p if DOWN else p // TOP_K) * K
        acc = _dot(qw, qz, sc, gi, x_row, offs_n, n_mask, N, K, BITS, ZOFF, AWQ, BLOCK_K)
        acc = add_bias(acc, base, off_bias, offs_n, n_mask, BIAS)
        if DOWN:
            total += tl.load(weights_ptr + p).to(tl.float32) * acc
        else:
            total = acc
    tl.store(out_ptr + row * N + offs_n, total.to(out_ptr.dtype.element_ty), mask=n_mask)


def tiered_up_gptq(x: torch.Tensor, ids: torch.Tensor, m: ImageMatrixGPTQ, tiers) -> torch.Tensor:
    """``[P, n]``: pair p (``ids`` ``[T, k]``, flat) is ``x[p // k]`` times its expert's matrix (+ bias), the
    expert read where ``tiers`` (``tiered.Tiers``) has it; counts each pair's expert and pool hit."""
    return pairs_up(functools.partial(_launch_tiered, tiers=tiers), x, ids, m, m.n)


def tiered_down_gptq(h: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, m: ImageMatrixGPTQ, tiers,
                     out_dtype: torch.dtype) -> torch.Tensor:
    """``[T, n]``: each token's ``k`` rows of ``h`` ``[T * k, K]`` through their experts' matrices (+ bias),
    weighted by ``weights`` ``[T, k]`` and summed in fp32."""
    return tokens_down(functools.partial(_launch_tiered, tiers=tiers), h, ids, weights, m, m.n, out_dtype)


def _tiles(n: int, k: int, bits: int, what: str) -> tuple[int, int]:
    """(outputs, input channels) a program takes a step, for both kernels; ValueError where ``what`` cannot
    take the matrix."""
    if not tiered_gptq_applies(n, k, bits):
        raise ValueError(f"{what} takes bits 2/4/8 (AWQ: 4) with in ({k}) and out ({n}) in whole words of codes")
    return min(64, triton.next_power_of_2(n)), min(64, max(triton.next_power_of_2(k), 16))


def tiered_gptq_applies(n: int, k: int, bits: int) -> bool:
    """Whether the kernels take a ``[n, k]`` matrix of ``bits``: both sides in whole words of codes."""
    per = 32 // bits if bits in (2, 4, 8) else 0
    return bool(per) and n % per == 0 and k % per == 0


def _launch_tiered(x, out, ids, weights, m: ImageMatrixGPTQ, top_k: int, down: bool, *, tiers) -> torch.Tensor:
    block_n, block_k = _tiles(m.n, m.k, m.bits, "the tiered GPTQ/AWQ GEMV")
    grid = (out.shape[0], triton.cdiv(m.n, block_n))
    _tiered_kernel[grid](x, out, weights if weights is not None else out, ids.reshape(-1).contiguous(),
                         *launch_args(tiers), *m.args(), m.n, m.k, m.bits, m.zero_offset, m.awq_group, top_k,
                         DOWN=down, COUNT=not down, BIAS=m.bias_kind, BLOCK_N=block_n, BLOCK_K=block_k,
                         num_warps=4)
    return out
