"""transformers' standard top-k MoE router with its softmax, top-k and renormalization as one kernel on CUDA.

Nine router classes (Qwen2-MoE, Qwen3-MoE, Qwen3-Next, OLMoE, FlexOlmo, ...) share one forward: the router logits
by one linear, then the logits to fp32, a softmax, ``topk`` (a gather and a bitonic sort), the renormalization's sum
and division and the cast back: seven small kernels a layer at decode, ~18 us of a Qwen3-30B-A3B batch-1 layer
replayed in its graph (H100, moe_bench trace, wave3_moe28), while the link idles: the experts' reads wait for it.

``fuse_routers`` gives each module of exactly that forward (``standard_router``, by its source) ``FusedRouter``: with
``FUSED_ROUTER`` and CUDA (or Triton's interpreter) the linear stays cuBLAS's and one Triton launch does the rest
(``moe_router_kernel``): each row's softmax in fp32 with the ``expf`` torch's softmax kernel calls, its ``top_k``
largest probabilities in descending order, divided by their sum where the module renormalizes, cast to the logits'
dtype. What may differ from the eager ops: the order of the softmax's and the renormalization's fp32 sums, so a
weight can differ in its last fp32 bit before its cast; the experts differ only where two probabilities are equal
to the last bit (the kernel then takes the lower expert, torch's ``topk`` either). Any other call runs the module's
own forward.

On by default since it was measured against the eager ops (``benchmarks/moe_bench.py``, ``*_fusedrouter`` against
``lfu_direct_r1`` / ``nocache_direct``, each case in its own process; an H200, 2026-12-06, wave3_moe29r,
``results/moe_router_ab.json``): Qwen3-30B-A3B NF4 batch 1 at 4 GB, hot set 0.0108 s a step against 0.0129, no
cache 0.0296 against 0.0306; its CUDA tests pass. ``*_eagerrouter`` cases measure the eager ops since.
"""

from __future__ import annotations

import functools

import torch
from torch import nn

from airquant.engine.moe.compute import fused_runs_on
from airquant.engine.norms import function_body, wrap_forwards
from airquant.quant import kernels

FUSED_ROUTER = True

# The forward's body, statement by statement, that the fused call computes.
STANDARD_BODY = (
    "hidden_states = hidden_states.reshape(-1, self.hidden_dim)",
    "router_logits = F.linear(hidden_states, self.weight)",
    "router_probs = torch.nn.functional.softmax(router_logits, dtype=torch.float, dim=-1)",
    "router_top_value, router_indices = torch.topk(router_probs, self.top_k, dim=-1)",
    "if self.norm_topk_prob:\n    router_top_value /= router_top_value.sum(dim=-1, keepdim=True)",
    "router_top_value = router_top_value.to(router_logits.dtype)",
    "router_scores = router_top_value",
    "return (router_logits, router_scores, router_indices)",
)
MAX_EXPERTS = 1024  # a row of logits in one program
MAX_TOP_K = 64  # the kernel unrolls its passes


@functools.cache
def standard_router(cls: type) -> bool:
    """Whether ``cls.forward`` is transformers' standard top-k router forward: arguments ``(self, hidden_states)``
    and, its docstring aside, the statements of ``STANDARD_BODY``."""
    return function_body(getattr(cls, "forward", None)) == (("self", "hidden_states"), STANDARD_BODY)


class FusedRouter:
    """A standard router module's forward: softmax, top-k and renormalization in one kernel where ``fusable``
    holds, the module's own elsewhere."""

    def __init__(self, module: nn.Module, forward):
        self.module, self.forward = module, forward

    def __call__(self, hidden_states: torch.Tensor, *args, **kwargs):
        m = self.module
        if args or kwargs or not (FUSED_ROUTER and fusable(hidden_states, m.weight, m.top_k)):
            return self.forward(hidden_states, *args, **kwargs)
        logits = torch.nn.functional.linear(hidden_states.reshape(-1, m.hidden_dim), m.weight)
        weights, indices = route_topk(logits, m.top_k, bool(m.norm_topk_prob))
        return logits, weights, indices


def fusable(hidden_states: torch.Tensor, weight: torch.Tensor, top_k: int) -> bool:
    """Whether ``route_topk`` takes the call: Triton runs on it (``fused_runs_on``: CUDA, or the interpreter), one
    dtype of three, at most ``MAX_EXPERTS`` experts and ``MAX_TOP_K`` picked, on one device."""
    if not fused_runs_on(hidden_states):
        return False
    return (hidden_states.dtype == weight.dtype and weight.dtype in (torch.float16, torch.bfloat16, torch.float32)
            and weight.dim() == 2 and 0 < top_k <= min(weight.shape[0], MAX_TOP_K)
            and weight.shape[0] <= MAX_EXPERTS and hidden_states.device == weight.device)


def route_topk(logits: torch.Tensor, top_k: int, norm: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The weights (``logits``' dtype) and experts (int64) of each row of ``logits`` ``[N, E]``, each ``[N, top_k]``,
    by one launch."""
    import triton

    from airquant.engine import moe_router_kernel

    rows, experts = logits.shape
    logits = logits if logits.stride(-1) == 1 else logits.contiguous()
    weights = torch.empty(rows, top_k, dtype=logits.dtype, device=logits.device)
    indices = torch.empty(rows, top_k, dtype=torch.long, device=logits.device)
    if rows:
        moe_router_kernel.router_kernel[(rows,)](
            logits, weights, indices, experts, logits.stride(0), K=top_k, KB=triton.next_power_of_2(top_k),
            NORM=norm, BLOCK=triton.next_power_of_2(experts), LIBDEVICE=not kernels.interpreting(),
            num_warps=1 if experts <= 256 else 4)
    return weights, indices


def fuse_routers(model: nn.Module) -> int:
    """Give every standard router of ``model`` the fused forward (``FusedRouter``) while ``FUSED_ROUTER`` is on
    (off: no wrapper on the routers' calls at all); how many."""
    if not FUSED_ROUTER:
        return 0
    return wrap_forwards(model, lambda m: standard_router(type(m)), FusedRouter)
