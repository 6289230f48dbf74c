"""Swap a resident model's decoder-layer linears for quantized modules, in memory.

Used by tests and the quality benchmark to measure a scheme without a store; it goes through the
same ``quantize_linear`` / ``make_linear`` pair the store and engine use, and loads the tensors into
the meta-built module with ``load_state_dict(assign=True)`` exactly as shards would arrive.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable

import torch
from torch import nn

from airquant.quant import QuantSpec, make_linear, quantize_linear

log = logging.getLogger(__name__)

_DECODER_LINEAR = re.compile(r"(^|\.)layers\.\d+\.")


def decoder_linears(model: nn.Module) -> list[str]:
    """Names of the nn.Linear modules inside the decoder stack (``...layers.N...``)."""
    return [n for n, m in model.named_modules() if isinstance(m, nn.Linear) and _DECODER_LINEAR.search(n)]


def replace_linear(
    model: nn.Module, name: str, tensors: dict[str, torch.Tensor], module_meta: dict, *, compute_dtype: torch.dtype
) -> nn.Module:
    """Put the module for (tensors, module_meta) in place of ``model.<name>`` and return it."""
    parent_name, _, child = name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    old = getattr(parent, child)
    bias = getattr(old, "bias", None)
    with torch.device("meta"):
        new = make_linear(module_meta, old.in_features, old.out_features, bias is not None, compute_dtype=compute_dtype)
    state = dict(tensors)
    if bias is not None:
        state["bias"] = bias.detach().to(compute_dtype)
    new.load_state_dict(state, strict=True, assign=True)
    setattr(parent, child, new)
    return new


def quantize_model_inplace(
    model: nn.Module,
    spec: QuantSpec,
    act_scales: dict[str, torch.Tensor] | None = None,
    *,
    hessians: dict[str, torch.Tensor] | None = None,
    compute_dtype: torch.dtype | None = None,
    include: Callable[[str], bool] | None = None,
) -> dict[str, dict]:
    """Quantize every decoder-layer linear of ``model`` per ``spec``; return {module name: module_meta}.

    ``act_scales`` / ``hessians`` are keyed by module name as returned by ``calibrate_act_scales`` /
    ``calibrate_hessians``; ``include`` can restrict which linears are converted.
    """
    metas = {}
    for name in decoder_linears(model):
        if include is not None and not include(name):
            continue
        linear = model.get_submodule(name)
        dtype = compute_dtype or linear.weight.dtype
        act = None if act_scales is None else act_scales[name]
        hess = None if hessians is None else hessians[name]
        tensors, meta = quantize_linear(spec, linear.weight.detach(), act_scale=act, hessian=hess)
        replace_linear(model, name, tensors, meta, compute_dtype=dtype)
        metas[name] = meta
    log.info("quantized %d linears with %s", len(metas), spec)
    return metas
