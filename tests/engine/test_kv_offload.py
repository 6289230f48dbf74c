"""KV offload: the offloaded layers' keys/values in host memory between their passes, in the loop's store
(``decode.slots.SlotKV``), which the decode loop and transformers' generate (``decode.fallback`` through
``decode.slot_cache.SlotCache``) both use: offloaded or not, on either path, the tokens are the loop's.
"""

import pytest
import torch

from airquant.config import GenerateConfig
from airquant.engine.decode import fallback
from airquant.engine.decode.slot_cache import KVOffloadError, SlotCache, SlotLayer
from airquant.engine.runner import Engine
from airquant.kv import KVConfig, cache_kwarg
from airquant.kv.config import KVConfigError

PROMPTS = ["Once upon a time in a land far far away there lived a king who", "Hi"]  # batch 2, left-padded
# A window shorter than the prompt: blocks are quantized at prefill and again while decoding.
TQ = KVConfig(backend="tq", bits_k=4, bits_v=2, window=8, block=4, sink=2)
KVS = {"plain": None, "tq": TQ}
NEW = 8


@pytest.fixture(scope="module")
def engines(tiny_store):
    on = Engine.open(tiny_store, device="cpu", kv_offload=False)
    off = Engine.open(tiny_store, device="cpu", kv_offload=True)
    yield on, off
    on.close()
    off.close()


def _requests(engine, prompts=PROMPTS):
    gen = GenerateConfig(max_new_tokens=NEW, ignore_eos=True)
    return [engine.request(engine.prompt_ids(p), gen) for p in prompts]


def _loop_tokens(engine, kv, prompts=PROMPTS):
    return [c.token_ids for c in engine.generate_requests(_requests(engine, prompts), kv=kv)]


def _fallback_tokens(engine, kv, offload: set[int], prompts=PROMPTS):
    """transformers' generate over the loop's store, as ``Engine`` runs the stacks the loop does not take."""
    out = fallback.generate_with_transformers(
        engine.model, engine.tokenizer, _requests(engine, prompts), device=engine.device, dtype=engine.dtype,
        eos_ids=engine.eos_ids(), kv=kv, offload=offload, cache_arg=cache_kwarg(engine.model),
        check_context=engine._check_context, on_error=lambda: None)
    return [c.token_ids for c in out]


@pytest.mark.parametrize("kv", list(KVS))
def test_offloaded_loop_gives_the_same_tokens(engines, kv):
    on, off = engines
    assert not on.offloaded_layers() and off.offloaded_layers() == {0, 1, 2}  # CPU: every layer streamed
    want = _loop_tokens(on, KVS[kv])
    assert _loop_tokens(off, KVS[kv]) == want and all(len(t) == NEW for t in want)


@pytest.mark.parametrize("offload", [False, True], ids=["on-device", "offloaded"])
@pytest.mark.parametrize("kv", list(KVS))
def test_generate_over_the_loops_store_gives_the_loops_tokens(engines, kv, offload):
    """A left-padded batch through transformers' generate: plain keys/values with the padding masked by the model,
    TurboQuant with the padding left out of each row's slot, so each row is decoded as the loop decodes it."""
    on, _ = engines
    want = _loop_tokens(on, KVS[kv])
    assert _fallback_tokens(on, KVS[kv], {0, 1, 2} if offload else set()) == want


def test_the_loops_offloaded_cache_is_counted_in_host_memory(engines):
    _, off = engines
    loop = off.decode_loop(2, context=64)
    assert loop.kv.offload == {0, 1, 2}
    loop.run(_requests(off))
    held = off.host_memory()["kv_offload"]
    assert held == loop.kv.host_bytes() > 0
    assert held == sum(t.numel() * t.element_size() for t in loop.kv._k + loop.kv._v)  # every layer's buffers


def test_an_offloaded_layers_prefix_is_one_block_of_host_memory():
    """What crosses the link for an offloaded layer each pass, its prefix ``[:, :, :span]`` (every slot, every head,
    the pass's span), is one block of host memory: a strided source goes through a pageable temporary, whose copy
    waits for everything queued on the GPU (the host stalled at every offloaded layer). New tokens still land
    where the next pass reads them."""
    from airquant.engine.decode.slots import Segment, SlotKV

    def one_block(t: torch.Tensor) -> bool:  # no gaps, no overlap: the last element is numel - 1 elements on
        return 1 + sum((n - 1) * st for n, st in zip(t.shape, t.stride())) == t.numel()

    kv = SlotKV(2, 3, 64, torch.device("cpu"), torch.float32, offload={1})
    g = torch.Generator().manual_seed(0)
    rows = {}
    for step, segments in enumerate([[Segment(0, 0, 5, 0), Segment(2, 0, 3, 5)],
                                     [Segment(0, 5, 1, 0), Segment(2, 3, 1, 1)]]):
        kv.begin(segments)
        n = sum(s.n for s in segments)
        for i in range(2):
            k, v = (torch.randn(1, 2, n, 8, generator=g) for _ in range(2))
            rows[step, i] = k
            kv.update(k, v, i)
    kv.begin([Segment(0, 6, 1, 0)])  # the next pass lands the last one's tokens in the host copy
    kv.update(*(torch.randn(1, 2, 1, 8, generator=g) for _ in range(2)), 1)
    home = kv._k[1]
    assert home.device.type == "cpu" and one_block(home[:, :, : kv.span]) and kv.span < kv.cap
    assert torch.equal(home[0, :, :5], rows[0, 1][0, :, :5]) and torch.equal(home[2, :, 3], rows[1, 1][0, :, 1])


