"""KV offload: the streamed layers' cache in host memory, moved with each layer, against the cache on the device.

The CUDA ordering is driven on CPU through the streamer tests' ``SimOps`` (eager: a copy into a buffer
still in use clobbers it; lazy: a copy runs only when something waits for its event), so a missing
wait or a buffer reused too early changes the logits, which must equal the on-device cache's exactly.
"""

import pytest
import torch
from test_streamer import SimOps  # tests/engine is on sys.path (no package __init__)

from airquant.engine.memory.placement import StreamPlan
from airquant.engine.runner import Engine
from airquant.engine.streamer import LayerStreamer
from airquant.kv import KVConfig

PROMPTS = ["Once upon a time in a land far far away there lived a king who", "Hi"]  # batch 2, left-padded
# A window shorter than the prompt: blocks are quantized at prefill and again while decoding.
TQ = KVConfig(backend="tq", bits_k=4, bits_v=2, window=8, block=4, sink=2)
KVS = {"plain": None, "tq": TQ}
STEPS = 6


class KVSimOps(SimOps):
    def retire(self, tensor):
        pass  # the simulated copy stream keeps its own references


def offload_engine(store, tiers, ops, slots=2):
    """A CPU engine with the KV cache offloaded, its streamer following ``tiers`` through ``ops``."""
    engine = Engine.open(store, device="cpu", kv_offload=True)
    layer_bytes = engine.manifest.layer_bytes
    plan = StreamPlan(tiers=list(tiers), slot_bytes=max(layer_bytes), slots=slots, fixed_bytes=0, kv_offload=True)
    streamer = LayerStreamer(store, engine.manifest, plan, torch.device("cpu"), engine.dtype, ops=ops)
    engine.streamer.close()
    for layer in engine.model.model.layers:
        layer.streamer = streamer
    engine.streamer, engine.plan = streamer, plan
    return engine


def decode_logits(engine, kv, steps=STEPS, announced=None):
    """Prefill and ``steps`` greedy decode steps through the engine's cache; the logits of each, and the cache.

    ``announced``: the tokens the offloaded cache is told to expect (default: all of them)."""
    enc = engine.encode(PROMPTS)
    ids, mask = enc["input_ids"], enc["attention_mask"]
    cache = engine._make_cache(kv) or __import__("transformers").DynamicCache(config=engine.config)
    offload = engine.streamer.kv if engine.streamer is not None else None
    if offload is not None:
        offload.bind(cache, tokens=ids.shape[1] + steps if announced is None else announced)
    out, arg = [], engine._cache_arg(cache)
    with torch.inference_mode():
        for _ in range(steps + 1):
            position_ids = (mask.long().cumsum(-1) - 1).clamp(min=0)[:, -ids.shape[1]:]
            logits = engine.model(input_ids=ids, attention_mask=mask, position_ids=position_ids, use_cache=True,
                                  **arg).logits[:, -1]
            out.append(logits)
            ids = logits.argmax(-1, keepdim=True)
            mask = torch.cat([mask, torch.ones_like(ids)], dim=1)
    return torch.stack(out), cache


@pytest.fixture(scope="module", params=list(KVS))
def reference(request, tiny_store):
    kv = KVS[request.param]
    engine = Engine.open(tiny_store, device="cpu", kv_offload=False)
    assert engine.streamer.kv is None
    logits, cache = decode_logits(engine, kv)
    if kv is not None:
        assert cache.layers[0].store.length > 0  # blocks were quantized: the packed store travels too
    tokens = [c.token_ids for c in engine.generate(PROMPTS, max_new_tokens=8, kv=kv, ignore_eos=True)]
    return kv, logits, tokens


def _points_at_host(engine, cache, i) -> bool:
    host = engine.streamer.kv.host_storages()
    layer = cache.layers[i]
    tensors = layer.tensors() if hasattr(layer, "tensors") else [layer.keys, layer.values]
    return all(t.untyped_storage().data_ptr() in host for t in tensors if t is not None and t.numel())


