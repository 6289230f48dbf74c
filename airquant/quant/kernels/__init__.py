"""Triton kernels that dequantize in registers; imported only when a CUDA tensor asks for them.

``use_triton(x)`` is the single switch the modules consult: Triton must import, ``x`` must be on a
CUDA device, and ``AIRQUANT_NO_TRITON=1`` forces the torch reference path (for A/B checks).
"""

from __future__ import annotations

import functools
import importlib.util
import os

import torch


@functools.cache
def triton_available() -> bool:
    return importlib.util.find_spec("triton") is not None and torch.cuda.is_available()


def use_triton(x: torch.Tensor) -> bool:
    return x.is_cuda and os.environ.get("AIRQUANT_NO_TRITON") != "1" and triton_available()


def int2_matmul(x, codes, scales, zeros, outlier_weight, outlier_idx, group):
    from airquant.quant.kernels.int2_triton import int2_matmul as impl

    return impl(x, codes, scales, zeros, outlier_weight, outlier_idx, group)


def gptq_matmul(x, qweight, qzeros, scales, g_idx, bits, zero_offset):
    from airquant.quant.kernels.packed_triton import gptq_matmul as impl

    return impl(x, qweight, qzeros, scales, g_idx, bits, zero_offset)


def awq_matmul(x, qweight, qzeros, scales, group_size):
    from airquant.quant.kernels.packed_triton import awq_matmul as impl

    return impl(x, qweight, qzeros, scales, group_size)


def gguf_matmul(x, weight_blocks, ggml_type):
    from airquant.quant.kernels.packed_triton import gguf_matmul as impl

    return impl(x, weight_blocks, ggml_type)
