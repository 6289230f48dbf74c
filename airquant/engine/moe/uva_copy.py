"""All of a call's expert copies in one kernel launch: the GPU reads the pinned RAM tier directly (UVA).

A routed MoE call's misses are one copy per expert tensor slice (the manifest's byte ranges: an NF4 expert has
12 slices), each a ``cudaMemcpyAsync`` of ~14 us of host time through torch: ~1.3 ms a layer for Qwen3-30B-A3B's
8 experts, 65 ms a step, more than the link time of the bytes (0.35 ms a layer). Pinned host memory is mapped
into the device's address space on 64-bit systems (unified virtual addressing), so one kernel can read every
slice of the call over the link and write it into its slot: one launch and one small descriptor copy a call.
Whether the host buffers are reachable is probed once (``probe``); where not, the pool keeps its per-slice
copies.

Each program copies one ``CHUNK`` of one slice (a descriptor row: source byte, destination byte, length);
programs past a slice's end return at once.
"""

from __future__ import annotations

import logging

import torch
import triton
import triton.language as tl

log = logging.getLogger(__name__)
CHUNK = 1 << 16  # bytes a program copies: Qwen3-30B-A3B's largest slice (1.5 MB) is 24 programs
BLOCK = 2048  # bytes a program moves per step (a warp's loads coalesce into 128-byte link reads)


@triton.jit
def _gather_kernel(src_ptr, dst_ptr, table_ptr, CHUNK: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    first = tl.program_id(1).to(tl.int64) * CHUNK
    src = tl.load(table_ptr + row * 3)
    dst = tl.load(table_ptr + row * 3 + 1)
    length = tl.load(table_ptr + row * 3 + 2)
    if first < length:
        offs = tl.arange(0, BLOCK)
        for at in range(0, CHUNK, BLOCK):
            pos = first + at + offs
            mask = pos < length
            tl.store(dst_ptr + dst + pos, tl.load(src_ptr + src + pos, mask=mask), mask=mask)


def gather(src: torch.Tensor, dst: torch.Tensor, table: torch.Tensor, longest: int) -> None:
    """Copy ``table``'s slices (rows of source byte, destination byte, length; int64 on ``dst``'s device)
    from ``src`` (pinned host bytes) into ``dst`` (device bytes), on the current stream."""
    grid = (table.shape[0], triton.cdiv(longest, CHUNK))
    _gather_kernel[grid](src, dst, table, CHUNK=CHUNK, BLOCK=BLOCK, num_warps=4)


def probe(src: torch.Tensor, device: torch.device) -> bool:
    """Whether the kernel can read ``src`` (a pinned host buffer) on ``device`` and copies it exactly: the
    first bytes of it against a copy by the copy engine."""
    n = min(src.numel(), 1 << 20)
    if n == 0:
        return False
    try:
        want = src[:n].to(device)
        got = torch.empty(n, dtype=torch.uint8, device=device)
        table = torch.tensor([[0, 0, n]], dtype=torch.int64, device=device)
        gather(src, got, table, n)
        ok = bool(torch.equal(got, want))
    except (ValueError, RuntimeError) as exc:  # Triton's "cannot be accessed" check, a driver refusal
        log.info("expert copies by one kernel are off: the GPU cannot read the pinned RAM tier (%s)", exc)
        return False
    if not ok:
        log.warning("expert copies by one kernel are off: a probe copy differed from the copy engine's")
    return ok
