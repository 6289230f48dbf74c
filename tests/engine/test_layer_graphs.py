"""Layer graphs (engine/layer_graphs.py): streamed layers' decode calls captured in graphs (with the plain cache's
static write and attention, or around the attention island) and replayed.

On the CPU the graphs are emulated (``EmulatedBackend``: the ops a capture saw, replayed on the same tensors, a
host read inside a capture refused as CUDA refuses it), so the split, the keys by weight slot and cache buffers,
the static twins and the island replay are checked in fp32 against the same decode run eagerly (``_static_eager``:
the cache's passes static as under graphs, nothing captured), where they must agree exactly; the static passes
against the plain cache's eager decode within fp32 rounding (another attention: masked, over a bucketed span).
On CUDA the real graphs against the eager path, with direct expert reads (GPU tests)."""

from __future__ import annotations

import pytest
import torch

from airquant.config import GenerateConfig
from airquant.engine import layer_graphs, skeleton
from airquant.engine.decode.slots import SlotKV
from airquant.engine.moe.compute import FUSED_TOKENS
from airquant.engine.runner import Engine
from tests.engine.test_expert_gemv import GEMV_SHAPES, PROMPT, _decode
from tests.engine.test_expert_gemv import _store as nf4_store
from tests.zoo import make_model


def _store(tmp_path_factory, tokenizer, model_type: str, **over):
    from airquant.models import resolve
    from airquant.store.split import split

    folder = tmp_path_factory.mktemp(model_type)
    source = resolve(str(make_model(folder / "model", tokenizer, model_type, **over)))
    split(source, folder / "store", dtype="float32", progress=False)
    return folder / "store"


@pytest.fixture(scope="module")
def stores(tmp_path_factory, real_tokenizer):
    return {**{t: _store(tmp_path_factory, real_tokenizer, t)
               for t in ("llama", "qwen3", "qwen2", "mistral", "qwen3_moe", "mixtral", "gpt_oss")},
            "mistral_window": _store(tmp_path_factory, real_tokenizer, "mistral", sliding_window=6)}


def _graphed(store, **opts) -> tuple[Engine, layer_graphs.LayerGraphs]:
    opts = {"experts": "whole", **opts}
    engine = Engine.open(store, device="cpu", dtype="float32", resident_layers=0, **opts)
    graphs = layer_graphs.LayerGraphs(layer_graphs.EmulatedBackend(), FUSED_TOKENS)
    skeleton.attach_graphs(engine.model, graphs)
    return engine, graphs


def _static_eager(store, run, **opts):
    """``run(engine)`` with the graph runner attached but no key ever captured: the cache's decode passes are
    static as under graphs and every call runs eagerly, the decode a replay must equal exactly."""
    with pytest.MonkeyPatch.context() as m:
        m.setattr(layer_graphs, "KEYS_PER_LAYER", 0)
        engine, graphs = _graphed(store, **opts)
        try:
            got = run(engine)
        finally:
            engine.close()
    assert graphs.stats["captures"] == 0 and graphs.stats["eager"] > 0
    return got


@pytest.mark.parametrize("model_type", ["llama", "qwen3", "qwen2", "mistral"])
def test_replayed_layers_decode_exactly_as_eager(stores, model_type):
    """Every layer is warmed up, captured, then replayed (its twins refreshed each pass, its cache write and
    attention in its one graph, reading the pass's slots and lengths from the cache's static tensor): the
    greedy tokens and every step's logits equal the same decode run eagerly."""
    want_tokens, want_logits = _static_eager(stores[model_type], lambda e: _decode(e, steps=8))
    engine, graphs = _graphed(stores[model_type])
    tokens, logits = _decode(engine, steps=8)
    layers = len(skeleton.decoder_layers(engine.model))
    engine.close()
    assert tokens == want_tokens
    assert torch.equal(logits, want_logits)
    assert graphs.stats["failed"] == 0 and graphs.stats["captures"] >= layers
    # 8 steps: a warm-up and a capture per key, a replay, then the pass graph's capture and its replays
    assert graphs.stats["replays"] + graphs.stats["pass_calls"] >= layers * 4 and graphs.stats["pass_replays"] >= 2
    assert all(not e.islands and len(e.graphs) == 1 and key[-1] is not None for key, e in graphs._entries.items())


@pytest.mark.parametrize("model_type", ["llama", "qwen3_moe"])
def test_a_layer_graph_hands_its_output_to_the_next_without_a_host_copy(stores, monkeypatch, model_type):
    """``CARRY``: each layer's graph ends by writing its output into the hidden states' twin, so the next layer's
    graph reads it there. The decode is the same, and a graphed pass copies its hidden states into a twin once, not
    once a layer."""
    runs = {}
    monkeypatch.setattr(layer_graphs, "PASS_GRAPHS", False)  # every pass through the layers' own graphs
    for carry in (False, True):
        monkeypatch.setattr(layer_graphs, "CARRY", carry)
        engine, graphs = _graphed(stores[model_type])
        result = _decode(engine, steps=8)
        layers = len(skeleton.decoder_layers(engine.model))
        engine.close()
        runs[carry] = (result, dict(graphs.stats))
    (tokens, logits), on = runs[True]
    (want_tokens, want_logits), off = runs[False]
    assert tokens == want_tokens and torch.equal(logits, want_logits)
    graphed = on["captures"] + on["replays"]
    assert graphed == off["captures"] + off["replays"] and graphed % layers == 0 and graphed >= 4 * layers
    assert off["input_copies"] - on["input_copies"] == (layers - 1) * graphed // layers


@pytest.mark.parametrize("model_type", ["llama", "qwen3_moe", "gpt_oss", "mistral_window"])
def test_static_passes_decode_as_the_plain_cache(stores, model_type):
    """The static passes (slots and lengths in a device tensor, a mask over a bucketed span) attend to what the
    plain cache's passes attend to: the same greedy tokens, logits within fp32 rounding; batch 1 and passes of
    3, 2 and 1 rows; gpt-oss with its sinks and sliding layers, Mistral with a window of 6 tokens (its mask a
    bias built once a pass)."""
    for run in (lambda e: _decode(e, steps=8), _batch):
        engine = Engine.open(stores[model_type], device="cpu", dtype="float32", resident_layers=0, experts="whole")
        want_tokens, want_logits = run(engine)
        engine.close()
        tokens, logits = _static_eager(stores[model_type], run)
        assert tokens == want_tokens
        torch.testing.assert_close(logits, want_logits, rtol=1e-5, atol=1e-5)


