"""How the expert pool runs a call's routed experts once they are packed as ``[U, ...]`` tensors.

Grouped: transformers 5's fused experts modules (``@use_experts_implementation``) have a grouped-matmul
forward (``grouped_mm``: ``torch.nn.functional.grouped_mm`` / ``torch._grouped_mm`` where present, a
per-expert loop inside transformers otherwise). Quantized experts are first decoded all at once into
stacked dense weights (``ExpertWeights.stacked``), in chunks of at most ``GROUPED_BYTES``, instead of the
eager loop's one decode and two small matmuls per expert: at batch 64, Qwen3-30B-A3B routes all 128
experts of a layer and the per-expert launches, not the math, set the step time.

Dispatched: Llama 4's experts module takes its tokens already spread over every expert, ``[E * T, H]``,
each row scaled by its routing score, which is exactly 0 for an expert the token was not routed to; a
bias-free GLU expert maps a zero row to a zero row, so only experts with a non-zero row need to run.
"""

from __future__ import annotations

import logging

import torch

from airquant.layout import swap_tensor
from airquant.quant.experts import ExpertWeights

log = logging.getLogger(__name__)
GROUPED_BYTES = 1 << 30  # stacked dense expert weights decoded at once; more experts run in further chunks


def grouped_forward(module):
    """transformers' grouped-matmul experts forward for ``module``, or None (not a fused experts module of
    a transformers version that has one: the module's own forward then runs)."""
    if not hasattr(module, "is_transposed") or not hasattr(module, "has_bias"):
        return None
    try:
        from transformers.integrations import moe
    except ImportError:
        return None
    table = getattr(moe, "ALL_EXPERTS_FUNCTIONS", None)
    fn = table.get("grouped_mm") if table is not None else None
    return fn or getattr(moe, "grouped_mm_experts_forward", None)


def quantized_children(module) -> dict[str, ExpertWeights]:
    return {name: child for name, child in module.named_children() if isinstance(child, ExpertWeights)}


def run_grouped(module, fn, hidden: torch.Tensor, index: torch.Tensor, weights: torch.Tensor,
                num: int) -> torch.Tensor:
    """The experts module on ``hidden`` [T, H] routed by ``index``/``weights`` [T, k] (rows of the ``num``
    packed experts), its quantized weights decoded as stacked dense tensors chunk by chunk."""
    quantized = quantized_children(module)
    if not quantized:
        return fn(module, hidden, index, weights)
    per_expert = sum(c.out_features * c.in_features for c in quantized.values()) * hidden.element_size()
    chunk = max(1, GROUPED_BYTES // max(per_expert, 1))
    if chunk >= num:
        return _chunk(module, fn, quantized, hidden, index, weights, 0, num, num)
    out = torch.zeros_like(hidden)
    for start in range(0, num, chunk):
        stop = min(start + chunk, num)
        inside = (index >= start) & (index < stop)
        rows = inside.any(dim=-1).nonzero().flatten()
        if rows.numel() == 0:
            continue
        # Rows routed partly outside the chunk: those slots point at its first expert with weight 0.
        local = torch.where(inside[rows], index[rows] - start, torch.zeros_like(index[rows]))
        part = _chunk(module, fn, quantized, hidden[rows], local, weights[rows] * inside[rows], start, stop, num)
        out.index_add_(0, rows, part.to(out.dtype))
    return out


def _chunk(module, fn, quantized: dict[str, ExpertWeights], hidden, index, weights, start: int, stop: int,
           total: int):
    """Experts ``start .. stop`` of the ``total`` packed ones: quantized weights decoded, the dense packed
    tensors (biases: gpt-oss) sliced to them, so that ``index`` counts from ``start``."""
    dense = {name: child.stacked(start, stop) for name, child in quantized.items()}
    sliced = {}
    if stop - start < total:
        tensors = list(module.named_parameters(recurse=False)) + list(module.named_buffers(recurse=False))
        sliced = {name: swap_tensor(module, name, t[start:stop]) for name, t in tensors
                  if t.dim() and t.shape[0] == total}
    num = getattr(module, "num_experts", None)
    for name in dense:
        del module._modules[name]
        setattr(module, name, dense[name])  # a plain attribute: the forward reads self.gate_up_proj etc.
    if num is not None:
        module.num_experts = stop - start
    try:
        return fn(module, hidden, index, weights)
    finally:
        for name, child in quantized.items():
            delattr(module, name)
            module._modules[name] = child
        for name, t in sliced.items():
            swap_tensor(module, name, t)
        if num is not None:
            module.num_experts = num


def dispatched(module) -> bool:
    """An experts module called with its tokens spread over every expert (Llama 4), which skipping
    unrouted experts leaves exact: no bias, so a zero row stays zero."""
    names = [n for n, _ in module.named_parameters()] + [n for n, _ in module.named_buffers()]
    return hasattr(module, "gate_up_proj") and not any("bias" in n for n in names)


def dispatched_union(hidden: torch.Tensor, num: int) -> tuple[torch.Tensor, list[int]]:
    """``hidden`` [E * T, H] as [E, T, H] and the experts with a non-zero row (the one host sync)."""
    rows = hidden.reshape(num, -1, hidden.shape[-1])
    return rows, rows.ne(0).flatten(1).any(dim=1).nonzero().flatten().tolist()
