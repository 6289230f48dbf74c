"""The capability rule: from a GPU's compute capability, the compute dtype, TF32, and each kernel's path.

AirQuant's users run T4s (sm_75: no bfloat16 tensor cores, 64 KB of shared memory per block), consumer
Ampere/Ada cards (sm_86/89) and A100s (sm_80) as well as Hopper (sm_90). One pure function,
``capability_plan(cap, stored_dtype)``, says what each gets; the engine (``compute_dtype``), ``airquant plan``
and ``airquant doctor`` all read it, and the kernels read the same thresholds from
``airquant.quant.kernels`` (``AIRQUANT_FORCE_CAPABILITY=7.5`` makes any GPU plan as that capability).

* dtype: bf16 stores compute in fp16 below sm_80 (the streamer casts each dense tensor on the device after
  its copy, so the link still moves the stored bytes); fp16 stores compute in fp32 on CPU.
* fp16 overflow: a model trained in bf16 can leave fp16's range; ``OverflowGuard`` checks the first forward's
  hidden states and raises ``Fp16OverflowError`` naming ``--dtype float32``.
* TF32: no kernel asks for TF32 products (fp32 models take IEEE products, half models half-precision ones;
  tests/quant/test_kernel_compile.py checks the PTX); ``tf32`` reports what the GPU has.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
from torch import nn

from airquant.errors import AirQuantError
from airquant.kv.triton_kernel import gluon_fits, history_reader
from airquant.quant.kernels import BF16_MIN, HOPPER_MIN, TF32_MIN, device_capability, forced_capability
from airquant.store.split import DTYPES

log = logging.getLogger(__name__)
Cap = tuple[int, int]


class Fp16OverflowError(AirQuantError):
    """The first forward in float16 produced inf/NaN hidden states."""


class DtypeNotSupportedError(AirQuantError, ValueError):
    """The requested compute dtype has no support on this GPU."""


@dataclass(frozen=True)
class CapabilityPlan:
    """What a GPU of ``capability`` (None: CPU) runs a store of ``stored_dtype`` with."""

    capability: Cap | None
    stored_dtype: str
    dtype: str  # the compute dtype
    bf16: bool  # native bfloat16 tensor cores
    tf32: bool  # the GPU has TF32 tensor cores (AirQuant's kernels do not ask for TF32)
    kernels: tuple[tuple[str, str], ...]  # (scheme or kernel, path), in report order
    note: str = ""  # why the dtype differs from the store's, if it does

    @property
    def arch(self) -> str:
        return "cpu" if self.capability is None else f"sm_{self.capability[0]}{self.capability[1]}"

    def describe(self) -> list[str]:
        lines = [f"compute   : {self.dtype} ({self.arch}; store {self.stored_dtype})"
                 + (f": {self.note}" if self.note else ""),
                 f"tf32      : {'available' if self.tf32 else 'not on this GPU' if self.capability else 'no GPU'}; "
                 "kernels use IEEE fp32 or half-precision products"]
        lines += [f"kernel    : {name:<12} {path}" for name, path in self.kernels]
        return lines


def kernel_paths(cap: Cap | None, head_dim: int = 128) -> tuple[tuple[str, str], ...]:
    """The path each weight scheme's matmul and the TurboQuant attention take on a GPU of ``cap``."""
    if cap is None:
        return (("dense", "torch (cpu)"), ("nf4", "bitsandbytes (cpu)"),
                ("int2", "torch: dequantize + matmul"), ("gptq/awq", "torch: dequantize + matmul"),
                ("gguf", "torch: dequantize + matmul"), ("tq-attn", "torch ops (kv.attention)"))
    tma = "gluon-tma (weights through a TMA ring)" if cap >= HOPPER_MIN else None
    gemv = (f"{tma}, from 128M weights; else gluon-ldg" if tma
            else "gluon-ldg (table lookups, plain loads)") + " from 16M weights; else triton"
    reader = history_reader(head_dim, cap)
    tq = (f"triton (fp16/bf16 products) for head dim {head_dim}" if reader != "torch"
          else f"torch ops: head dim {head_dim} needs {4 * head_dim * head_dim // 1024} KB of shared memory")
    if reader == "gluon":
        tq += "; K4/V2 decode histories: gluon (tensor cores)"
    elif reader == "triton" and gluon_fits(head_dim, cap):
        tq += "; the gluon history kernel for K4/V2 decode: AIRQUANT_TQ_HISTORY=gluon"
    return (("dense", "cuBLAS"), ("nf4", "bitsandbytes (CUDA)"),
            ("int2", f"decode {gemv}; batches: triton GEMM"),
            ("gptq/awq", "triton packed GEMM"), ("gguf", "triton packed GEMM (Q4_0/Q4_1/Q8_0); others torch"),
            ("tq-attn", tq))