def test_stale_keys_give_their_place_to_new_buckets(stores, monkeypatch):
    """A layer at its limit of keys forgets those unused for ``STALE_PASSES`` passes instead of running every new
    one eagerly: a decode crossing many buckets (here every 4 columns, 2 keys a layer, stale after 1 pass) keeps
    capturing and replaying its layers, and equals the same decode run eagerly."""
    from airquant.engine.decode import slots

    monkeypatch.setattr(slots, "STATIC_STEP", 4)
    want = _static_eager(stores["qwen3"], lambda e: _decode(e, steps=14))
    monkeypatch.setattr(layer_graphs, "KEYS_PER_LAYER", 2)
    monkeypatch.setattr(layer_graphs, "STALE_PASSES", 1)
    engine, graphs = _graphed(stores["qwen3"])
    tokens, logits = _decode(engine, steps=14)
    layers = len(skeleton.decoder_layers(engine.model))
    left = max(len(keys) for keys in graphs._keys.values())
    engine.close()
    assert tokens == want[0] and torch.equal(logits, want[1])
    assert graphs.stats["captures"] >= 3 * layers and left <= 2 and graphs.stats["failed"] == 0, graphs.stats


def test_a_failed_static_capture_falls_back_to_the_island(stores, monkeypatch):
    """A static capture that fails in the cache write or attention (here the attention reads a value on the
    host, which a capture refuses) turns static passes off from the next pass on: the layers are captured around
    the attention island instead and replayed, and the decode is the plain cache's (tokens equal, logits within
    fp32 rounding: the first passes ran static). A failure elsewhere in the call leaves them on (the test
    above: the layer runs eagerly)."""
    from airquant.engine.decode import slots

    engine = Engine.open(stores["qwen3"], device="cpu", dtype="float32", resident_layers=0)
    want_tokens, want_logits = _decode(engine, steps=8)
    engine.close()
    real = slots._attend
    monkeypatch.setattr(slots, "_attend", lambda q, k, v, keep, *a: real(q, k, v, keep, *a) * keep.any().item())
    engine, graphs = _graphed(stores["qwen3"])
    tokens, logits = _decode(engine, steps=8)
    islands = [len(e.islands) for key, e in graphs._entries.items()]
    engine.close()
    assert tokens == want_tokens
    torch.testing.assert_close(logits, want_logits, rtol=1e-5, atol=1e-5)
    assert not graphs.static_ok and graphs.stats["failed"] >= 1 and graphs.stats["replays"] > 0
    assert islands and all(n == 1 for n in islands)


def test_a_static_warm_up_that_synchronizes_falls_back_to_the_island(stores):
    """The warm-up's sync check saw a sync inside the static cache write or attention (CUDA:
    ``set_sync_debug_mode``): static passes go off, nothing is marked eager for it, and the layers are captured
    around the island from the next pass on."""

    class Synced(layer_graphs._NoCheck):
        static_synced = True

    class Backend(layer_graphs.EmulatedBackend):
        @staticmethod
        def warmup():
            return Synced()

    engine = Engine.open(stores["llama"], device="cpu", dtype="float32", resident_layers=0)
    graphs = layer_graphs.LayerGraphs(Backend(), FUSED_TOKENS)
    skeleton.attach_graphs(engine.model, graphs)
    _decode(engine, steps=6)
    entries = list(graphs._entries.items())
    engine.close()
    assert not graphs.static_ok and graphs.stats["failed"] == 0 and not graphs._eager
    assert entries and all(key[-1] is None and len(e.islands) == 1 for key, e in entries)


def test_a_static_warm_up_that_synchronizes_once_warms_up_again(stores):
    """A sync inside the static cache write or attention at each key's first warm-up only (a table a kernel makes
    and copies at its first launch, as the TurboQuant byte tables did from pageable memory): the key warms up
    again at its next call and is captured then; static passes stay on, and the decode equals the static decode
    run eagerly."""
    want = _static_eager(stores["llama"], lambda e: _decode(e, steps=8))
    warmups = []

    class Synced(layer_graphs._NoCheck):
        static_synced = True

    class Backend(layer_graphs.EmulatedBackend):
        @staticmethod
        def warmup():
            warmups.append(1)
            return Synced() if len(warmups) <= layers else layer_graphs._NoCheck()

    engine = Engine.open(stores["llama"], device="cpu", dtype="float32", resident_layers=0, experts="whole")
    layers = len(skeleton.decoder_layers(engine.model))
    graphs = layer_graphs.LayerGraphs(Backend(), FUSED_TOKENS)
    skeleton.attach_graphs(engine.model, graphs)
    tokens, logits = _decode(engine, steps=8)
    keys = list(graphs._entries)
    engine.close()
    assert tokens == want[0] and torch.equal(logits, want[1])
    assert graphs.static_ok and len(warmups) == 2 * layers and graphs.stats["failed"] == 0
    assert keys and all(key[-1] is not None for key in keys)  # static keys, captured after their second warm-up


def test_static_span_buckets():
    from airquant.engine.decode.slots import static_span

    assert [static_span(n, 1 << 20) for n in (1, 256, 257, 1024, 1025, 2049, 5000)] == \
        [256, 256, 512, 1024, 1280, 2560, 5120]
    assert static_span(300, 300) == 300  # never past the buffers


def test_a_new_bucket_is_captured_again(stores, monkeypatch):
    """A decode crossing a bucket (here every 4 columns) attends over more columns: each layer gets a key per
    bucket, each captured and replayed, and the decode equals the same decode run eagerly."""
    from airquant.engine.decode import slots

    monkeypatch.setattr(slots, "STATIC_STEP", 4)
    want = _static_eager(stores["qwen3"], lambda e: _decode(e, steps=12))
    engine, graphs = _graphed(stores["qwen3"])
    tokens, logits = _decode(engine, steps=12)
    layers = len(skeleton.decoder_layers(engine.model))
    spans, entries = {key[-1][0] for key in graphs._entries}, len(graphs._entries)
    engine.close()
    assert tokens == want[0] and torch.equal(logits, want[1])
    assert len(spans) >= 3 and entries == layers * len(spans) and graphs.stats["failed"] == 0
    assert graphs.stats["pass_captures"] >= 2  # a pass graph per bucket that lasted long enough


@pytest.mark.parametrize("model_type,parts", [("llama", 1), ("qwen3_moe", 1), ("qwen3_moe", 2), ("qwen3_moe", 3)])
def test_a_decode_pass_replays_as_one_graph(stores, monkeypatch, model_type, parts):
    """Once a pass has replayed every layer's own graph (fixed weights, each layer fed the previous one's output),
    the next pass is captured whole and the later ones replay it from the first layer's call; the other layers
    only return their output. The decode equals the same decode run eagerly. ``PASS_GRAPH_PARTS``: the pass in
    that many graphs split at layer boundaries, replayed in order, the same captures and replays."""
    want = _static_eager(stores[model_type], lambda e: _decode(e, steps=10))
    monkeypatch.setattr(layer_graphs, "PASS_GRAPH_PARTS", parts)
    engine, graphs = _graphed(stores[model_type])
    tokens, logits = _decode(engine, steps=10)
    layers = len(skeleton.decoder_layers(engine.model))
    engine.close()
    assert tokens == want[0] and torch.equal(logits, want[1])
    s = graphs.stats
    # 9 decode passes: a warm-up, a capture, one pass of replays (traced), the pass graph's capture, 5 replays
    assert (s["captures"], s["replays"], s["pass_captures"], s["pass_replays"]) == (layers, layers, 1, 5), s
    assert s["pass_calls"] == 6 * layers and s["pass_breaks"] == 0 and s["failed"] == 0
    assert [len(e.graphs) for e in graphs._passes.values()] == [min(parts, layers)]


