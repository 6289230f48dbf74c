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


# -- speculative reads (engine/moe/direct.py ``DirectReads.speculate``) --------------------------------------
# A layer's guessed experts planned and copied in two launches beside its attention, with no host sync:
# ``spec_plan`` takes the router's logits, picks the top ``K`` (first index on ties, a NaN logit never), points the
# layer's table at the guesses' slots (a hot-set entry stays) and counts; ``gather_images`` copies the guessed
# images that were not in the hot set from the RAM tier into those slots. The gather reads 4-byte words where
# every address is 16-byte aligned (the copy of 2 Qwen3-30B-A3B images by byte loads ran ~26 GB/s on an H100
# beside the attention, where a kernel's word loads get ~51 of the link's 55: results/uva_bench.json), in
# at most ``IMAGE_PROGRAMS`` programs, each looping over chunks of ``IMAGE_CHUNK`` bytes. Why few: a program per
# 16 KB chunk (338 for 2 images) copied at 51 GB/s but sat on every SM, and the attention kernel beside it
# (larger shared memory) started ~55 us late each layer, until the copy drained (wave3_moe36 trace, H100): the
# step gained 0.5 ms where its kernels read 4.5 ms less. The rest of the SMs stay free for the attention.
IMAGE_CHUNK = 1 << 14
IMAGE_BLOCK = 8192  # bytes a program moves per step (2048 words: two 16-byte loads a thread at 8 warps)
IMAGE_WARPS = 8
IMAGE_PROGRAMS = 48  # over all guesses of a call


@triton.jit
def _spec_plan_kernel(logits_ptr, experts, table_ptr, slots_ptr, guess_ptr, free_ptr, copied_ptr, calls_ptr,
                      K: tl.constexpr, BLOCK_E: tl.constexpr):
    offs = tl.arange(0, BLOCK_E)
    x = tl.load(logits_ptr + offs, mask=offs < experts, other=float("-inf")).to(tl.float32)
    x = tl.where(x == x, x, float("-inf"))  # NaN: never a guess
    copied = tl.zeros((), tl.int64)
    for j in tl.static_range(K):
        best = tl.max(x, axis=0)
        e = tl.min(tl.where((x == best) & (offs < experts), offs, BLOCK_E), axis=0)
        ok = e < experts
        e = tl.where(ok, e, 0)
        held = tl.load(table_ptr + e)
        free = ok & (held < 0)
        tl.store(guess_ptr + j, e)
        tl.store(free_ptr + j, free.to(tl.int32))
        tl.store(table_ptr + e, tl.where(free, tl.load(slots_ptr + j), held))
        copied += free.to(tl.int64)
        x = tl.where(offs == e, float("-inf"), x)
    tl.store(copied_ptr, tl.load(copied_ptr) + copied)
    tl.store(calls_ptr, tl.load(calls_ptr) + 1)


@triton.jit
def _gather_images_kernel(src_ptr, dst_ptr, guess_ptr, free_ptr, slots_ptr, start, stride, row, length,
                          ROUNDS: tl.constexpr, WORDS: tl.constexpr, CHUNK: tl.constexpr,
                          BLOCK: tl.constexpr):
    """Program (j, p) copies chunks p, p + P, ... (P programs a guess, ``ROUNDS`` chunks each) of guess j's image
    when it is to be copied; units are 4-byte words where ``WORDS`` (every address a multiple of 16 bytes,
    ``length`` of 64), else bytes."""
    j = tl.program_id(0)
    if WORDS:
        source = src_ptr.to(tl.pointer_type(tl.int32))
        target = dst_ptr.to(tl.pointer_type(tl.int32))
    else:
        source = src_ptr
        target = dst_ptr
    if tl.load(free_ptr + j) != 0:
        s = start + tl.load(guess_ptr + j).to(tl.int64) * stride
        d = tl.load(slots_ptr + j).to(tl.int64) * row
        if WORDS:
            s = tl.multiple_of(s, 4)
            d = tl.multiple_of(d, 4)
        offs = tl.arange(0, BLOCK)
        for r in range(0, ROUNDS):
            first = (tl.program_id(1).to(tl.int64) + r * tl.num_programs(1)) * CHUNK
            for at in range(0, CHUNK, BLOCK):
                pos = first + at + offs
                mask = pos < length
                tl.store(target + d + pos, tl.load(source + s + pos, mask=mask), mask=mask)


