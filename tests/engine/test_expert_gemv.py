"""Routed NF4 experts with few rows run by bitsandbytes' 4-bit matmul on their packed bytes (expert_compute.run_gemv).

The path must give the stacked-decode path's output (fp32 on CPU within 1e-5; bf16 on CUDA within bf16 rounding),
run on every call whose experts have at most ``GEMV_TOKENS`` rows without decoding any expert (counted:
``NF4Linear.dequantize_stacked`` / ``dequantize`` never run inside such a call), and leave every other call and
store (more rows, NF4 blocks straddling rows on the CPU, biases, other schemes) to the stacked path.
"""

from __future__ import annotations

import pytest
import torch
from transformers import MixtralConfig, Qwen3MoeConfig
from transformers.models.mixtral.modeling_mixtral import MixtralExperts
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

from airquant.config import GenerateConfig
from airquant.engine.moe import compute as expert_compute
from airquant.engine.runner import Engine
from airquant.models import resolve
from airquant.quant import QuantSpec
from airquant.quant.experts import ExpertWeights, quantize_experts
from airquant.quant.nf4 import NF4Linear
from airquant.store.quantize import make_transform
from airquant.store.split import split
from tests.zoo import make_model

# Every matrix's in_features a multiple of NF4's blocksize (64): bitsandbytes multiplies them on the CPU too.
GEMV_SHAPES = {"mixtral": dict(hidden_size=64, intermediate_size=128),
               "qwen3_moe": dict(hidden_size=64, moe_intermediate_size=64)}
# Stores the path leaves to the stacked decode: the down projection's 32 inputs straddle NF4 blocks (CPU);
# gpt-oss's experts have biases; int2 experts are not multiplied from their packed bytes.
FALLBACK = {"qwen3_moe-straddling": ("qwen3_moe", "nf4", dict(moe_intermediate_size=32)),
            "gpt_oss-bias": ("gpt_oss", "nf4", {}), "mixtral-int2": ("mixtral", "int2", {})}
PROMPT = [17, 254, 1033, 88, 512, 731, 42]


def _store(folder, tokenizer, model_type: str, method: str = "nf4", dense_dtype: str = "float32", **over):
    """A tiny quantized store; ``dense_dtype``: what its dense tensors are stored in (bf16: the engine's own
    on CUDA, so a fetch does not cast them into new tensors each call)."""
    model = make_model(folder / "model", tokenizer, model_type, **over)
    source = resolve(str(model))
    spec = QuantSpec(method="int2", group=16, outliers=0.0) if method == "int2" else QuantSpec(method=method)
    transform, record = make_transform(source, spec)
    split(source, folder / "store", dtype=dense_dtype, quant=record, transform=transform, progress=False)
    return folder / "store"


@pytest.fixture(scope="module")
def stores(tmp_path_factory, real_tokenizer):
    return {t: _store(tmp_path_factory.mktemp(t), real_tokenizer, t, **over) for t, over in GEMV_SHAPES.items()}


class Calls:
    """Per call of ``run_grouped``: its rows, whether ``run_gemv`` computed it, and the NF4 decodes inside it."""

    def __init__(self, monkeypatch):
        self.rows: list[tuple[int, bool, int]] = []
        self.decodes = 0
        for name in ("dequantize_stacked", "dequantize"):
            real = getattr(NF4Linear, name)
            monkeypatch.setattr(NF4Linear, name, self._counted(real))
        gemv, grouped = expert_compute.run_gemv, expert_compute.run_grouped
        self.last = None

        def run_gemv(*args, **kwargs):
            self.last = gemv(*args, **kwargs)
            return self.last

        def run_grouped(module, fn, hidden, *args, **kwargs):
            before, self.last = self.decodes, None
            out = grouped(module, fn, hidden, *args, **kwargs)
            self.rows.append((hidden.shape[0], self.last is not None, self.decodes - before))
            return out

        monkeypatch.setattr(expert_compute, "run_gemv", run_gemv)
        monkeypatch.setattr(expert_compute, "run_grouped", run_grouped)

    def _counted(self, real):
        def counted(*args, **kwargs):
            self.decodes += 1
            return real(*args, **kwargs)
        return counted


def _decode(engine: Engine, steps: int = 5) -> tuple[list[int], torch.Tensor]:
    """Greedy tokens of a batch-1 decode (prefill, then one token a step) and the head's logits of each call."""
    logits = []
    handle = engine.model.get_output_embeddings().register_forward_hook(
        lambda _m, _a, out: logits.append(out[:, -1].float().cpu()))
    try:
        ids = torch.tensor([PROMPT])
        out = engine.generate_requests([engine.request(row, GenerateConfig(max_new_tokens=steps, ignore_eos=True))
                                        for row in ids.tolist()])
    finally:
        handle.remove()
    return list(out[0].token_ids), torch.cat(logits)