def test_a_pass_whose_layer_gets_other_weights_runs_that_layer_alone(stores, monkeypatch):
    """A layer handed another weights dict than the pass graph ran with (here once, the same tensors) runs from its
    own input, replaying its own graph, and the pass goes on without the pass graph; the next passes are traced
    again and replay it. The decode equals the same decode run eagerly."""
    want = _static_eager(stores["llama"], lambda e: _decode(e, steps=10))
    engine, graphs = _graphed(stores["llama"])
    fetch, once = engine.streamer.fetch, []

    def other_dict(i):
        tensors = fetch(i)
        if i == 1 and graphs.stats["pass_replays"] and not once:
            once.append(i)
            return dict(tensors)
        return tensors

    monkeypatch.setattr(engine.streamer, "fetch", other_dict)
    tokens, logits = _decode(engine, steps=10)
    engine.close()
    assert once and tokens == want[0] and torch.equal(logits, want[1])
    s = graphs.stats
    assert s["pass_breaks"] == 1 and s["pass_captures"] == 1 and s["pass_replays"] >= 3, s


def test_layers_copied_before_their_call_never_run_in_a_pass_graph(tmp_path_factory, real_tokenizer):
    """Four layers through two device slots (``SimOps``): each lands in the same slot every pass, so its weights
    dict, key and graph are the same, but its bytes are copied in before each call. A pass graph would run
    layer 2 while its slot still holds layer 0: such layers are not ``fixed`` and no pass graph is captured; the
    decode equals the same decode run eagerly."""
    store = _store(tmp_path_factory, real_tokenizer, "llama", num_hidden_layers=4)
    slotted = _through_two_slots(store, 4, lazy=True, steps=10)
    want = _static_eager(store, slotted)
    engine, graphs = _graphed(store)
    got = slotted(engine)
    fixed = [engine.streamer.fixed(i) for i in range(4)]
    engine.close()
    assert got[0] == want[0] and torch.equal(got[1], want[1])
    assert all(len({key[3] for key in graphs._entries if key[0] == i}) == 1 for i in range(4))  # one slot each
    assert graphs.stats["pass_captures"] == 0 and graphs.stats["replays"] >= 4 * 6, graphs.stats
    assert not any(fixed)


def _through_two_slots(store, layers: int, lazy: bool, steps: int):
    """``run(engine)``: the engine's ``layers`` layers streamed through two device slots (``SimOps``: the streamer's
    CUDA path on the CPU, ``lazy``: copies deferred until waited for), then a batch-1 decode of ``steps``."""
    from airquant.engine.memory.placement import StreamPlan
    from airquant.engine.streamer import LayerStreamer
    from tests.engine.test_streamer import SimOps

    def run(engine):
        plan = StreamPlan(tiers=["ram"] * layers, slot_bytes=max(engine.manifest.layer_bytes), slots=2,
                          fixed_bytes=0)
        streamer = LayerStreamer(store, engine.manifest, plan, torch.device("cpu"), engine.dtype, ops=SimOps(lazy))
        engine.streamer.close()
        for layer in skeleton.decoder_layers(engine.model):
            layer.streamer = streamer
        engine.streamer, engine.plan = streamer, plan
        return _decode(engine, steps=steps)

    return run


def _batch(engine: Engine, kv=None) -> tuple[list[list[int]], torch.Tensor]:
    """Three sequences of different lengths in one decode loop: passes of 3, then 2, then 1 decode rows."""
    logits = []
    handle = engine.model.get_output_embeddings().register_forward_hook(
        lambda _m, _a, out: logits.append(out[0].float().cpu()))
    prompts = [PROMPT, PROMPT[:4], PROMPT[2:]]
    try:
        out = engine.generate_requests([engine.request(p, GenerateConfig(max_new_tokens=n, ignore_eos=True))
                                        for p, n in zip(prompts, (9, 6, 12))], kv=kv)
    finally:
        handle.remove()
    return [list(c.token_ids) for c in out], torch.cat(logits)


@pytest.mark.parametrize("kv", ["plain", "tq"])
def test_batched_decode_passes_replay_exactly_as_eager(stores, kv):
    """Decode passes of 3, 2 and 1 rows (sequences ending at different steps): a key per row count, each
    warmed up, captured and replayed, the cache write and attention in the graph (the TurboQuant arena's too:
    its pages reserved and its flushes run by the cache outside the layers); tokens and logits equal the eager
    loop's."""
    from airquant.kv.config import KVConfig

    config = KVConfig(backend="tq", bits_k=4, bits_v=2, window=8, block=4) if kv == "tq" else None
    want_tokens, want_logits = _static_eager(stores["qwen3"], lambda e: _batch(e, config))
    engine, graphs = _graphed(stores["qwen3"])
    tokens, logits = _batch(engine, config)
    rows = {key[2][0][0][1] for key in graphs._entries}  # the hidden states' [1, T, H]: T per key
    engine.close()
    assert tokens == want_tokens
    assert torch.equal(logits, want_logits)
    assert graphs.stats["failed"] == 0 and graphs.stats["replays"] > 0 and rows == {1, 2, 3}
    assert all(not e.islands and key[-1] is not None for key, e in graphs._entries.items())


def test_graph_rows_follow_the_plan(stores):
    """Passes of up to 32 rows replay where every layer is dense and stays in VRAM (the host bounds such a pass);
    a layer that streams, or any layer with experts, keeps the expert kernels' limit of 8."""
    from airquant.engine.memory.placement import StreamPlan
    from airquant.engine.runner import graph_rows
    from airquant.store.manifest import open_store

    def rows(model_type, tiers):
        manifest = open_store(stores[model_type])
        n = manifest.num_layers
        return graph_rows(manifest, StreamPlan(tiers=[tiers(i) for i in range(n)], slot_bytes=0, slots=0,
                                               fixed_bytes=0))

    assert rows("llama", lambda i: "vram") == layer_graphs.RESIDENT_ROWS == 32
    assert rows("llama", lambda i: "vram" if i else "ram") == FUSED_TOKENS == 8
    assert rows("qwen3_moe", lambda i: "vram") == FUSED_TOKENS


