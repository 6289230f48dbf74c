"""The streamer's tiers, slots, staging buffers and event ordering, against the resident model.

The CUDA path is driven on CPU through ``SimOps``, an object with ``CudaOps``' methods that runs the
copies eagerly (a copy into a slot still in use clobbers the weights being computed with) or lazily
(a copy runs only when something waits for its event, so a missing wait computes with stale bytes).
Either bug changes the logits, which are compared with the resident model's.
"""

import ctypes
import threading
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from airquant.engine.memory.placement import StreamPlan
from airquant.engine.runner import Engine
from airquant.engine.streamer import LayerStreamer, ShardLayout

PROMPTS = ["The quick brown fox", "Once upon a time in a land far far away there lived", "Hi"]


class SimEvent:
    def __init__(self, fired: bool = False):
        self.fired = fired


class SimOps:
    """``CudaOps`` on CPU tensors; ``lazy`` defers every copy until its event is waited for."""

    def __init__(self, lazy: bool):
        self.lazy = lazy
        self.queue: list[tuple[SimEvent, torch.Tensor, torch.Tensor]] = []  # the copy stream, in order
        self.lock = threading.Lock()
        self.copies = 0
        self.copies_out = 0
        self.targets = 0  # device tensors allocated for the copy stream to fill (``copy_target``)
        self.out_queue: list[tuple[SimEvent, torch.Tensor, torch.Tensor]] = []  # device-to-host copies, in order

    def alloc(self, nbytes):
        return torch.full((nbytes,), 0xA5, dtype=torch.uint8)  # garbage until a copy lands

    def copy_target(self, like):
        self.targets += 1
        return torch.empty_like(like).view(torch.uint8).fill_(0xA5).view(like.dtype)  # garbage until a copy lands

    def copy(self, dst, src, after):
        assert after is None or after.fired, "a copy was ordered after compute that has not run"
        done = SimEvent()
        with self.lock:
            self.queue.append((done, dst, src))
            self.copies += 1
        if not self.lazy:
            self._run_until(done)
        return None, done

    def _run_until(self, event):
        with self.lock:
            queue = self.out_queue if any(e is event for e, _, _ in self.out_queue) else self.queue
            while not event.fired:
                done, dst, src = queue.pop(0)
                dst.copy_(src)
                done.fired = True

    def wait(self, event):
        self._run_until(event)

    def copy_out(self, pairs, after):
        """Device-to-host copies: a queue of their own (a stream of their own on a GPU), run when waited for."""
        assert after is None or after.fired
        done = SimEvent(fired=not pairs)
        with self.lock:
            self.out_queue += [(SimEvent(), dst, src) for dst, src in pairs[:-1]]
            self.out_queue += [(done, *pairs[-1])] if pairs else []
            self.copies_out += len(pairs)
        if not self.lazy:
            self._run_until(done)
        return done

    def host_wait(self, event):
        self._run_until(event)

    def mark(self):
        return SimEvent(fired=True)  # CPU compute is synchronous: done when marked

    @staticmethod
    def elapsed_ms(start, end):
        return 0.0


def streamed_engine(store, tiers, ops, slots=2, readahead=2, dense_layers=()):
    """A CPU engine whose streamer follows ``tiers`` through ``ops`` (None: layers used in place); ``dense_layers``
    keep their (here: whole) layout on the device after one copy."""
    engine = Engine.open(store, device="cpu")
    layer_bytes = engine.manifest.layer_bytes
    plan = StreamPlan(tiers=list(tiers), slot_bytes=max(layer_bytes), slots=slots, fixed_bytes=0,
                      dense_layers=list(dense_layers))
    streamer = LayerStreamer(store, engine.manifest, plan, torch.device("cpu"), engine.dtype,
                             readahead=readahead, ops=ops)
    engine.streamer.close()
    for layer in engine.model.model.layers:
        layer.streamer = streamer
    engine.streamer, engine.plan = streamer, plan
    return engine


@pytest.fixture(scope="module")
def reference(tiny_store):
    engine = Engine.open(tiny_store, device="cpu", resident=True)
    enc = engine.encode(PROMPTS)
    logits = engine.forward(**enc)
    tokens = [c.token_ids for c in engine.generate(PROMPTS, max_new_tokens=6)]
    return enc, logits, tokens