@pytest.mark.parametrize("tiers, ops", [
    (("ram", "ram", "ram"), None),  # CPU: the same path with plain copies
    (("ram", "disk", "ram"), lambda: KVSimOps(lazy=False)),
    (("ram", "ram", "disk"), lambda: KVSimOps(lazy=True)),
    (("vram", "ram", "disk"), lambda: KVSimOps(lazy=True)),  # a VRAM layer keeps its cache on the device
], ids=["cpu", "eager", "lazy", "vram+lazy"])
def test_offloaded_cache_gives_the_same_logits(tiny_store, reference, tiers, ops):
    kv, want, tokens = reference
    engine = offload_engine(tiny_store, tiers, ops() if ops else None, slots=1 if ops is None else 2)
    for _ in range(2):  # the second generation reuses the host buffers of the first
        got, cache = decode_logits(engine, kv)
        assert torch.equal(got, want)
        for i, tier in enumerate(tiers):
            assert _points_at_host(engine, cache, i) == (tier != "vram"), f"layer {i} ({tier})"
    host = []
    for _ in range(2):
        got = engine.generate(PROMPTS, max_new_tokens=8, kv=kv, ignore_eos=True)
        assert [c.token_ids for c in got] == tokens
        host.append(engine.streamer.kv.host_bytes())
    assert host[0] == host[1]  # sized once for prompt + new tokens, then reused
    engine.close()


def test_host_buffers_grow_past_the_announced_tokens(tiny_store, reference):
    """Told to expect 1 token, the host buffers double as the cache grows (lazy copies: growth must wait)."""
    kv, want, _ = reference
    engine = offload_engine(tiny_store, ("ram", "disk", "ram"), KVSimOps(lazy=True))
    got, cache = decode_logits(engine, kv, announced=1)
    assert torch.equal(got, want)
    assert all(_points_at_host(engine, cache, i) for i in range(3))


def test_generate_cli_takes_the_kv_offload_flag(tiny_store, capsys):
    from airquant.cli import build_parser, main

    parse = build_parser().parse_args
    assert parse(["generate", "s", "--prompt", "x"]).kv_offload is None
    assert parse(["batch", "s", "--input", "i", "--output", "o", "--kv-offload"]).kv_offload is True
    assert parse(["generate", "s", "--prompt", "x", "--no-kv-offload"]).kv_offload is False
    assert main(["generate", str(tiny_store), "--device", "cpu", "--prompt", "Hi", "--max-new-tokens", "3",
                 "--kv-offload"]) == 0
    assert capsys.readouterr().out.strip()


def test_nothing_of_an_offloaded_cache_stays_on_the_device(tiny_store, reference):
    """Between steps the cache's tensors are the host buffers; the device holds only the pass-through buffers."""
    kv, _, _ = reference
    engine = Engine.open(tiny_store, device="cpu", kv_offload=True)
    _, cache = decode_logits(engine, kv)
    offload = engine.streamer.kv
    from airquant.kv import cache_nbytes

    held = cache_nbytes(cache)
    assert held > 0 and all(_points_at_host(engine, cache, i) for i in range(len(cache.layers)))
    assert offload.host_bytes() >= held
    # One buffer (CPU, used in place: one slot) with one layer's cache, plus room to append (tq).
    per_layer = held // len(cache.layers)
    assert 0 < offload.device_bytes() <= 2 * per_layer + 64 * 1024


def test_offload_refuses_a_cache_it_cannot_move(tiny_store):
    from airquant.engine.memory.kv_offload import KVOffloadError

    engine = Engine.open(tiny_store, device="cpu", kv_offload=True)
    engine.streamer.kv.bind(type("Odd", (), {"layers": []})())
    engine.streamer.kv._records.clear()
    from transformers.cache_utils import DynamicSlidingWindowLayer

    layer = DynamicSlidingWindowLayer(sliding_window=4)
    layer.lazy_initialization(torch.zeros(1, 1, 1, 2), torch.zeros(1, 1, 1, 2))
    engine.streamer.kv.cache.layers.append(layer)
    with pytest.raises(KVOffloadError, match="--no-kv-offload"):
        engine.streamer.kv.leave(0)