def test_resident_passes_of_more_rows_replay_exactly_as_eager(stores):
    """Passes of 12, then fewer, rows with the resident dense layers' limit (``RESIDENT_ROWS``), plain and
    TurboQuant: each captured and replayed, tokens and logits equal the eager loop's. A cache of more than
    ``LENT_SLOTS`` slots keeps its own buffers: the graphs' runner keeps none of it after the loop."""
    from airquant.engine.decode import slots
    from airquant.kv.config import KVConfig

    prompts = [PROMPT[n % 5:] for n in range(12)]
    for kv in (None, KVConfig(backend="tq", bits_k=4, bits_v=2, window=8, block=4)):
        run = lambda e: _batch_of(e, prompts, 6 + len(prompts) % 3, kv)  # noqa: E731
        with pytest.MonkeyPatch.context() as m:
            m.setattr(layer_graphs, "KEYS_PER_LAYER", 0)
            engine = Engine.open(stores["llama"], device="cpu", dtype="float32", resident_layers=0)
            skeleton.attach_graphs(engine.model, layer_graphs.LayerGraphs(layer_graphs.EmulatedBackend(),
                                                                          layer_graphs.RESIDENT_ROWS))
            want_tokens, want_logits = run(engine)
            engine.close()
        engine = Engine.open(stores["llama"], device="cpu", dtype="float32", resident_layers=0)
        graphs = layer_graphs.LayerGraphs(layer_graphs.EmulatedBackend(), layer_graphs.RESIDENT_ROWS)
        skeleton.attach_graphs(engine.model, graphs)
        tokens, logits = run(engine)
        rows = {key[2][0][0][1] for key in graphs._entries}
        engine.close()
        assert tokens == want_tokens
        assert torch.equal(logits, want_logits)
        assert graphs.stats["failed"] == 0 and graphs.stats["replays"] > 0 and 12 in rows
        assert 12 > slots.LENT_SLOTS and graphs.buffers.nbytes() == 0


@pytest.mark.parametrize("sink", [0, 2])
def test_static_turboquant_passes_decode_as_the_bucketed_passes(stores, sink):
    """TurboQuant static passes (every row at once over its whole window and the pass's bucketed history, a mask
    from the rows' lengths on the device, the flushes at the end of the pass) against the bucketed passes without
    layer graphs: the same greedy tokens, logits within fp32 rounding; histories quantized and flushed on the way
    (window 8, block 4), with and without sink tokens."""
    from airquant.kv.config import KVConfig

    config = KVConfig(backend="tq", bits_k=4, bits_v=2, window=8, block=4, sink=sink)
    engine = Engine.open(stores["qwen3"], device="cpu", dtype="float32", resident_layers=0, experts="whole")
    want_tokens, want_logits = _batch(engine, config)
    engine.close()
    seen = {}
    with pytest.MonkeyPatch.context() as m:
        begin = SlotKV._static_begin

        def spy(kv, dec):
            begin(kv, dec)
            seen[kv.tq_hist] = seen.get(kv.tq_hist, 0) + 1

        m.setattr(SlotKV, "_static_begin", spy)
        tokens, logits = _static_eager(stores["qwen3"], lambda e: _batch(e, config))
    assert tokens == want_tokens
    torch.testing.assert_close(logits, want_logits, rtol=1e-5, atol=1e-5)
    assert 0 in seen and any(h > 0 for h in seen), seen  # passes before and after the first flush


def test_a_turboquant_decode_pass_replays_as_one_graph(stores):
    """A TurboQuant cache's static passes are captured whole too (its pages reserved and its flushes run by the cache
    between passes): the decode equals the same decode run eagerly, the pass graph replayed with no break."""
    from airquant.kv.config import KVConfig

    config = KVConfig(backend="tq", bits_k=4, bits_v=2, window=8, block=4, sink=1)

    def run(engine):
        return _batch_of(engine, [PROMPT], 14, config)

    want = _static_eager(stores["llama"], run)
    engine, graphs = _graphed(stores["llama"])
    got = run(engine)
    engine.close()
    assert got[0] == want[0] and torch.equal(got[1], want[1])
    s = graphs.stats
    # a key (and a pass graph) before the first flush and one after: the history attended grows from none
    assert s["pass_captures"] == 2 and s["pass_replays"] >= 3 and s["pass_breaks"] == 0 and s["failed"] == 0, s


def test_a_cache_after_another_is_captured_into_a_live_pool(stores):
    """A TurboQuant loop after a plain one in the same engine: the plain cache's graphs go (its buffers are not
    the arena's), and the next captures go to a fresh pool handle, as the CUDA allocator fails a capture into a
    pool whose graphs were all destroyed (the emulated backend fails so too). Every layer of the TurboQuant
    loop is captured and replayed, and it decodes as it does eagerly."""
    from airquant.kv.config import KVConfig

    config = KVConfig(backend="tq", bits_k=4, bits_v=2, window=8, block=4)
    run = lambda e, kv: _batch_of(e, [PROMPT], 10, kv)  # noqa: E731
    want = _static_eager(stores["llama"], lambda e: (run(e, None), run(e, config)))
    engine, graphs = _graphed(stores["llama"])
    engine.graphs = graphs  # as Engine.open sets it on CUDA
    plain = run(engine, None)
    first = graphs.backend.pool.handle
    captures = graphs.stats["captures"]
    tq = run(engine, config)
    engine.close()
    assert graphs.stats["failed"] == 0 and graphs.stats["captures"] > captures, graphs.stats
    assert graphs.backend.pool.handle is not first  # the plain cache's graphs all went: a fresh handle
    assert plain[0] == want[0][0] and torch.equal(plain[1], want[0][1])
    assert tq[0] == want[1][0] and torch.equal(tq[1], want[1][1])


def _batch_of(engine: Engine, prompts: list, new: int, kv=None) -> tuple[list[list[int]], torch.Tensor]:
    """``prompts`` decoded ``new`` tokens each in one decode loop (greedy): tokens and every pass's logits."""
    logits = []
    handle = engine.model.get_output_embeddings().register_forward_hook(
        lambda _m, _a, out: logits.append(out[0].float().cpu()))
    try:
        out = engine.generate_requests([engine.request(p, GenerateConfig(max_new_tokens=new, ignore_eos=True))
                                        for p in prompts], kv=kv)
    finally:
        handle.remove()
    return [list(c.token_ids) for c in out], torch.cat(logits)


def test_a_second_request_replays_the_same_graphs(stores):
    """A static layer's graph reads its cache's buffers at their addresses: the runner keeps them
    (``KVBuffers``) and lends them to the next request's cache, which replays the graphs captured for the first
    and decodes as the same decode run eagerly. An offloaded cache's layers keep the island, whose graphs any
    cache replays."""
    want = _static_eager(stores["llama"], lambda e: _decode(e, steps=4))
    engine, graphs = _graphed(stores["llama"])
    layers = len(skeleton.decoder_layers(engine.model))
    _decode(engine, steps=4)
    assert graphs.stats["captures"] == layers and graphs.buffers.nbytes() > 0
    tokens, logits = _decode(engine, steps=4)
    assert graphs.stats["captures"] == layers and len(graphs._entries) == layers
    assert tokens == want[0] and torch.equal(logits, want[1])
    run = lambda e: e.decode_loop(1, context=64, offload=set(range(layers))).run(  # noqa: E731
        [e.request(PROMPT, GenerateConfig(max_new_tokens=4, ignore_eos=True))])[0].out
    first = run(engine)
    captures = graphs.stats["captures"]
    assert run(engine) == first and graphs.stats["captures"] == captures
    engine.close()


