"""The device memory of routed experts (engine/moe/compute.py) is what the plan says it is.

A ``TorchDispatchMode`` counts the bytes of every tensor storage created while a routed forward runs and
still alive (a storage's Python object lives exactly as long as the storage: its finalizer marks the free),
and the peak of each experts call above what was alive when the call began. That peak is compared with the
plan's terms for the call: the gather of the routed experts, the stacked decode with its temporaries, one
grouped call's intermediates, and the reserve's MLP chunk for the call's tokens (the block's input and output
rows). Budgets are shrunk so that the token chunks, decode slices and expert chunks are all exercised.
"""

from __future__ import annotations

import weakref

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from airquant.config import GenerateConfig
from airquant.engine.memory.placement import mlp_chunk_bytes
from airquant.engine.moe import compute as expert_compute
from airquant.engine.moe.sizing import expert_matrices, plan_experts
from airquant.engine.runner import Engine
from airquant.quant import QuantSpec
from airquant.quant.experts import ExpertWeights, quantize_experts
from airquant.store.manifest import load_manifest
from tests.engine.test_expert_streaming import _store

# Mixtral-like (top-2 of 8) and Qwen3-MoE-like (top-4 of 16, narrow experts) tiny shapes.
SHAPES = {"mixtral": dict(num_local_experts=8, num_experts_per_tok=2, hidden_size=64, intermediate_size=128),
          "qwen3_moe": dict(num_experts=16, num_experts_per_tok=4, hidden_size=64, moe_intermediate_size=32)}
DEFAULT = (expert_compute.DECODE_TEMP_BYTES, expert_compute.COMPUTE_BYTES, expert_compute.GROUPED_BYTES)
SMALL = (30_000, 60_000, 100_000)  # decode slices, token chunks of a few tokens, two or more expert chunks


class LiveBytes(TorchDispatchMode):
    """Bytes of the storages created inside the mode that are still alive, and their peak since ``mark``."""

    def __init__(self):
        super().__init__()
        self.sizes: dict[int, int] = {}
        self.live = self.peak = 0

    def mark(self) -> int:
        self.peak = self.live
        return self.live

    def _free(self, key: int) -> None:
        self.live -= self.sizes.pop(key)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        # A view, an in-place op or an out= op returns an input's storage: nothing new.
        inputs = {t.untyped_storage().data_ptr() for t in tree_leaves((args, kwargs))
                  if isinstance(t, torch.Tensor) and t.device.type != "meta"}
        for t in tree_leaves(out):
            if not isinstance(t, torch.Tensor) or t.device.type == "meta":
                continue
            storage = t.untyped_storage()
            key, size = id(storage), storage.nbytes()
            if storage.data_ptr() in inputs or key in self.sizes or size == 0:
                continue
            self.sizes[key] = size
            self.live += size
            self.peak = max(self.peak, self.live)
            weakref.finalize(storage, self._free, key)
        return out


def _set_budgets(monkeypatch, budgets) -> None:
    for name, value in zip(("DECODE_TEMP_BYTES", "COMPUTE_BYTES", "GROUPED_BYTES"), budgets):
        monkeypatch.setattr(expert_compute, name, value)


@pytest.fixture(scope="module")
def stores(tmp_path_factory, real_tokenizer):
    return {t: _store(tmp_path_factory.mktemp(t), real_tokenizer, t, "nf4", **SHAPES[t])[1] for t in SHAPES}


@pytest.mark.parametrize("budgets", [DEFAULT, SMALL], ids=["default", "small-budgets"])
@pytest.mark.parametrize("model_type", list(SHAPES))
def test_planned_bytes_cover_every_routed_call(stores, monkeypatch, model_type, budgets):
    _set_budgets(monkeypatch, budgets)
    store = stores[model_type]
    engine = Engine.open(store, device="cpu", experts="routed", expert_cache_gb=0.0, expert_prefetch=False)
    width = engine.dtype.itemsize
    plan = plan_experts(load_manifest(store), None, width=width, device="cpu", speculate=False)
    mode, calls = LiveBytes(), []
    run = engine.experts.run

    def tracked(i, module, forward, args, kwargs):
        base = mode.mark()
        out = run(i, module, forward, args, kwargs)
        calls.append((args[0].shape[0], mode.peak - base))
        return out

    engine.experts.run = tracked
    ids = torch.randint(100, 1000, (2, 48))
    with mode:
        engine.generate_requests([engine.request(row, GenerateConfig(max_new_tokens=3, ignore_eos=True))
                                  for row in ids.tolist()])
    assert {t for t, _ in calls} >= {96, 2}  # the prefill (2 x 48 tokens) and decode steps were tracked
    if budgets == SMALL:
        assert plan.call_tokens < 96  # the prefill ran in token chunks
    for tokens, peak in calls:
        planned = (plan.gather_bytes + plan.decode_bytes + plan.compute_bytes
                   + mlp_chunk_bytes(engine.config, tokens, width))
        assert 0 < peak <= planned, (tokens, peak, planned)
    engine.close()


