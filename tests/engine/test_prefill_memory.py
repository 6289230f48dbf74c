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