def test_a_layer_in_either_device_slot_replays_the_graph_of_that_slot(tmp_path_factory, real_tokenizer):
    """Three layers through two device slots (``SimOps``: the streamer's CUDA path on the CPU) land in the other
    slot every pass: each layer has a graph per slot, keyed by its weights' addresses (looked up again only when
    the streamer hands another weights dict), and the decode equals the same decode run eagerly. A replay of the
    other slot's graph would compute with the weights that slot held."""
    store = _store(tmp_path_factory, real_tokenizer, "llama", num_hidden_layers=3)
    slotted = _through_two_slots(store, 3, lazy=False, steps=8)
    want = _static_eager(store, slotted)
    engine, graphs = _graphed(store)
    got = slotted(engine)
    engine.close()
    assert got[0] == want[0] and torch.equal(got[1], want[1])
    for index in range(3):
        weights = {key[3] for key in graphs._entries if key[0] == index}
        assert len(weights) == 2, (index, weights)  # one graph per slot
    assert graphs.stats["failed"] == 0 and graphs.stats["replays"] >= 3 * 2  # each slot's graph replayed


@pytest.mark.parametrize("kv", ["plain", "tq"])
def test_a_partly_offloaded_cache_mixes_static_layers_and_islands(stores, kv):
    """KV offloaded for some layers only: in the same static pass, the device layers write and attend in their
    graph and the offloaded ones keep the island (their host copies land the pass's own slots; a TurboQuant one
    attends by buckets and flushes at once, the static ones at the end of the pass); tokens and logits equal the
    same decode run eagerly."""
    from airquant.kv.config import KVConfig

    config = KVConfig(backend="tq", bits_k=4, bits_v=2, window=4, block=2) if kv == "tq" else None

    def run(engine):
        logits = []
        hook = engine.model.get_output_embeddings().register_forward_hook(
            lambda _m, _a, out: logits.append(out[:, -1].float().cpu()))
        try:
            seqs = engine.decode_loop(2, context=64, offload={0}, kv=config).run(
                [engine.request(p, GenerateConfig(max_new_tokens=n, ignore_eos=True))
                 for p, n in ((PROMPT, 7), (PROMPT[:5], 5))])
        finally:
            hook.remove()
        return [s.out for s in seqs], torch.cat(logits)

    want = _static_eager(stores["llama"], run)
    engine, graphs = _graphed(stores["llama"])
    got = run(engine)
    kinds = {(key[0], key[-1] is None, len(e.islands)) for key, e in graphs._entries.items()}
    engine.close()
    assert got[0] == want[0] and torch.equal(got[1], want[1])
    assert {k for k in kinds if k[0] == 0} == {(0, True, 1)} and (1, False, 0) in kinds, kinds


def test_two_loops_at_once_do_not_share_buffers(stores):
    """A loop's cache that attaches while another loop's is alive gets its own buffers (and its own graphs): the
    first loop, resumed after the second ran whole, decodes as it would alone. A loop of another batch frees the
    kept buffers it cannot use, and a TurboQuant loop frees them all."""
    from airquant.kv.config import KVConfig

    req = lambda e, n: e.request(PROMPT, GenerateConfig(max_new_tokens=n, ignore_eos=True))  # noqa: E731
    want = _static_eager(stores["llama"], lambda e: [e.decode_loop(1, context=64).run([req(e, 8)])[0].out,
                                                    e.decode_loop(1, context=64).run([req(e, 6)])[0].out])
    engine, graphs = _graphed(stores["llama"])
    engine.graphs = graphs  # as Engine.open sets it on CUDA: release_kv and stats reach it
    first = engine.decode_loop(1, context=64)
    seq = first.submit(req(engine, 8))
    for _ in range(4):
        first.step()
    second = engine.decode_loop(1, context=64)
    other = second.run([req(engine, 6)])[0]
    assert second.kv.pool is None and first.kv.pool is graphs.buffers
    assert {t.data_ptr() for t in second.kv._k}.isdisjoint(t.data_ptr() for t in first.kv._k)
    while not first.idle:
        first.step()
    assert [seq.out, other.out] == want and graphs.stats["failed"] == 0
    del first, second
    kept = graphs.buffers.nbytes()
    engine.generate_requests([req(engine, 3), req(engine, 3)])  # two slots: the one-slot buffers go
    assert 0 < graphs.buffers.nbytes() != kept and all(b.shape[0] == 2 for b in graphs.buffers._bufs.values())
    assert engine.stats()["kv_kept_gb"] == graphs.buffers.nbytes() / 1e9
    engine.release_kv()
    assert graphs.buffers.nbytes() == 0
    engine.generate_requests([req(engine, 3)])
    assert graphs.buffers.nbytes() > 0
    engine.generate_requests([req(engine, 3)], kv=KVConfig(backend="tq", bits_k=4, bits_v=2, window=8, block=4))
    assert graphs.buffers.nbytes() == 0
    engine.close()


@pytest.mark.parametrize("model_type", ["qwen3_moe", "mixtral", "gpt_oss"])
def test_moe_layers_replay_exactly_as_eager(stores, model_type):
    """MoE layers with their experts run whole (transformers 5's fused experts: routing on the device, no host
    read): replayed, equal; gpt-oss with its attention sinks and sliding layers."""
    want_tokens, want_logits = _static_eager(stores[model_type], lambda e: _decode(e, steps=8))
    engine, graphs = _graphed(stores[model_type])
    tokens, logits = _decode(engine, steps=8)
    engine.close()
    assert tokens == want_tokens and torch.equal(logits, want_logits)
    assert graphs.stats["failed"] == 0 and graphs.stats["replays"] > 0


def _host_experts_decode(store):
    engine, graphs = _graphed(store, experts="cpu")
    got = _decode(engine, steps=8)
    calls = engine.experts.stats["calls"]
    layers = len(skeleton.decoder_layers(engine.model))
    engine.close()
    return got, graphs, calls, layers


@pytest.mark.parametrize("model_type, quantized", [("qwen3_moe", False), ("mixtral", False), ("qwen3_moe", True)])
def test_host_experts_run_between_the_graphs_exactly_as_eager(stores, tmp_path_factory, real_tokenizer, model_type,
                                                             quantized):
    """--experts cpu: the experts call reads its rows on the host, so it runs as an eager island between the
    layer's graphs (it used to refuse the capture: the whole layer ran eagerly). Every entry has the experts
    island (two graphs; the attention is in the first); the tokens and logits equal the same decode run eagerly.
    NF4: the host kernel; fp32: transformers' grouped forward on host tensors."""
    store = nf4_store(tmp_path_factory.mktemp(model_type), real_tokenizer, model_type,
                      **GEMV_SHAPES.get(model_type, {})) if quantized else stores[model_type]
    want_tokens, want_logits = _static_eager(store, lambda e: _decode(e, steps=8), experts="cpu")
    (tokens, logits), graphs, calls, layers = _host_experts_decode(store)
    assert tokens == want_tokens and torch.equal(logits, want_logits)
    assert calls > 0 and graphs.stats["failed"] == 0 and graphs.stats["replays"] >= layers * 4, graphs.stats
    assert all(len(e.islands) == 1 and len(e.graphs) == 2 for e in graphs._entries.values())


