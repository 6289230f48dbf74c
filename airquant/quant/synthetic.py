"""Round-to-nearest GPTQ/AWQ packing and tiny pre-quantized Llama checkpoints for tests and benchmarks.

The packers write the published on-disk layouts (see ``airquant.quant.gptq``); the quantizer is plain
round-to-nearest with GPTQ's min/max grid (no Hessian), which is all a layout test or a speed
benchmark needs. ``write_synthetic_gptq_checkpoint`` writes a folder that looks like a hub GPTQ/AWQ
model: ``config.json`` with ``quantization_config`` and one ``model.safetensors``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch

from airquant.quant.gptq import AWQ_ORDER, n_groups

_LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


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


@dataclass(frozen=True)
class SyntheticCheckpoint:
    path: Path
    config: dict  # the config.json written
    reference_state_dict: dict[str, torch.Tensor]  # plain-Llama fp32 weights equal to the dequantized checkpoint


def tiny_llama_config(**overrides) -> dict:
    """Config of a random 2-layer Llama whose shapes exercise partial groups (in=160 with group 64)."""
    cfg = {"hidden_size": 160, "intermediate_size": 256, "num_hidden_layers": 2, "num_attention_heads": 5,
           "num_key_value_heads": 1, "head_dim": 32, "vocab_size": 320, "max_position_embeddings": 256,
           "tie_word_embeddings": False, "rms_norm_eps": 1e-5}
    cfg.update(overrides)
    return cfg


def write_synthetic_gptq_checkpoint(
    directory: str | Path,
    *,
    method: Literal["gptq", "awq"] = "gptq",
    bits: int = 4,
    group_size: int = 64,
    desc_act: bool = False,
    sym: bool = True,
    seed: int = 0,
    llama_config: dict | None = None,
) -> SyntheticCheckpoint:
    """Write a tiny random LlamaForCausalLM as a GPTQ/AWQ checkpoint folder (config.json + model.safetensors)."""
    from safetensors.torch import save_file
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(**(llama_config or tiny_llama_config()))
    model = LlamaForCausalLM(cfg).eval()
    tensors, reference = {}, {}
    for name, param in model.state_dict().items():
        module = name.rsplit(".", 1)[0]
        if not (name.endswith(".weight") and module.rsplit(".", 1)[-1] in _LINEARS):
            tensors[name] = reference[name] = param.detach().clone().contiguous()
            continue
        perm = torch.randperm(param.shape[1]) if desc_act else None
        rtn = rtn_quantize(param.detach(), bits, group_size, sym=sym if method == "gptq" else False, perm=perm)
        packed = gptq_tensors(rtn, bits) if method == "gptq" else awq_tensors(rtn)
        tensors.update({f"{module}.{k}": v for k, v in packed.items()})
        reference[name] = rtn.dequantize()
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    config = cfg.to_dict()
    config["quantization_config"] = quantization_config(method, bits, group_size, desc_act, sym)
    config["architectures"] = ["LlamaForCausalLM"]
    (directory / "config.json").write_text(json.dumps(config, indent=2, default=str))
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
    return SyntheticCheckpoint(path=directory, config=config, reference_state_dict=reference)
