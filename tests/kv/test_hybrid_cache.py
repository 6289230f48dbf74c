"""The compressed cache on hybrid stacks: attention layers compressed, the fixed states left to transformers."""

from types import SimpleNamespace

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, DynamicCache

from airquant.kv import KVConfig, LayerStates, cache_nbytes, make_cache, model_dims
from airquant.kv.cache import TQLayer
from airquant.kv.config import KVConfigError
from airquant.kv.quality import compression_vs_fp16
from tests.zoo import tiny_config

# Hybrid caches (LinearAttentionLayer, DummyLayer) came with transformers 5.2x; an older install (the GPU machine
# has 5.17) skips this module instead of failing its collection.
cache_utils = pytest.importorskip("transformers.cache_utils")
if not all(hasattr(cache_utils, n) for n in ("DummyLayer", "LinearAttentionLayer")):
    pytest.skip("this transformers has no hybrid cache layers (DummyLayer, LinearAttentionLayer)",
                allow_module_level=True)
DummyLayer, LinearAttentionLayer = cache_utils.DummyLayer, cache_utils.LinearAttentionLayer


@pytest.fixture(scope="module")
def qwen3_next(real_tokenizer):
    """Three Gated DeltaNet layers, then one attention layer."""
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(tiny_config("qwen3_next", real_tokenizer), dtype=torch.float32).eval()


def _generate(model, ids, cache, new_tokens=12):
    return model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                          do_sample=False, past_key_values=cache, pad_token_id=0)


def test_only_the_attention_layers_are_compressed(qwen3_next):
    ids = torch.randint(2, 500, (2, 20), generator=torch.Generator().manual_seed(0))
    ref = _generate(qwen3_next, ids, DynamicCache(config=qwen3_next.config))
    wide = make_cache(qwen3_next.config, KVConfig(backend="tq", window=512))
    assert torch.equal(_generate(qwen3_next, ids, wide), ref)  # nothing quantized: transformers' own tokens
    cache = make_cache(qwen3_next.config, KVConfig(backend="tq", window=4, block=2))
    _generate(qwen3_next, ids, cache)
    assert [type(layer) for layer in cache.layers] == [LinearAttentionLayer] * 3 + [TQLayer]
    assert cache.layers[3].store.length > 0
    states = [t for layer in cache.layers[:3] for t in (layer.conv_states[0], layer.recurrent_states[0])]
    assert {t.dtype for t in states} == {torch.float32}  # the model's dtype; untouched by the codec
    state_bytes = sum(t.nbytes for t in states)
    assert state_bytes == 2 * LayerStates.of(qwen3_next.config).state_bytes(4)
    assert cache_nbytes(cache) == state_bytes + cache_nbytes(SimpleNamespace(layers=cache.layers[3:]))


def test_compression_ratio_counts_the_attention_layers(qwen3_next):
    ratio = compression_vs_fp16(qwen3_next.config, KVConfig(backend="tq", window=8, block=8), n_tokens=512)
    assert 3 < ratio < 6  # K4/V2 past an 8-token window, one attention layer of four


def test_layers_without_attention_hold_transformers_own_state_layers(real_tokenizer):
    cfg = tiny_config("nemotron_h", real_tokenizer)  # Mamba-2, MoE, attention, MLP
    cache = make_cache(cfg, KVConfig(backend="tq"))
    assert [type(layer) for layer in cache.layers] == [LinearAttentionLayer, DummyLayer, TQLayer, DummyLayer]
    assert model_dims(cfg) == (4, 2, 16)


@pytest.mark.parametrize("model_type, kw, says", [
    ("gemma2", {}, "sliding_attention"),
    ("falcon_h1", {}, "hybrid"),  # attention and a Mamba state in one layer
    ("mamba", {}, "no attention layers"),
])
def test_layouts_the_cache_cannot_hold_are_refused(real_tokenizer, model_type, kw, says):
    cfg = tiny_config(model_type, real_tokenizer, **kw)
    with pytest.raises(KVConfigError, match=f"{says}.*use kv backend 'none'"):
        make_cache(cfg, KVConfig(backend="tq"))


def test_the_turboquant_package_backend_refuses_hybrids():
    cfg = AutoConfig.for_model("qwen3_next", num_hidden_layers=4)
    with pytest.raises(KVConfigError, match="use 'tq'"):
        make_cache(cfg, KVConfig(backend="turboquant", bits_k=4, bits_v=4))