def test_an_eager_island_outside_a_runner_is_the_call():
    assert layer_graphs.eager_island(torch.add, torch.ones(2), 1).tolist() == [2.0, 2.0]


def test_a_layer_that_reads_on_the_host_runs_eagerly(stores, monkeypatch):
    """A layer whose call reads a tensor on the host (here its MLP branches on a value, as a copy path reading
    its routing does): the capture is refused, the call runs eagerly, the key is never captured again, and the
    decode equals the eager one; the other layers still replay."""
    want_tokens, want_logits = _static_eager(stores["llama"], lambda e: _decode(e, steps=8))
    engine, graphs = _graphed(stores["llama"])
    mlp = skeleton.decoder_layers(engine.model)[1].layer.mlp
    real = mlp.forward
    monkeypatch.setattr(mlp, "forward", lambda x: real(x) if x.abs().sum().item() >= 0 else x)
    tokens, logits = _decode(engine, steps=8)
    eager = len(graphs._eager)
    engine.close()
    assert tokens == want_tokens and torch.equal(logits, want_logits)
    assert graphs.stats["failed"] == 1 and eager == 1 and graphs.stats["eager"] > 0
    assert graphs.stats["replays"] > 0 and graphs.static_ok


def test_a_call_that_synchronizes_at_warm_up_twice_is_never_captured(stores):
    """The warm-up's sync check (CUDA: ``set_sync_debug_mode``) said the call synchronized: a first time is
    forgiven (a one-time probe), a second marks the key eager; nothing is captured, the decode is eager's."""

    class Synced(layer_graphs._NoCheck):
        synced = True

    class Backend(layer_graphs.EmulatedBackend):
        @staticmethod
        def warmup():
            return Synced()

    want = _static_eager(stores["llama"], lambda e: _decode(e, steps=5))
    engine = Engine.open(stores["llama"], device="cpu", dtype="float32", resident_layers=0)
    graphs = layer_graphs.LayerGraphs(Backend(), FUSED_TOKENS)
    skeleton.attach_graphs(engine.model, graphs)
    got = _decode(engine, steps=5)
    layers = len(skeleton.decoder_layers(engine.model))
    engine.close()
    assert got[0] == want[0] and torch.equal(got[1], want[1])
    assert graphs.stats["captures"] == 0 and len(graphs._eager) == layers and graphs.stats["eager"] == 2 * layers  # 4 decode passes: 2 warm-ups, 2 eager


def test_graphs_do_not_keep_a_finished_loops_cache(stores):
    """The twins remember which pass they hold by a weak reference to the cache: a finished loop's cache (its
    KV buffers) is freed, not kept until the next pass."""
    import gc

    engine, graphs = _graphed(stores["llama"])
    _decode(engine, steps=4)
    gc.collect()
    assert graphs.stats["replays"] > 0 and engine._live_kv is not None and engine._live_kv() is None
    engine.close()


def test_layers_not_known_to_capture_run_eagerly(stores, monkeypatch):
    monkeypatch.setattr(layer_graphs, "CAPTURED_LAYERS", frozenset())
    engine, graphs = _graphed(stores["llama"])
    _decode(engine, steps=4)
    engine.close()
    assert graphs.stats == {"replays": 0, "captures": 0, "eager": 0, "failed": 0, "input_copies": 0, "pass_replays": 0,
                            "pass_captures": 0, "pass_calls": 0, "pass_breaks": 0} \
        and not graphs._work


def test_host_work_runs_once_a_call_whoever_owns_it():
    """Outside a graph runner the caller runs its host work; at warm-up ``host_work`` runs and records it; in a
    captured or replayed call the runner owns it (the caller skips)."""
    ran = []
    assert layer_graphs.host_work(lambda: ran.append("x")) is False and ran == []
    work: list = []
    with layer_graphs._mode("warmup", work):
        assert layer_graphs.host_work(lambda: ran.append("w")) is True
    assert ran == ["w"] and len(work) == 1
    with layer_graphs._mode("runner"):
        assert layer_graphs.host_work(lambda: ran.append("r")) is True
    assert ran == ["w"]


@pytest.mark.parametrize("read", [lambda t: t.sum().item(), lambda t: t.tolist()], ids=["item", "tolist"])
def test_emulated_capture_refuses_a_host_read(read):
    """``tolist`` too (a CPU tensor's is no op the mode sees: the copy path's routing read was captured and its
    first call's routing replayed, giving other tokens than eager); after the capture it reads again."""
    graph = layer_graphs.EmulatedBackend().begin()
    try:
        with pytest.raises(RuntimeError, match="not permitted when stream is capturing"):
            read(torch.ones(2))
    finally:
        layer_graphs.EmulatedBackend.end(graph)
    assert torch.ones(2).tolist() == [1.0, 1.0]


def test_routed_copy_path_layers_run_eagerly_under_emulated_graphs(stores):
    """Qwen3-MoE with its experts routed through the copy path (its routing read on the host): the layers are
    refused at capture and run eagerly, and three sequences decode as with no graphs at all."""
    plain = Engine.open(stores["qwen3_moe"], device="cpu", dtype="float32", resident_layers=0, experts="routed")
    want = _batch(plain)[0]
    plain.close()
    engine, graphs = _graphed(stores["qwen3_moe"], experts="routed")
    got = _batch(engine)[0]
    engine.close()
    assert got == want and graphs.stats["eager"] > 0 and graphs.stats["replays"] == 0, graphs.stats


def _nf4_store(tmp_path_factory, tokenizer, model_type: str):
    # bf16 dense tensors, as the engine computes: a store in fp32 is cast at each fetch (new tensors a call)
    return nf4_store(tmp_path_factory.mktemp(model_type), tokenizer, model_type, dense_dtype="bfloat16",
                     **GEMV_SHAPES.get(model_type, {}))


