"""The decode loop's work per decoder layer, counted with a dispatch mode (deterministic, unlike timings).

A batch pass of an 8B model on an H200 is bound by the host queueing kernels, not by the GPU: every op
inside a decoder layer is a launch per layer per pass, and a host sync inside one stops the host from
queueing ahead. These tests pin what the cache on the device costs per layer: no op that reads device data
on the host (``.item()``, ``nonzero``, ``bool(t)``) and no tensor made from host data (``torch.tensor``: a
host-to-device copy on a GPU) inside any layer, in prefill and decode passes alike; a decode pass writes its
new keys and values with one gather and one scatter each. On CPU the same aten ops dispatch as on a GPU.
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from airquant.engine import skeleton
from airquant.engine.decode import Request
from airquant.engine.runner import Engine

# Ops that read a tensor's data on the host (a device sync on a GPU), and those that make a tensor of host data.
SYNCS = {"_local_scalar_dense", "nonzero", "is_nonzero", "item", "masked_select", "unique_consecutive",
         "_unique2", "equal"}
HOST_DATA = {"lift_fresh", "lift_fresh_copy"}
WORDS = "the quick brown fox jumps over a lazy dog while seven wise owls watch from an old oak tree".split()


class OpCounter(TorchDispatchMode):
    """Aten ops by where they ran ("outside", "layer", "kv_write") and whether they are kernels: an in-place
    op, or one whose output is new memory (views and no-op conversions return an input's storage)."""

    def __init__(self):
        super().__init__()
        self.where = "outside"
        self.ops: Counter = Counter()  # (where, op)
        self.kernels: Counter = Counter()  # (where, op)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        self.ops[(self.where, name)] += 1
        leaves = torch.utils._pytree.tree_leaves((args, kwargs))
        inputs = {t.untyped_storage().data_ptr() for t in leaves if isinstance(t, torch.Tensor)}
        outputs = [t for t in torch.utils._pytree.tree_leaves(out) if isinstance(t, torch.Tensor)]
        if name.endswith("_") or any(t.untyped_storage().data_ptr() not in inputs for t in outputs):
            self.kernels[(self.where, name)] += 1
        return out

    def at(self, where: str, counter: Counter | None = None) -> Counter:
        return Counter({op: n for (w, op), n in (counter or self.ops).items() if w == where})


@pytest.fixture(scope="module")
def engine(tiny_store):
    e = Engine.open(tiny_store, device="cpu")
    yield e
    e.close()


def _counted_passes(engine, slots: int = 3) -> list[tuple[list, OpCounter]]:
    """Every pass of a mixed job (prompts arriving while others decode) with its op counts; per pass the
    segments it ran (``(n, ...)``: n > 1 a prompt chunk, 1 a decode token)."""
    loop = engine.decode_loop(slots, context=96, token_budget=8, offload=set())
    layers = skeleton.decoder_layers(engine.model)
    state: dict = {"mode": None}

    def enter(where):
        def hook(*_):
            if state["mode"] is not None:
                state["mode"].where = where
        return hook

    handles = [h for layer in layers for h in (layer.register_forward_pre_hook(enter("layer")),
                                               layer.register_forward_hook(enter("outside")))]
    update = loop.kv.update

    def counted_update(*args, **kwargs):  # the cache's write, called by every attention module
        mode, prev = state["mode"], state["mode"].where
        mode.where = "kv_write"
        try:
            return update(*args, **kwargs)
        finally:
            mode.where = prev

    loop.kv.update = counted_update
    for k in range(5):
        loop.submit(Request(tuple(engine.prompt_ids(" ".join(WORDS[: 3 + 4 * k]))), 4 + k, ignore_eos=True))
    passes = []
    try:
        while not loop.idle:
            state["mode"] = OpCounter()
            with state["mode"]:
                loop.step()
            state["mode"].full = loop.kv.full  # every slot decoded, in slot order
            passes.append(([s.n for s in loop.kv.segments], state["mode"]))
    finally:
        for h in handles:
            h.remove()
    return passes


def test_no_host_sync_or_host_data_inside_a_layer(engine):
    passes = _counted_passes(engine)
    assert any(max(n) > 1 for n, _ in passes) and any(max(n) == 1 for n, _ in passes)  # prefill and decode passes
    for segments, mode in passes:
        for where in ("layer", "kv_write"):
            ops = mode.at(where)
            assert sum(ops.values()) > 0, where
            assert not {op for op in ops if op in SYNCS | HOST_DATA}, (segments, where, ops)


def test_a_decode_pass_writes_its_kv_with_one_gather_and_one_scatter_each(engine):
    """Per layer on a decode-only pass: keys and values gathered from the packed row (``index``) and scattered
    into the slots (``index_put_``), nothing else launched; views and no-op casts launch nothing. A pass of one
    sequence's one token (batch 1) writes each by a slice copy instead (``SlotKV.single``), and a pass of every
    slot in slot order (``SlotKV.full``) reads them from the row as views: the scatters alone."""
    passes = [(n, mode) for n, mode in _counted_passes(engine) if max(n) == 1]
    assert any(n == [1] for n, _ in passes) and any(m.full and len(n) > 1 for n, m in passes)
    layers = engine.config.num_hidden_layers
    for segments, mode in passes:
        kernels = mode.at("kv_write", mode.kernels)
        if segments == [1]:
            want = {"copy_": 2 * layers}
        elif mode.full:
            want = {"index_put_": 2 * layers}
        else:
            want = {"index": 2 * layers, "index_put_": 2 * layers}
        assert kernels == Counter(want), (segments, kernels)


def test_greedy_tokens_of_a_pass_are_read_in_one_go_not_one_sync_per_sequence(engine):
    """Sampling outside the layers: a greedy decode pass of several sequences reads its tokens with one
    argmax over the rows (``tolist``, no per-sequence ``_local_scalar_dense``: one GPU sync each)."""
    passes = [(n, mode) for n, mode in _counted_passes(engine) if max(n) == 1 and len(n) > 1]
    assert passes
    for segments, mode in passes:
        outside = mode.at("outside")
        assert outside["_local_scalar_dense"] == 0, (segments, outside)
        assert outside["argmax"] == 1, (segments, outside)


def test_a_decode_pass_builds_its_attention_mask_once_not_per_layer(engine):
    """The decode rows' [slots, L] mask is the same for every layer of a pass (one span, one window): the
    first layer builds it (one ``arange``, one ``lt``), the others reuse it."""
    passes = [(n, mode) for n, mode in _counted_passes(engine) if max(n) == 1]
    assert passes and engine.config.num_hidden_layers > 1
    for segments, mode in passes:
        layer = mode.at("layer")
        if segments == [1]:  # batch 1: the slot's keys are attended whole, with no mask and no index
            assert (layer["arange"], layer["lt"], layer["index"], layer["index_put_"]) == (0, 0, 0, 0), layer
        else:
            assert (layer["arange"], layer["lt"]) == (1, 1), (segments, layer)


@pytest.mark.parametrize("window", [None, 4, 64])
def test_batch1_attention_by_slices_equals_the_masked_path(window):
    """A pass of one sequence's one token (``SlotKV.single``): its key/value written by a slice, its attention
    over its own slot's keys with the window as a slice and no mask, equals the masked gather/scatter path of a
    decode pass (the other slot's stale rows never read), within fp32 rounding."""
    from airquant.engine.decode.slots import PassContext, Segment, SlotKV, _plain_attention

    torch.manual_seed(0)
    hkv, g, dim = 2, 3, 8
    kv = SlotKV(1, slots=2, cap=32, device=torch.device("cpu"), dtype=torch.float32)
    kv.begin([Segment(slot=0, start=0, n=20, offset=0), Segment(slot=1, start=0, n=11, offset=20)])
    kv.update(torch.randn(1, hkv, 31, dim), torch.randn(1, hkv, 31, dim), 0)  # slot 0 holds 9 tokens more
    kv.free(0)
    kv.begin([Segment(slot=1, start=11, n=1, offset=0)])
    assert kv.single is not None
    key, value = torch.randn(1, hkv, 1, dim), torch.randn(1, hkv, 1, dim)
    keys, values = kv._plain_update(key, value, 0)
    assert torch.equal(keys[1, :, 11], key[0, :, 0]) and torch.equal(values[1, :, 11], value[0, :, 0])
    ctx = PassContext(kv, 0, keys=keys, values=values)
    query = torch.randn(1, hkv * g, 1, dim)
    fast = _plain_attention(query, ctx, 0.3, window)
    kv.single, kv.full = None, False  # the general path over the same pass
    slow = _plain_attention(query, ctx, 0.3, window)
    assert fast.shape == slow.shape == (1, hkv * g, 1, dim)
    assert torch.allclose(fast, slow, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("window", [None, 4])
def test_full_batch_attention_by_views_equals_the_gathered_path(window):
    """A pass of every slot's one token in slot order (``SlotKV.full``): its keys/values written and its query
    and output read as views of the packed row equal the gather/scatter path, within fp32 rounding."""
    from airquant.engine.decode.slots import PassContext, Segment, SlotKV, _plain_attention

    torch.manual_seed(0)
    hkv, g, dim = 2, 3, 8
    kv = SlotKV(1, slots=3, cap=32, device=torch.device("cpu"), dtype=torch.float32)
    kv.begin([Segment(slot=0, start=0, n=9, offset=0), Segment(slot=1, start=0, n=5, offset=9),
              Segment(slot=2, start=0, n=12, offset=14)])
    kv.update(torch.randn(1, hkv, 26, dim), torch.randn(1, hkv, 26, dim), 0)
    kv.begin([Segment(slot=n, start=start, n=1, offset=n) for n, start in enumerate((9, 5, 12))])
    assert kv.full and kv.single is None
    key, value = torch.randn(1, hkv, 3, dim), torch.randn(1, hkv, 3, dim)
    keys, values = kv._plain_update(key, value, 0)
    for n, start in enumerate((9, 5, 12)):
        assert torch.equal(keys[n, :, start], key[0, :, n]) and torch.equal(values[n, :, start], value[0, :, n])
    ctx = PassContext(kv, 0, keys=keys, values=values)
    query = torch.randn(1, hkv * g, 3, dim)
    fast = _plain_attention(query, ctx, 0.3, window)
    kv.full = False
    slow = _plain_attention(query, ctx, 0.3, window)
    assert fast.shape == slow.shape == (1, hkv * g, 3, dim)
    assert torch.allclose(fast, slow, atol=1e-6, rtol=1e-5)