@triton.jit
def _spec_settle_kernel(table_ptr, guess_ptr, free_ptr, slots_ptr, K: tl.constexpr):
    for j in tl.static_range(K):
        e = tl.load(guess_ptr + j)
        slot = tl.load(slots_ptr + j)
        if (tl.load(free_ptr + j) != 0) & (tl.load(table_ptr + e) == slot):
            tl.store(table_ptr + e, -1)


def spec_plan(logits: torch.Tensor, table: torch.Tensor, slots: torch.Tensor, guess: torch.Tensor,
              free: torch.Tensor, copied: torch.Tensor, calls: torch.Tensor) -> None:
    """The ``guess.numel()`` largest of ``logits`` [E]: their ids into ``guess`` (int64), whether each is to be
    copied (not in the hot set: ``table`` entry < 0) into ``free`` (int32), ``table`` (a layer's int32 row)
    pointed at ``slots``' (int32) slot for those; ``copied`` += their count and ``calls`` += 1 (int64 [1])."""
    k = guess.numel()
    _spec_plan_kernel[(1,)](logits, logits.numel(), table, slots, guess, free, copied, calls, K=k,
                            BLOCK_E=triton.next_power_of_2(max(logits.numel(), 16)), num_warps=1)


def gather_images(src: torch.Tensor, dst: torch.Tensor, guess: torch.Tensor, free: torch.Tensor,
                  slots: torch.Tensor, start: int, stride: int, length: int, experts: int) -> None:
    """For each guess j (< ``experts``) with ``free[j]``: ``length`` bytes of ``src`` (pinned host bytes) from
    ``start + guess[j] * stride`` into row ``slots[j]`` of ``dst`` (device bytes [slots, row]), on the current
    stream. In 4-byte words, the run rounded up to 64 bytes (a length Triton knows divides by 16 words: 16-byte
    loads), where every address is 16-byte aligned and the rounded run of every expert stays inside ``src``, its
    stride and a row; bytes otherwise."""
    row = dst.shape[1]
    wide = -(-length // 64) * 64
    words = all(v % 16 == 0 for v in (start, stride, row, src.data_ptr(), dst.data_ptr())) and \
        wide <= min(row, stride) and start + (experts - 1) * stride + wide <= src.numel()
    unit = 4 if words else 1
    n = (wide if words else length) // unit
    chunk = IMAGE_CHUNK // unit
    chunks = triton.cdiv(n, chunk)
    per_guess = max(1, min(chunks, IMAGE_PROGRAMS // max(guess.numel(), 1)))
    rounds = triton.cdiv(chunks, per_guess)
    _gather_images_kernel[(guess.numel(), per_guess)](src, dst, guess, free, slots, start // unit, stride // unit,
                                                      row // unit, n, ROUNDS=rounds, WORDS=words, CHUNK=chunk,
                                                      BLOCK=IMAGE_BLOCK // unit, num_warps=IMAGE_WARPS)


def spec_settle(table: torch.Tensor, guess: torch.Tensor, free: torch.Tensor, slots: torch.Tensor) -> None:
    """After the layer's kernels: each copied guess whose ``table`` entry still points at its slot points back at
    the RAM tier (-1); an entry a hot-set refresh rewrote meanwhile keeps the hot slot."""
    _spec_settle_kernel[(1,)](table, guess, free, slots, K=guess.numel(), num_warps=1)