def _eager_then_graphed(monkeypatch, store, run, experts: str = "routed"):
    """``run`` with CUDA graphs on but nothing captured (the static passes run eagerly), then replayed; the
    stats of the second, with ``static``: the captured keys' (static write and attention, attention islands)."""
    opts = dict(device="cuda", dtype="bfloat16", experts=experts, resident_layers=0)
    with monkeypatch.context() as m:
        m.setattr(layer_graphs, "KEYS_PER_LAYER", 0)
        engine = Engine.open(store, **opts)  # --cuda-graphs is the default
        want = run(engine)
        assert engine.graphs.stats["captures"] == 0
        engine.close()
    engine = Engine.open(store, **opts)
    got = run(engine)
    stats = engine.stats()
    entries = engine.graphs._entries
    stats["static"] = (sum(key[-1] is not None for key in entries),
                       sum(isinstance(i, layer_graphs._Island) for e in entries.values() for i in e.islands))
    engine.close()
    return want, got, stats, len(skeleton.decoder_layers(engine.model))


@pytest.mark.gpu
@pytest.mark.parametrize("model_type", ["mixtral", "qwen3_moe", "gpt_oss"])
def test_cuda_layer_graphs_with_direct_reads_equal_eager(monkeypatch, tmp_path_factory, real_tokenizer, model_type):
    """Real CUDA graphs on a routed NF4 decode with direct reads (the default on CUDA): the same kernels
    replayed, so the tokens and logits equal the eager decode's; every layer replayed, none failed."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    store = _nf4_store(tmp_path_factory, real_tokenizer, model_type)
    (want_tokens, want_logits), (tokens, logits), stats, layers = _eager_then_graphed(
        monkeypatch, store, lambda engine: _decode(engine, steps=10))
    graphed = stats["layer_graphs"]["replays"] + stats["layer_graphs"]["pass_calls"]
    assert stats["layer_graphs"]["failed"] == 0 and graphed >= layers * 4, stats
    # the dense parts in VRAM, the experts read in place: the decode passes replay as one CUDA graph
    assert stats["layer_graphs"]["pass_replays"] >= 2 and stats["layer_graphs"]["pass_breaks"] == 0, stats
    assert stats["experts"]["direct"]["direct_pairs"] > 0, stats
    assert stats["static"][0] >= layers and stats["static"][1] == 0, stats  # the attention in the graphs
    assert tokens == want_tokens
    assert torch.equal(logits, want_logits)


@pytest.mark.gpu
def test_cuda_pass_graph_in_parts_equals_eager(monkeypatch, tmp_path_factory, real_tokenizer):
    """``PASS_GRAPH_PARTS`` on CUDA (Qwen3-MoE NF4, direct reads): the pass captured in 2 graphs, each replayed at
    its capture's end and then every pass in order; the tokens and logits equal the eager decode's."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    monkeypatch.setattr(layer_graphs, "PASS_GRAPH_PARTS", 2)
    store = _nf4_store(tmp_path_factory, real_tokenizer, "qwen3_moe")
    (want_tokens, want_logits), (tokens, logits), stats, layers = _eager_then_graphed(
        monkeypatch, store, lambda engine: _decode(engine, steps=10))
    assert stats["layer_graphs"]["failed"] == 0 and stats["layer_graphs"]["pass_replays"] >= 2, stats
    assert stats["layer_graphs"]["pass_breaks"] == 0, stats
    assert tokens == want_tokens
    assert torch.equal(logits, want_logits)


@pytest.mark.gpu
def test_cuda_batched_decode_passes_with_graphs_equal_eager(monkeypatch, tmp_path_factory, real_tokenizer):
    """Passes of 3, 2 and 1 rows on CUDA (Qwen3-MoE NF4, direct reads): replayed per row count, equal."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    store = _nf4_store(tmp_path_factory, real_tokenizer, "qwen3_moe")
    (want_tokens, want_logits), (tokens, logits), stats, _ = _eager_then_graphed(monkeypatch, store, _batch)
    assert stats["layer_graphs"]["failed"] == 0 and stats["layer_graphs"]["replays"] > 0, stats
    assert stats["static"][0] > 0 and stats["static"][1] == 0, stats
    assert tokens == want_tokens
    assert torch.equal(logits, want_logits)


@pytest.mark.gpu
def test_cuda_resident_dense_passes_of_16_rows_replay_equal_eager(monkeypatch, tmp_path_factory, real_tokenizer):
    """A dense store whose layers all fit stays in VRAM; its passes of 16 rows (more than the expert kernels' 8)
    are captured and replayed, plain and TurboQuant K4/V2, equal to the same passes run eagerly."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from airquant.kv.config import KVConfig

    store = _store(tmp_path_factory, real_tokenizer, "llama")
    prompts = [PROMPT[n % 5:] for n in range(16)]
    for kv in (None, KVConfig(backend="tq", bits_k=4, bits_v=2, window=8, block=4, sink=1)):
        got = []
        for keys in (0, layer_graphs.KEYS_PER_LAYER):
            with monkeypatch.context() as m:
                m.setattr(layer_graphs, "KEYS_PER_LAYER", keys)
                engine = Engine.open(store, device="cuda", dtype="bfloat16")
                assert engine.plan.ram_layers == [] and engine.graphs.max_rows == layer_graphs.RESIDENT_ROWS
                got.append(_batch_of(engine, prompts, 8, kv))
                stats = engine.stats()["layer_graphs"]
                engine.close()
        assert stats["failed"] == 0 and stats["replays"] + stats["pass_calls"] > 0, stats
        assert got[0][0] == got[1][0]
        assert torch.equal(got[0][1], got[1][1])


@pytest.mark.gpu
def test_cuda_turboquant_static_passes_with_graphs_equal_eager(monkeypatch, tmp_path_factory, real_tokenizer):
    """TurboQuant K4/V2 on CUDA (Qwen3-MoE NF4: the Triton kernel with fixed tiles reading the
    arena in place): passes of 3, 2 and 1 rows and a batch-1 decode whose history grows past its first flushes,
    their cache writes and attention captured in the layer graphs and the passes as one graph, equal to the same
    passes run eagerly."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from airquant.kv.config import KVConfig

    config = KVConfig(backend="tq", bits_k=4, bits_v=2, window=8, block=4, sink=1)
    store = _nf4_store(tmp_path_factory, real_tokenizer, "qwen3_moe")
    for run in (lambda e: _batch(e, config), lambda e: _batch_of(e, [PROMPT], 20, config)):
        (want_tokens, want_logits), (tokens, logits), stats, _ = _eager_then_graphed(monkeypatch, store, run)
        assert stats["layer_graphs"]["failed"] == 0, stats
        assert stats["static"][0] > 0 and stats["static"][1] == 0, stats  # no island
        assert tokens == want_tokens
        assert torch.equal(logits, want_logits)
    assert stats["layer_graphs"]["pass_replays"] > 0 and stats["layer_graphs"]["pass_breaks"] == 0, stats


@pytest.mark.gpu
def test_cuda_host_experts_between_graphs_equal_eager(monkeypatch, tmp_path_factory, real_tokenizer):
    """--experts cpu on CUDA (Qwen3-MoE NF4): the host experts' island between real graphs (its rows read on the
    host, the sum copied back), the rest replayed; tokens and logits equal the eager decode's."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    store = _nf4_store(tmp_path_factory, real_tokenizer, "qwen3_moe")
    (want_tokens, want_logits), (tokens, logits), stats, layers = _eager_then_graphed(
        monkeypatch, store, lambda engine: _decode(engine, steps=10), experts="cpu")
    assert stats["experts"]["where"] == "host" and stats["experts"]["calls"] > 0, stats
    graphed = stats["layer_graphs"]["replays"] + stats["layer_graphs"]["pass_calls"]
    assert stats["layer_graphs"]["failed"] == 0 and graphed >= layers * 4, stats
    assert tokens == want_tokens
    assert torch.equal(logits, want_logits)


