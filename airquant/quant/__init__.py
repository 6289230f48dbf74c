"""Quantized-weight primitives: quantize one linear at shard time, rebuild its module at run time.

Contract with the store and engine:

* ``quantize_linear(spec, weight)`` -> (tensors keyed by suffix, module_meta). The store writes each
  tensor as ``<module>.<suffix>`` in the layer's shard and ``module_meta`` in the manifest.
* ``make_linear(module_meta, in, out, bias, compute_dtype=...)`` builds, on the current device
  (usually meta), a module whose state_dict keys are exactly those suffixes (+ ``bias``) and whose
  forward computes purely from them, so ``torch.func.functional_call`` can feed it the shard.
* Pre-quantized checkpoints: ``prequant.detect`` (GPTQ/AWQ) and ``gguf_keep.gguf_linear_tensors``
  (GGUF blocks) produce the same (tensors, module_meta) pairs without quantizing.
"""

from __future__ import annotations

import torch
from torch import nn

from airquant.quant.spec import SUPPORTED_SCHEMES, QuantSpec, check_scheme

__all__ = [
    "QuantSpec",
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
    if spec.method == "none":
        return {"weight": weight.contiguous()}, {"scheme": "none"}
    if spec.method == "nf4":
        from airquant.quant.nf4 import quantize_nf4

        return quantize_nf4(weight, spec.blocksize, spec.double_quant)
    if spec.method == "int2":
        if spec.error_feedback:
            if hessian is None:
                raise ValueError("QuantSpec(error_feedback=True) needs hessian=X^T X/n (see calibrate_hessians)")
            from airquant.quant.int2_gptq import quantize_int2_gptq

            return quantize_int2_gptq(weight, hessian, spec.group, spec.outliers, act_scale)
        from airquant.quant.int2 import quantize_int2

        return quantize_int2(weight, spec.group, spec.outliers, act_scale)
    raise ValueError(
        "method 'keep' keeps GGUF blocks as they are: use airquant.quant.gguf_keep.gguf_linear_tensors "
        "on the file's raw bytes instead of quantize_linear"
    )


def make_linear(
    module_meta: dict, in_features: int, out_features: int, bias: bool, *, compute_dtype: torch.dtype
) -> nn.Module:
    """Build (on the current device, usually meta) the module that computes from the tensors of
    ``quantize_linear``; its state_dict keys are those suffixes (+ "bias" if ``bias``)."""
    scheme = check_scheme(module_meta)
    shape = dict(in_features=in_features, out_features=out_features, bias=bias)
    if scheme == "none":
        return nn.Linear(**shape, dtype=compute_dtype)
    if scheme == "nf4":
        from airquant.quant.nf4 import NF4Linear

        return NF4Linear(**shape, blocksize=module_meta["blocksize"], double_quant=module_meta["double_quant"],
                         compute_dtype=compute_dtype)
    if scheme == "gptq":
        from airquant.quant.gptq import GPTQLinear

        return GPTQLinear(**shape, bits=module_meta["bits"], group_size=module_meta["group_size"],
                          zero_offset=module_meta["zero_offset"], compute_dtype=compute_dtype)
    if scheme == "awq":
        from airquant.quant.gptq import AWQLinear

        return AWQLinear(**shape, group_size=module_meta["group_size"], compute_dtype=compute_dtype)
    if scheme == "gguf":
        from airquant.quant.gguf_keep import GGUFLinear

        return GGUFLinear(**shape, ggml_type=module_meta["ggml_type"], compute_dtype=compute_dtype)
    from airquant.quant.int2 import Int2Linear

    return Int2Linear(**shape, group=module_meta["group"], n_outliers=module_meta["n_outliers"],
                      outlier_cols=module_meta.get("outlier_cols"), compute_dtype=compute_dtype)


def __getattr__(name: str):
    # Heavier helpers (transformers hooks, model walks) load on first use, keeping the import light.
    if name == "quantize_model_inplace":
        from airquant.quant.swap import quantize_model_inplace

        return quantize_model_inplace
    if name in ("calibrate_act_scales", "calibrate_hessians"):
        from airquant.quant import calibrate

        return getattr(calibrate, name)
    raise AttributeError(f"module 'airquant.quant' has no attribute {name!r}")
