"""The planner's reserve covers what a prefill pass really holds (``plan.reserve_for``).

A batch's whole prompt goes through the stack in one pass (one weight pass for every prompt), so the
activations of every prompt token exist at once: the residual, the normed input, q/k/v and the attention
output, and an RMSNorm's fp32 upcast and square in a 16-bit dtype; the MLP runs in token chunks, whose
intermediates (per routed row in a Mixture-of-Experts block) are the reserve's MLP term. A dispatch mode
counts the bytes of every storage created during the generate call and still alive, and their peak is
compared with the reserve less its fixed workspace (cuBLAS's, not allocated on the CPU).
"""

from __future__ import annotations

import pytest
import torch

from airquant.config import MLP_CHUNK_TOKENS, GenerateConfig
from airquant.engine.memory.placement import reserve_for
from airquant.engine.runner import Engine
from airquant.models import resolve
from airquant.store.split import split
from tests.engine.test_expert_memory import LiveBytes
from tests.zoo import make_model

# Mixtral's ratios (attention 4 query heads to 1 KV head, an expert 3.5 x the hidden width, top-2 of 8)
SHAPE = dict(max_position_embeddings=4096, hidden_size=256, num_attention_heads=4, num_key_value_heads=1,
             intermediate_size=896, num_hidden_layers=2)
BATCH, PROMPT, NEW = 8, 512, 2  # 4096 prompt tokens in one pass: two MLP chunks


@pytest.mark.parametrize("model_type", ["llama", "mixtral"])
def test_a_prefill_pass_stays_within_the_planned_reserve(tmp_path, real_tokenizer, model_type):
    over = dict(SHAPE, **(dict(num_local_experts=8, num_experts_per_tok=2) if model_type == "mixtral" else {}))
    model = make_model(tmp_path / "model", real_tokenizer, model_type, **over)
    split(resolve(str(model)), tmp_path / "store", dtype="bfloat16", progress=False)
    engine = Engine.open(tmp_path / "store", device="cpu", dtype="bfloat16", resident_layers=0, experts="whole")
    assert BATCH * PROMPT > MLP_CHUNK_TOKENS
    ids = torch.randint(100, 1000, (BATCH, PROMPT))
    mode = LiveBytes()
    with mode:
        engine.generate_requests([engine.request(row, GenerateConfig(max_new_tokens=NEW, ignore_eos=True))
                                  for row in ids.tolist()])
    planned = reserve_for(engine.config, batch=BATCH, context=PROMPT + NEW, dtype_bytes=2)
    assert 0 < mode.peak <= planned.total - planned.workspace, (mode.peak, planned.describe())
    engine.close()


@pytest.mark.parametrize("kv", ["none", "tq"])
def test_a_chunked_prefill_stays_within_one_passs_reserve(tmp_path, real_tokenizer, kv):
    """``prefill="chunked"`` (airquant batch: the decode loop's passes) plans the activations of one pass, not of
    every prompt at once; the engine then prefills the batch in passes that fit it, and what a generation holds
    stays within that smaller reserve (KV, TurboQuant's gathered histories, activations)."""
    from airquant.config import EngineConfig
    from airquant.engine.memory.placement import pass_tokens
    from airquant.engine.memory.planner import workload_for
    from airquant.kv import KVConfig

    model = make_model(tmp_path / "model", real_tokenizer, "llama", **SHAPE)
    split(resolve(str(model)), tmp_path / "store", dtype="bfloat16", progress=False)
    context = PROMPT + NEW
    cfg = EngineConfig(device="cpu", dtype="bfloat16", resident_layers=0, batch_size=BATCH, context=context,
                       kv_cache=kv, prefill="chunked")
    engine = Engine.open(tmp_path / "store", cfg)
    tokens = pass_tokens(BATCH, context)
    assert engine.plan.pass_tokens == tokens < BATCH * PROMPT
    ids = torch.randint(100, 1000, (BATCH, PROMPT))
    tq = KVConfig(backend="tq", bits_k=4, bits_v=2, window=128) if kv == "tq" else None
    mode = LiveBytes()
    with mode:
        engine.generate_requests([engine.request(row, GenerateConfig(max_new_tokens=NEW, ignore_eos=True))
                                  for row in ids.tolist()], kv=tq)
    from airquant.engine.memory.planner import reserve_of
    from airquant.engine.memory.router import Candidate

    c = Candidate.open(tmp_path / "store")
    chunked = reserve_of(c.manifest, c.dims, workload_for(cfg), kv, 2, gpu=False)
    whole = reserve_of(c.manifest, c.dims, workload_for(cfg, prefill="whole"), kv, 2, gpu=False)
    assert chunked.activations * BATCH * context == whole.activations * tokens
    assert 0 < mode.peak <= chunked.total, (mode.peak, chunked.describe())
    engine.close()