def _both_paths(engine: Engine, monkeypatch, calls: Calls, steps: int = 5):
    """The decode with the GEMV path on, then off; and how many of ``calls`` the first made."""
    gemv = _decode(engine, steps)
    first = len(calls.rows)
    with monkeypatch.context() as m:
        m.setattr(expert_compute, "GEMV_TOKENS", 0)
        stacked = _decode(engine, steps)
    return gemv, stacked, first


@pytest.mark.parametrize("model_type", list(GEMV_SHAPES))
def test_batch1_decode_by_gemv_equals_the_stacked_decode(stores, monkeypatch, model_type):
    engine = Engine.open(stores[model_type], device="cpu", experts="routed")
    calls = Calls(monkeypatch)
    (tokens, logits), (want_tokens, want_logits), first = _both_paths(engine, monkeypatch, calls)
    gemv_calls = calls.rows[:first]
    assert sum(r == 1 for r, _, _ in gemv_calls) >= 4 * len(engine.experts.layers), "no one-token decode steps"
    assert all(used and d == 0 for r, used, d in gemv_calls if r == 1), "a one-row call fell back or decoded"
    assert not any(used for _, used, _ in calls.rows[first:]), "GEMV_TOKENS = 0 still ran it"
    assert tokens == want_tokens
    assert (logits - want_logits).abs().max().item() <= 1e-5 * want_logits.abs().max().item()
    engine.close()


@pytest.mark.parametrize("model_type", list(GEMV_SHAPES))
def test_a_call_with_more_rows_takes_the_stacked_path(stores, monkeypatch, model_type):
    engine = Engine.open(stores[model_type], device="cpu", experts="routed", expert_prefetch=False)
    calls = Calls(monkeypatch)
    ids = torch.randint(100, 1000, (1, 40))  # 40 tokens x top-k rows over at most 16 experts: > 4 rows somewhere
    engine.forward(ids)
    assert calls.rows and all(r == 40 and not used and d > 0 for r, used, d in calls.rows)
    engine.close()


@pytest.mark.parametrize("case", list(FALLBACK))
def test_a_store_the_path_cannot_run_falls_back(tmp_path, real_tokenizer, monkeypatch, case):
    model_type, method, over = FALLBACK[case]
    store = _store(tmp_path, real_tokenizer, model_type, method, **over)
    engine = Engine.open(store, device="cpu", experts="routed")
    calls = Calls(monkeypatch)
    (tokens, logits), (want_tokens, want_logits), _ = _both_paths(engine, monkeypatch, calls, steps=3)
    assert calls.rows and not any(used for _, used, _ in calls.rows)
    assert tokens == want_tokens and torch.equal(logits, want_logits)
    engine.close()


def _module(kind: str, num: int, dtype: torch.dtype, device: str, double_quant: bool = False):
    """A transformers experts module of ``num`` NF4 experts, hidden 128 (its fused parameters quantized)."""
    torch.manual_seed(0)
    if kind == "mixtral":
        module = MixtralExperts(MixtralConfig(hidden_size=128, intermediate_size=256, num_local_experts=num))
    elif kind == "qwen3_moe":
        module = Qwen3MoeExperts(Qwen3MoeConfig(hidden_size=128, moe_intermediate_size=64, num_experts=num))
    else:  # not gated (up_proj, then the activation alone); a transformers 5 release may not have the type yet
        nemotron = pytest.importorskip("transformers.models.nemotron_h.modeling_nemotron_h")
        config = nemotron.NemotronHConfig(hidden_size=128, moe_intermediate_size=192, n_routed_experts=num)
        module = nemotron.NemotronHExperts(config)
    for name in [n for n, _ in module.named_parameters(recurse=False)]:
        weight = torch.randn_like(getattr(module, name)) * 0.08
        tensors, meta = quantize_experts(QuantSpec(method="nf4", double_quant=double_quant), weight,
                                         transposed=False)
        with torch.device("meta"):
            experts = ExpertWeights(meta, compute_dtype=dtype)
        experts.load_state_dict({k: v.to(device) for k, v in tensors.items()}, assign=True)
        delattr(module, name)
        setattr(module, name, experts)
    return module


ROUTES = {"one-token": [[3, 1]], "two-rows": [[0, 1], [1, 2], [2, 0]], "four-rows": [[0, 1]] * 4,
          "five-rows": [[0, 1]] * 5}


def _stacked(module, hidden, index, weights, monkeypatch):
    """The stacked path's output: the experts decoded to dense weights, transformers' grouped forward."""
    with monkeypatch.context() as m:
        m.setattr(expert_compute, "GEMV_TOKENS", 0)
        return expert_compute.run_grouped(module, expert_compute.grouped_forward(module), hidden, index, weights,
                                          num=len(module.down_proj))