TIERS = {
    "ram": ("ram", "ram", "ram"),
    "disk": ("disk", "disk", "disk"),
    "vram+ram+disk": ("vram", "ram", "disk"),
    "ram+disk+disk": ("ram", "disk", "disk"),
    "disk+ram+disk": ("disk", "ram", "disk"),
}
OPS = {"in-place": lambda: None, "eager": lambda: SimOps(lazy=False), "lazy": lambda: SimOps(lazy=True)}


@pytest.mark.parametrize("ops", OPS)
@pytest.mark.parametrize("tiers", TIERS)
def test_every_tier_mix_gives_the_resident_logits(tiny_store, reference, tiers, ops):
    enc, want, _ = reference
    engine = streamed_engine(tiny_store, TIERS[tiers], OPS[ops]())
    for _ in range(3):  # later passes reuse slots and staging buffers, and prefetch across passes
        assert torch.equal(engine.forward(**enc), want)
    if ops != "in-place":
        streamed = sum(t != "vram" for t in TIERS[tiers])
        assert engine.streamer.ops.copies >= 3 * streamed
        assert engine.stats()["bytes_streamed"] > 0
    engine.close()


def test_a_ram_tier_on_huge_pages_gives_the_resident_logits(tiny_store, reference, monkeypatch):
    """``streamer.HUGE_PAGES`` (moe_bench's ``*_huge`` cases): each RAM-tier layer's buffer starts on a 2 MB
    boundary (its pages advised huge) and the streamed logits are the resident ones."""
    from airquant.engine import streamer as streamer_mod

    monkeypatch.setattr(streamer_mod, "HUGE_PAGES", True)
    enc, want, _ = reference
    engine = streamed_engine(tiny_store, ("ram", "ram", "ram"), SimOps(lazy=True))
    for _ in range(2):
        assert torch.equal(engine.forward(**enc), want)
    assert engine.streamer._host and all(buf.data_ptr() % (2 << 20) == 0 for buf in engine.streamer._host.values())
    engine.close()


@pytest.mark.parametrize("ops", OPS)
def test_dense_resident_layers_are_copied_once_and_keep_the_resident_logits(tiny_store, reference, ops):
    """``plan.dense_layers`` (a routed MoE layer's dense part kept in VRAM, planner._dense_resident): the layer is
    copied at its first fetch and used from that buffer after, while the other layers still cycle through the
    slots, prefetched around it; the lazy copy engine shows a missing wait as wrong logits. Without a copy
    engine (``in-place``) there is no device to keep it on and the layer streams as before."""
    enc, want, _ = reference
    engine = streamed_engine(tiny_store, ("ram", "ram", "ram"), OPS[ops](), dense_layers=[0, 2])
    copies = []
    for _ in range(3):
        assert torch.equal(engine.forward(**enc), want)
        copies.append(engine.streamer.ops.copies if engine.streamer.ops else 0)
    if ops == "in-place":
        assert engine.streamer.dense == set() and engine.streamer.streamed == [0, 1, 2]
        assert "dense_resident_gb" not in engine.stats()
    else:
        assert engine.streamer.dense == {0, 2} and engine.streamer.streamed == [1]
        kept = engine.streamer.layouts[0].nbytes + engine.streamer.layouts[2].nbytes  # their data sections
        assert engine.stats()["dense_resident_gb"] == kept / 1e9
        # the first pass: layers 0 and 2 once, layer 1, and layer 1 again for the next pass (prefetched across
        # passes); every later pass copies layer 1 alone
        assert copies[0] == 4 and copies[1] - copies[0] == copies[2] - copies[1] == 1
        # each kept buffer made by ``CudaOps.copy_target``: a block the host just freed may still be read by
        # queued kernels, which the copy waits for
        assert engine.streamer.ops.targets == 2
    engine.close()


