"""Quantized-weight primitives: quantize one linear at shard time, rebuild its module at run time.

Contract with the store and engine:

* ``quantize_linear(spec, weight)`` -> (tensors keyed by suffix, module_meta). The store writes each
  tensor as ``<module>.<suffix>`` in the layer's shard and ``module_meta`` in the manifest.
* ``make_linear(module_meta, in, out, bias, compute_dtype=...)`` builds, on the current device
  (usually meta), a module whose state_dict keys are exactly those suffixes (+ ``bias``) and whose
  forward computes purely from them, so ``torch.func.functional_call`` can feed it the shard.
* Each format is one ``Scheme`` in ``airquant.quant.schemes.SCHEMES``; both functions dispatch through it.
* Pre-quantized checkpoints: ``prequant.detect`` (GPTQ/AWQ) and ``gguf_keep.gguf_linear_tensors``
  (GGUF blocks) produce the same (tensors, module_meta) pairs without quantizing.
"""

from __future__ import annotations

import torch
from torch import nn

from airquant.quant.schemes import SCHEMES, SUPPORTED_SCHEMES, Scheme, scheme_of
from airquant.quant.spec import QuantSpec

__all__ = [
    "QuantSpec",
    "Scheme",
    "SCHEMES",
    "SUPPORTED_SCHEMES",
    "quantize_linear",
    "make_linear",
    "quantize_model_inplace",
    "calibrate_act_scales",
    "calibrate_hessians",
]


def quantize_linear(
    spec: QuantSpec,
    weight: torch.Tensor,
    *,
    act_scale: torch.Tensor | None = None,
    hessian: torch.Tensor | None = None,
) -> tuple[dict[str, torch.Tensor], dict]:
    """Quantize one [out, in] linear weight.

    Returns (tensors keyed by suffix, e.g. {"weight_packed": ..., "absmax": ...}, module_meta: a JSON-able
    dict with the scheme name and the parameters ``make_linear`` needs). ``act_scale`` (mean |x| per input
    channel) ranks int2 outlier channels; ``hessian`` (X^T X / n) is needed by ``spec.error_feedback``.
    """
    if weight.dim() != 2:
        raise ValueError(f"quantize_linear expects an [out, in] weight, got shape {tuple(weight.shape)}")
    return SCHEMES[spec.method].quantize(spec, weight, act_scale, hessian)


def make_linear(
    module_meta: dict, in_features: int, out_features: int, bias: bool, *, compute_dtype: torch.dtype
) -> nn.Module:
    """Build (on the current device, usually meta) the module that computes from the tensors of
    ``quantize_linear``; its state_dict keys are those suffixes (+ "bias" if ``bias``)."""
    return scheme_of(module_meta).make_module(module_meta, in_features, out_features, bias, compute_dtype)


def __getattr__(name: str):
    # Heavier helpers (transformers hooks, model walks) load on first use, keeping the import light.
    if name == "quantize_model_inplace":
        from airquant.quant.swap import quantize_model_inplace  # lazy: cycle (quant.swap imports airquant.quant)

        return quantize_model_inplace
    if name in ("calibrate_act_scales", "calibrate_hessians"):
        from airquant.quant import calibrate  # lazy: cycle (quant.calibrate -> quant.swap -> airquant.quant)

        return getattr(calibrate, name)
    raise AttributeError(f"module 'airquant.quant' has no attribute {name!r}")
