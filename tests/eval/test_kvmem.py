"""KV-cache memory against context: the plain cache's bytes against the formula, the compressed one smaller."""

from __future__ import annotations

import pytest

from airquant.errors import EvalConfigError
from airquant.eval import read_rows, write_row
from airquant.eval.kvmem import run_kv_memory
from airquant.kv import KVConfig


@pytest.fixture(scope="module")
def engine(tiny_store, eval_data):
    from airquant.engine.runner import Engine

    e = Engine.open(tiny_store, device="cpu")
    yield e
    e.close()


def test_plain_cache_bytes_equal_keys_and_values_of_every_layer(engine, tmp_path):
    row = run_kv_memory(engine, context_lengths=(16, 64), vram_budget_gb=4.0)
    cfg = engine.config
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    per_token = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * head_dim * engine.dtype.itemsize
    assert row.cache_bytes == (16 * per_token, 64 * per_token)
    assert row.bytes_per_token == (per_token, per_token)
    assert row.planned_max_batch[0] >= row.planned_max_batch[1] > 0
    assert read_rows(write_row(row, tmp_path / "kv.json")) == [row]


def test_turboquant_cache_is_smaller_past_the_window(engine):
    kv = KVConfig(backend="tq", bits_k=4, bits_v=2, window=16, block=16)
    plain = run_kv_memory(engine, context_lengths=(192,), vram_budget_gb=None)
    tq = run_kv_memory(engine, context_lengths=(192,), kv=kv, vram_budget_gb=None)
    assert tq.run.kv_scheme == "tq-k4v2" and tq.planned_max_batch == (None,)
    assert tq.cache_bytes[0] < 0.6 * plain.cache_bytes[0]


def test_contexts_beyond_the_model_are_refused(engine):
    with pytest.raises(EvalConfigError, match="context lengths"):
        run_kv_memory(engine, context_lengths=(10_000,))


def test_the_prefill_uses_no_deprecated_transformers_argument(tiny_engine, small_text_file):
    """``generate(past_key_values=...)`` warned that it goes away in a later transformers (a break waiting)."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        warnings.simplefilter("error", DeprecationWarning)
        row = run_kv_memory(tiny_engine, context_lengths=(32,), data=small_text_file, vram_budget_gb=None)
    assert row.cache_bytes[0] > 0