@pytest.mark.parametrize("slots, readahead", [(1, 1), (2, 1), (3, 3)])
@pytest.mark.parametrize("lazy", [False, True], ids=["eager", "lazy"])
def test_decode_with_kv_cache_matches_resident(tiny_store, reference, slots, readahead, lazy):
    _, _, want = reference
    engine = streamed_engine(tiny_store, TIERS["ram+disk+disk"], SimOps(lazy), slots=slots, readahead=readahead)
    got = engine.generate(PROMPTS, max_new_tokens=6)
    assert [c.token_ids for c in got] == want
    assert not engine.streamer._inflight or all(not e.in_use for e in engine.streamer._inflight.values())
    engine.close()


def _loop_tokens(engine, offload: set[int], prompts=PROMPTS, new=6, kv=None, after_step=None) -> list[list[int]]:
    """The tokens of ``prompts`` through one two-slot loop; ``after_step(loop)`` after each pass."""
    from airquant.engine.decode import Request

    # plain: prompts in chunks, admitted late; TurboQuant: whole prompts, one a pass
    loop = engine.decode_loop(2, context=160, token_budget=8 if kv is None else 128, offload=offload, kv=kv)
    seqs = [loop.submit(Request(tuple(engine.prompt_ids(p)), new, ignore_eos=True)) for p in prompts]
    while not loop.idle:
        loop.step()
        if after_step is not None:
            after_step(loop)
    return [s.out for s in seqs]


@pytest.mark.parametrize("kv", ["plain", "tq"])
@pytest.mark.parametrize("lazy", [False, True], ids=["eager", "lazy"])
def test_an_offloaded_cache_crosses_on_the_copy_stream_ahead_of_its_layer(tiny_store, lazy, kv, monkeypatch):
    """KV offload in the decode loop over a streamed model: each offloaded layer's cache (plain: its prefix;
    TurboQuant: its arena and page table, pages reserved first) goes through the copy stream (``ops``), queued
    while the layer before it runs, and its layer waits for it; nothing goes through the layer's own copy. Eager
    copies catch one issued before the host copy was complete; lazy ones, a layer that does not wait. The tokens
    are the loop's with the cache on the device."""
    from airquant.engine.decode.tqslots import SlotArena
    from airquant.kv import KVConfig

    config = KVConfig(backend="tq", bits_k=4, bits_v=2, window=8, block=4, sink=1) if kv == "tq" else None
    ops = SimOps(lazy)
    engine = streamed_engine(tiny_store, TIERS["ram"], ops)
    layers = set(range(engine.config.num_hidden_layers))
    # histories of one to two 64-token pages, slots freed and refilled out of order: page tables change
    words = "the quick brown fox jumps over a lazy dog while seven wise owls watch".split()
    prompts = [" ".join(words * n)[:chars] for n, chars in ((6, 400), (1, 20), (8, 520), (2, 60), (5, 300))]
    checked = []

    def tables_as_pages(loop):  # each current page table as its arena's pages are (they change: slots refilled)
        for i in layers if kv == "tq" else ():
            arena = loop.kv.arena(i)
            if arena is not None and not arena.table_stale:
                checked.append(any(arena.pages))
                assert torch.equal(arena.fixed_table, arena.table_rows(arena.table_capacity)), i

    run = lambda offload: _loop_tokens(engine, offload, prompts, kv=config, after_step=tables_as_pages)  # noqa: E731
    want = run(set())
    before = ops.copies
    run(set())
    weights = ops.copies - before
    inline = {"prefetch": 0}
    real = SlotArena.prefetch
    monkeypatch.setattr(SlotArena, "prefetch", lambda self: inline.__setitem__("prefetch", inline["prefetch"] + 1)
                        or real(self))
    before = ops.copies
    checked.clear()
    got = run(layers)
    assert got == want
    assert ops.copies - weights - before > 2 * len(layers)  # the caches of every layer, most passes
    assert inline["prefetch"] == 0  # a TurboQuant arena never crossed on the compute stream
    assert (kv == "plain") != any(checked)
    engine.close()


