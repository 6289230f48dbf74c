"""The metrics on the real streamed ``airquant.engine.Engine`` over a tiny store.

The other tests run on a stand-in; this one checks that the engine the CLI hands over keeps the
same contract, and that streamed perplexity agrees with the guide's loop on the original HF model.
"""

from __future__ import annotations

import pytest
import torch

from airquant.eval import run_niah, run_perf, run_perplexity, run_rouge

runner = pytest.importorskip("airquant.engine.runner", reason="the engine is not there yet")


@pytest.fixture(scope="module")
def engine(tiny_store):
    eng = runner.Engine.open(tiny_store, device="cpu")
    yield eng
    eng.close()


def test_streamed_perplexity_matches_the_guide_on_the_hf_model(engine, tiny_llama, small_text_file):
    from test_perplexity import guide_perplexity
    from transformers import AutoModelForCausalLM

    row = run_perplexity(engine, data=small_text_file, limit_tokens=400, max_length=128, stride=64, batch_size=2)
    model = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()
    ids = torch.tensor([engine.tokenizer(small_text_file.read_text())["input_ids"][:400]])
    assert abs(row.ppl / guide_perplexity(model, ids, 128, 64) - 1) < 0.005
    assert row.run.streamed and row.run.store_scheme == "float32"


def test_generation_metrics_run_on_the_engine(engine, small_text_file, tmp_path):
    perf = run_perf(engine, data=small_text_file, prompt_length=32, max_new_tokens=4, batch_size=2, warmup=0,
                    repeats=1)
    assert perf.samples[0].prompt_tokens >= 60 and perf.ttft_s > 0 and perf.bytes_per_decode_step > 0
    niah = run_niah(engine, data=small_text_file, context_lengths=(200,), depths=(50,), max_new_tokens=4)
    assert niah.cells[0].prompt_tokens <= 196
    cnn = tmp_path / "cnn.jsonl"
    cnn.write_text('{"id": "a", "article": "' + "The ship sailed on. " * 100 + '", "highlights": "It sailed."}\n')
    rouge = run_rouge(engine, data=cnn, max_new_tokens=4, batch_size=1)
    assert rouge.n_truncated == 1 and rouge.samples[0].prompt_tokens + 4 <= 256
