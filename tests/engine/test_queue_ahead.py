"""Queue ahead (engine/decode/loop.py ``QUEUE_AHEAD``): the next greedy decode pass is queued from the device's own
argmax before this pass's tokens are read; what every sequence gets is what it gets without."""

from __future__ import annotations

import pytest
import torch

from airquant.engine.decode import Request
from airquant.engine.decode import loop as loop_mod
from airquant.engine.runner import Engine

PROMPTS = ["The quick brown fox", "Once upon a time", "Water is", "A B C"]


@pytest.fixture(scope="module")
def engine(tiny_store):
    e = Engine.open(tiny_store, device="cpu")
    yield e
    e.close()


@pytest.fixture
def ahead(monkeypatch):
    monkeypatch.setattr(loop_mod, "QUEUE_AHEAD", True)


def _job(engine, slots=2, new=(9, 6, 7, 3), eos=None, stop=(), late=()):
    """Each prompt's tokens and finish reason; ``late``: indices submitted after the first pass."""
    loop = engine.decode_loop(slots, context=64)
    if eos is not None:
        loop.eos = {eos}
    seqs = {}
    for k, (p, n) in enumerate(zip(PROMPTS, new)):
        if k not in late:
            seqs[k] = loop.submit(Request(tuple(engine.prompt_ids(p)), n, ignore_eos=eos is None, stop=stop))
    loop.step()
    for k in late:
        seqs[k] = loop.submit(Request(tuple(engine.prompt_ids(PROMPTS[k])), new[k], ignore_eos=eos is None,
                                      stop=stop))
    while not loop.idle:
        loop.step()
    return [(seqs[k].out, seqs[k].finish_reason, seqs[k].detok.text) for k in range(len(PROMPTS))], loop


@pytest.mark.parametrize("slots,late", [(1, ()), (2, ()), (4, (2, 3)), (2, (3,))], ids=["one", "two", "late", "full"])
def test_queued_ahead_equals_read_first(engine, monkeypatch, slots, late):
    want, plain = _job(engine, slots, late=late)
    assert plain.stats.ahead == 0
    monkeypatch.setattr(loop_mod, "QUEUE_AHEAD", True)
    got, loop = _job(engine, slots, late=late)
    assert got == want
    assert loop.stats.ahead > 0  # passes did go ahead
    assert loop.stats.passes == plain.stats.passes and loop.stats.useful_tokens == plain.stats.useful_tokens


def test_an_eos_met_while_a_pass_is_queued_ahead_drops_that_row(engine, monkeypatch):
    """A sequence that ends by EOS while its next pass is queued: its row of that pass is dropped, its pass-mate
    goes on, and both get what they get read-first."""
    free, _ = _job(engine, 2, new=(9, 9, 1, 1))
    eos = free[0][0][3]  # the first prompt's fourth token ends it
    want, _ = _job(engine, 2, new=(9, 9, 1, 1), eos=eos)
    monkeypatch.setattr(loop_mod, "QUEUE_AHEAD", True)
    got, loop = _job(engine, 2, new=(9, 9, 1, 1), eos=eos)
    assert got == want
    assert got[0][1] == "stop" and len(got[0][0]) <= 3 and loop.stats.ahead > 0
    assert loop.idle and not loop.running


def test_a_stop_string_met_while_a_pass_is_queued_ahead(engine, monkeypatch):
    free, _ = _job(engine, 2, new=(12, 12, 1, 1))
    stop = (free[0][2][4:7],)
    want, _ = _job(engine, 2, new=(12, 12, 1, 1), stop=stop)
    monkeypatch.setattr(loop_mod, "QUEUE_AHEAD", True)
    got, loop = _job(engine, 2, new=(12, 12, 1, 1), stop=stop)
    assert got == want and got[0][1] == "stop" and loop.stats.ahead > 0


def test_a_cancel_while_a_pass_is_queued_ahead(engine, ahead):
    loop = engine.decode_loop(2, context=64)
    a = loop.submit(Request(tuple(engine.prompt_ids(PROMPTS[0])), 20, ignore_eos=True))
    b = loop.submit(Request(tuple(engine.prompt_ids(PROMPTS[1])), 8, ignore_eos=True))
    loop.step()
    loop.step()
    assert loop._ahead is not None
    loop.cancel(a)
    loop.step()  # the pass queued before the cancel, a's row dropped
    assert loop._ahead is not None and [seq for seq, _ in loop._ahead.plan] == [b]  # none queued for a since
    while not loop.idle:
        loop.step()
    assert a.finish_reason == "cancelled" and b.finish_reason == "length" and len(b.out) == 8
    assert len(a.out) < 20 and not loop.running


def test_sampled_and_prefilling_passes_are_never_queued_ahead(engine, ahead):
    loop = engine.decode_loop(2, context=64)
    loop.submit(Request(tuple(engine.prompt_ids(PROMPTS[0])), 6, temperature=0.8, seed=1))
    loop.submit(Request(tuple(engine.prompt_ids(PROMPTS[1])), 6, ignore_eos=True))
    while not loop.idle:
        loop.step()
    assert loop.stats.ahead == 0