@pytest.mark.parametrize("lazy", [False, True], ids=["eager", "lazy"])
def test_an_offloaded_arena_goes_back_into_one_kept_host_image(tiny_store, lazy, monkeypatch):
    """An offloaded TurboQuant arena returns to the host through the device-to-host copies (``copy_out``) into
    one host image kept from pass to pass (no tensor allocated per pass: the window tensors, which never grow,
    keep their storage), never through ``offload``'s allocating ``.to("cpu")``; its next fetch reads the image
    only after that copy landed: lazy copies that are never waited for leave a stale image, and other tokens."""
    from airquant.engine.decode.tqslots import SlotArena
    from airquant.kv import KVConfig

    config = KVConfig(backend="tq", bits_k=4, bits_v=2, window=8, block=4, sink=1)
    ops = SimOps(lazy)
    engine = streamed_engine(tiny_store, TIERS["ram"], ops)
    layers = set(range(engine.config.num_hidden_layers))
    words = "the quick brown fox jumps over a lazy dog while seven wise owls watch".split()
    prompts = [" ".join(words * n)[:chars] for n, chars in ((6, 400), (1, 20), (8, 520), (2, 60))]
    want = _loop_tokens(engine, set(), prompts, kv=config)
    monkeypatch.setattr(SlotArena, "offload", lambda self: pytest.fail("an arena offloaded by .to('cpu')"))
    images: dict[int, set[int]] = {}

    def images_kept(loop):
        for i in layers:
            arena = loop.kv.arena(i)
            if arena is not None and arena.home is not None:
                images.setdefault(i, set()).add(arena.home["win_k"].data_ptr())

    assert _loop_tokens(engine, layers, prompts, kv=config, after_step=images_kept) == want
    assert ops.copies_out > 0 and set(images) == layers and all(len(p) == 1 for p in images.values())
    if lazy:  # the fetch no longer waits for the copy to the host: it reads the image before the copy ran
        landed = []
        real = ops.copy_out

        def copy_out(pairs, after):
            landed.append(real(pairs, after))
            return landed[-1]

        monkeypatch.setattr(ops, "copy_out", copy_out)
        for name in ("host_wait", "wait"):
            run = getattr(ops, name)
            monkeypatch.setattr(ops, name, lambda event, run=run: None if any(event is e for e in landed) else
                                run(event))
        assert _loop_tokens(engine, layers, prompts, kv=config) != want
    engine.close()


def test_the_simulator_catches_a_missing_wait(tiny_store, reference, monkeypatch):
    """Without the compute stream waiting for the copy, the lazy simulator computes with garbage."""
    enc, want, _ = reference
    ops = SimOps(lazy=True)
    engine = streamed_engine(tiny_store, TIERS["ram"], ops)
    monkeypatch.setattr(ops, "wait", lambda event: None)
    assert not torch.equal(engine.forward(**enc), want)


def test_the_simulator_catches_a_slot_reused_while_in_use(tiny_store, reference, monkeypatch):
    """A prefetch into the slot of the layer about to compute overwrites its weights (eager copies)."""
    enc, want, _ = reference
    engine = streamed_engine(tiny_store, TIERS["ram"], SimOps(lazy=False))
    streamer = engine.streamer
    monkeypatch.setattr(streamer, "_free_slot", lambda prefetch: streamer._slot_order[-1])
    assert not torch.equal(engine.forward(**enc), want)


@pytest.mark.parametrize("tiers", ["ram+disk+disk", "disk"])
def test_a_forward_cut_short_leaves_a_usable_streamer(tiny_store, reference, tiers):
    enc, want, _ = reference
    engine = streamed_engine(tiny_store, TIERS[tiers], SimOps(lazy=True))
    layer = engine.model.model.layers[1]
    original = layer.layer.forward

    def fail(*args, **kwargs):
        raise torch.OutOfMemoryError("injected")

    layer.layer.forward = fail
    with pytest.raises(torch.OutOfMemoryError):
        engine.generate(PROMPTS, max_new_tokens=2)
    layer.layer.forward = original
    assert all(not e.in_use for e in engine.streamer._inflight.values())
    for _ in range(2):
        assert torch.equal(engine.forward(**enc), want)


def test_host_embedding_keeps_the_table_on_the_host(tiny_store, reference):
    enc, want, _ = reference
    engine = Engine.open(tiny_store, device="cpu", host_embedding=True)
    embed = engine.model.model.embed_tokens
    assert type(embed).__name__ == "HostEmbedding" and embed.table.device.type == "cpu"
    assert engine.model.device.type == "cpu" and engine.model.dtype == engine.dtype
    assert torch.equal(engine.forward(**enc), want)
    assert engine.plan.host_fixed_bytes == engine.manifest.shards["embed"].bytes
    assert engine.plan.fixed_bytes == sum(engine.manifest.shards[g].bytes for g in ("norm", "lm_head"))


