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


@pytest.mark.parametrize("model_type", ["mixtral", "gpt_oss"])
def test_calibration_gives_each_expert_the_mean_abs_input_of_its_tokens(tmp_path, real_tokenizer, model_type):
    """Per expert, mean |x| over the tokens routed to it, against the experts module's inputs captured by
    a hook of the test's own (hidden states and routing indices)."""
    from transformers import AutoModelForCausalLM

    from airquant.quant import calibrate_act_scales
    from tests.zoo import make_model

    model = AutoModelForCausalLM.from_pretrained(make_model(tmp_path, real_tokenizer, model_type)).eval()
    experts = model.model.layers[1].mlp.experts
    calls = []
    handle = experts.register_forward_pre_hook(lambda m, a: calls.append((a[0].detach(), a[1].detach())))
    scales = calibrate_act_scales(model, real_tokenizer, "The quick brown fox jumps over the lazy dog. " * 20,
                                  n_tokens=64)
    handle.remove()
    x = torch.cat([h.reshape(-1, h.shape[-1]) for h, _ in calls]).float()
    idx = torch.cat([i.reshape(x.shape[0] if len(calls) == 1 else -1, i.shape[-1]) for _, i in calls])
    got = scales["model.layers.1.mlp.experts.gate_up_proj"]
    down = scales["model.layers.1.mlp.experts.down_proj"]
    assert got.shape == (4, x.shape[-1]) and down.shape[0] == 4
    for e in range(4):
        tokens = (idx == e).any(-1)
        if tokens.any():
            torch.testing.assert_close(got[e], x[tokens].abs().mean(0), rtol=1e-5, atol=1e-6)
            assert torch.isfinite(down[e]).all() and (down[e] > 0).any()
        else:
            assert torch.isnan(got[e]).all()


def test_calibrated_int2_experts_rank_outliers_by_their_own_tokens(tmp_path, real_tokenizer, capsys):
    import json

    from airquant.cli import main
    from airquant.engine.runner import Engine
    from tests.zoo import make_model

    folder = make_model(tmp_path / "model", real_tokenizer, "mixtral")
    calib = tmp_path / "calib.txt"
    calib.write_text("Calibration text about many things, numbers 1 2 3 and words. " * 40)
    store = tmp_path / "store"
    assert main(["shard", str(folder), "--store", str(store), "--dtype", "float32", "--quant", "int2",
                 "--group", "16", "--outliers", "0.1", "--calib", str(calib), "--quiet"]) == 0
    manifest = json.loads((store / "manifest.json").read_text())
    meta = manifest["shards"]["layer.0"]["modules"]["mlp.experts.gate_up_proj"]
    assert meta["experts"] == 4 and meta["n_outliers"] == 6  # 10 % of 64 input channels, per expert
    streamed = Engine.open(store, device="cpu")
    resident = Engine.open(store, device="cpu", resident=True)
    enc = streamed.encode(["The quick brown fox", "Hi"])
    # Streamed MoE layers run their routed experts as one grouped matmul (engine/moe/compute.py), which
    # sums in another order than the resident model's per-expert loop: equal to fp32 rounding, not bit-equal.
    torch.testing.assert_close(streamed.forward(**enc), resident.forward(**enc), rtol=1e-5, atol=1e-5)
