"""Hybrid stacks: attention layers beside linear-attention / state-space / conv layers with a fixed state.

Each type of ``tests.zoo.HYBRID_TYPES`` is sharded once and streamed. The reference is the resident
transformers model loaded from the same folder: streamed logits and greedy tokens must match it, a
left-padded batch must decode each prompt as it decodes alone (padding must not leak into the
recurrent or conv state), the TurboQuant cache must compress the attention layers only, and the KV
offload must move the attention layers' keys/values (the loop's store) and leave the fixed states to transformers.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from transformers import AutoModelForCausalLM, DynamicCache

from airquant.engine.decode.slot_cache import SlotAndStateLayer, SlotCache, SlotLayer
from airquant.engine.runner import Engine
from airquant.errors import UnsupportedModelError
from airquant.kv import KVConfig, LayerStates, kv_logits, make_cache
from airquant.kv.cache import TQLayer
from airquant.models import resolve
from airquant.store.split import split
from tests.zoo import HYBRID_TYPES, make_model

PROMPTS = ["The quick brown fox", "Once upon a time in a land far far away there lived", "Hi"]
NEW = 16
# LFM2's config makes every layer attend unless told which ones do: one attends here, two convolve.
OVERRIDES = {"lfm2": dict(full_attn_idxs=[1])}
# Nothing leaves the window: the compressed cache must give exactly the plain cache's tokens.
TQ_WIDE = KVConfig(backend="tq", bits_k=4, bits_v=2, window=256)
# A window shorter than the prompts: history is quantized at prefill and while decoding.
TQ_SMALL = KVConfig(backend="tq", bits_k=4, bits_v=2, window=4, block=2)


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """One intra-op thread: these matrices are tiny, and two threads on a busy 2-core machine made the
    file three times slower (50 s instead of 17 s; 105 s while other jobs ran)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module", params=HYBRID_TYPES)
def hybrid(request, tmp_path_factory, real_tokenizer):
    root = tmp_path_factory.mktemp(request.param)
    folder = make_model(root / "model", real_tokenizer, request.param, **OVERRIDES.get(request.param, {}))
    split(resolve(str(folder)), root / "store", dtype="float32", progress=False)
    engine = Engine.open(root / "store", device="cpu")
    reference = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    states = LayerStates.of(engine.config)
    assert states.attention_layers and states.recurrent_layers, f"{request.param} is not hybrid: {states.kinds}"
    alone = [_greedy(engine, [p])[0] for p in PROMPTS]  # the tokens every test compares with
    yield SimpleNamespace(store=root / "store", engine=engine, reference=reference, states=states,
                          tokenizer=real_tokenizer, alone=alone)
    engine.close()


def _greedy(engine, prompts, kv=None) -> list[tuple[int, ...]]:
    return [c.token_ids for c in engine.generate(prompts, max_new_tokens=NEW, ignore_eos=True, kv=kv)]


def _reference_greedy(h, prompts) -> list[tuple[int, ...]]:
    enc = h.tokenizer(prompts, return_tensors="pt", padding=True, padding_side="left")
    out = h.reference.generate(**enc, max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False,
                               eos_token_id=h.engine.eos_ids(), pad_token_id=h.tokenizer.pad_token_id)
    return [tuple(row) for row in out[:, enc["input_ids"].shape[1]:].tolist()]


def test_streamed_logits_equal_transformers(hybrid):
    enc = hybrid.engine.encode(PROMPTS)
    logits = hybrid.engine.forward(enc["input_ids"], enc["attention_mask"])  # [B, S, V], left-padded
    with torch.no_grad():
        for row, mask, prompt in zip(logits, enc["attention_mask"], PROMPTS):
            want = hybrid.reference(**hybrid.tokenizer(prompt, return_tensors="pt")).logits[0]
            assert ((row[mask.bool()] - want).abs().max() / want.abs().max()).item() <= 1e-4


def test_greedy_tokens_equal_transformers_generate(hybrid):
    assert [hybrid.alone[1]] == _reference_greedy(hybrid, PROMPTS[1:2]) and len(hybrid.alone[1]) == NEW


def test_the_decode_loop_refuses_it_and_names_the_path_that_runs_it(hybrid):
    """A caller stepping the loop itself (the provider) learns at once, not from a cache method the first pass
    misses; ``generate`` runs the stack through transformers' generate (``decode.fallback``)."""
    assert not hybrid.engine.loop_supported
    with pytest.raises(UnsupportedModelError, match="transformers' generate"):
        hybrid.engine.decode_loop(2, context=64)