def _registered(buf: torch.Tensor) -> bool:
    """Whether ``buf``'s own bytes, first and last, are page-locked: asked of tensors whose storage starts at
    each of those bytes (ctypes views, no copy), since ``is_pinned`` asks about the storage's first byte and a
    buffer from ``HostMemory.empty`` is a view starting on a page of a larger allocation. Not by registering
    them again: the refusal (cudaErrorHostMemoryAlreadyRegistered) stays the thread's last CUDA error, which
    the next kernel launch then reports (the H100, 2026-12-06: the next test's first ``randn`` failed)."""
    nbytes = buf.numel() * buf.element_size()

    def pinned(address: int) -> bool:
        return torch.frombuffer((ctypes.c_char * 1).from_address(address), dtype=torch.uint8).is_pinned()

    return pinned(buf.data_ptr()) and pinned(buf.data_ptr() + nbytes - 1)


@pytest.mark.gpu
@pytest.mark.parametrize("kw", [dict(resident_layers=0), dict(resident_layers=1, max_ram_gb=0.0)],
                         ids=["ram", "vram+disk"])
def test_cuda_nf4_store_with_host_embedding_equals_resident(tmp_path, real_tokenizer, kw):
    pytest.importorskip("bitsandbytes")
    from airquant.config import EngineConfig
    from airquant.store.synth import SynthSpec, synth

    store = tmp_path / "nf4"
    synth(SynthSpec("llama3-8b", "nf4", layers=3, overrides=(("hidden", 256), ("intermediate", 512), ("heads", 4),
                                                             ("kv_heads", 2), ("vocab", 3000))),
          store, device="cuda", tokenizer=real_tokenizer, progress=False)
    streamed = Engine.open(store, EngineConfig(device="cuda", host_embedding=True, profile=True, **kw))
    resident = Engine.open(store, device="cuda", resident=True)
    enc = streamed.encode(PROMPTS)
    for _ in range(2):
        torch.testing.assert_close(streamed.forward(**enc), resident.forward(**enc), rtol=1e-3, atol=1e-3)
    got = streamed.generate(PROMPTS, max_new_tokens=6)
    assert [c.token_ids for c in got] == [c.token_ids for c in resident.generate(PROMPTS, max_new_tokens=6)]
    memory = streamed.streamer.memory
    assert memory._registered and all(_registered(b) for b in memory._registered)  # exact-size page-locked
    rows = streamed.layer_profile()
    assert rows and all(r["copy_ms"] > 0 and r["compute_ms"] > 0 for r in rows)
    streamed.close()


def test_a_layers_views_of_a_buffer_are_made_once_and_read_its_current_bytes():
    """``_views_of``: the same tensors each time a layer is in one buffer (no slicing per fetch), aliasing it, so
    new bytes written there show; a layout with a misaligned tensor (copied by ``ShardLayout.views``) is made
    again each time, and another buffer or layout gets its own views."""
    lay = ShardLayout(Path("shard"), 0, 16, (("a", torch.float32, (2,), 0, 8), ("b", torch.int32, (2,), 8, 16)))
    streamer = SimpleNamespace(_views={})
    flat = torch.zeros(16, dtype=torch.uint8)
    first = LayerStreamer._views_of(streamer, 3, lay, flat)
    assert LayerStreamer._views_of(streamer, 3, lay, flat) is first
    flat[:8] = torch.tensor([1.5, -2.0]).view(torch.uint8)
    assert first["a"].tolist() == [1.5, -2.0]
    other = torch.zeros(16, dtype=torch.uint8)
    assert LayerStreamer._views_of(streamer, 3, lay, other)["a"].tolist() == [0.0, 0.0]
    odd = ShardLayout(Path("shard"), 0, 16, (("c", torch.int16, (2,), 1, 5),))
    assert lay.aligned and not odd.aligned
    assert LayerStreamer._views_of(streamer, 3, odd, flat) is not LayerStreamer._views_of(streamer, 3, odd, flat)