def test_a_failure_queueing_ahead_comes_after_the_pass_before_is_delivered(engine, ahead, monkeypatch):
    loop = engine.decode_loop(1, context=64)
    seq = loop.submit(Request(tuple(engine.prompt_ids(PROMPTS[0])), 8, ignore_eos=True))
    loop.step()
    real = loop._forward

    def failing(ids, *args):
        if not isinstance(ids, list):  # the pass queued ahead
            raise RuntimeError("out of memory (planted)")
        return real(ids, *args)

    monkeypatch.setattr(loop, "_forward", failing)
    events = loop.step()
    assert [len(e.token_ids) for e in events] == [1] and len(seq.out) == 2  # the pass before, delivered
    with pytest.raises(RuntimeError, match="planted"):
        loop.step()
    monkeypatch.setattr(loop, "_forward", real)
    while not loop.idle:
        loop.step()
    assert len(seq.out) == 8


@pytest.mark.parametrize("model_type, experts", [("llama", "whole"), ("qwen3_moe", "whole"), ("qwen3_moe", "routed")])
def test_queued_ahead_through_emulated_layer_graphs(tmp_path_factory, real_tokenizer, monkeypatch, model_type,
                                                    experts):
    """Streamed layers replayed from (emulated) layer graphs, a MoE's experts whole (replayed) or routed (the copy
    path reads its routing on the host: those layers run eagerly): the same tokens ahead."""
    from tests.engine.test_layer_graphs import _batch, _graphed, _store

    store = _store(tmp_path_factory, real_tokenizer, model_type)
    results = []
    for on in (False, True):
        monkeypatch.setattr(loop_mod, "QUEUE_AHEAD", on)
        engine, graphs = _graphed(store, experts=experts)
        try:
            results.append((_batch(engine)[0], engine.last_timings["ahead_passes"]))
            replayed = graphs.stats["replays"] + graphs.stats["pass_calls"]
            assert replayed > 0 if experts == "whole" else graphs.stats["eager"] > 0, graphs.stats
        finally:
            engine.close()
    (want, none), (got, ahead) = results
    assert got == want and none == 0 and ahead > 0


@pytest.mark.gpu
@pytest.mark.parametrize("model_type, host_embedding", [("llama", False), ("qwen3_moe", False), ("qwen3_moe", True)])
def test_cuda_queued_ahead_equals_read_first(tmp_path_factory, real_tokenizer, monkeypatch, model_type,
                                             host_embedding):
    """On CUDA with the layer graphs (a streamed dense NF4 store; Qwen3-MoE NF4 with direct expert reads, its
    pass one graph; its embedding table in host RAM, rows then read by the GPU): the passes queued ahead give the
    tokens and logits the read-first passes give."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from tests.engine.test_layer_graphs import _batch, _nf4_store

    store = _nf4_store(tmp_path_factory, real_tokenizer, model_type)
    results = []
    for on in (False, True):
        monkeypatch.setattr(loop_mod, "QUEUE_AHEAD", on)
        engine = Engine.open(store, device="cuda", dtype="bfloat16", resident_layers=0, host_embedding=host_embedding,
                             **({"experts": "routed"} if model_type == "qwen3_moe" else {}))
        try:
            results.append((*_batch(engine), engine.last_timings["ahead_passes"], engine.stats()))
        finally:
            engine.close()
    (want, want_logits, none, _), (got, logits, ahead, stats) = results
    assert got == want and torch.equal(logits, want_logits)
    assert none == 0 and ahead > 0 and stats["layer_graphs"]["failed"] == 0, stats


@pytest.mark.gpu
@pytest.mark.parametrize("model_type, host_embedding", [("llama", False), ("qwen3_moe", False), ("qwen3_moe", True)])
def test_cuda_a_pass_queued_ahead_never_waits_for_the_device(tmp_path_factory, real_tokenizer, monkeypatch,
                                                            model_type, host_embedding):
    """Queueing a pass ahead must not synchronize (a pageable host-to-device copy, a host read): the host would
    wait for the pass before and nothing would overlap. Once the graphs are captured, a batch-1 greedy decode's
    passes queued ahead run under torch's sync debug mode without a synchronizing call; with the embedding table
    in host RAM too (its rows read by the GPU from the pinned table)."""
    import warnings

    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from tests.engine.test_layer_graphs import _nf4_store

    monkeypatch.setattr(loop_mod, "QUEUE_AHEAD", True)
    store = _nf4_store(tmp_path_factory, real_tokenizer, model_type)
    engine = Engine.open(store, device="cuda", dtype="bfloat16", resident_layers=0, host_embedding=host_embedding,
                         **({"experts": "routed"} if model_type == "qwen3_moe" else {}))
    if host_embedding:
        assert type(engine.model.get_input_embeddings()).__name__ == "HostEmbedding"
    loop = engine.decode_loop(1, context=64)
    real, synced = loop._queue, []

    def watched(plan, tokens=None):
        if tokens is None:
            return real(plan, tokens)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                return real(plan, tokens)
            finally:
                torch.cuda.set_sync_debug_mode(0)
                synced.append([str(w.message)[:120] for w in caught if "synchroniz" in str(w.message)])

    monkeypatch.setattr(loop, "_queue", watched)
    try:
        loop.run([Request(tuple(engine.prompt_ids(PROMPTS[0])), 16, ignore_eos=True)])
        assert engine.stats()["layer_graphs"]["failed"] == 0
    finally:
        engine.close()
    assert len(synced) >= 8 and synced[-6:] == [[]] * 6, synced