def test_slot_cache_holds_attention_layers_and_refuses_what_it_cannot_offload():
    from transformers import Qwen2Config

    config = Qwen2Config(num_hidden_layers=2, hidden_size=16, num_attention_heads=2, num_key_value_heads=1,
                         intermediate_size=32, layer_types=["sliding_attention", "full_attention"],
                         use_sliding_window=True, sliding_window=4)
    cpu = dict(rows=1, cap=8, device=torch.device("cpu"), dtype=torch.float32)
    cache = SlotCache(config, offload={1}, **cpu)
    assert not isinstance(cache.layers[0], SlotLayer) and isinstance(cache.layers[1], SlotLayer)
    with pytest.raises(KVOffloadError, match=r"\{0: 'DynamicSlidingWindowLayer'\}.*--no-kv-offload"):
        SlotCache(config, offload={0, 1}, **cpu)
    with pytest.raises(KVConfigError, match="kv backend 'none'"):
        SlotCache(config, kv=TQ, **cpu)


def test_turboquant_needs_attention_the_loop_reaches():
    """GPT-Neo computes attention in its module code: the TurboQuant arenas would never be read."""
    from transformers import AutoModelForCausalLM, GPTNeoConfig

    config = GPTNeoConfig(num_layers=2, hidden_size=16, num_heads=2, attention_types=[[["global"], 2]],
                          vocab_size=32, max_position_embeddings=32)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    assert not fallback.attention_by_name(model)
    cpu = dict(rows=1, cap=8, pads=[0], device=torch.device("cpu"), dtype=torch.float32)
    with pytest.raises(KVConfigError, match="own module code.*kv backend 'none'"):
        fallback._cache(model, TQ, set(), **cpu)
    with pytest.raises(KVOffloadError, match="--no-kv-offload"):
        fallback._cache(model, KVConfig(backend="turboquant", bits_k=4, bits_v=4), {0}, **cpu)


def test_generate_cli_takes_the_kv_offload_flag(tiny_store, capsys):
    from airquant.cli import build_parser, main

    parse = build_parser().parse_args
    assert parse(["generate", "s", "--prompt", "x"]).kv_offload is None
    assert parse(["batch", "s", "--input", "i", "--output", "o", "--kv-offload"]).kv_offload is True
    assert parse(["generate", "s", "--prompt", "x", "--no-kv-offload"]).kv_offload is False
    assert main(["generate", str(tiny_store), "--device", "cpu", "--prompt", "Hi", "--max-new-tokens", "3",
                 "--kv-offload"]) == 0
    assert capsys.readouterr().out.strip()


def test_resident_and_default_engines_do_not_offload(tiny_store):
    assert not Engine.open(tiny_store, device="cpu").offloaded_layers()  # auto: no GPU, nothing to offload
    assert not Engine.open(tiny_store, device="cpu", resident=True).offloaded_layers()


# -- CUDA: pinned host buffers, and the VRAM it saves --------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("kw", [dict(resident_layers=0), dict(resident_layers=1, slots=3),
                                dict(resident_layers=0, max_ram_gb=0.0)], ids=["ram", "vram1-slots3", "disk"])
@pytest.mark.parametrize("kv", list(KVS))
def test_cuda_offloaded_cache_equals_the_cache_on_the_device(tiny_store, kw, kv):
    from airquant.config import EngineConfig

    on = Engine.open(tiny_store, EngineConfig(device="cuda", kv_offload=False, **kw))
    off = Engine.open(tiny_store, EngineConfig(device="cuda", kv_offload=True, **kw))
    assert off.plan.kv_offload and off.offloaded_layers() and not on.offloaded_layers()
    want = _loop_tokens(on, KVS[kv])
    for _ in range(2):
        assert _loop_tokens(off, KVS[kv]) == want
        assert _fallback_tokens(off, KVS[kv], off.offloaded_layers()) == want
    loop = off.decode_loop(2, context=64, kv=KVS[kv])
    loop.run(_requests(off))
    for i in range(off.config.num_hidden_layers):
        on_host = [t.device.type == "cpu" and t.is_pinned() for t in (loop.kv._k[i], loop.kv._v[i])
                   if t is not None] if kv == "plain" else [loop.kv.arena(i).t["win_k"].device.type == "cpu"]
        assert all(on_host) == (i in off.offloaded_layers()), f"layer {i}"
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

    from airquant.config import EngineConfig

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
