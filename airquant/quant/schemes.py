"""One object per weight format, registered once: how it quantizes, which module computes from it,
how the report names it and what it costs the planner.

A format is a ``Scheme`` subclass added to ``SCHEMES``; ``quantize_linear``/``make_linear``, the
report's labels (``airquant.eval.references``) and the planner's workspace (``engine.plan``) all read
it from here. The module classes import inside the methods: bitsandbytes and triton are optional.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from torch import nn

from airquant.errors import UnsupportedModelError
from airquant.quant.gguf_keep import GGUFLinear
from airquant.quant.gptq import AWQLinear, GPTQLinear
from airquant.quant.int2 import Int2Linear, quantize_int2
from airquant.quant.int2_gptq import quantize_int2_gptq
from airquant.quant.nf4 import NF4Linear, quantize_nf4

if TYPE_CHECKING:
    import torch
    from torch import nn

    from airquant.quant.spec import QuantSpec

Tensors = dict[str, "torch.Tensor"]


class Scheme:
    """A weight format. ``name`` is the ``scheme`` a module_meta records."""

    name: str = ""
    label: str = ""  # the report's column heading for a store of this format
    aliases: tuple[str, ...] = ()  # older names `--quant` / QuantSpec(method=...) still accept
    shard_time: bool = False  # `--quant NAME` produces it when sharding (else: detected in the source)

    def quantize(self, spec: QuantSpec, weight: torch.Tensor, act_scale: torch.Tensor | None,
                 hessian: torch.Tensor | None) -> tuple[Tensors, dict]:
        """(tensors keyed by suffix, module_meta) of one [out, in] weight."""
        raise ValueError(f"scheme {self.name!r} is read from pre-quantized checkpoints (airquant.quant.prequant), "
                         "not quantized by quantize_linear")

    def make_module(self, meta: dict, in_features: int, out_features: int, bias: bool,
                    compute_dtype: torch.dtype) -> nn.Module:
        raise NotImplementedError

    def workspace_elems(self, meta: dict, dense_elems: int) -> int:
        """Elements a multi-token matmul of this module decodes at once: the whole weight
        (``dense_elems``, out*in) for every packed format."""
        return dense_elems


class Dense(Scheme):
    name, label = "none", "dense"

    def quantize(self, spec, weight, act_scale, hessian):
        return {"weight": weight.contiguous()}, {"scheme": "none"}

    def make_module(self, meta, in_features, out_features, bias, compute_dtype):
        return nn.Linear(in_features, out_features, bias=bias, dtype=compute_dtype)

    def workspace_elems(self, meta, dense_elems):
        return 0


class NF4(Scheme):
    name, label, shard_time = "nf4", "NF4", True

    def quantize(self, spec, weight, act_scale, hessian):
        return quantize_nf4(weight, spec.blocksize, spec.double_quant)

    def make_module(self, meta, in_features, out_features, bias, compute_dtype):
        return NF4Linear(in_features=in_features, out_features=out_features, bias=bias,
                         blocksize=meta["blocksize"], double_quant=meta["double_quant"], compute_dtype=compute_dtype)


class GPTQ(Scheme):
    name, label = "gptq", "GPTQ"

    def make_module(self, meta, in_features, out_features, bias, compute_dtype):
        return GPTQLinear(in_features=in_features, out_features=out_features, bias=bias, bits=meta["bits"],
                          group_size=meta["group_size"], zero_offset=meta["zero_offset"], compute_dtype=compute_dtype)


class AWQ(Scheme):
    name, label = "awq", "AWQ"

    def make_module(self, meta, in_features, out_features, bias, compute_dtype):
        return AWQLinear(in_features=in_features, out_features=out_features, bias=bias,
                         group_size=meta["group_size"], compute_dtype=compute_dtype)


class GGUF(Scheme):
    name, label, aliases, shard_time = "gguf", "GGUF", ("keep",), True

    def quantize(self, spec, weight, act_scale, hessian):
        raise ValueError(
            "method 'gguf' (formerly 'keep') keeps GGUF blocks as they are: use "
            "airquant.quant.gguf_keep.gguf_linear_tensors on the file's raw bytes instead of quantize_linear")

    def make_module(self, meta, in_features, out_features, bias, compute_dtype):
        return GGUFLinear(in_features=in_features, out_features=out_features, bias=bias,
                          ggml_type=meta["ggml_type"], compute_dtype=compute_dtype)


class Int2(Scheme):
    name, label, shard_time = "int2", "2-bit (int2)", True

    def quantize(self, spec, weight, act_scale, hessian):
        if spec.error_feedback:
            if hessian is None:
                raise ValueError("QuantSpec(error_feedback=True) needs hessian=X^T X/n (see calibrate_hessians)")

            return quantize_int2_gptq(weight, hessian, spec.group, spec.outliers, act_scale)

        return quantize_int2(weight, spec.group, spec.outliers, act_scale)

    def make_module(self, meta, in_features, out_features, bias, compute_dtype):
        return Int2Linear(in_features=in_features, out_features=out_features, bias=bias, group=meta["group"],
                          n_outliers=meta["n_outliers"], outlier_cols=meta.get("outlier_cols"),
                          compute_dtype=compute_dtype)


# Registration order is the order errors list them and the report's columns follow (after dense).
SCHEMES: dict[str, Scheme] = {s.name: s for s in (Dense(), NF4(), GPTQ(), AWQ(), Int2(), GGUF())}
SUPPORTED_SCHEMES: tuple[str, ...] = tuple(SCHEMES)
_BY_ALIAS = {alias: s for s in SCHEMES.values() for alias in s.aliases}


def canonical_name(name: str) -> str:
    """``keep`` -> ``gguf``; a registered name or an unknown one as it is."""
    scheme = _BY_ALIAS.get(name)
    return scheme.name if scheme is not None else name


def find_scheme(name: str) -> Scheme | None:
    """The scheme registered under ``name`` or one of its aliases; None for another name (a dtype)."""
    return SCHEMES.get(name) or _BY_ALIAS.get(name)


def scheme_of(module_meta: dict) -> Scheme:
    """The scheme named by ``module_meta``; raise naming the supported ones otherwise."""
    scheme = SCHEMES.get(module_meta.get("scheme"))
    if scheme is None:
        raise UnsupportedModelError(
            f"module scheme {module_meta.get('scheme')!r} (module_meta={module_meta}) is not one AirQuant can run; "
            f"supported: {', '.join(SUPPORTED_SCHEMES)}"
        )
    return scheme


def workspace_elems(module_meta: dict, dense_elems: int) -> int:
    """``Scheme.workspace_elems`` of a manifest module; ``dense_elems`` (out*in of the largest linear)
    for a scheme this version does not know, so the plan errs on the side of room."""
    scheme = SCHEMES.get(module_meta.get("scheme", "none"))
    return dense_elems if scheme is None else scheme.workspace_elems(module_meta, dense_elems)


def shard_methods() -> tuple[str, ...]:
    """Names `--quant` accepts: none, the formats quantized or kept at shard time, then their aliases."""
    names = [s.name for s in SCHEMES.values() if s.shard_time or s.name == "none"]
    return tuple(names + [a for s in SCHEMES.values() if s.shard_time for a in s.aliases])
