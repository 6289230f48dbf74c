"""Perplexity through the KV cache against ``airquant.eval.perplexity.score_windows`` on the same logits."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from airquant.eval.kv_perplexity import compare_logits, kv_perplexity
from airquant.eval.perplexity import plan_windows, score_windows
from airquant.kv import KVConfig, kv_logits, model_dims


@pytest.fixture(scope="module")
def model() -> LlamaForCausalLM:
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=16, max_position_embeddings=1024, attn_implementation="sdpa")
    return LlamaForCausalLM(cfg).eval()


@pytest.mark.parametrize("max_length, stride", [(64, 32), (50, 50), (40, 13), (300, 512)])
@pytest.mark.parametrize("backend", ["none", "tq"])
def test_kv_perplexity_matches_the_eval_window_scoring(model, max_length, stride, backend):
    ids = torch.randint(0, 96, (1, 157), generator=torch.Generator().manual_seed(0))  # [1, N]
    kv = KVConfig() if backend == "none" else KVConfig(backend="tq", bits_k=4, bits_v=2, window=8, block=1)
    row, scored = kv_perplexity(model, ids, kv, max_length=max_length, stride=stride)

    engine = SimpleNamespace(device=torch.device("cpu"),
                             forward=lambda inputs, kv: kv_logits(model, inputs, None, kv))
    windows = plan_windows(ids.shape[1], max_length, stride)
    nll_sum, count = score_windows(engine, ids[0], windows, kv=kv)
    assert row.tokens_scored == count == sum(s.shape[0] for s in scored)
    # Same windows and tokens; float32 log_softmax+gather vs cross_entropy sums differ in the last digits.
    assert row.ppl == pytest.approx(math.exp(nll_sum / count), rel=1e-5)


def test_the_exact_cache_agrees_with_itself(model):
    ids = torch.randint(0, 96, (1, 80), generator=torch.Generator().manual_seed(1))
    row, scored = kv_perplexity(model, ids, KVConfig(), max_length=48, stride=24)
    num_layers, _, head_dim = model_dims(model.config)
    same = compare_logits(row, scored, scored, head_dim, num_layers)
    assert same.top1_agreement == 1.0 and same.logit_cosine == pytest.approx(1.0) and same.bits_per_element is None