@pytest.mark.parametrize("double_quant", [False, True])
@pytest.mark.parametrize("route", list(ROUTES))
@pytest.mark.parametrize("kind", ["mixtral", "qwen3_moe", "nemotron_h"])
def test_module_output_equals_the_grouped_forward(monkeypatch, kind, route, double_quant):
    module = _module(kind, 4, torch.float32, "cpu", double_quant)
    index = torch.tensor(ROUTES[route])  # [T, k]
    hidden, weights = torch.randn(index.shape[0], 128), torch.rand(index.shape)
    got = expert_compute.run_gemv(module, hidden, index, weights, 4)
    if route == "five-rows":  # over GEMV_TOKENS rows for expert 0: left to the stacked path
        assert got is None
        return
    want = _stacked(module, hidden, index, weights, monkeypatch)
    assert got is not None and got.shape == want.shape and got.dtype == want.dtype
    assert (got - want).abs().max().item() <= 1e-5 * want.abs().max().item()


@pytest.mark.gpu
@pytest.mark.parametrize("route", ["one-token", "two-rows", "four-rows"])
@pytest.mark.parametrize("kind", ["mixtral", "qwen3_moe"])
def test_cuda_bf16_module_output_equals_the_grouped_forward(monkeypatch, kind, route):
    """bf16 on CUDA: bitsandbytes' fused kernel against the decode + grouped matmul, both against fp32 math
    on the same dequantized weights: the fused path is no further from it than bf16 rounding allows."""
    module = _module(kind, 4, torch.bfloat16, "cuda")
    index = torch.tensor(ROUTES[route], device="cuda")
    hidden = torch.randn(index.shape[0], 128, device="cuda", dtype=torch.bfloat16)
    weights = torch.rand(index.shape, device="cuda", dtype=torch.bfloat16)
    calls = Calls(monkeypatch)
    got = expert_compute.run_grouped(module, expert_compute.grouped_forward(module), hidden, index, weights, num=4)
    assert calls.rows == [(index.shape[0], True, 0)]
    want = _stacked(module, hidden, index, weights, monkeypatch)
    exact = _fp32_reference(module, hidden, index, weights)
    scale = exact.abs().max().item()
    assert got.dtype == torch.bfloat16
    assert (got.float() - exact).abs().max().item() <= 2e-2 * scale
    assert (got.float() - want.float()).abs().max().item() <= 2e-2 * scale


def _fp32_reference(module, hidden, index, weights) -> torch.Tensor:
    """Mixtral's per-expert loop in fp32 on the experts' dequantized weights."""
    out = torch.zeros(hidden.shape, dtype=torch.float32, device=hidden.device)
    for t in range(index.shape[0]):
        for slot in range(index.shape[1]):
            e = int(index[t, slot])
            gate, up = (hidden[t].float() @ module.gate_up_proj[e].float().t()).chunk(2)
            y = (module.act_fn(gate) * up) @ module.down_proj[e].float().t()
            out[t] += y * weights[t, slot].float()
    return out


@pytest.mark.gpu
@pytest.mark.parametrize("model_type", list(GEMV_SHAPES))
def test_cuda_bf16_batch1_decode_by_gemv_equals_the_stacked_decode(stores, monkeypatch, model_type):
    # resident_layers=0: a tiny store fits in VRAM, and resident layers never reach the expert pool. The fused
    # kernels (test_expert_fused.py) would take these calls first: this test is of the per-expert path.
    monkeypatch.setattr(expert_compute, "FUSED", False)
    engine = Engine.open(stores[model_type], device="cuda", dtype="bfloat16", experts="routed", resident_layers=0)
    calls = Calls(monkeypatch)
    (tokens, logits), (want_tokens, want_logits), first = _both_paths(engine, monkeypatch, calls)
    assert any(r == 1 for r, _, _ in calls.rows[:first])
    assert all(used and d == 0 for r, used, d in calls.rows[:first] if r == 1)
    # Equal tokens, or where they part, a near-tie the two paths' bf16 rounding may flip (the steps after it
    # see other contexts: only those up to it are compared).
    same = next((i for i, (a, b) in enumerate(zip(tokens, want_tokens)) if a != b), len(tokens))
    diff = (logits[:same + 1] - want_logits[:same + 1]).abs().max().item()
    assert diff <= 3e-2 * want_logits.abs().max().item()
    if same < len(tokens):
        margin = (want_logits[same, want_tokens[same]] - want_logits[same, tokens[same]]).item()
        assert margin <= 2 * diff, (same, margin, diff)
    engine.close()
