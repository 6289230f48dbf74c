"""The decode loop's slot-batched TurboQuant cache against one batch-1 ``TQLayer`` per sequence.

Ragged slots (a long prompt with history from its prefill, a short one that reaches its first flush
while decoding, an idle slot, a late arrival, a slot freed and reused by a one-token prompt): every pass,
the batched decode attention must give what the per-sequence path gives (one ``TQLayer.update`` and one
attention call per segment), and the packed histories must be the same bytes.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from airquant.engine.decode.slots import Segment, SlotKV, ragged_attention
from airquant.engine.decode.tqslots import PAGE_TOKENS, SlotArena
from airquant.kv import KVConfig
from airquant.kv.attention import compressed_attention
from airquant.kv.cache import TQLayer, context_of
from airquant.kv.masks import keep_mask

SLOTS, HKV, HQ, DIM = 4, 2, 4, 16
CONFIGS = {
    "plain": KVConfig(backend="tq", bits_k=4, bits_v=2, window=8, block=4),
    "mixed": KVConfig(backend="tq", bits_k=3, bits_v=2, window=8, block=4, sink=2, center_k=True, center_v=True,
                      norm_bits=8, unbiased=True),
}
# pass -> {slot: prompt length}: new prompts; FREE: pass -> slots whose sequence ended before it.
ARRIVALS = {0: {0: 20, 1: 3}, 3: {3: 9}, 8: {0: 1}}
FREE = {8: [0]}
PASSES = 24


class _Module:
    """An attention module without a sliding window (what ragged_attention asks of it)."""

    config = None


def _reference(layer: TQLayer, q, k, v, scale) -> torch.Tensor:
    """The per-segment path: one TQLayer update and one attention call; ``[1, Hq, n, D]``."""
    keys, values = layer.update(k, v)
    ctx, plain = context_of(keys), keys.as_subclass(torch.Tensor)
    ctx.receipt.consumed = True
    if ctx.history.length:
        return compressed_attention(q, plain, values, ctx, None, scale).transpose(1, 2)
    g = q.shape[1] // plain.shape[1]
    keep = keep_mask(None, 1, q.shape[2], plain.shape[2], q.device)
    return F.scaled_dot_product_attention(q, plain.repeat_interleave(g, 1), values.repeat_interleave(g, 1),
                                          attn_mask=keep, scale=scale)


def _poison(tensors) -> None:
    for t in tensors:
        t.fill_(float("nan") if t.is_floating_point() else 0xA5)


def _emulated_offload(monkeypatch):
    """KV offload on CPU: ``offload`` keeps a "host" copy aside and poisons the "device" tensors the arena
    still points at; ``prefetch`` brings fresh copies back and poisons the host ones. A read without a
    prefetch, or a write after the offload, changes the results."""
    def offload(self):
        self.host = {name: t.clone() for name, t in self.t.items()}
        _poison(self.t.values())

    def prefetch(self):
        self.t = {name: t.clone() for name, t in self.host.items()}
        _poison(self.host.values())

    monkeypatch.setattr(SlotArena, "offload", offload)
    monkeypatch.setattr(SlotArena, "prefetch", prefetch)


@pytest.mark.parametrize("offload", [False, True], ids=["on-device", "kv-offload"])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_batched_decode_attention_equals_per_segment_path(name, offload, monkeypatch):
    from airquant.engine.decode import slots

    if offload:
        _emulated_offload(monkeypatch)
    buckets = {True: 0, False: 0}  # decode buckets read as the pass's whole output / gathered and scattered
    real = slots._bucket_out
    monkeypatch.setattr(slots, "_bucket_out", lambda out, q, bucket, part: buckets.__setitem__(
        bucket.whole, buckets[bucket.whole] + 1) or real(out, q, bucket, part))
    batched_with_history, flushed_in_decode, _ = _drive(CONFIGS[name], 2, ARRIVALS, FREE, PASSES, {1} if offload else set())
    assert batched_with_history and flushed_in_decode  # the scenario reached what it is about
    assert buckets[True] and buckets[False]  # both ways of placing a bucket's output were checked


def test_histories_of_very_different_lengths_take_their_own_pages():
    """A 700-token prompt beside 3- and 90-token ones, one freed and its slot reused: outputs and codes equal
    the per-segment path, each slot holds only its own history's pages, and no attention call reads a short
    slot's history as long as the long one's."""
    kv = CONFIGS["plain"]
    arrivals, free = {0: {0: 700, 1: 3, 2: 90}, 2: {3: 150}, 5: {2: 5}}, {5: [2]}
    _, _, cache = _drive(kv, 1, arrivals, free, 8, set())
    arena, page = cache.arena(0), PAGE_TOKENS
    lengths = [kv.schedule.quantized_count(n) for n in cache._seen]
    used = sum(-(-h // page) for h in lengths)
    assert [len(p) for p in arena.pages] == [-(-h // page) for h in lengths]
    # The pool: the pages in use plus those freed, grown by an eighth at most (padded: slots x the longest).
    assert arena.pool_pages <= used + -(-90 // page) + -(-arena.pool_pages // 8)
    assert arena.pool_pages < SLOTS * -(-max(lengths) // page)
    plan = cache.plan
    assert len(plan.buckets) > 1
    read = sum(len(b.rows) * b.hist_len for b in plan.buckets)
    assert read <= 2 * page * used < len(plan.slots) * plan.hist_len


def test_page_tables_are_written_before_the_layers_in_one_copy(monkeypatch):
    """Nothing inside a layer builds a host tensor for the device (a page table, a prefill's slot index): on a GPU
    such a copy on the compute stream waits behind the layer copies already queued, and the layers then ran one
    after another's copy (a TurboQuant pass took its copies plus its compute). Past the first pass, which makes
    the arenas, every table that changed is written by ``begin``, every layer's in one copy (pages are reserved
    in most passes of the scenario); the outputs and codes still equal the per-segment path."""
    from airquant.engine.decode import slots, tqslots

    state = {"in_layers": False, "passes": 0, "inside": [], "copies": 0}
    begin, table, on_device = SlotKV.begin, SlotArena.table, tqslots.on_device

    def counted_begin(self, segments):
        state["in_layers"] = False
        begin(self, segments)
        state["in_layers"], state["passes"] = True, state["passes"] + 1

    def counted_table(self):
        if self._table is None and state["in_layers"] and state["passes"] > 1:
            state["inside"].append(("table", state["passes"]))
        return table(self)

    def counted_on_device(values, device, dtype=torch.long):
        if state["in_layers"] and state["passes"] > 1:
            state["inside"].append(("on_device", state["passes"]))
        return on_device(values, device, dtype)

    real_runs = slots._runs
    monkeypatch.setattr(slots, "_runs", lambda idx: state.__setitem__("copies", state["copies"] + 1) or real_runs(idx))
    monkeypatch.setattr(SlotKV, "begin", counted_begin)
    monkeypatch.setattr(SlotArena, "table", counted_table)
    monkeypatch.setattr(tqslots, "on_device", counted_on_device)
    arrivals = {**ARRIVALS, 5: {1: 70}}  # slot 1's sequence ends, a long prompt takes it (a release, new pages)
    _, _, cache = _drive(CONFIGS["plain"], 3, arrivals, {**FREE, 5: [1]}, PASSES, set(), cap=256)
    assert state["inside"] == []
    assert 0 < state["copies"] < PASSES and slots._runs([0, 1, 2, 5, 6]) == [(0, 3), (5, 7)]
    for i in range(3):  # each layer's table is the view the one copy writes, and holds its pages
        arena = cache.arena(i)
        assert arena.table().data_ptr() == cache._tables[0][i].data_ptr()
        assert arena.table()[:, :2].tolist() == [(p + [0, 0])[:2] for p in arena.pages]


def _drive(kv: KVConfig, layers: int, arrivals: dict, free: dict, passes: int, offload: set, cap: int = 64) -> tuple:
    """Runs the scenario against one ``TQLayer`` per slot and layer, checking every pass's outputs and codes;
    returns (passes that batched slots with history, passes with a flush in decode, the cache). ``cap``: tokens a
    slot holds (a longer sequence outgrows the fixed-width page tables: its arena keeps a table of its own)."""
    cache = SlotKV(layers, SLOTS, cap, torch.device("cpu"), torch.float32, kv=kv, offload=offload)
    refs: dict[int, list[TQLayer]] = {}
    seen: dict[int, int] = {}
    gen = torch.Generator().manual_seed(0)
    scale, flushed_in_decode, batched_with_history = DIM ** -0.5, 0, 0
    for step in range(passes):
        for slot in free.get(step, []):
            cache.free(slot)
            del seen[slot]
        for slot, n in arrivals.get(step, {}).items():
            refs[slot] = [TQLayer(kv, i, DIM) for i in range(layers)]
            seen[slot] = -n  # negative: a prompt of n tokens is due
        segments, offset = [], 0
        for slot in sorted(seen):
            n = -seen[slot] if seen[slot] < 0 else 1
            segments.append(Segment(slot, max(seen[slot], 0), n, offset))
            offset += n
        cache.begin(segments)
        plan = cache.plan
        for i in range(layers):
            q = torch.randn(1, HQ, offset, DIM, generator=gen)
            k, v = (torch.randn(1, HKV, offset, DIM, generator=gen) * 2 + 0.5 for _ in range(2))
            tagged, value = cache.update(k, v, i)
            got = ragged_attention(_Module(), q, tagged, value, None, scaling=scale)[0][0].transpose(0, 1)
            for s in segments:
                rows = slice(s.offset, s.offset + s.n)
                want = _reference(refs[s.slot][i], q[:, :, rows], k[:, :, rows], v[:, :, rows], scale)[0]
                assert (got[:, rows] - want).abs().max() <= 1e-5, f"pass {step}, layer {i}, slot {s}"
        for s in segments:
            seen[s.slot] = s.start + s.n
        batched_with_history += plan is not None and plan.hist_len > 0 and len(plan.slots) > 1
        flushed_in_decode += plan is not None and plan.flush is not None
        _assert_same_histories(cache, refs, seen, layers)
    return batched_with_history, flushed_in_decode, cache


def _assert_same_histories(cache: SlotKV, refs, seen, layers) -> None:
    """Each running slot's packed history (and window) in the arena equals its own TQLayer's."""
    for i in range(layers):
        arena = cache.arena(i)
        held = arena.host if i in cache.offload else arena.t  # an offloaded layer: its emulated host copy
        for slot, layer in ((s, refs[s][i]) for s in seen):
            store = layer.store
            for name in ("k_codes", "k_norms", "v_codes", "v_norms"):
                if store.length:
                    assert torch.equal(arena.history_of(slot, name, store.length, held),
                                       store.tensors[name][0, :, : store.length])
            window = layer.keys.shape[2]
            assert torch.equal(held["win_k"][slot, :, :window], layer.keys[0]), f"slot {slot} layer {i}"


def test_reserve_all_reserves_what_reserve_does_and_again_after_a_release():
    """A pass's (slot, history tokens) reserved at once: the pages ``reserve`` gives each slot, none for a slot its
    pages already hold; a released slot holds none, so the next sequence in it gets pages again."""
    kv = KVConfig(backend="tq", bits_k=4, bits_v=2, window=8, block=4)
    one, many = (SlotArena(kv, 0, 3, 2, 16, "cpu", torch.float32) for _ in range(2))
    passes = [[(0, 0), (1, 70), (2, 5)], [(0, 64), (1, 70), (2, 130)], [(0, 65), (1, 71), (2, 130)]]
    for targets in passes:
        for slot, tokens in targets:
            one.reserve(slot, tokens)
        many.reserve_all(targets)
        assert many.pages == one.pages
    assert [len(p) for p in many.pages] == [2, 2, 3] and many._room == [2 * PAGE_TOKENS, 2 * PAGE_TOKENS,
                                                                         3 * PAGE_TOKENS]
    many.release(1)
    many.reserve_all([(1, 10)])
    assert len(many.pages[1]) == 1 and many._room[1] == PAGE_TOKENS


@pytest.mark.parametrize("name", ["plain", "mixed"])
def test_an_arena_makes_every_table_a_history_read_takes_when_it_is_made(name, monkeypatch):
    """A history read (kv/triton_kernel) takes each codec's centroids and byte table in the query's dtype or fp32
    and its rotation in fp32 and fp64. An arena is made in its layer's first pass; those made later, at a later
    pass's first history read, were host tensors pinned and copied inside the layer (on CUDA: behind the next
    layers' weight copies)."""
    from airquant.kv import codec as codec_mod
    from airquant.kv import rotation as rotation_mod

    arena = SlotArena(CONFIGS[name], 1, SLOTS, HKV, DIM, "cpu", torch.bfloat16)
    made = []
    for mod in (codec_mod, rotation_mod):
        monkeypatch.setattr(mod, "to_device", lambda t, device, made=made: made.append(t.shape) or t.to(device))
    for codec in (arena.k_codec, arena.v_codec):
        for dtype in (torch.bfloat16, torch.float32):
            codec.centroids("cpu", dtype)
            if 8 % codec.bits == 0:
                codec.byte_table("cpu", dtype)
        codec.rotation.matrix("cpu", torch.float64)
        codec.rotation.matrix("cpu", torch.float32)
    assert made == []