def test_left_padded_batch_decodes_each_prompt_as_alone(hybrid):
    """Left padding ("Hi" padded by 11 tokens) must leave the recurrent and conv states as they are alone."""
    assert _greedy(hybrid.engine, PROMPTS) == hybrid.alone
    assert _reference_greedy(hybrid, PROMPTS) == hybrid.alone  # transformers itself masks the padding too


def test_turboquant_compresses_the_attention_layers_only(hybrid):
    engine, plain = hybrid.engine, hybrid.alone
    assert _greedy(engine, PROMPTS, TQ_WIDE) == plain  # the fixed states sit in the cache as in transformers'
    small = _greedy(engine, PROMPTS, TQ_SMALL)
    assert all(len(t) == NEW for t in small)
    assert [t[0] for t in small] == [t[0] for t in plain]  # the first token survives K4/V2 on a 4-token window
    bf16 = Engine.open(hybrid.store, device="cpu", dtype="bfloat16")  # a model dtype the codec would change
    enc = bf16.encode(PROMPTS)
    caches = {}
    for name, cache in (("plain", DynamicCache(config=bf16.config)), ("tq", make_cache(bf16.config, TQ_SMALL))):
        decode(bf16, enc, cache, steps=3)
        caches[name] = cache
    for i, (tq, own) in enumerate(zip(caches["tq"].layers, caches["plain"].layers)):
        if i in hybrid.states.attention_layers:
            assert isinstance(tq, TQLayer) and tq.store.length > 0, f"layer {i}: nothing was compressed"
        else:  # transformers' own state layer, states of the same shapes and dtypes as in its plain cache
            assert type(tq) is type(own) and not isinstance(tq, TQLayer)
            assert _state_shapes(tq) == _state_shapes(own)
            assert all(t.dtype == torch.bfloat16 for t in getattr(tq, "conv_states", {}).values() if t is not None)
    bf16.close()


def test_turboquant_decoding_matches_its_one_forward_simulation(hybrid):
    """Token by token through the compressed cache (recurrent layers stepping their state) against
    ``kv_logits``, which simulates the same quantization in one forward over the whole sequence."""
    engine = hybrid.engine
    seq = engine.encode(PROMPTS[1:2])["input_ids"]  # [1, S]
    cache = make_cache(engine.config, TQ_SMALL)
    with torch.inference_mode():
        steps = [engine.model(input_ids=seq[:, t: t + 1], use_cache=True, **engine._cache_arg(cache)).logits
                 for t in range(seq.shape[1])]
        simulated = kv_logits(engine.model, seq, torch.ones_like(seq), TQ_SMALL)
        exact = kv_logits(engine.model, seq, torch.ones_like(seq), KVConfig())
    torch.testing.assert_close(torch.cat(steps, dim=1), simulated, atol=1e-4, rtol=1e-4)
    assert (simulated - exact).abs().max() > 1e-3  # quantization did act


@pytest.mark.parametrize("kv", [None, TQ_SMALL], ids=["plain", "tq"])
def test_offloaded_hybrid_decodes_as_on_the_device(hybrid, kv):
    engine = Engine.open(hybrid.store, device="cpu", kv_offload=True)
    assert engine.offloaded_layers() == set(range(len(hybrid.states.kinds)))
    assert _greedy(engine, PROMPTS, kv) == _greedy(hybrid.engine, PROMPTS, kv)
    engine.close()


def test_turboquant_batch_decodes_each_prompt_as_alone(hybrid):
    """The padding of a left-padded row is neither calibrated on nor quantized (``slot_cache``)."""
    alone = [_greedy(hybrid.engine, [p], TQ_SMALL)[0] for p in PROMPTS]
    assert _greedy(hybrid.engine, PROMPTS, TQ_SMALL) == alone


def test_turboquant_decodes_as_generate_through_tq_cache(hybrid):
    """The loop's TurboQuant arenas under transformers' generate give the tokens of ``kv.cache.TQCache``."""
    engine, prompt = hybrid.engine, PROMPTS[1]
    ids = engine.encode([prompt])["input_ids"]
    config = engine.model.config
    previous = config._attn_implementation  # make_cache sets TurboQuant's attention on the config
    try:
        with torch.inference_mode():
            want = engine.model.generate(input_ids=ids, max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False,
                                         pad_token_id=engine.tokenizer.pad_token_id,
                                         **engine._cache_arg(make_cache(config, TQ_SMALL)))
    finally:
        config._attn_implementation = previous
    assert _greedy(engine, [prompt], TQ_SMALL) == [tuple(want[0, ids.shape[1]:].tolist())]


