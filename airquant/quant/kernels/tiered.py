"""What the tiered expert kernels of direct reads share (engine/moe/direct.py: each few-row call's experts read by
the kernel where they are, the VRAM hot set or the pinned RAM tier): the layer's ``Tiers``, the expert-image
lookup with its device counters, and the bias row an image may hold. The int2 and GPTQ tiered kernels
(``int2_moe``, ``gptq_moe``) call these helpers (Triton inlines them); the NF4 one (``nf4_moe``), tuned and
measured on the H200 before they existed, keeps its own copy of the same lines."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

# The dtype of an expert's dense bias rows in its image, as the tiered kernels' BIAS code (0: no bias).
BIAS_KINDS = {torch.float32: 1, torch.bfloat16: 2, torch.float16: 3}


@dataclass(frozen=True)
class Tiers:
    """Where one layer's experts are: ``host`` (uint8, the RAM tier's layer buffer; expert e's image at
    ``host_start + e * host_stride``), ``pool`` (uint8 ``[slots, slot_bytes]``; slot s's image at
    ``s * slot_bytes``), ``table`` (int32 ``[E]``, on the device: the slot holding expert e, -1 for none) and
    per-layer counters on the device (``counts`` int32 ``[E]``: pairs routed to each expert; ``hits`` int64
    ``[1]``: pairs read from the pool)."""

    host: torch.Tensor
    host_start: int
    host_stride: int
    pool: torch.Tensor
    table: torch.Tensor
    counts: torch.Tensor
    hits: torch.Tensor
    quant_map: torch.Tensor | None = None  # NF4: fp32 [16] on the device, every expert's code book where all agree
    nested_quant_map: torch.Tensor | None = None  # NF4: fp32 [256], the same for the nested code book


class ImageBuffers:
    """What a format's image matrix (``nf4_moe.ImageMatrix``, ``int2_moe.ImageMatrixInt2``,
    ``gptq_moe.ImageMatrixGPTQ``) shares: the byte offset of each of its buffers in an expert's image (None:
    absent, never read) and its bias row ``[n]`` (offset, dtype) if any."""

    offsets: tuple[int | None, ...]
    bias: tuple[int, torch.dtype] | None
    FILL = 0  # the buffer whose offset an absent one's argument takes

    def args(self) -> list[int]:
        """The tiered kernel's offset arguments: the buffers' (an absent one as ``FILL``'s) and the bias row's."""
        fill = self.offsets[self.FILL]
        return [fill if off is None else off for off in self.offsets] + [self.bias[0] if self.bias else 0]

    @property
    def bias_kind(self) -> int:
        """The BIAS code of the bias row, 0 for none."""
        if self.bias is None:
            return 0
        if self.bias[1] not in BIAS_KINDS:
            raise ValueError(f"tiered expert GEMV: bias dtype {self.bias[1]} is not one of {list(BIAS_KINDS)}")
        return BIAS_KINDS[self.bias[1]]


@triton.jit
def expert_image(ids_ptr, p, table_ptr, counts_ptr, hits_ptr, host_ptr, host_start, host_stride, pool_ptr,
                 slot_bytes, COUNT: tl.constexpr):
    """Pair ``p``'s expert image (a uint8 pointer): its hot-set slot where the table has one, else its place in
    the RAM tier. ``COUNT``: the programs of the first output block count the pair's expert and pool hit."""
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
    return base


@triton.jit
def add_bias(acc, base, off_bias, offs_n, n_mask, BIAS: tl.constexpr):
    """``acc`` plus the image's bias row at ``off_bias`` (``BIAS_KINDS`` code; 0: none), in fp32."""
    if BIAS == 1:
        acc += tl.load((base + off_bias).to(tl.pointer_type(tl.float32)) + offs_n, mask=n_mask, other=0.0)
    elif BIAS == 2:
        acc += tl.load((base + off_bias).to(tl.pointer_type(tl.bfloat16)) + offs_n, mask=n_mask,
                       other=0.0).to(tl.float32)
    elif BIAS == 3:
        acc += tl.load((base + off_bias).to(tl.pointer_type(tl.float16)) + offs_n, mask=n_mask,
                       other=0.0).to(tl.float32)
    return acc


def launch_args(tiers: Tiers) -> list:
    """The tiered kernels' table, counter and tier arguments, in their order."""
    return [tiers.table, tiers.counts, tiers.hits, tiers.host, tiers.host_start, tiers.host_stride, tiers.pool,
            tiers.pool.shape[1]]
