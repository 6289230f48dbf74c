"""Modules for pre-quantized GPTQ and AWQ (GEMM) checkpoints, computing from the on-disk packed layout.

On-disk layouts (tensor names are those of the checkpoints, relative to the linear):

GPTQ (AutoGPTQ / optimum / gptqmodel "gptq" and "gptq_v2" formats), ``per = 32 // bits``:
  * ``qweight`` int32 [in / per, out]: input channel k of column n in word [k // per, n], bits ``bits*(k % per)``.
  * ``qzeros``  int32 [n_groups, out / per]: zero of (group g, column n) in word [g, n // per], bits ``bits*(n % per)``;
    the v1 "gptq" format stores ``zero - 1`` (a historical off-by-one that readers add back), v2 stores ``zero``.
  * ``scales``  fp16 [n_groups, out];  ``g_idx`` int32 [in]: group of each input channel (act-order permutes it).
  * W[n, k] = scales[g, n] * (q[k, n] - zero[g, n]) with g = g_idx[k].

AWQ GEMM (AutoAWQ ``version: gemm``), 4-bit only:
  * ``qweight`` int32 [in, out / 8]: packed along *output* features in AWQ's interleaved order: nibble i of word
    [k, j] holds column ``8*j + AWQ_ORDER[i]``; ``qzeros`` int32 [n_groups, out / 8] packed the same way.
  * ``scales`` fp16 [n_groups, out]; group of input channel k is k // group_size; W[n, k] = scales * (q - zero).
"""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.nn import functional as F

from airquant.errors import UnsupportedModelError
from airquant.quant.base import QuantLinear
from airquant.quant.kernels import awq_matmul, gptq_matmul, use_triton

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # nibble i holds column AWQ_ORDER[i] of its group of 8
AWQ_REVERSE_ORDER = (0, 4, 1, 5, 2, 6, 3, 7)  # column j sits in nibble AWQ_REVERSE_ORDER[j]


def n_groups(in_features: int, group_size: int) -> int:
    """Groups along the input dimension; group_size -1 means one group (per-column quantization)."""
    return 1 if group_size in (-1, 0) else math.ceil(in_features / group_size)