def test_slot_cache_keeps_keys_in_the_store_and_states_in_transformers(hybrid):
    engine = hybrid.engine
    enc = engine.encode(PROMPTS)
    n = len(hybrid.states.kinds)
    cache = SlotCache(engine.config, rows=len(PROMPTS), cap=enc["input_ids"].shape[1] + 4, device=engine.device,
                      dtype=engine.dtype, offload=set(range(n)))
    decode(engine, enc, cache, steps=3)
    own = DynamicCache(config=engine.config).layers
    for i in range(n):
        if i in hybrid.states.attention_layers:
            assert isinstance(cache.layers[i], SlotLayer) and cache.store._k[i] is not None, f"layer {i}"
            assert cache.layers[i].get_seq_length() == enc["input_ids"].shape[1] + 3
        else:
            assert type(cache.layers[i]) is type(own[i]) and cache.store._k[i] is None, f"layer {i}"
    assert cache.store.host_bytes() > 0


def test_offload_carries_a_layer_with_attention_and_a_state(tmp_path, real_tokenizer):
    """Falcon-H1 keeps keys/values and a Mamba-2 state in one cache layer: keys/values in the store, the state in
    transformers' class, the tokens those of transformers' own cache."""
    split(resolve(str(make_model(tmp_path / "model", real_tokenizer, "falcon_h1"))), tmp_path / "store",
          dtype="float32", progress=False)
    engine = Engine.open(tmp_path / "store", device="cpu", kv_offload=True)
    enc = engine.encode(PROMPTS[1:2])
    cache = SlotCache(engine.config, rows=1, cap=enc["input_ids"].shape[1] + NEW, device=engine.device,
                      dtype=engine.dtype, offload=engine.offloaded_layers())
    with torch.inference_mode():
        args = dict(**enc, max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False,
                    pad_token_id=engine.tokenizer.pad_token_id)
        want = engine.model.generate(**args)
        got = engine.model.generate(**args, **engine._cache_arg(cache))
    assert torch.equal(got, want)
    layer = cache.layers[1]
    assert isinstance(layer, SlotAndStateLayer) and cache.store._k[1] is not None and _state_tensors(layer)
    assert _greedy(engine, PROMPTS[1:2]) == [tuple(want[0, enc["input_ids"].shape[1]:].tolist())]
    engine.close()

def decode(engine, enc, cache, steps: int) -> None:
    """Prefill a left-padded batch and decode ``steps`` greedy tokens through ``cache``."""
    ids, mask = enc["input_ids"], enc["attention_mask"]
    with torch.inference_mode():
        for _ in range(steps + 1):
            position_ids = (mask.long().cumsum(-1) - 1).clamp(min=0)[:, -ids.shape[1]:]
            logits = engine.model(input_ids=ids, attention_mask=mask, position_ids=position_ids, use_cache=True,
                                  **engine._cache_arg(cache)).logits[:, -1]
            ids = logits.argmax(-1, keepdim=True)
            mask = torch.cat([mask, torch.ones_like(ids)], dim=1)


def _state_tensors(layer) -> list[torch.Tensor]:
    groups = (getattr(layer, "conv_states", {}), getattr(layer, "recurrent_states", {}))
    return [t for group in groups for t in group.values() if t is not None]


def _state_shapes(layer) -> list[tuple]:
    return [(tuple(t.shape), t.dtype) for t in _state_tensors(layer)]



def test_a_chunked_prefill_plan_runs_generate_in_groups_that_fit_it(hybrid, monkeypatch):
    """An engine planned for the decode loop's passes (``prefill="chunked"``, one 8-token sequence here) hands
    generate the prompts in groups that fit one pass (each prompt alone): the same tokens as one call for all."""
    from airquant.engine.decode import fallback

    engine = Engine.open(hybrid.store, device="cpu", prefill="chunked", batch_size=1, context=8)
    assert engine.plan.pass_tokens == 8  # no two of the three prompts fit together
    calls = []
    real = fallback.generate_with_transformers
    monkeypatch.setattr(fallback, "generate_with_transformers",
                        lambda model, tok, requests, **kw: calls.append(len(requests)) or real(model, tok, requests,
                                                                                               **kw))
    assert _greedy(engine, PROMPTS) == hybrid.alone
    assert calls == [1, 1, 1]
    engine.close()