@pytest.mark.gpu
def test_cuda_a_second_request_replays_the_same_graphs(tmp_path_factory, real_tokenizer):
    """On CUDA the kept KV buffers make the second request's cache replay the first one's graphs (the
    attention captured in them): no capture, the same tokens and logits."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    store = _nf4_store(tmp_path_factory, real_tokenizer, "qwen3_moe")
    engine = Engine.open(store, device="cuda", dtype="bfloat16", experts="routed", resident_layers=0)
    first = _decode(engine, steps=6)
    captures = engine.graphs.stats["captures"]
    second = _decode(engine, steps=6)
    stats = engine.stats()
    engine.close()
    assert captures > 0 and stats["layer_graphs"]["captures"] == captures and stats["kv_kept_gb"] > 0, stats
    assert first[0] == second[0] and torch.equal(first[1], second[1])


@pytest.mark.gpu
def test_cuda_a_turboquant_loop_after_a_plain_one_is_captured(monkeypatch, tmp_path_factory, real_tokenizer):
    """On CUDA, one engine, a plain decode then a TurboQuant one (kv_bench's order): the plain cache's graphs go
    with its buffers and the TurboQuant layers are captured into a fresh pool, none failed (on 2026-12-05 every
    layer failed here with the allocator's ``use_count > 0`` assert and decoded without graphs); its tokens and
    logits equal the same TurboQuant decode's in an engine of its own."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from airquant.kv.config import KVConfig

    config = KVConfig(backend="tq", bits_k=4, bits_v=2, window=8, block=4, sink=1)
    store = _nf4_store(tmp_path_factory, real_tokenizer, "qwen3_moe")
    run = lambda e, kv: _batch_of(e, [PROMPT], 12, kv)  # noqa: E731
    opts = dict(device="cuda", dtype="bfloat16", experts="routed", resident_layers=0)
    engine = Engine.open(store, **opts)
    want = run(engine, config)
    engine.close()
    engine = Engine.open(store, **opts)
    run(engine, None)
    captures = engine.graphs.stats["captures"]
    got = run(engine, config)
    stats = engine.stats()["layer_graphs"]
    engine.close()
    assert stats["failed"] == 0 and stats["captures"] > captures, stats
    assert got[0] == want[0] and torch.equal(got[1], want[1])


def test_a_second_turboquant_loop_decodes_as_it_does_eagerly(stores):
    """Two TurboQuant loops one after the other in the same engine (kv_bench's timed generation then its traced
    loop; a server's batches): the second cache gets the first one's buffers and pages lent (``KVBuffers``) and
    may replay graphs captured over the first's arena; with other prompts of other lengths it must decode exactly
    as the same two loops run eagerly (a replay reading the first arena's tables or lengths would not)."""
    from airquant.kv.config import KVConfig

    config = KVConfig(backend="tq", bits_k=4, bits_v=2, window=8, block=4)
    second = PROMPT + [5, 61, 980, 2047, 33, 310, 7, 1500, 64, 21, 11, 700, 19]  # longer: other lengths
    run = lambda e: (_batch_of(e, [PROMPT], 12, config), _batch_of(e, [second, PROMPT], 12, config))  # noqa: E731
    want = _static_eager(stores["llama"], run)
    engine, graphs = _graphed(stores["llama"])
    engine.graphs = graphs
    got = run(engine)
    engine.close()
    assert graphs.stats["failed"] == 0 and graphs.stats["replays"] > 0, graphs.stats
    for g, w in zip(got, want):
        assert g[0] == w[0] and torch.equal(g[1], w[1])


def _reordered(engine: Engine) -> tuple[list[list[int]], torch.Tensor]:
    """Four requests through three slots: decode passes of three rows in slot order, then (the first one done, the
    fourth in its slot 0, last in the row) of three rows out of slot order."""
    logits = []
    handle = engine.model.get_output_embeddings().register_forward_hook(
        lambda _m, _a, out: logits.append(out[0].float().cpu()))
    lengths = ((PROMPT, 6), (PROMPT[:4], 14), (PROMPT[2:], 14), (PROMPT[1:], 6))
    try:
        seqs = engine.decode_loop(3, context=64).run(
            [engine.request(p, GenerateConfig(max_new_tokens=n, ignore_eos=True)) for p, n in lengths])
    finally:
        handle.remove()
    return [list(s.out) for s in seqs], torch.cat(logits)


def test_passes_in_and_out_of_slot_order_replay_their_own_graphs(stores):
    """A static pass whose rows are every slot in slot order reads its queries and places its outputs as views
    (``SlotKV.full``); one of as many rows out of slot order gathers and scatters them. Each replays the graph of
    its own kind: the decode equals the same decode run eagerly."""
    want = _static_eager(stores["llama"], _reordered)
    engine, graphs = _graphed(stores["llama"])
    got = _reordered(engine)
    engine.close()
    assert graphs.stats["replays"] > 0 and graphs.stats["failed"] == 0, graphs.stats
    assert got[0] == want[0] and torch.equal(got[1], want[1])


def test_a_cache_of_its_own_keys_its_graphs_by_itself():
    """A cache the runner does not lend its buffers to builds its static masks in buffers of its own, which only
    its own passes refill: its static keys name it, so a later cache whose key and value buffers and static tensor
    land where its were never replays its graphs (they would read its masks, stale). Caches lent the same buffers
    share the masks too, and their keys."""
    from airquant.engine.decode.slots import KVBuffers, Segment

    def cache(pool=None):
        kv = SlotKV(1, 1, 32, torch.device("cpu"), torch.float32)
        kv.graph_rows, kv.pool = 1, pool
        kv._k[0] = kv._v[0] = shared  # the same addresses
        kv._static = static
        kv.begin([Segment(0, 5, 1, 0)])
        return kv

    shared, static = torch.zeros(1, 2, 32, 4), torch.zeros(4, 1, dtype=torch.long)
    a, b = cache(), cache()
    assert a.static and a.full and a.static_key(0) != b.static_key(0)
    pool = KVBuffers()
    assert cache(pool).static_key(0) == cache(pool).static_key(0)
    bias = a.static_bias(a.static_span, None, torch.float32)
    assert bias.shape == (1, a.static_span) and bias.stride(0) % 16 == 0
    assert torch.equal(bias[0, :7].isfinite(), torch.tensor([True] * 6 + [False]))
