"""transformers' standard rotary embedding of the query and key as one kernel on CUDA, bit for bit the eager result.

Most decoder families (Llama, Mistral, Mixtral, Qwen2/3 and their MoE variants, ...) rotate with the same two
module-level functions: ``rotate_half`` (two slices, a negation, a concatenation) and ``apply_rotary_pos_emb``
(two unsqueezes, then ``q * cos + rotate_half(q) * sin`` and the same for the key): about ten small kernels a
layer at decode. In a Qwen3-30B-A3B batch-1 pass replayed as one graph they are part of ~38 small kernels a layer
that took 3.5 of the pass's 10.7 ms of device time, and each node of the graph costs the GPU a gap as well
(H100, moe_bench trace, wave3_moe25).

``fuse_rope`` gives a model's modeling module(s) whose two functions are exactly those (``standard_rotary``, by their
source) ``FusedRope`` in place of ``apply_rotary_pos_emb``: with ``FUSED_ROPE`` and CUDA tensors of the usual
shapes (query ``[B, Hq, T, D]``, key ``[B, Hk, T, D]``, cos and sin ``[B, T, D]``, one dtype, ``unsqueeze_dim`` 1)
one Triton launch rotates both, rounding where the eager ops round (each product to the dtype, then their sum), so
the result equals the eager one exactly; any other call runs the original function. The replaced name is the
modeling module's, so the original keeps running for every call that does not qualify.

On by default since measured on a GPU against the eager ops (``benchmarks/moe_bench.py``, each case in its own
process, an H100, wave3_moe27): Qwen3-30B-A3B NF4 under 4 GB at batch 1, the hot set 0.0134 s a step against 0.0141
(74.9 tokens/s against 70.7), no cache 0.0312 s against 0.0320. ``*_eagerrope`` cases are the A/B since.
"""

from __future__ import annotations

import functools
import sys

import torch
from torch import nn

from airquant.engine.moe.compute import fused_runs_on
from airquant.engine.norms import function_body

FUSED_ROPE = True

STANDARD_APPLY = (
    "cos = cos.unsqueeze(unsqueeze_dim)",
    "sin = sin.unsqueeze(unsqueeze_dim)",
    "q_embed = q * cos + rotate_half(q) * sin",
    "k_embed = k * cos + rotate_half(k) * sin",
    "return (q_embed, k_embed)",
)
STANDARD_ROTATE = (
    "x1 = x[..., :x.shape[-1] // 2]",
    "x2 = x[..., x.shape[-1] // 2:]",
    "return torch.cat((-x2, x1), dim=-1)",
)
APPLY_ARGS = (("q", "k", "cos", "sin", "unsqueeze_dim"), ("q", "k", "cos", "sin", "position_ids", "unsqueeze_dim"))


def standard_rotary(module) -> bool:
    """Whether a modeling module's ``apply_rotary_pos_emb`` and ``rotate_half`` are transformers' standard ones."""
    apply, rotate = getattr(module, "apply_rotary_pos_emb", None), getattr(module, "rotate_half", None)
    if isinstance(apply, FusedRope):
        apply = apply.original
    if not callable(apply) or not callable(rotate):
        return False
    return _same(apply, APPLY_ARGS, STANDARD_APPLY) and _same(rotate, (("x",),), STANDARD_ROTATE)


@functools.cache
def _same(fn, args: tuple, body: tuple) -> bool:
    found = function_body(fn)
    return found is not None and found[0] in args and found[1] == body


class FusedRope:
    """A modeling module's ``apply_rotary_pos_emb``: one kernel where the call qualifies, the original elsewhere."""

    def __init__(self, original):
        self.original = original
        functools.update_wrapper(self, original)

    def __call__(self, q, k, cos, sin, *args, **kwargs):
        if FUSED_ROPE and not args and set(kwargs) <= {"unsqueeze_dim"} and kwargs.get("unsqueeze_dim", 1) == 1 \
                and applies(q, k, cos, sin):
            return rotate(q, k, cos, sin)
        return self.original(q, k, cos, sin, *args, **kwargs)


def applies(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> bool:
    """Whether ``rotate`` takes the call: Triton runs on ``q`` (``fused_runs_on``: CUDA, or the interpreter), one
    dtype, the usual shapes, rows contiguous."""
    if not fused_runs_on(q):
        return False
    if q.dim() != 4 or k.dim() != 4 or cos.dim() != 3 or cos.shape != sin.shape:
        return False
    b, _, t, d = q.shape
    if k.shape[0] != b or k.shape[2:] != (t, d) or cos.shape != (b, t, d) or d % 2 or d > 1024:
        return False
    if len({q.dtype, k.dtype, cos.dtype, sin.dtype}) != 1 or q.dtype not in (torch.float16, torch.bfloat16,
                                                                               torch.float32):
        return False
    return all(x.stride(-1) == 1 for x in (q, k, cos, sin)) and len({q.device, k.device, cos.device,
                                                                      sin.device}) == 1


def rotate(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """``apply_rotary_pos_emb(q, k, cos, sin)`` by one launch (``applies`` must hold); outputs laid out as the
    inputs (as the eager ops lay them out)."""
    import triton

    from airquant.engine import rope_kernel

    qo, ko = torch.empty_like(q), torch.empty_like(k)
    b, hq, t, d = q.shape
    hk = k.shape[1]
    rope_kernel.rope_kernel[(b * t, hq + hk)](
        q, k, qo, ko, cos, sin, hq, t, *q.stride()[:3], *k.stride()[:3], *qo.stride()[:3], *ko.stride()[:3],
        *cos.stride()[:2], *sin.stride()[:2], D=d, BLOCK=triton.next_power_of_2(d), num_warps=1 if d <= 128 else 2,
        enable_fp_fusion=False)
    return qo, ko


def fuse_rope(model: nn.Module) -> int:
    """Give each modeling module of ``model``'s classes whose rotary functions are the standard ones
    ``FusedRope`` while ``FUSED_ROPE`` is on (off: nothing is replaced); how many modules."""
    if not FUSED_ROPE:
        return 0
    count = 0
    for name in sorted({type(m).__module__ for m in model.modules()}):
        module = sys.modules.get(name)
        if module is None or isinstance(getattr(module, "apply_rotary_pos_emb", None), FusedRope):
            continue
        if standard_rotary(module):
            module.apply_rotary_pos_emb = FusedRope(module.apply_rotary_pos_emb)
            count += 1
    return count
