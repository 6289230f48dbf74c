"""Triton kernels that dequantize in registers; imported only when a CUDA tensor asks for them.

``use_triton(x)`` is the single switch the modules consult: Triton must import, ``x`` must be on a
CUDA device whose capability runs the kernels in x's dtype, and ``AIRQUANT_NO_TRITON=1`` forces the
torch reference path (for A/B checks).

``device_capability`` is the one place a kernel learns which GPU it plans for: the device's compute
capability, or ``AIRQUANT_FORCE_CAPABILITY=7.5`` (how benchmarks/t4_profile.py makes an H200 take the
paths a T4 would). The thresholds below are the capability rule's kernel half; airquant.engine.capability
adds the compute dtype and reports both (tests/quant/test_kernel_compile.py compiles every kernel for
sm_75 ... sm_90).
"""

from __future__ import annotations

import functools
import importlib.util
import os

import torch

from airquant.errors import AirQuantError

FORCE_ENV = "AIRQUANT_FORCE_CAPABILITY"
# bfloat16 tensor-core products (mma.bf16) and TF32 start with Ampere; Triton cannot lower a bf16 tl.dot for
# sm_75, so bf16 inputs there take the torch path (use_triton).
BF16_MIN = (8, 0)
TF32_MIN = (8, 0)
# TMA, mbarriers and programmatic dependent launch (griddepcontrol): Hopper.
HOPPER_MIN = (9, 0)
# Shared memory one block may use (bytes, the opt-in maximum; CUDA programming guide): a kernel that needs more
# cannot launch there. Unlisted capabilities take the nearest older one's.
SHARED_PER_BLOCK = {(7, 0): 98304, (7, 5): 65536, (8, 0): 166912, (8, 6): 101376, (8, 7): 166912, (8, 9): 101376,
                    (9, 0): 232448}


def shared_per_block(capability: tuple[int, int]) -> int:
    older = [c for c in SHARED_PER_BLOCK if c <= capability]
    return SHARED_PER_BLOCK[max(older)] if older else 0


class CapabilityError(AirQuantError, ValueError):
    """AIRQUANT_FORCE_CAPABILITY is not a compute capability."""


def parse_capability(text: str) -> tuple[int, int]:
    """ "7.5" / "sm_75" / "75" -> (7, 5)."""
    raw = text.strip().lower().removeprefix("sm_").removeprefix("sm")
    major, _, minor = raw.partition(".") if "." in raw else (raw[:-1], "", raw[-1:])
    if not (major.isdigit() and minor.isdigit()):
        raise CapabilityError(f"{FORCE_ENV}={text!r} is not a compute capability; write it as 7.5, 8.6 or 9.0 "
                              "(or unset it to use the GPU's own)")
    return int(major), int(minor)


def forced_capability() -> tuple[int, int] | None:
    text = os.environ.get(FORCE_ENV)
    return parse_capability(text) if text else None


def device_capability(device: torch.device | str | None = None) -> tuple[int, int] | None:
    """(major, minor) the kernels plan for: AIRQUANT_FORCE_CAPABILITY when set, else the CUDA device's;
    None for a CPU device (or no GPU)."""
    device = torch.device(device) if device is not None else None
    if device is not None and device.type != "cuda":
        return None
    forced = forced_capability()
    if forced is not None:
        return forced
    if not torch.cuda.is_available():
        return None
    return tuple(torch.cuda.get_device_capability(device))


def dtype_supported(dtype: torch.dtype, capability: tuple[int, int] | None) -> bool:
    """Whether the Triton kernels run with inputs of ``dtype`` on a GPU of ``capability``."""
    return capability is not None and (dtype != torch.bfloat16 or capability >= BF16_MIN)


@functools.cache
def triton_available() -> bool:
    return importlib.util.find_spec("triton") is not None and torch.cuda.is_available()


def interpreting() -> bool:
    """Triton's interpreter is on (``TRITON_INTERPRET=1``, read when the kernels are defined): its kernels then
    run on CPU tensors, slowly, which is how the CPU tests check a kernel against the torch path."""
    return os.environ.get("TRITON_INTERPRET") == "1" and importlib.util.find_spec("triton") is not None


def use_triton(x: torch.Tensor) -> bool:
    return (x.is_cuda and os.environ.get("AIRQUANT_NO_TRITON") != "1" and triton_available()
            and dtype_supported(x.dtype, device_capability(x.device)))


def outlier_read_cols(ow: torch.Tensor, n_out: int) -> tuple[int, int]:
    """(row stride, columns the kernels read) of the int2 outlier residuals ow [N, >= n_out]: n_out rounded
    up to 16 where the rows are padded that far (stores written with ``airquant.quant.int2.outlier_cols``:
    zeros there, which the kernels multiply by 0), so that the column mask bound is a multiple of 16 and the
    loads vectorize (with n_out = 1003 they were 2-byte loads); n_out for unpadded rows."""
    if not n_out:
        return 0, 0
    padded = -(-n_out // 16) * 16  # whatever outlier_cols stored: a padded store of any size reads padded
    return ow.stride(0), padded if padded <= ow.stride(0) else n_out


def int2_matmul(x, codes, scales, zeros, outlier_weight, outlier_idx, group):
    from airquant.quant.kernels.int2_triton import int2_matmul_triton as impl

    return impl(x, codes, scales, zeros, outlier_weight, outlier_idx, group)


def gptq_matmul(x, qweight, qzeros, scales, g_idx, bits, zero_offset):
    from airquant.quant.kernels.packed_triton import gptq_matmul_triton as impl

    return impl(x, qweight, qzeros, scales, g_idx, bits, zero_offset)


def awq_matmul(x, qweight, qzeros, scales, group_size):
    from airquant.quant.kernels.packed_triton import awq_matmul_triton as impl

    return impl(x, qweight, qzeros, scales, group_size)


def gguf_matmul(x, weight_blocks, ggml_type):
    from airquant.quant.kernels.packed_triton import gguf_matmul_triton as impl

    return impl(x, weight_blocks, ggml_type)