def default_g_idx(in_features: int, group_size: int) -> torch.Tensor:
    """g_idx of a checkpoint without act-order (for checkpoints that omit the tensor)."""
    if group_size in (-1, 0):
        return torch.zeros(in_features, dtype=torch.int32)
    return (torch.arange(in_features) // group_size).to(torch.int32)


def _shifts(bits: int, device: torch.device) -> torch.Tensor:
    return torch.arange(0, 32, bits, dtype=torch.int32, device=device)


def unpack_rows(qweight: torch.Tensor, bits: int) -> torch.Tensor:
    """int32 [rows / per, cols] packed along rows -> int32 [rows, cols] of values in [0, 2**bits)."""
    mask = (1 << bits) - 1
    q = (qweight[:, None, :] >> _shifts(bits, qweight.device)[None, :, None]) & mask  # [rows/per, per, cols]
    return q.reshape(-1, qweight.shape[1])


def unpack_cols(packed: torch.Tensor, bits: int, order: tuple[int, ...] | None = None) -> torch.Tensor:
    """int32 [rows, cols / per] packed along columns -> int32 [rows, cols]; ``order`` undoes an interleave."""
    mask = (1 << bits) - 1
    q = (packed[:, :, None] >> _shifts(bits, packed.device)[None, None, :]) & mask  # [rows, cols/per, per]
    if order is not None:
        q = q[..., list(order)]
    return q.reshape(packed.shape[0], -1)


def dequantize_gptq(
    qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, g_idx: torch.Tensor, bits: int, zero_offset: int
) -> torch.Tensor:
    """fp32 [out, in] weight of a GPTQ linear."""
    q = unpack_rows(qweight, bits)  # [in, out]
    zeros = unpack_cols(qzeros, bits) + zero_offset  # [G, out]
    g = g_idx.long()
    return ((q - zeros[g]).float() * scales.float()[g]).t()


def dequantize_awq(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, group_size: int) -> torch.Tensor:
    """fp32 [out, in] weight of an AWQ GEMM linear."""
    q = unpack_cols(qweight, 4, AWQ_REVERSE_ORDER)  # [in, out]
    zeros = unpack_cols(qzeros, 4, AWQ_REVERSE_ORDER)  # [G, out]
    g = default_g_idx(q.shape[0], group_size).long().to(q.device)
    return ((q - zeros[g]).float() * scales.float()[g]).t()


class _PackedIntLinear(QuantLinear):
    """Shared plumbing: bias, dtype handling and the torch/Triton dispatch."""

    def _init_common(self, in_features: int, out_features: int, bias: bool, compute_dtype: torch.dtype) -> None:
        self.in_features, self.out_features, self.compute_dtype = in_features, out_features, compute_dtype
        self.bias = nn.Parameter(torch.empty(out_features, dtype=compute_dtype), requires_grad=False) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = None if self.bias is None else self.bias.to(self.compute_dtype)
        xc = x.to(self.compute_dtype)
        if use_triton(x):
            y = self._triton_matmul(xc)
            y = y if bias is None else y + bias
        else:
            y = F.linear(xc, self.dequantize().to(self.compute_dtype), bias)
        return y.to(x.dtype)


class GPTQLinear(_PackedIntLinear):
    """Linear over GPTQ ``qweight/qzeros/scales/g_idx`` (act-order honoured through g_idx)."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool,
        *,
        bits: int,
        group_size: int,
        zero_offset: int,
        compute_dtype: torch.dtype,
    ) -> None:
        super().__init__()
        per = 32 // bits if bits in (2, 4, 8) else 0
        if not per or in_features % per or out_features % per:
            raise UnsupportedModelError(
                f"GPTQ {bits}-bit with in={in_features}, out={out_features}: AirQuant reads bits 2/4/8 with "
                f"in and out divisible by {per or 'the pack factor'}"
            )
        self._init_common(in_features, out_features, bias, compute_dtype)
        self.bits, self.group_size, self.zero_offset = bits, group_size, zero_offset
        groups = n_groups(in_features, group_size)
        self.register_buffer("qweight", torch.empty((in_features // per, out_features), dtype=torch.int32))
        self.register_buffer("qzeros", torch.empty((groups, out_features // per), dtype=torch.int32))
        self.register_buffer("scales", torch.empty((groups, out_features), dtype=torch.float16))
        self.register_buffer("g_idx", torch.empty(in_features, dtype=torch.int32))

    def dequantize(self) -> torch.Tensor:
        return dequantize_gptq(self.qweight, self.qzeros, self.scales, self.g_idx, self.bits, self.zero_offset)

    def _triton_matmul(self, x: torch.Tensor) -> torch.Tensor:
        return gptq_matmul(x, self.qweight, self.qzeros, self.scales, self.g_idx, self.bits, self.zero_offset)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, gptq bits={self.bits}, "
            f"group_size={self.group_size}, bias={self.bias is not None}"
        )


class AWQLinear(_PackedIntLinear):
    """Linear over AWQ GEMM ``qweight/qzeros/scales`` (4-bit, interleaved column order)."""

    def __init__(
        self, in_features: int, out_features: int, bias: bool, *, group_size: int, compute_dtype: torch.dtype
    ) -> None:
        super().__init__()
        if out_features % 8:
            raise UnsupportedModelError(f"AWQ GEMM needs out_features divisible by 8, got {out_features}")
        self._init_common(in_features, out_features, bias, compute_dtype)
        self.bits, self.group_size = 4, group_size
        groups = n_groups(in_features, group_size)
        self.register_buffer("qweight", torch.empty((in_features, out_features // 8), dtype=torch.int32))
        self.register_buffer("qzeros", torch.empty((groups, out_features // 8), dtype=torch.int32))
        self.register_buffer("scales", torch.empty((groups, out_features), dtype=torch.float16))

    def dequantize(self) -> torch.Tensor:
        return dequantize_awq(self.qweight, self.qzeros, self.scales, self.group_size)

    def _triton_matmul(self, x: torch.Tensor) -> torch.Tensor:
        group = self.in_features if self.group_size in (-1, 0) else self.group_size
        return awq_matmul(x, self.qweight, self.qzeros, self.scales, group)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, awq gemm bits=4, "
            f"group_size={self.group_size}, bias={self.bias is not None}"
        )