@pytest.mark.parametrize("budgets", [(DEFAULT[0], 200, DEFAULT[2]), SMALL], ids=["token-chunks", "all-chunked"])
@pytest.mark.parametrize("model_type", list(SHAPES))
def test_chunked_long_prefill_equals_one_call(stores, monkeypatch, model_type, budgets):
    engine = Engine.open(stores[model_type], device="cpu", experts="routed", expert_cache_gb=0.0)
    ids = torch.randint(100, 1000, (2, 64))
    whole = engine.forward(ids)
    _set_budgets(monkeypatch, budgets)
    calls = []
    real = expert_compute.grouped_forward
    monkeypatch.setattr(expert_compute, "grouped_forward",
                        lambda m: (lambda mod, h, *a: calls.append(h.shape[0]) or real(m)(mod, h, *a)))
    chunked = engine.forward(ids)
    assert max(calls) < 128 and len(calls) > 2 * engine.config.num_hidden_layers  # several calls per layer
    assert (chunked - whole).abs().max().item() <= 1e-5 * whole.abs().max().item()
    assert torch.equal(chunked[:, -1].argmax(-1), whole[:, -1].argmax(-1))
    engine.close()


def test_sliced_decode_equals_one_decode(monkeypatch):
    torch.manual_seed(0)
    tensors, meta = quantize_experts(QuantSpec(method="nf4"), torch.randn(6, 96, 64) * 0.1, transposed=False)
    with torch.device("meta"):
        experts = ExpertWeights(meta, compute_dtype=torch.float32)
    experts.load_state_dict(tensors, assign=True)
    whole = expert_compute.decode_stacked(experts, 1, 6)
    monkeypatch.setattr(expert_compute, "DECODE_TEMP_BYTES", 96 * 64 * 50)  # two experts a slice on CPU
    assert expert_compute.decode_slice(96 * 64, 5, 4, True, "cpu") == 2
    assert torch.equal(expert_compute.decode_stacked(experts, 1, 6), whole)
    assert torch.equal(whole, experts.stacked(1, 6))


def test_plan_terms_at_real_shapes():
    """Mixtral-8x7B and Qwen3-30B-A3B experts in bf16 on CUDA: the bounds the plan prints."""
    mixtral = expert_compute.ExpertMatrices(((28672, 4096), (4096, 14336)), 2, (True, True), (True, True))
    qwen3 = expert_compute.ExpertMatrices(((1536, 2048), (2048, 768)), 8, (True, True), (True, True))
    assert mixtral.row_elems() == 4096 + 4 * 14336 + 4096 and qwen3.row_elems() == 5 * 2048
    for m in (mixtral, qwen3):
        assert m.compute_bytes(2, 2048) <= expert_compute.COMPUTE_BYTES
    assert mixtral.chunk_experts(2) == 3 and qwen3.chunk_experts(2) == 113
    # Three Mixtral experts decode in one call (0.5 B/elem of absmax temporaries); 113 Qwen3 gate_up
    # matrices are decoded in slices whose temporaries fit DECODE_TEMP_BYTES.
    gate_up = 28672 * 4096
    assert mixtral.decode_bytes(8, 2, "cuda") == 3 * (gate_up + 4096 * 14336) * 2 + gate_up * 3 // 2
    assert expert_compute.decode_slice(1536 * 2048, 113, 2, True, "cuda") < 113
    assert qwen3.decode_bytes(128, 2, "cuda") <= expert_compute.GROUPED_BYTES + expert_compute.DECODE_TEMP_BYTES


def test_manifest_matrices(stores):
    entry = load_manifest(stores["qwen3_moe"]).shards["layer.0"]
    m = expert_matrices(entry)
    assert sorted(m.shapes) == [(64, 32), (64, 64)] and m.top_k == 4 and all(m.quantized) and all(m.stacks)


@pytest.mark.gpu
def test_cuda_stacked_decode_writes_the_compute_dtype_within_its_temporaries():
    torch.manual_seed(0)
    tensors, meta = quantize_experts(QuantSpec(method="nf4"), torch.randn(4, 512, 256) * 0.1, transposed=False)
    with torch.device("meta"):
        experts = ExpertWeights(meta, compute_dtype=torch.bfloat16)
    experts.load_state_dict({k: v.cuda() for k, v in tensors.items()}, assign=True)
    one_by_one = torch.stack([experts[e] for e in range(4)])  # the whole-layer path's per-expert decode
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    stacked = expert_compute.decode_stacked(experts, 0, 4)
    elems = 4 * 512 * 256
    assert torch.cuda.max_memory_allocated() - base <= elems * (2 + expert_compute.DECODE_TEMP_PER_ELEM["cuda"])
    assert stacked.dtype == torch.bfloat16 and torch.equal(stacked, one_by_one)


@pytest.mark.parametrize("model_type", list(SHAPES))
def test_a_routed_call_leaves_only_its_output_alive(stores, model_type):
    """After an experts call, nothing it made is still alive but its output: no gather, decode or view of one
    kept by a module (batch-1 decode runs by ``run_gemv``; the prefill by the stacked decode)."""
    engine = Engine.open(stores[model_type], device="cpu", experts="routed", expert_cache_gb=0.0,
                         expert_prefetch=False)
    mode, left = LiveBytes(), []
    run = engine.experts.run

    def tracked(i, module, forward, args, kwargs):
        base = mode.mark()
        out = run(i, module, forward, args, kwargs)
        left.append((args[0].shape[0], mode.live - base - out.untyped_storage().nbytes()))
        return out

    engine.experts.run = tracked
    ids = torch.randint(100, 1000, (1, 24))
    with mode:
        engine.generate_requests([engine.request(row, GenerateConfig(max_new_tokens=4, ignore_eos=True))
                                  for row in ids.tolist()])
    assert {t for t, _ in left} == {24, 1}  # prefill and one-token decode calls
    assert all(extra == 0 for _, extra in left), left
    engine.close()
