"""Host syncs of a routed MoE layer at batch-1 decode, counted on the CPU (deterministic, unlike timings).

On a GPU every read of device data on the host (``tolist``, ``item``, ``bool(t)``, ``unique``/``nonzero``,
whose output size the host must know) stops the host until the compute queued before it has run, and so
does a tensor made from a host list (``torch.tensor(list, device=...)``: a blocking host-to-device copy). At
batch 1 the routed path is bound by such stalls, one MoE layer after another: a call of the experts reads
its routing (and the speculated experts of the next layer) to the host exactly once, and nothing else.
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from airquant.config import GenerateConfig
from airquant.engine.moe import pool as experts
from airquant.engine.runner import Engine
from tests.engine.test_expert_streaming import _store

# Aten ops that read device data on the host, and those that make a tensor of host data (as in
# test_decode_dispatch.py); Tensor methods that read it to Python.
SYNC_OPS = {"_local_scalar_dense", "nonzero", "is_nonzero", "item", "masked_select", "unique_consecutive",
            "_unique2", "unique_dim", "equal", "lift_fresh", "lift_fresh_copy"}
HOST_READS = ("tolist", "item", "__bool__", "__int__", "__float__", "__index__", "numpy")
PROMPT = [17, 254, 1033, 88, 512, 731, 42]


class SyncCounter(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops: Counter = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name in SYNC_OPS:
            self.ops[name] += 1
        return func(*args, **(kwargs or {}))


@pytest.fixture(scope="module")
def store(tmp_path_factory, real_tokenizer):
    """A 3-layer Mixtral of 8 NF4 experts (every in_features a multiple of 64: the 4-bit GEMV path runs)."""
    return _store(tmp_path_factory.mktemp("mixtral"), real_tokenizer, "mixtral", "nf4", hidden_size=64,
                  intermediate_size=128)[1]


def _decode_calls(engine: Engine, monkeypatch) -> list[tuple[Counter, Counter]]:
    """Per call of a routed experts module after the prefill of a batch-1 decode (one token: [T, H], or
    Llama 4's [E * T, H]): host reads by Tensor method, and sync / host-data aten ops."""
    calls, active = [], []
    for method in HOST_READS:
        real = getattr(torch.Tensor, method)

        def counted(self, *args, _real=real, _name=method, **kwargs):
            if active:
                active[-1][0][_name] += 1
            return _real(self, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, method, counted)
    run = experts.ExpertPool.run

    def counted_run(pool, i, module, forward, args, kwargs):
        hidden = args[0] if args else next(iter(kwargs.values()))
        reads, mode = Counter(), SyncCounter()
        active.append((reads, mode))
        try:
            with mode:
                return run(pool, i, module, forward, args, kwargs)
        finally:
            active.pop()
            if hidden.reshape(-1, hidden.shape[-1]).shape[0] in (1, len(pool.layers[i].ranges)):
                calls.append((reads, mode.ops))

    monkeypatch.setattr(experts.ExpertPool, "run", counted_run)
    ids = torch.tensor([PROMPT])
    engine.generate_requests([engine.request(row, GenerateConfig(max_new_tokens=4, ignore_eos=True))
                              for row in ids.tolist()])
    return calls


@pytest.mark.parametrize("prefetch", [True, False])
def test_a_routed_layer_reads_the_device_once_per_decode_step(store, monkeypatch, prefetch):
    engine = Engine.open(store, device="cpu", experts="routed", expert_prefetch=prefetch)
    try:
        calls = _decode_calls(engine, monkeypatch)
        layers = len(engine.experts.layers)
        assert layers == 3 and len(calls) == 3 * layers  # 3 one-token steps after the prefill
        if prefetch:
            assert engine.experts.stats["guessed"] > 0  # speculation ran, its read folded into the routing's
        for reads, ops in calls:
            assert reads == Counter(tolist=1), reads
            assert not ops, ops
    finally:
        engine.close()


def test_a_long_prefill_reads_only_its_distinct_experts(store, monkeypatch):
    """A call of more rows than the few-row path takes reads its distinct experts, not every routing id
    (a long prompt's ids would make a host list of tokens x top-k a layer): at most the layer's experts."""
    engine = Engine.open(store, device="cpu", experts="routed", expert_prefetch=False)
    lengths, real = [], torch.Tensor.tolist

    def tolist(self):
        out = real(self)
        lengths.append(len(out) if isinstance(out, list) else 1)
        return out

    run = experts.ExpertPool.run

    def counted_run(pool, i, module, forward, args, kwargs):
        lengths.clear()
        monkeypatch.setattr(torch.Tensor, "tolist", tolist)
        try:
            return run(pool, i, module, forward, args, kwargs)
        finally:
            monkeypatch.setattr(torch.Tensor, "tolist", real)
            reads.append(list(lengths))

    reads: list[list[int]] = []
    monkeypatch.setattr(experts.ExpertPool, "run", counted_run)
    try:
        engine.forward(torch.randint(100, 1000, (1, 64)))  # 64 tokens x top-2 ids per layer
        num = len(next(iter(engine.experts.layers.values())).ranges)
        assert len(reads) == len(engine.experts.layers)
        assert all(r and max(r) <= num for r in reads), reads
    finally:
        engine.close()


@pytest.mark.parametrize("prefetch", [True, False])
def test_a_dispatched_layer_reads_the_device_once_per_decode_step(tmp_path_factory, real_tokenizer,
                                                                  monkeypatch, prefetch):
    """Llama 4 hands its experts every token spread over all of them: which experts have a row, and the
    next layer's guess, come to the host in one read; the routed ids go back without host data."""
    llama4 = _store(tmp_path_factory.mktemp("llama4"), real_tokenizer, "llama4_text", "nf4")[1]
    engine = Engine.open(llama4, device="cpu", experts="routed", expert_prefetch=prefetch)
    try:
        calls = _decode_calls(engine, monkeypatch)
        layers = len(engine.experts.layers)
        assert layers and len(calls) == 3 * layers  # 3 one-token steps after the prefill
        if prefetch:
            assert engine.experts.stats["guessed"] > 0
        for reads, ops in calls:
            assert reads == Counter(tolist=1), reads
            assert not ops, ops
    finally:
        engine.close()
