"""Calibration hooks and the in-memory module swap, on a tiny random Llama."""

from __future__ import annotations

import copy

import pytest
import torch
from torch.nn import functional as F

from airquant.quant import QuantSpec, calibrate_act_scales, calibrate_hessians, quantize_model_inplace
from airquant.quant.int2 import Int2Linear
from airquant.quant.swap import decoder_linears


class ByteTokenizer:
    """Stand-in tokenizer: one token per UTF-8 byte."""

    def __init__(self, vocab: int) -> None:
        self.vocab = vocab

    def __call__(self, text: str, return_tensors: str = "pt"):
        ids = torch.tensor([[b % self.vocab for b in text.encode()]])
        return type("Encoding", (), {"input_ids": ids})()


@pytest.fixture(scope="module")
def tiny():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=256, max_position_embeddings=512)
    return LlamaForCausalLM(cfg).eval()


TEXT = "The quick brown fox jumps over the lazy dog. " * 8


def test_act_scales_and_hessian_equal_the_layer_inputs(tiny):
    tok = ByteTokenizer(256)
    scales = calibrate_act_scales(tiny, tok, TEXT, n_tokens=300)
    scales2, hessians = calibrate_hessians(tiny, tok, TEXT, n_tokens=300)
    assert set(scales) == set(decoder_linears(tiny)) == set(hessians)
    ids = tok(TEXT).input_ids[:, :300]
    with torch.no_grad():
        hidden = tiny(ids, output_hidden_states=True).hidden_states
        for layer in range(2):
            x = tiny.model.layers[layer].input_layernorm(hidden[layer])[0]  # input of q/k/v_proj, [T, 64]
            name = f"model.layers.{layer}.self_attn.q_proj"
            torch.testing.assert_close(scales[name], x.abs().mean(0), rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(scales2[name], scales[name])
            torch.testing.assert_close(hessians[name], x.t() @ x / x.shape[0], rtol=1e-4, atol=1e-5)
            torch.testing.assert_close(scales[name.replace("q_proj", "v_proj")], scales[name])


@pytest.mark.parametrize("spec,min_cos", [(QuantSpec(method="nf4"), 0.98), (QuantSpec(method="int2"), 0.8)])
def test_quantize_model_inplace(tiny, spec, min_cos):
    if spec.method == "nf4":
        pytest.importorskip("bitsandbytes")
    model = copy.deepcopy(tiny)
    ids = torch.randint(0, 256, (1, 40))
    with torch.no_grad():
        before = model(ids).logits
    metas = quantize_model_inplace(model, spec)
    assert len(metas) == 14 and all(m["scheme"] == spec.method for m in metas.values())
    assert not any(isinstance(model.get_submodule(n), torch.nn.Linear) for n in metas)
    assert isinstance(model.lm_head, torch.nn.Linear)  # only decoder-layer linears are swapped
    with torch.no_grad():
        after = model(ids).logits
    assert F.cosine_similarity(after, before, dim=-1).mean() > min_cos


def test_include_filter_and_error_feedback_swap(tiny):
    model = copy.deepcopy(tiny)
    scales, hessians = calibrate_hessians(model, ByteTokenizer(256), TEXT, n_tokens=300)
    metas = quantize_model_inplace(model, QuantSpec(method="int2", error_feedback=True), act_scales=scales,
                                   hessians=hessians, include=lambda n: "mlp" in n)
    assert len(metas) == 6 and all(m["error_feedback"] for m in metas.values())
    assert isinstance(model.model.layers[0].mlp.down_proj, Int2Linear)
    assert isinstance(model.model.layers[0].self_attn.q_proj, torch.nn.Linear)
