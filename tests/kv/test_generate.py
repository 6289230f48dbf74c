"""The cache inside transformers: generate(), step-by-step decode vs kv_logits, misuse guard."""

import pytest
import torch
from transformers import DynamicCache

from airquant.kv import KVConfig, cache_nbytes, kv_logits, make_cache
from airquant.kv.config import KVConfigError
from airquant.kv.store import CHUNK_TOKENS


def _generate(model, ids, mask, cache, new_tokens=24):
    return model.generate(
        input_ids=ids,
        attention_mask=mask,
        max_new_tokens=new_tokens,
        do_sample=False,
        past_key_values=cache,
        return_dict_in_generate=True,
        output_scores=True,
    )


def _batch(seed=0):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(2, 95, (2, 21), generator=gen)
    mask = torch.ones_like(ids)
    mask[1, :6] = 0  # left padding
    ids[1, :6] = 0
    return ids, mask


@pytest.mark.parametrize("head_dim", [16, 32])
def test_window_covering_everything_equals_dynamic_cache(make_llama, head_dim):
    model = make_llama(head_dim=head_dim)
    ids, mask = _batch()
    ref = _generate(model, ids, mask, DynamicCache(config=model.config))
    kv = KVConfig(backend="tq", bits_k=4, bits_v=4, window=512)
    out = _generate(model, ids, mask, make_cache(model.config, kv))
    assert torch.equal(out.sequences, ref.sequences)
    for a, b in zip(out.scores, ref.scores):
        assert torch.equal(a, b)


def test_quantized_generation_runs_and_holds_expected_bytes(make_llama):
    model = make_llama(head_dim=32)
    ids, mask = _batch()
    kv = KVConfig(backend="tq", bits_k=4, bits_v=2, window=8, block=4)
    cache = make_cache(model.config, kv)
    out = _generate(model, ids, mask, cache, new_tokens=40)
    assert out.sequences.shape == (2, 61)
    # The last generated token is never written to the cache: 60 tokens seen.
    assert cache.get_seq_length() == 60
    quantized = (60 - 7) // 4 * 4
    layer = cache.layers[0]
    assert layer.store.length == quantized
    per_token = (32 * 4 // 8 + 2) + (32 * 2 // 8 + 2)  # packed codes + fp16 norm, K and V
    store = 2 * 2 * CHUNK_TOKENS * per_token  # batch 2, 2 kv heads, one chunk of capacity
    residual = 2 * 2 * 2 * (60 - quantized) * 32 * 4  # K+V, fp32
    assert cache_nbytes(cache) == 2 * (store + residual)


@pytest.mark.parametrize("center_k", [False, True])  # True: the whole mixed-precision toolbox
def test_decoding_token_by_token_matches_kv_logits(make_llama, center_k):
    model = make_llama(head_dim=32, layers=3)
    gen = torch.Generator().manual_seed(1)
    seq = torch.randint(2, 95, (2, 45), generator=gen)
    kv = KVConfig(
        backend="tq", bits_k=3, bits_v=2, window=6, block=3, sink=2, center_k=center_k, center_v=center_k,
        norm_bits=8 if center_k else 16, unbiased=center_k, layer_bits=((1, 4, 3),),
    )
    cache = make_cache(model.config, kv)
    with torch.no_grad():
        steps = [model(input_ids=seq[:, t : t + 1], past_key_values=cache).logits for t in range(seq.shape[1])]
    decoded = torch.cat(steps, dim=1)
    simulated = kv_logits(model, seq, None, kv)
    exact = kv_logits(model, seq, None, KVConfig())
    torch.testing.assert_close(simulated, decoded, atol=2e-5, rtol=1e-4)
    assert (simulated - exact).abs().max() > 1e-3  # quantization did act


def test_other_attention_implementation_does_not_pass_silently(make_llama):
    model = make_llama()
    cache = make_cache(model.config, KVConfig(backend="tq", window=4, block=1))
    model.config._attn_implementation = "sdpa"
    ids = torch.randint(2, 95, (1, 12))
    # sdpa trips over the mask sized for the full cache; a mask-free kernel would hit the cache's guard.
    with torch.no_grad(), pytest.raises((KVConfigError, RuntimeError)):
        for _ in range(3):
            model(input_ids=ids[:, :4], past_key_values=cache)


def test_backend_none_gives_no_cache(make_llama):
    assert make_cache(make_llama().config, KVConfig(), device="cpu", dtype=torch.float32) is None
