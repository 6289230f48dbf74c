"""Routed NF4 experts multiplied straight from their packed bytes: two launches a MoE layer call, any batch.

Run expert by expert, a routed call is two ``matmul_4bit`` calls per expert, each decoding its nested absmax
(Qwen3-30B-A3B at batch 1: ~120 launches and ~7 ms of host time a layer, the GPU idle 88 % of a step); at
batch 64 its 128 experts run one after another, decoded first (2.5 s a step where the link allows 0.31 s).
Here every (token, expert) pair of a call is a row, and an expert's bytes are found by its index:

* ``Operand``: where one NF4 matrix of every expert sits, a base tensor per buffer (packed bytes, absmax or
  its codes, nested absmax, the two code books, the nested offset) and the elements between two experts.
  The expert pool's slots (one slot per expert, each buffer at a fixed offset) and a module's stacked
  ``[E, ...]`` buffers (a whole streamed layer) are both that.
* ``gemv``: few rows (decode): one program per (pair, block of outputs), decoding in registers, fp32 sums.
* ``grouped``: more rows: pairs sorted by expert into blocks of ``BLOCK_M`` rows of one expert (each expert's
  group padded to a block; static shapes, no host read), each block a tensor-core product of its rows by the
  expert's weight tile decoded in registers (vLLM's fused-MoE layout, over NF4 instead of a dense weight).

``up`` gives ``[P, N]`` (+ bias); the module's own gating runs on it (transformers' activation, unchanged);
``down`` multiplies each pair by its routing weight and sums a token's ``top_k`` pairs, in fp32.

NF4 layout (bitsandbytes): element i of the flat ``[out, in]`` matrix is nibble ``i % 2`` of byte ``i // 2``
(the even element in the high nibble), scaled by ``absmax[i // blocksize]``; with double quant that absmax
is ``nested_code[absmax_u8] * nested_absmax[block // 256] + offset``. Callers guarantee ``in % blocksize == 0``
(no block straddles two rows).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from airquant.quant.kernels.expert_operands import Buffers, in_slots, slot_bias, stacked
from airquant.quant.kernels.tiered import (  # noqa: F401 - BIAS_KINDS, Tiers: this module's callers take them here
    BIAS_KINDS,
    ImageBuffers,
    Tiers,
)

BUFFERS = ("weight_packed", "absmax", "nested_absmax", "nested_quant_map", "nested_offset", "quant_map")
GEMV_ROWS = 8  # tokens up to which a call runs by ``gemv`` (re-reading an expert per pair); ``grouped`` above
BLOCK_M = 16  # rows of one expert a grouped block multiplies (tl.dot's smallest M)
# Wider blocks for calls whose experts have more rows (a prefill): each block decodes its expert's tile once, so
# rows past a block's width decode the expert again (Mixtral-8x7B at batch 498 decoded every expert 8 times over in
# 16-row blocks: 2.33 s a step, H200). Not shown to pay yet: a 128-token Mixtral prefill from the pool's slots
# (~32 rows an expert) took 0.92 s with them as with 16-row blocks, against 0.40 s gathered and decoded stacked
# (H100, wave3_moe25/26); what bounds it there is not traced. Correct at every width (tests/engine).
BLOCK_M_WIDE = (64, 128)
# Software-pipelined K steps of the grouped kernel: 3 (Triton's default) needs 110 KB of shared memory for the
# down projection, over an RTX 30/40's 99 KB per block (tests/quant/test_kernel_compile.py).
GROUPED_STAGES = 2


@dataclass(frozen=True)
class Operand(Buffers):
    """One ``[n, k]`` NF4 matrix of every expert (``expert_operands.Buffers``: a base tensor and the elements
    from one expert's copy to the next per buffer of ``BUFFERS``; absent double-quant buffers: the code book,
    stride 0, never read; the experts' dense bias rows ``[experts, n]`` if any)."""

    n: int
    k: int
    blocksize: int
    double: bool
    bases: tuple[torch.Tensor, ...]
    strides: tuple[int, ...]
    bias: torch.Tensor | None = None


def pool_operand(pool: torch.Tensor, offsets: dict[str, int], dtypes: dict[str, torch.dtype], n: int, k: int,
                 blocksize: int, double: bool, bias: tuple[int, torch.dtype] | None = None) -> Operand:
    """A matrix whose buffers sit at ``offsets`` (bytes) inside every slot of ``pool`` ``[slots, slot_bytes]``."""
    bases, strides = in_slots(pool, offsets, dtypes, BUFFERS, set(offsets), "quant_map")
    return Operand(n, k, blocksize, double, bases, strides, slot_bias(pool, bias, n))


def stacked_operand(buffers: dict[str, torch.Tensor], n: int, k: int, blocksize: int, double: bool,
                    bias: torch.Tensor | None = None) -> Operand:
    """A matrix whose buffers are stacked ``[E, ...]`` tensors (a quantized experts module's)."""
    bases, strides = stacked(buffers, BUFFERS, set(buffers), "quant_map")
    return Operand(n, k, blocksize, double, bases, strides, bias)


@triton.jit
def _scale(block, a_ptr, na_ptr, nqm_ptr, noff_ptr, mask, DOUBLE: tl.constexpr):
    """The fp32 absmax of NF4 blocks ``block``: stored as is, or (double quant) an 8-bit code into the nested
    code book, times its 256-block group's nested absmax, plus the offset."""
    if DOUBLE:
        code = tl.load(a_ptr + block, mask=mask, other=0).to(tl.int32)
        scale = tl.load(nqm_ptr + code, mask=mask, other=0.0) * tl.load(na_ptr + block // 256, mask=mask, other=0.0) \
            + tl.load(noff_ptr)
    else:
        scale = tl.load(a_ptr + block, mask=mask, other=0.0)
    return scale


@triton.jit
def _decode(flat, w_ptr, a_ptr, na_ptr, nqm_ptr, noff_ptr, qm_ptr, mask, DOUBLE: tl.constexpr,
            BS: tl.constexpr):
    """The fp32 weights at flat element indices ``flat`` of one expert's NF4 matrix."""
    byte = tl.load(w_ptr + flat // 2, mask=mask, other=0).to(tl.int32)
    nibble = tl.where(flat % 2 == 0, byte >> 4, byte & 15)
    value = tl.load(qm_ptr + nibble, mask=mask, other=0.0)
    scale = _scale(flat // BS, a_ptr, na_ptr, nqm_ptr, noff_ptr, mask, DOUBLE)
    return value * scale


@triton.jit
def _decode_bytes(rows, kk, w_ptr, a_ptr, na_ptr, nqm_ptr, noff_ptr, qm_ptr, mask, DOUBLE: tl.constexpr,
                  BS: tl.constexpr):
    """The fp32 weights of elements ``rows + kk`` (``kk`` even) and the next ones: one load of each byte, both
    nibbles, one scale (a byte's two elements share their block: the blocksize is even)."""
    flat = rows + kk
    byte = tl.load(w_ptr + flat // 2, mask=mask, other=0).to(tl.int32)
    hi = tl.load(qm_ptr + (byte >> 4), mask=mask, other=0.0)
    lo = tl.load(qm_ptr + (byte & 15), mask=mask, other=0.0)
    scale = _scale(flat // BS, a_ptr, na_ptr, nqm_ptr, noff_ptr, mask, DOUBLE)
    return hi * scale, lo * scale


@triton.jit
def _gemv_kernel(x_ptr, out_ptr, bias_ptr, weights_ptr, ids_ptr,
                 w_ptr, w_st, a_ptr, a_st, na_ptr, na_st, nqm_ptr, nqm_st, noff_ptr, noff_st, qm_ptr, qm_st,
                 N, K: tl.constexpr, TOP_K: tl.constexpr, DOWN: tl.constexpr, HAS_BIAS: tl.constexpr,
                 DOUBLE: tl.constexpr, BS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """up (``DOWN`` False): ``out[p] = W[ids[p]] @ x[p // TOP_K] (+ bias[p])``, one program per pair and block of
    outputs; down: ``out[t] = sum_j weights[t, j] * (W[ids[t, j]] @ x[t * TOP_K + j] (+ bias))``."""
    row = tl.program_id(0).to(tl.int64)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    offs_j = tl.arange(0, BLOCK_K // 2)
    total = tl.zeros([BLOCK_N], dtype=tl.float32)
    rows = offs_n.to(tl.int64)[:, None] * K
    for j in range(0, TOP_K if DOWN else 1):
        p = row * TOP_K + j if DOWN else row
        e = tl.load(ids_ptr + p).to(tl.int64)
        x_row = x_ptr + (p if DOWN else p // TOP_K) * K
        acc = tl.zeros([BLOCK_N], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            kk = k0 + 2 * offs_j  # the even element of each byte
            k_mask = kk < K
            mask = n_mask[:, None] & k_mask[None, :]
            w_even, w_odd = _decode_bytes(rows, kk[None, :], w_ptr + e * w_st, a_ptr + e * a_st, na_ptr + e * na_st,
                                          nqm_ptr + e * nqm_st, noff_ptr + e * noff_st, qm_ptr + e * qm_st, mask,
                                          DOUBLE, BS)
            x_even = tl.load(x_row + kk, mask=k_mask, other=0.0).to(tl.float32)
            x_odd = tl.load(x_row + kk + 1, mask=k_mask, other=0.0).to(tl.float32)
            acc += tl.sum(w_even * x_even[None, :] + w_odd * x_odd[None, :], axis=1)
        if HAS_BIAS:
            acc += tl.load(bias_ptr + p * N + offs_n, mask=n_mask, other=0.0).to(tl.float32)
        if DOWN:
            total += tl.load(weights_ptr + p).to(tl.float32) * acc
        else:
            total = acc
    tl.store(out_ptr + row * N + offs_n, total.to(out_ptr.dtype.element_ty), mask=n_mask)


@triton.jit
def _grouped_kernel(x_ptr, out_ptr, bias_ptr, weights_ptr, rows_ptr, experts_ptr,
                    w_ptr, w_st, a_ptr, a_st, na_ptr, na_st, nqm_ptr, nqm_st, noff_ptr, noff_st, qm_ptr, qm_st,
                    N, K: tl.constexpr, TOP_K: tl.constexpr, DOWN: tl.constexpr, HAS_BIAS: tl.constexpr,
                    DOUBLE: tl.constexpr, BS: tl.constexpr, IEEE: tl.constexpr, BLOCK_M: tl.constexpr,
                    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """A block of ``BLOCK_M`` pairs of one expert (``rows``: pair ids, -1 padding) times a ``BLOCK_N`` slice of
    its matrix: ``out[p] = W[e] @ x[p // TOP_K or p] (+ bias) (* weights[p] when DOWN)``."""
    block = tl.program_id(0)
    e = tl.load(experts_ptr + block).to(tl.int64)
    if e >= 0:
        rows = tl.load(rows_ptr + block * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
        row_mask = rows >= 0
        src = tl.where(row_mask, rows if DOWN else rows // TOP_K, 0)
        offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        n_mask = offs_n < N
        offs_k = tl.arange(0, BLOCK_K)
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            kk = k0 + offs_k
            k_mask = kk < K
            a = tl.load(x_ptr + src[:, None] * K + kk[None, :], mask=row_mask[:, None] & k_mask[None, :], other=0.0)
            w = _decode(offs_n.to(tl.int64)[None, :] * K + kk[:, None], w_ptr + e * w_st, a_ptr + e * a_st,
                        na_ptr + e * na_st, nqm_ptr + e * nqm_st, noff_ptr + e * noff_st, qm_ptr + e * qm_st,
                        k_mask[:, None] & n_mask[None, :], DOUBLE, BS)  # [BLOCK_K, BLOCK_N]
            if IEEE:  # fp32 inputs: exact products, never TF32
                acc = tl.dot(a, w.to(a.dtype), acc, input_precision="ieee")
            else:
                acc = tl.dot(a, w.to(a.dtype), acc)
        safe = tl.where(row_mask, rows, 0)
        mask = row_mask[:, None] & n_mask[None, :]
        if HAS_BIAS:
            acc += tl.load(bias_ptr + safe[:, None] * N + offs_n[None, :], mask=mask, other=0.0).to(tl.float32)
        if DOWN:
            acc *= tl.load(weights_ptr + safe, mask=row_mask, other=0.0).to(tl.float32)[:, None]
        tl.store(out_ptr + safe[:, None] * N + offs_n[None, :], acc.to(out_ptr.dtype.element_ty), mask=mask)


def _tiles(n: int, k: int) -> tuple[int, int]:
    """Output rows per program and elements per K step of the GEMV: small tiles, so that a batch-1 call of a
    few experts still spreads over every SM (Qwen3-30B-A3B's down projection: 8 pairs x 2048 rows)."""
    return min(32, triton.next_power_of_2(n)), min(256, max(triton.next_power_of_2(k), 32))


def block_rows(rows_per_expert: float) -> int:
    """The grouped blocks' rows for a call whose routed experts have ``rows_per_expert`` rows on average: the
    narrowest of ``BLOCK_M`` and ``BLOCK_M_WIDE`` that holds them (each block decodes its expert's tile)."""
    for width in (BLOCK_M, *BLOCK_M_WIDE):
        if rows_per_expert <= width:
            return width
    return BLOCK_M_WIDE[-1]


def sort_pairs(ids: torch.Tensor, experts: int, block_m: int = BLOCK_M) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Pairs grouped by expert into blocks of ``block_m`` rows (``rows``: pair ids, -1 where an expert's group is
    padded), each block's expert (-1: an unused block) and ``block_m``: static sizes (at most P / block_m +
    experts blocks), so nothing is read back to the host."""
    flat = ids.reshape(-1).long()
    pairs = flat.numel()
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=experts)
    padded = (counts + block_m - 1) // block_m * block_m
    start = torch.cumsum(counts, 0) - counts  # of each expert in the sorted pairs
    padded_start = torch.cumsum(padded, 0) - padded
    sorted_experts = flat[order]
    position = padded_start[sorted_experts] + torch.arange(pairs, device=flat.device) - start[sorted_experts]
    blocks = pairs // block_m + min(experts, pairs)
    rows = torch.full((blocks * block_m,), -1, dtype=torch.int64, device=flat.device)
    rows[position] = order
    block_experts = torch.full((blocks,), -1, dtype=torch.int64, device=flat.device)
    block_experts[position // block_m] = sorted_experts
    return rows, block_experts, block_m


def up(x: torch.Tensor, ids: torch.Tensor, op: Operand, sorted_pairs=None) -> torch.Tensor:
    """``[P, n]``: pair p (``ids`` ``[T, k]``, flat) is ``x[p // k]`` times its expert's matrix (+ bias)."""
    return _run(x.contiguous(), ids, op, None, sorted_pairs, down=False)


def down(h: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, op: Operand, out_dtype: torch.dtype,
         sorted_pairs=None) -> torch.Tensor:
    """``[T, n]``: each token's ``k`` rows of ``h`` ``[T * k, K]`` through their experts' matrices (+ bias),
    weighted by ``weights`` ``[T, k]`` and summed in fp32."""
    tokens, top_k = weights.shape
    if sorted_pairs is None and tokens <= GEMV_ROWS:
        out = torch.empty((tokens, op.n), dtype=out_dtype, device=h.device)
        return _launch_gemv(h.contiguous(), out, ids, weights.contiguous(), op, top_k, down=True)
    rows = _run(h.contiguous(), ids, op, weights.contiguous(), sorted_pairs, down=True)  # [P, n], weighted, fp32
    return rows.view(tokens, top_k, op.n).sum(dim=1).to(out_dtype)


def _run(x, ids, op: Operand, weights, sorted_pairs, down: bool) -> torch.Tensor:
    top_k = ids.shape[-1]
    pairs = ids.numel()
    if sorted_pairs is None and pairs // top_k <= GEMV_ROWS and not down:
        out = torch.empty((pairs, op.n), dtype=x.dtype, device=x.device)
        return _launch_gemv(x, out, ids, None, op, top_k, down=False)
    rows, experts, block_m = sorted_pairs
    out = torch.empty((pairs, op.n), dtype=torch.float32 if down else x.dtype, device=x.device)
    block_n, block_k = 64, 64
    bias = op.bias_rows(ids)
    grid = (experts.numel(), triton.cdiv(op.n, block_n))
    _grouped_kernel[grid](x, out, bias if bias is not None else out, weights if weights is not None else out, rows,
                          experts, *op.args(), op.n, op.k, top_k, DOWN=down, HAS_BIAS=bias is not None,
                          DOUBLE=op.double, BS=op.blocksize, IEEE=x.dtype == torch.float32, BLOCK_M=block_m,
                          BLOCK_N=block_n, BLOCK_K=block_k,
                          num_warps=4, num_stages=GROUPED_STAGES)
    return out


def _launch_gemv(x, out, ids, weights, op: Operand, top_k: int, down: bool) -> torch.Tensor:
    block_n, block_k = _tiles(op.n, op.k)
    bias = op.bias_rows(ids)
    grid = (out.shape[0], triton.cdiv(op.n, block_n))
    _gemv_kernel[grid](x, out, bias if bias is not None else out, weights if weights is not None else out,
                       ids.reshape(-1).contiguous(), *op.args(), op.n, op.k, top_k, DOWN=down,
                       HAS_BIAS=bias is not None, DOUBLE=op.double, BS=op.blocksize, BLOCK_N=block_n,
                       BLOCK_K=block_k, num_warps=4)
    return out


# -- tiered: experts read where they are, by the routing on the device -------------------------------------
# Few-row calls whose experts are not copied first: each expert is read by the kernel itself from the VRAM
# cache slot that holds it, or else straight from the pinned RAM tier over the link (unified virtual
# addressing: the GPU dereferences page-locked host memory). The routing never goes to the host, so a MoE
# layer queues its work without a sync and the host runs ahead of the GPU.
#
# Reading host memory from a kernel is latency-bound: a byte load per nibble pair (``_gemv_kernel``) reads the
# link at ~13 GB/s (engine/uva_copy). Here each thread loads 16 contiguous bytes of a row at a time (int32 words,
# eight nibbles each), and many programs are in flight. Measured (H200, Qwen3-30B-A3B batch 1, a step's 96
# launches reading ~1 GB, mostly from the RAM tier): 29.8 ms, ~34 GB/s, 0.62 of the copy engine's 55 GB/s.
@dataclass(frozen=True)
class ImageMatrix(ImageBuffers):
    """One ``[n, k]`` NF4 matrix inside an expert's image: the byte offset of each of its buffers
    (``BUFFERS``; absent double-quant buffers: None) and of its bias row ``[n]`` (offset, dtype) if any."""

    n: int
    k: int
    blocksize: int
    double: bool
    offsets: tuple[int | None, ...]
    bias: tuple[int, torch.dtype] | None = None
    FILL = BUFFERS.index("quant_map")  # every NF4 image has its code book


@triton.jit
def _tiered_gemv_kernel(x_ptr, out_ptr, weights_ptr, ids_ptr, table_ptr, counts_ptr, hits_ptr,
                        host_ptr, host_start, host_stride, pool_ptr, slot_bytes,
                        off_w, off_a, off_na, off_nqm, off_noff, off_qm, off_bias,
                        qmd_ptr, nqmd_ptr,
                        N, K: tl.constexpr, TOP_K: tl.constexpr, DOWN: tl.constexpr, COUNT: tl.constexpr,
                        DOUBLE: tl.constexpr, BIAS: tl.constexpr, BS: tl.constexpr, BLOCK_N: tl.constexpr,
                        BLOCK_W: tl.constexpr, PREFETCH: tl.constexpr, TABLES: tl.constexpr,
                        SPLIT: tl.constexpr):
    """As ``_gemv_kernel`` (up: one program per pair and block of outputs; down: per token, its ``TOP_K``
    pairs weighted and summed), each pair's expert image found by ``table``: a pool slot or the RAM tier.
    ``COUNT``: the programs of the first output block also count each pair's expert and pool hits. ``BIAS``
    (``BIAS_KINDS``, 0: none): the expert's bias row, added to its product before the routing weight.
    ``PREFETCH``: a K step's words are loaded while the step before is computed (two steps' loads in flight).
    ``TABLES``: the code books are read from ``qmd_ptr``/``nqmd_ptr`` (device copies shared by every expert)
    instead of each image's own (host memory for an expert of the RAM tier). ``SPLIT`` (down): one program per
    pair and block of outputs, its weighted product stored at the pair's row (the caller sums a token's rows):
    ``TOP_K`` times the programs of a token's loop, for batch-1 calls whose token loop leaves SMs idle."""
    row = tl.program_id(0).to(tl.int64)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    offs_w = tl.arange(0, BLOCK_W)  # int32 words: 8 elements each
    rows = offs_n.to(tl.int64) * K
    row_words = offs_n.to(tl.int64) * (K // 8)
    total = tl.zeros([BLOCK_N], dtype=tl.float32)
    for j in range(0, TOP_K if DOWN and not SPLIT else 1):
        p = row * TOP_K + j if DOWN and not SPLIT else row
        e = tl.load(ids_ptr + p).to(tl.int64)
        slot = tl.load(table_ptr + e).to(tl.int64)
        if slot >= 0:
            base = pool_ptr + slot * slot_bytes
        else:
            base = host_ptr + host_start + e * host_stride
        if COUNT:
            if tl.program_id(1) == 0:
                tl.atomic_add(counts_ptr + e, 1)
                tl.atomic_add(hits_ptr, (slot >= 0).to(tl.int64))
        w_ptr = (base + off_w).to(tl.pointer_type(tl.int32))
        if DOUBLE:
            a_ptr = (base + off_a).to(tl.pointer_type(tl.uint8))
        else:
            a_ptr = (base + off_a).to(tl.pointer_type(tl.float32))
        na_ptr = (base + off_na).to(tl.pointer_type(tl.float32))
        noff_ptr = (base + off_noff).to(tl.pointer_type(tl.float32))
        if TABLES:
            nqm_ptr = nqmd_ptr
            qm_ptr = qmd_ptr
        else:
            nqm_ptr = (base + off_nqm).to(tl.pointer_type(tl.float32))
            qm_ptr = (base + off_qm).to(tl.pointer_type(tl.float32))
        x_row = x_ptr + (p if DOWN else p // TOP_K) * K
        acc = tl.zeros([BLOCK_N], dtype=tl.float32)
        if PREFETCH:
            ahead = tl.load(w_ptr + row_words[:, None] + offs_w[None, :],
                            mask=n_mask[:, None] & (8 * offs_w < K)[None, :], other=0)
        for k0 in range(0, K, 8 * BLOCK_W):
            cols = k0 + 8 * offs_w  # the first element of each word
            k_mask = cols < K
            mask = n_mask[:, None] & k_mask[None, :]
            # contiguous words along a row (k0 // 8 + offs_w), so each thread's loads are 16-byte vectors
            if PREFETCH:
                words = ahead
                ahead = tl.load(w_ptr + row_words[:, None] + (k0 // 8 + BLOCK_W + offs_w)[None, :],
                                mask=n_mask[:, None] & (cols + 8 * BLOCK_W < K)[None, :], other=0)
            else:
                words = tl.load(w_ptr + row_words[:, None] + (k0 // 8 + offs_w)[None, :], mask=mask, other=0)
            part = tl.zeros([BLOCK_N, BLOCK_W], dtype=tl.float32)
            for m in tl.static_range(8):
                # element m of a word: byte m // 2 (little-endian), the high nibble for the even element
                nibble = (words >> (8 * (m // 2) + 4 * (1 - m % 2))) & 15
                xm = tl.load(x_row + cols + m, mask=k_mask, other=0.0).to(tl.float32)
                part += tl.load(qm_ptr + nibble) * xm[None, :]
            scale = _scale((rows[:, None] + cols[None, :]) // BS, a_ptr, na_ptr, nqm_ptr, noff_ptr, mask, DOUBLE)
            acc += tl.sum(part * scale, axis=1)
        if BIAS == 1:
            acc += tl.load((base + off_bias).to(tl.pointer_type(tl.float32)) + offs_n, mask=n_mask, other=0.0)
        elif BIAS == 2:
            acc += tl.load((base + off_bias).to(tl.pointer_type(tl.bfloat16)) + offs_n, mask=n_mask,
                           other=0.0).to(tl.float32)
        elif BIAS == 3:
            acc += tl.load((base + off_bias).to(tl.pointer_type(tl.float16)) + offs_n, mask=n_mask,
                           other=0.0).to(tl.float32)
        if DOWN:
            total += tl.load(weights_ptr + p).to(tl.float32) * acc
        else:
            total = acc
    tl.store(out_ptr + row * N + offs_n, total.to(out_ptr.dtype.element_ty), mask=n_mask)


@dataclass(frozen=True)
class TieredConfig:
    """A launch of the tiered kernel: outputs per program (``block_n``), int32 words of a row per K step
    (``block_w``), warps, whether a step's loads are issued a step ahead (``prefetch``); None: ``_tiered_tiles``."""

    block_n: int | None = None
    block_w: int | None = None
    warps: int = 4
    prefetch: bool = False
    split: bool = False  # down: a program per pair, a token's pairs summed after (``SPLIT``)


# The launch of each projection's tiered calls (benchmarks/uva_bench.py sweeps the alternatives). Down: 32
# outputs a program, loads a step ahead: Qwen3-30B-A3B's down projection (a token's 8 pairs in one program's
# loop, 64 programs at batch 1) read host RAM at 43 GB/s against 31 with 16 and no prefetch, Mixtral's the
# same within 1 % (H200, code books from device copies, results/uva_bench.json).
TIERED = {"up": TieredConfig(), "down": TieredConfig(block_n=32, prefetch=True)}


def _tiered_tiles(n: int, k: int, down: bool, config: TieredConfig = TieredConfig()) -> tuple[int, int]:
    """(outputs per program, words per K step): 32 words (256 elements, 128 bytes of a row: one line of the
    link) per step; outputs per program small enough that a batch-1 call spreads over every SM with enough
    loads in flight to cover the link's latency (the down projection runs a token's pairs in one program)."""
    words = min(config.block_w or 32, max(triton.next_power_of_2(k) // 8, 1))
    return min(config.block_n or (16 if down else 32), triton.next_power_of_2(n)), words


def tiered_up(x: torch.Tensor, ids: torch.Tensor, m: ImageMatrix, tiers: Tiers) -> torch.Tensor:
    """``[P, n]``: pair p (``ids`` ``[T, k]``, flat) is ``x[p // k]`` times its expert's matrix, the expert read
    where ``tiers`` has it; counts each pair's expert and pool hit."""
    top_k, pairs = ids.shape[-1], ids.numel()
    out = torch.empty((pairs, m.n), dtype=x.dtype, device=x.device)
    return _launch_tiered(x.contiguous(), out, ids, None, m, tiers, top_k, down=False)


def tiered_down(h: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, m: ImageMatrix, tiers: Tiers,
                out_dtype: torch.dtype) -> torch.Tensor:
    """``[T, n]``: each token's ``k`` rows of ``h`` ``[T * k, K]`` through their experts' matrices, weighted by
    ``weights`` ``[T, k]`` and summed in fp32."""
    tokens, top_k = weights.shape
    if TIERED["down"].split:  # each pair's weighted product in fp32, a token's rows summed in fp32
        parts = torch.empty((tokens * top_k, m.n), dtype=torch.float32, device=h.device)
        _launch_tiered(h.contiguous(), parts, ids, weights.contiguous(), m, tiers, top_k, down=True)
        return parts.view(tokens, top_k, m.n).sum(1).to(out_dtype)
    out = torch.empty((tokens, m.n), dtype=out_dtype, device=h.device)
    return _launch_tiered(h.contiguous(), out, ids, weights.contiguous(), m, tiers, top_k, down=True)


def _launch_tiered(x, out, ids, weights, m: ImageMatrix, tiers: Tiers, top_k: int, down: bool) -> torch.Tensor:
    if m.k % 8 or m.blocksize % 8:
        raise ValueError(f"tiered NF4 GEMV needs in_features ({m.k}) and blocksize ({m.blocksize}) multiples of 8")
    config = TIERED["down" if down else "up"]
    block_n, block_w = _tiered_tiles(m.n, m.k, down, config)
    grid = (out.shape[0], triton.cdiv(m.n, block_n))
    tables = tiers.quant_map is not None and (tiers.nested_quant_map is not None or not m.double)
    qmd = tiers.quant_map if tables else tiers.table
    nqmd = tiers.nested_quant_map if tables and m.double else qmd
    _tiered_gemv_kernel[grid](x, out, weights if weights is not None else out, ids.reshape(-1).contiguous(),
                              tiers.table, tiers.counts, tiers.hits, tiers.host, tiers.host_start,
                              tiers.host_stride, tiers.pool, tiers.pool.shape[1], *m.args(), qmd, nqmd, m.n, m.k,
                              top_k, DOWN=down, COUNT=not down, DOUBLE=m.double, BIAS=m.bias_kind, BS=m.blocksize,
                              BLOCK_N=block_n, BLOCK_W=block_w, PREFETCH=config.prefetch, TABLES=tables,
                              SPLIT=down and config.split, num_warps=config.warps)
    return out
