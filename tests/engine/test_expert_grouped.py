"""The expert pool's compute paths and its fit with the rest of the engine (engine/moe/compute.py).

Grouped matmuls over experts decoded all at once equal transformers' per-expert loop; routed experts
under the TurboQuant KV cache and KV offload decode the tokens whole-layer streaming does; Llama 4's
dispatched experts move only routed experts; JetMoE, which cannot route, streams whole under ``auto``.
"""

from __future__ import annotations

import logging

import pytest
import torch

from airquant.engine.decode import Request
from airquant.engine.moe import compute as expert_compute
from airquant.engine.moe.sizing import ExpertsError
from airquant.engine.runner import Engine
from airquant.kv.config import KVConfig
from airquant.quant import QuantSpec
from airquant.quant.experts import ExpertWeights, quantize_experts
from tests.engine.test_expert_streaming import _greedy, _logits, _store

TQ = KVConfig(backend="tq", bits_k=4, bits_v=2, window=8, block=4)


@pytest.mark.parametrize("double_quant", [True, False])
@pytest.mark.parametrize("transposed", [False, True])
def test_stacked_nf4_decode_equals_expert_by_expert(double_quant, transposed):
    torch.manual_seed(0)
    weight = torch.randn(5, 96, 64) * 0.1  # 96 x 64: NF4 blocks never straddle two experts
    tensors, meta = quantize_experts(QuantSpec(method="nf4", double_quant=double_quant), weight,
                                     transposed=transposed)
    with torch.device("meta"):
        experts = ExpertWeights(meta, compute_dtype=torch.float32)
    experts.load_state_dict(tensors, assign=True)
    one_by_one = torch.stack([experts[e] for e in range(5)])
    assert torch.equal(experts.stacked(), one_by_one)
    assert torch.equal(experts.stacked(1, 4), one_by_one[1:4])


GROUPED = [("qwen3_moe", "nf4"), ("gpt_oss", "nf4"), ("mixtral", "int2"), ("qwen3_moe", None)]


@pytest.mark.parametrize("chunked", [False, True], ids=["one-decode", "chunk-per-expert"])
@pytest.mark.parametrize("model_type, method", GROUPED)
def test_grouped_equals_the_per_expert_loop(tmp_path, real_tokenizer, monkeypatch, model_type, method, chunked):
    _, store = _store(tmp_path, real_tokenizer, model_type, method)
    if chunked:  # every chunk one expert: rows routed partly outside a chunk are masked, not dropped
        monkeypatch.setattr(expert_compute, "GROUPED_BYTES", 1)
    engine = Engine.open(store, device="cpu", experts="routed")
    calls = []
    real = expert_compute.run_grouped
    monkeypatch.setattr(expert_compute, "run_grouped", lambda *a, **k: calls.append(1) or real(*a, **k))
    grouped = (_logits(engine), _greedy(engine, 4))
    assert calls, "the grouped path did not run"
    engine.experts.grouped = False
    loop = (_logits(engine), _greedy(engine, 4))
    assert (grouped[0] - loop[0]).abs().max().item() <= 1e-5 * loop[0].abs().max().item()
    assert grouped[1] == loop[1]
    engine.close()


def _decode(engine: Engine, kv, offload: bool) -> list[list[int]]:
    layers = set(range(engine.config.num_hidden_layers)) if offload else set()
    loop = engine.decode_loop(2, context=64, kv=kv, token_budget=64, offload=layers)
    prompts = ["Once upon a time in a land far far away there lived", "Hi"]
    seqs = [loop.submit(Request(tuple(engine.prompt_ids(p)), 6, ignore_eos=True)) for p in prompts]
    while not loop.idle:
        loop.step()
    return [list(s.out) for s in seqs]


@pytest.mark.parametrize("kv, offload", [(None, True), (TQ, False), (TQ, True)],
                         ids=["plain-offload", "turboquant", "turboquant-offload"])
def test_routed_decodes_like_whole_layer_with_turboquant_and_kv_offload(tmp_path, real_tokenizer, kv, offload):
    _, store = _store(tmp_path, real_tokenizer, "qwen3_moe", "nf4")  # full attention: TurboQuant applies
    whole = Engine.open(store, device="cpu", experts="whole")
    routed = Engine.open(store, device="cpu", experts="routed", expert_cache_gb=0.0)
    assert routed.loop_supported
    want = _decode(whole, kv, offload)
    assert _decode(routed, kv, offload) == want and all(want)
    assert routed.experts.bytes_copied > 0
    whole.close()
    routed.close()


def test_llama4_dispatched_experts_move_only_routed_ones(tmp_path, real_tokenizer):
    """Llama 4 hands its experts every token spread over all experts; only those routed are copied."""
    _, store = _store(tmp_path, real_tokenizer, "llama4_text")
    whole = Engine.open(store, device="cpu", experts="whole")
    routed = Engine.open(store, device="cpu", experts="routed", expert_cache_gb=0.0, expert_prefetch=False)
    ids = routed.encode(["Hi"])["input_ids"]
    assert ids.shape[1] == 1
    routed.reset_stats()
    got = routed.forward(ids)
    layers = len(routed.experts.layers)
    assert 0 < routed.experts.stats["routed"] <= 2 * layers < 4 * layers  # top-2 of 4 per layer
    assert (got - whole.forward(ids)).abs().max().item() <= 1e-5 * got.abs().max().item()
    assert _greedy(routed) == _greedy(whole)
    whole.close()
    routed.close()


@pytest.mark.parametrize("chunked", [False, True], ids=["one-decode", "chunk-per-expert"])
@pytest.mark.parametrize("method", ["nf4", "int2"])
def test_llama4_quantized_experts_run_decoded(tmp_path, real_tokenizer, monkeypatch, method, chunked):
    """Llama 4's experts multiply stacked tensors (torch.bmm): quantized ones are decoded a chunk of experts
    at a time, streamed whole or routed, and equal the resident engine's on the same weights."""
    _, store = _store(tmp_path, real_tokenizer, "llama4_text", method)
    if chunked:
        monkeypatch.setattr(expert_compute, "GROUPED_BYTES", 1)
    resident = Engine.open(store, device="cpu", resident=True)
    ids = torch.tensor([[5, 6, 7, 300, 41]])
    want = resident.forward(ids)
    for mode in ("whole", "routed"):
        engine = Engine.open(store, device="cpu", experts=mode)
        got = engine.forward(ids)
        assert (got - want).abs().max().item() <= 1e-5 * want.abs().max().item(), mode
        assert _greedy(engine) == _greedy(resident), mode
        engine.close()
    resident.close()


def test_a_type_that_cannot_route_streams_whole_under_auto(tmp_path, real_tokenizer, caplog):
    _, store = _store(tmp_path, real_tokenizer, "jetmoe")
    with caplog.at_level(logging.INFO, logger="airquant.engine.moe.sizing"):
        engine = Engine.open(store, device="cpu")
    assert engine.experts is None and "whole layers for jetmoe" in caplog.text
    engine.close()
    with pytest.raises(ExpertsError, match="cannot run jetmoe.*--experts auto"):
        Engine.open(store, device="cpu", experts="routed")
