"""Layer graphs (engine/layer_graphs.py): streamed layers' decode calls captured in graphs around the attention
island (and the host experts' island) and replayed.

On the CPU the graphs are emulated (``EmulatedBackend``: the ops a capture saw, replayed on the same tensors, a
host read inside a capture refused as CUDA refuses it), so the split, the keys by weight slot, the static twins
and the island replay are checked against the eager decode in fp32, where they must agree exactly. On CUDA the
real graphs against the eager path, with direct expert reads (GPU tests)."""

from __future__ import annotations

import pytest
import torch

from airquant.config import GenerateConfig
from airquant.engine import layer_graphs, skeleton
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
    return {t: _store(tmp_path_factory, real_tokenizer, t)
            for t in ("llama", "qwen3", "qwen2", "mistral", "qwen3_moe", "mixtral", "gpt_oss")}


def _graphed(store) -> tuple[Engine, layer_graphs.LayerGraphs]:
    engine = Engine.open(store, device="cpu", dtype="float32", resident_layers=0, experts="whole")
    graphs = layer_graphs.LayerGraphs(layer_graphs.EmulatedBackend(), FUSED_TOKENS)
    skeleton.attach_graphs(engine.model, graphs)
    return engine, graphs


@pytest.mark.parametrize("model_type", ["llama", "qwen3", "qwen2", "mistral"])
def test_replayed_layers_decode_exactly_as_eager(stores, model_type):
    """Every layer is warmed up, captured, then replayed (its twins refreshed each pass, its cache write and
    attention run between its graphs): the greedy tokens and every step's logits equal the eager decode's."""
    engine = Engine.open(stores[model_type], device="cpu", dtype="float32", resident_layers=0)
    want_tokens, want_logits = _decode(engine, steps=8)
    engine.close()
    engine, graphs = _graphed(stores[model_type])
    tokens, logits = _decode(engine, steps=8)
    layers = len(skeleton.decoder_layers(engine.model))
    engine.close()
    assert tokens == want_tokens
    assert torch.equal(logits, want_logits)
    assert graphs.stats["failed"] == 0 and graphs.stats["captures"] >= layers
    assert graphs.stats["replays"] >= layers * 4  # 8 steps: a warm-up and a capture per key, the rest replays
    assert all(len(e.islands) == 1 and len(e.graphs) == 2 for e in graphs._entries.values())


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
    warmed up, captured and replayed; the island reads the pass's slots (and the TurboQuant arena, whose
    writes and flushes stay eager); tokens and logits equal the eager loop's."""
    from airquant.kv.config import KVConfig

    config = KVConfig(backend="tq", bits_k=4, bits_v=2, window=8, block=4) if kv == "tq" else None
    engine = Engine.open(stores["qwen3"], device="cpu", dtype="float32", resident_layers=0)
    want_tokens, want_logits = _batch(engine, config)
    engine.close()
    engine, graphs = _graphed(stores["qwen3"])
    tokens, logits = _batch(engine, config)
    rows = {key[2][0][0][1] for key in graphs._entries}  # the hidden states' [1, T, H]: T per key
    engine.close()
    assert tokens == want_tokens
    assert torch.equal(logits, want_logits)
    assert graphs.stats["failed"] == 0 and graphs.stats["replays"] > 0 and rows == {1, 2, 3}


def test_a_second_request_replays_the_same_graphs(stores):
    """Graphs read no cache buffer (the island gets the pass's cache): a new request, with a new cache, replays
    the graphs captured for the first one and decodes as eager does."""
    engine = Engine.open(stores["llama"], device="cpu", dtype="float32", resident_layers=0)
    want = _decode(engine, steps=4)
    engine.close()
    engine, graphs = _graphed(stores["llama"])
    _decode(engine, steps=4)
    captures = graphs.stats["captures"]
    tokens, logits = _decode(engine, steps=4)
    engine.close()
    assert graphs.stats["captures"] == captures and tokens == want[0] and torch.equal(logits, want[1])


@pytest.mark.parametrize("model_type", ["qwen3_moe", "mixtral", "gpt_oss"])
def test_moe_layers_replay_exactly_as_eager(stores, model_type):
    """MoE layers with their experts run whole (transformers 5's fused experts: routing on the device, no host
    read): replayed, equal; gpt-oss with its attention sinks and sliding layers."""
    engine = Engine.open(stores[model_type], device="cpu", dtype="float32", resident_layers=0, experts="whole")
    want_tokens, want_logits = _decode(engine, steps=8)
    engine.close()
    engine, graphs = _graphed(stores[model_type])
    tokens, logits = _decode(engine, steps=8)
    engine.close()
    assert tokens == want_tokens and torch.equal(logits, want_logits)
    assert graphs.stats["failed"] == 0 and graphs.stats["replays"] > 0


def _host_experts_decode(store, graphed: bool):
    engine = Engine.open(store, device="cpu", dtype="float32", resident_layers=0, experts="cpu")
    graphs = None
    if graphed:
        graphs = layer_graphs.LayerGraphs(layer_graphs.EmulatedBackend(), FUSED_TOKENS)
        skeleton.attach_graphs(engine.model, graphs)
    got = _decode(engine, steps=8)
    calls = engine.experts.stats["calls"]
    layers = len(skeleton.decoder_layers(engine.model))
    engine.close()
    return got, graphs, calls, layers