def capability_plan(cap: Cap | None, stored_dtype: str, requested: str | None = None,
                    head_dim: int = 128) -> CapabilityPlan:
    """The pure rule (tests mock ``cap``): compute dtype, TF32, kernel paths."""
    bf16, tf32 = cap is not None and cap >= BF16_MIN, cap is not None and cap >= TF32_MIN
    note = ""
    if requested is not None:
        if requested == "bfloat16" and cap is not None and not bf16:
            raise DtypeNotSupportedError(
                f"--dtype bfloat16 was asked for, but this GPU (sm_{cap[0]}{cap[1]}) has no bfloat16 tensor cores "
                "and AirQuant's kernels do not run bf16 there; use --dtype float16 (or float32)")
        dtype = requested
    elif cap is None and stored_dtype == "float16":
        dtype, note = "float32", "fp16 matmuls on CPU are slow and lose precision"
    elif stored_dtype == "bfloat16" and cap is not None and not bf16:
        dtype, note = "float16", "no bf16 tensor cores below sm_80; cast per layer on the GPU after the copy"
    else:
        dtype = stored_dtype
    return CapabilityPlan(cap, stored_dtype, dtype, bf16, tf32, kernel_paths(cap, head_dim), note)


def compute_line(stored_dtype: str, requested: str | None, device: str = "auto") -> str:
    """The ``compute`` line of ``airquant plan`` for ``--device`` (no GPU touched beyond its capability)."""
    cap = None if device == "cpu" else device_capability("cuda" if torch.cuda.is_available() or forced_capability()
                                                         else "cpu")
    return capability_plan(cap, stored_dtype, requested).describe()[0]


_ANNOUNCED: set = set()


def compute_dtype(stored_dtype: str, requested: str | None, device: torch.device) -> torch.dtype:
    """The engine's compute dtype on ``device``; a dtype change from the store's is logged once per process."""
    plan = capability_plan(device_capability(device), stored_dtype, requested)
    if plan.note and (plan.arch, stored_dtype) not in _ANNOUNCED:
        _ANNOUNCED.add((plan.arch, stored_dtype))
        forced = " (AIRQUANT_FORCE_CAPABILITY)" if forced_capability() and device.type == "cuda" else ""
        log.info("computing a %s store in %s on %s%s: %s", stored_dtype, plan.dtype, plan.arch, forced, plan.note)
    return DTYPES[plan.dtype]


class OverflowGuard:
    """Checks the hidden states after every decoder layer of the first forward for inf/NaN (fp16 compute only).

    The flags stay on the device until the forward ends (one sync, once); then the hooks are removed, so later
    steps pay nothing. transformers keeps norms and softmax in fp32, so what overflows is the residual stream
    of a model whose activations exceed 65504."""

    def __init__(self, model: nn.Module, layers: nn.ModuleList):
        self.flags: list[torch.Tensor] = []
        self.hooks = [layer.register_forward_hook(self._check) for layer in layers]
        self.hooks.append(model.register_forward_hook(self._finish))

    def _check(self, module, args, out) -> None:
        hidden = out[0] if isinstance(out, tuple) else out
        if isinstance(hidden, torch.Tensor) and hidden.is_floating_point():
            self.flags.append(~torch.isfinite(hidden).all())

    def _finish(self, module, args, out) -> None:
        flags, self.flags = self.flags, []
        for hook in self.hooks:
            hook.remove()
        if flags and bool(torch.stack(flags).any()):
            first = int(torch.stack(flags).nonzero()[0, 0])
            raise Fp16OverflowError(
                f"decoder layer {first} produced inf/NaN activations in float16 on the first pass: this model's "
                "activations exceed fp16's range (65504); run it with --dtype float32 (or bfloat16 on sm_80+)")


def guard_overflow(model: nn.Module, layers: nn.ModuleList, dtype: torch.dtype) -> OverflowGuard | None:
    """An ``OverflowGuard`` on ``model`` when computing in float16 (bf16/fp32 do not overflow), else None."""
    return OverflowGuard(model, layers) if dtype == torch.float16 else None