def test_resident_and_default_engines_do_not_offload(tiny_store):
    assert Engine.open(tiny_store, device="cpu").streamer.kv is None  # auto: no GPU, nothing to offload
    assert Engine.open(tiny_store, device="cpu", resident=True).streamer is None


# -- CUDA: the copy stream, pinned host buffers, and the VRAM it saves --------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("kw", [dict(resident_layers=0), dict(resident_layers=1, slots=3),
                                dict(resident_layers=0, max_ram_gb=0.0)], ids=["ram", "vram1-slots3", "disk"])
def test_cuda_offloaded_cache_equals_the_cache_on_the_device(tiny_store, reference, kw):
    from airquant.config import EngineConfig

    kv = reference[0]
    on = Engine.open(tiny_store, EngineConfig(device="cuda", kv_offload=False, **kw))
    off = Engine.open(tiny_store, EngineConfig(device="cuda", kv_offload=True, **kw))
    assert off.plan.kv_offload and off.streamer.kv is not None and on.streamer.kv is None
    want, _ = decode_logits(on, kv)
    for _ in range(2):  # the second pass reuses the pinned buffers and the device buffers
        got, cache = decode_logits(off, kv)
        assert torch.equal(got, want)
        for i, tier in enumerate(off.plan.tiers):
            layer = cache.layers[i]
            tensors = [t for t in (layer.tensors() if hasattr(layer, "tensors") else [layer.keys, layer.values])
                       if t is not None and t.numel()]
            on_host = [t.device.type == "cpu" and t.is_pinned() for t in tensors]
            assert all(on_host) if tier != "vram" else not any(on_host), f"layer {i} ({tier})"
    ga = on.generate(PROMPTS, max_new_tokens=8, kv=kv, ignore_eos=True)
    gb = off.generate(PROMPTS, max_new_tokens=8, kv=kv, ignore_eos=True)
    assert [c.token_ids for c in gb] == [c.token_ids for c in ga]
    off.close()
    on.close()


def _long_context_store(folder, tokenizer):
    """16 layers whose cache outweighs their weights: 4 KV heads of 64, bf16, 4096 positions."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from airquant.models import resolve
    from airquant.store.split import split

    torch.manual_seed(0)
    config = AutoConfig.for_model("llama", vocab_size=len(tokenizer), hidden_size=256, intermediate_size=512,
                                  num_hidden_layers=16, num_attention_heads=4, num_key_value_heads=4,
                                  max_position_embeddings=4096, bos_token_id=tokenizer.bos_token_id,
                                  eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(folder / "hf")
    tokenizer.save_pretrained(folder / "hf")
    split(resolve(str(folder / "hf")), folder / "store", dtype="bfloat16", progress=False)
    return folder / "store"


@pytest.mark.gpu
def test_cuda_offload_lowers_peak_vram_at_long_context(tmp_path, real_tokenizer):
    import gc

    from airquant.config import EngineConfig, GenerateConfig

    store = _long_context_store(tmp_path, real_tokenizer)
    batch, prompt, new = 4, 2048, 4
    ids = torch.randint(100, 40000, (batch, prompt), generator=torch.Generator().manual_seed(0))
    peaks, tokens = {}, {}
    for offload in (False, True):
        engine = Engine.open(store, EngineConfig(device="cuda", resident_layers=0, kv_offload=offload))
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        out = engine.generate_requests([engine.request(row, GenerateConfig(max_new_tokens=new, ignore_eos=True))
                                        for row in ids.tolist()])
        torch.cuda.synchronize()
        peaks[offload] = torch.cuda.max_memory_allocated() - base
        tokens[offload] = [c.token_ids for c in out]
        engine.close()
        del engine, out
        gc.collect()
        torch.cuda.empty_cache()
    kv = batch * (prompt + new) * 16 * 2 * 4 * 64 * 2  # 16 layers of K and V, 4 heads of 64, bf16: 134 MB
    assert tokens[True] == tokens[False]
    # On the device the whole cache is held at the last layer; offloaded, only the layers in flight (and
    # the prefill's copies back not yet run) of 16.
    assert peaks[True] < peaks[False] - kv // 3, {k: v / 1e6 for k, v in peaks.items()}