@pytest.mark.parametrize("model_type, quantized", [("qwen3_moe", False), ("mixtral", False), ("qwen3_moe", True)])
def test_host_experts_run_between_the_graphs_exactly_as_eager(stores, tmp_path_factory, real_tokenizer, model_type,
                                                             quantized):
    """--experts cpu: the experts call reads its rows on the host, so it runs as an eager island between the
    layer's graphs (it used to refuse the capture: the whole layer ran eagerly). Every entry has the attention
    island and the experts island (three graphs); the tokens and logits equal the eager decode's. NF4: the host
    kernel; fp32: transformers' grouped forward on host tensors."""
    store = nf4_store(tmp_path_factory.mktemp(model_type), real_tokenizer, model_type,
                      **GEMV_SHAPES.get(model_type, {})) if quantized else stores[model_type]
    (want_tokens, want_logits), _, _, _ = _host_experts_decode(store, graphed=False)
    (tokens, logits), graphs, calls, layers = _host_experts_decode(store, graphed=True)
    assert tokens == want_tokens and torch.equal(logits, want_logits)
    assert calls > 0 and graphs.stats["failed"] == 0 and graphs.stats["replays"] >= layers * 4, graphs.stats
    assert all(len(e.islands) == 2 and len(e.graphs) == 3 for e in graphs._entries.values())


def test_an_eager_island_outside_a_runner_is_the_call():
    assert layer_graphs.eager_island(torch.add, torch.ones(2), 1).tolist() == [2.0, 2.0]


def test_a_layer_that_reads_on_the_host_runs_eagerly(stores, monkeypatch):
    """A layer whose call reads a tensor on the host (here its MLP branches on a value, as a copy path reading
    its routing does): the capture is refused, the call runs eagerly, the key is never captured again, and the
    decode equals the eager one; the other layers still replay."""
    engine = Engine.open(stores["llama"], device="cpu", dtype="float32", resident_layers=0)
    want_tokens, want_logits = _decode(engine, steps=8)
    engine.close()
    engine, graphs = _graphed(stores["llama"])
    mlp = skeleton.decoder_layers(engine.model)[1].layer.mlp
    real = mlp.forward
    monkeypatch.setattr(mlp, "forward", lambda x: real(x) if x.abs().sum().item() >= 0 else x)
    tokens, logits = _decode(engine, steps=8)
    engine.close()
    assert tokens == want_tokens and torch.equal(logits, want_logits)
    assert graphs.stats["failed"] == 1 and len(graphs._eager) == 1 and graphs.stats["eager"] > 0
    assert graphs.stats["replays"] > 0


def test_a_call_that_synchronizes_at_warm_up_twice_is_never_captured(stores):
    """The warm-up's sync check (CUDA: ``set_sync_debug_mode``) said the call synchronized: a first time is
    forgiven (a one-time probe), a second marks the key eager; nothing is captured, the decode is eager's."""

    class Synced(layer_graphs._NoCheck):
        synced = True

    class Backend(layer_graphs.EmulatedBackend):
        @staticmethod
        def warmup():
            return Synced()

    engine = Engine.open(stores["llama"], device="cpu", dtype="float32", resident_layers=0)
    want = _decode(engine, steps=5)
    engine.close()
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
    assert graphs.stats == {"replays": 0, "captures": 0, "eager": 0, "failed": 0} and not graphs._work


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


def test_emulated_capture_refuses_a_host_read():
    graph = layer_graphs.EmulatedBackend.begin()
    try:
        with pytest.raises(RuntimeError, match="not permitted when stream is capturing"):
            torch.ones(2).sum().item()
    finally:
        layer_graphs.EmulatedBackend.end(graph)


def _nf4_store(tmp_path_factory, tokenizer, model_type: str):
    # bf16 dense tensors, as the engine computes: a store in fp32 is cast at each fetch (new tensors a call)
    return nf4_store(tmp_path_factory.mktemp(model_type), tokenizer, model_type, dense_dtype="bfloat16",
                     **GEMV_SHAPES.get(model_type, {}))


def _eager_then_graphed(monkeypatch, store, run, experts: str = "routed"):
    opts = dict(device="cuda", dtype="bfloat16", experts=experts, resident_layers=0)
    engine = Engine.open(store, cuda_graphs=False, **opts)
    assert engine.graphs is None
    want = run(engine)
    engine.close()
    engine = Engine.open(store, **opts)  # --cuda-graphs is the default
    got = run(engine)
    stats = engine.stats()
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
    assert stats["layer_graphs"]["failed"] == 0 and stats["layer_graphs"]["replays"] >= layers * 4, stats
    assert stats["experts"]["direct"]["direct_pairs"] > 0, stats
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
    assert tokens == want_tokens
    assert torch.equal(logits, want_logits)


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
    assert stats["layer_graphs"]["failed"] == 0 and stats["layer_graphs"]["replays"] >= layers * 4, stats
    assert tokens == want_tokens
    assert torch.equal(logits, want_logits)
