"""Quantized expert weights: stacked per-expert tensors, decoded one expert at a time."""

from __future__ import annotations

import pytest
import torch

from airquant.quant import QuantSpec, make_linear, quantize_linear
from airquant.quant.experts import ExpertWeights, quantize_experts

SPECS = [QuantSpec(method="nf4"), QuantSpec(method="nf4", double_quant=True),
         QuantSpec(method="int2", group=32, outliers=0.05)]


def _one_expert(spec: QuantSpec, w: torch.Tensor) -> torch.Tensor:
    """Expert matrix [out, in] quantized alone and decoded by its linear module."""
    tensors, meta = quantize_linear(spec, w)
    with torch.device("meta"):
        module = make_linear(meta, w.shape[1], w.shape[0], False, compute_dtype=torch.float32)
    module.load_state_dict(tensors, assign=True)
    return module.dequantize().float()


def _loaded(tensors: dict, meta: dict, dtype=torch.float32) -> ExpertWeights:
    with torch.device("meta"):
        weights = ExpertWeights(meta, compute_dtype=dtype)
    weights.load_state_dict(tensors, assign=True, strict=True)
    return weights


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: f"{s.method}-dq{s.double_quant}")
@pytest.mark.parametrize("transposed", [False, True])
def test_each_expert_decodes_like_it_was_quantized_alone(spec, transposed):
    torch.manual_seed(0)
    fused = torch.randn(3, 128, 64) * 0.05  # [E, out, in], or [E, in, out] when transposed
    tensors, meta = quantize_experts(spec, fused, transposed=transposed)
    assert meta["experts"] == 3 and meta["transposed"] is transposed
    assert all(t.shape[0] == 3 and t.is_contiguous() for t in tensors.values())
    weights = _loaded(tensors, meta)
    assert weights.shape == fused.shape and len(weights) == 3
    for e in range(3):
        want = _one_expert(spec, fused[e].t().contiguous() if transposed else fused[e])
        got = weights[torch.tensor(e)]  # transformers indexes with 0-d tensors
        assert got.shape == fused[e].shape
        assert torch.equal(got, want.t() if transposed else want)
        assert (got - fused[e]).abs().mean() < 0.5 * fused[e].abs().mean()


def test_transposed_experts_are_quantized_along_their_input_dimension():
    """gpt-oss stores [E, in, out]: int2's groups and outliers must run over ``in`` as for any linear."""
    torch.manual_seed(1)
    fused = torch.randn(2, 64, 32) * 0.05  # in = 64, out = 32
    _, meta = quantize_experts(QuantSpec(method="int2", group=32, outliers=0.0), fused, transposed=True)
    assert meta["shape"] == [32, 64]


@pytest.mark.gpu
def test_nf4_expert_decode_on_cuda_matches_cpu():
    torch.manual_seed(2)
    fused = torch.randn(4, 256, 128, dtype=torch.bfloat16) * 0.05
    tensors, meta = quantize_experts(QuantSpec(method="nf4"), fused, transposed=False)
    cpu = _loaded(tensors, meta, torch.bfloat16)
    gpu = _loaded({k: v.cuda() for k, v in tensors.items()}, meta, torch.bfloat16)
    for e in range(4):
        assert torch.equal(gpu[e].cpu(), cpu[e])
