"""Round-to-nearest GPTQ/AWQ packing: the published on-disk layouts from plain weights.

The packers write the layouts ``airquant.quant.gptq`` reads; the quantizer is plain round-to-nearest
with GPTQ's min/max grid (no Hessian), which is all a random-weight store of a real shape
(``airquant synth --dtype gptq``), a layout test or a speed benchmark needs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from airquant.quant.gptq import AWQ_ORDER, n_groups


@dataclass(frozen=True)
class RTNResult:
    """Integer codes and grid of one [out, in] weight; W ~= scales[g] * (q - zeros[g]), g = g_idx[k]."""

    q: torch.Tensor  # int32 [out, in]
    zeros: torch.Tensor  # int32 [G, out]
    scales: torch.Tensor  # fp16 [G, out]
    g_idx: torch.Tensor  # int32 [in]

    def dequantize(self) -> torch.Tensor:
        g = self.g_idx.long()
        return (self.q - self.zeros[g].t()).float() * self.scales.float()[g].t()


def rtn_quantize(
    weight: torch.Tensor, bits: int, group_size: int, *, sym: bool, perm: torch.Tensor | None = None
) -> RTNResult:
    """GPTQ-grid round-to-nearest; ``perm`` (act-order) lists input channels in quantization order."""
    out_f, in_f = weight.shape
    maxq = (1 << bits) - 1
    perm = torch.arange(in_f) if perm is None else perm.long()
    gs = in_f if group_size in (-1, 0) else group_size
    g_idx = torch.empty(in_f, dtype=torch.int32)
    g_idx[perm] = (torch.arange(in_f) // gs).to(torch.int32)  # channel perm[j] falls in group j // gs
    groups = n_groups(in_f, group_size)
    w = weight.float()
    scales = torch.empty(groups, out_f)
    zeros = torch.empty(groups, out_f, dtype=torch.int32)
    for g in range(groups):
        cols = w[:, perm[g * gs : (g + 1) * gs]]
        # GPTQ's Quantizer widens the range to include 0 so the grid can represent it.
        xmin, xmax = cols.min(1).values.clamp(max=0), cols.max(1).values.clamp(min=0)
        if sym:
            xmax = torch.maximum(xmin.abs(), xmax)
            scale = (2 * xmax / maxq).clamp_min(1e-8)
            zero = torch.full_like(scale, (maxq + 1) // 2)
        else:
            scale = ((xmax - xmin) / maxq).clamp_min(1e-8)
            # v1 GPTQ stores zero - 1 in an unsigned field, so zero 0 cannot be written: keep it >= 1.
            zero = torch.round(-xmin / scale).clamp(1, maxq)
        scales[g] = scale.half().float()
        zeros[g] = zero.to(torch.int32)
    s, z = scales[g_idx.long()].t(), zeros[g_idx.long()].t()  # [out, in]
    q = torch.clamp(torch.round(w / s) + z, 0, maxq).to(torch.int32)
    return RTNResult(q=q, zeros=zeros, scales=scales.half(), g_idx=g_idx)


def _to_int32(x: torch.Tensor) -> torch.Tensor:
    """Reinterpret values in [0, 2**32) held in int64 as int32 (two's complement)."""
    return torch.where(x >= 2**31, x - 2**32, x).to(torch.int32)


def pack_rows(values: torch.Tensor, bits: int) -> torch.Tensor:
    """int [rows, cols] -> int32 [rows / per, cols]: row k in word k // per at bits bits*(k % per)."""
    per = 32 // bits
    v = values.long().reshape(-1, per, values.shape[1])
    shifts = torch.arange(0, 32, bits, dtype=torch.int64, device=values.device)[None, :, None]
    return _to_int32((v << shifts).sum(1))


def pack_cols(values: torch.Tensor, bits: int, order: tuple[int, ...] | None = None) -> torch.Tensor:
    """int [rows, cols] -> int32 [rows, cols / per]; with ``order``, nibble i holds column order[i]."""
    per = 32 // bits
    v = values.long().reshape(values.shape[0], -1, per)
    if order is not None:
        v = v[..., list(order)]
    shifts = torch.arange(0, 32, bits, dtype=torch.int64, device=values.device)[None, None, :]
    return _to_int32((v << shifts).sum(-1))


def gptq_tensors(rtn: RTNResult, bits: int, *, zero_offset: int = 1) -> dict[str, torch.Tensor]:
    """GPTQ checkpoint tensors; ``zero_offset`` 1 writes the v1 "gptq" format (zero - 1), 0 writes gptq_v2."""
    mask = (1 << bits) - 1
    return {
        "qweight": pack_rows(rtn.q.t(), bits),
        "qzeros": pack_cols((rtn.zeros - zero_offset) & mask, bits),
        "scales": rtn.scales.contiguous(),
        "g_idx": rtn.g_idx.contiguous(),
    }


def awq_tensors(rtn: RTNResult) -> dict[str, torch.Tensor]:
    """AWQ GEMM checkpoint tensors (4-bit, AWQ's interleaved column order, no g_idx)."""
    return {
        "qweight": pack_cols(rtn.q.t(), 4, AWQ_ORDER),
        "qzeros": pack_cols(rtn.zeros, 4, AWQ_ORDER),
        "scales": rtn.scales.contiguous(),
    }


def quantization_config(method: Literal["gptq", "awq"], bits: int, group_size: int, desc_act: bool, sym: bool) -> dict:
    """The ``quantization_config`` block hub checkpoints of that method carry."""
    if method == "gptq":
        return {"quant_method": "gptq", "bits": bits, "group_size": group_size, "desc_act": desc_act,
                "sym": sym, "damp_percent": 0.01, "true_sequential": True, "checkpoint_format": "gptq"}
    return {"quant_method": "awq", "bits": 4, "group_size": group_size, "zero_point": True, "version": "gemm",
            "modules_to_not_convert": None}
