"""The capability rule with mocked GPUs: T4 (7.5), a consumer Ampere card (8.6), Hopper (9.0), and CPU."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from airquant.engine import capability
from airquant.engine.capability import (
    DtypeNotSupportedError,
    Fp16OverflowError,
    capability_plan,
    compute_dtype,
    guard_overflow,
)
from airquant.quant import kernels
from airquant.quant.kernels import CapabilityError, dtype_supported, parse_capability


def _paths(plan) -> dict[str, str]:
    return dict(plan.kernels)


@pytest.mark.parametrize("cap,stored,dtype,bf16,tma,tq_kernel", [
    ((7, 5), "bfloat16", "float16", False, False, False),  # T4: fp16, no TMA, head 128 too big for 64 KB
    ((7, 5), "float16", "float16", False, False, False),
    ((7, 5), "float32", "float32", False, False, False),
    ((8, 6), "bfloat16", "bfloat16", True, False, True),
    ((8, 0), "bfloat16", "bfloat16", True, False, True),
    ((9, 0), "bfloat16", "bfloat16", True, True, True),
    (None, "float16", "float32", False, False, False),  # CPU
    (None, "bfloat16", "bfloat16", False, False, False),
])
def test_rule_table(cap, stored, dtype, bf16, tma, tq_kernel):
    plan = capability_plan(cap, stored)
    paths = _paths(plan)
    assert plan.dtype == dtype and plan.bf16 == bf16 and plan.tf32 == (cap is not None and cap >= (8, 0))
    assert ("gluon-tma" in paths["int2"]) == tma
    assert paths["tq-attn"].startswith("triton") == tq_kernel
    assert bool(plan.note) == (dtype != stored)
    if cap is not None:
        assert "gluon-ldg" in paths["int2"] and "triton packed GEMM" in paths["gptq/awq"]
    else:
        assert all("torch" in p or "cpu" in p for p in paths.values())


def test_t4_runs_small_heads_in_the_kernel():
    assert _paths(capability_plan((7, 5), "bfloat16", head_dim=64))["tq-attn"].startswith("triton")
    assert "torch ops" in _paths(capability_plan((7, 5), "bfloat16", head_dim=128))["tq-attn"]


def test_describe_names_dtype_and_paths():
    text = "\n".join(capability_plan((7, 5), "bfloat16").describe())
    assert "compute   : float16 (sm_75; store bfloat16)" in text and "cast per layer" in text
    assert "not on this GPU" in text and "kernel    : int2" in text


def test_requested_dtype_wins_except_bf16_before_ampere():
    assert capability_plan((7, 5), "bfloat16", requested="float32").dtype == "float32"
    assert capability_plan((8, 6), "float16", requested="bfloat16").dtype == "bfloat16"
    with pytest.raises(DtypeNotSupportedError, match="--dtype float16"):
        capability_plan((7, 5), "bfloat16", requested="bfloat16")


def test_forced_capability_drives_compute_dtype(monkeypatch, caplog):
    """AIRQUANT_FORCE_CAPABILITY (benchmarks/t4_profile.py on the H200) plans a CUDA device as that GPU."""
    monkeypatch.setenv(kernels.FORCE_ENV, "7.5")
    assert kernels.device_capability("cuda") == (7, 5)
    assert kernels.device_capability("cpu") is None  # a CPU device stays a CPU device
    capability._ANNOUNCED.clear()
    with caplog.at_level("INFO", logger="airquant.engine.capability"):
        assert compute_dtype("bfloat16", None, torch.device("cuda", 0)) == torch.float16
        assert compute_dtype("bfloat16", None, torch.device("cuda", 0)) == torch.float16
    said = [r for r in caplog.records if "float16" in r.getMessage()]
    assert len(said) == 1 and "AIRQUANT_FORCE_CAPABILITY" in said[0].getMessage()  # once per process
    monkeypatch.setenv(kernels.FORCE_ENV, "9.0")
    assert compute_dtype("bfloat16", None, torch.device("cuda", 0)) == torch.bfloat16
    assert compute_dtype("float16", None, torch.device("cpu")) == torch.float32


@pytest.mark.parametrize("text,cap", [("7.5", (7, 5)), ("sm_86", (8, 6)), ("90", (9, 0)), (" 8.9 ", (8, 9))])
def test_parse_capability(text, cap):
    assert parse_capability(text) == cap


def test_bad_forced_capability_names_the_fix(monkeypatch):
    monkeypatch.setenv(kernels.FORCE_ENV, "turing")
    with pytest.raises(CapabilityError, match="7.5, 8.6 or 9.0"):
        kernels.device_capability("cuda")


def test_bf16_kernels_take_the_torch_path_before_ampere():
    """The fallback: use_triton is False for bf16 inputs on sm_75 (Triton cannot lower a bf16 dot there), so
    the modules dequantize and call torch's matmul (the reference path every quant test checks)."""
    assert not dtype_supported(torch.bfloat16, (7, 5)) and dtype_supported(torch.float16, (7, 5))
    assert dtype_supported(torch.bfloat16, (8, 0)) and not dtype_supported(torch.float16, None)
    assert kernels.shared_per_block((7, 5)) == 65536 and kernels.shared_per_block((8, 7)) == 166912
    assert kernels.shared_per_block((12, 0)) == kernels.SHARED_PER_BLOCK[(9, 0)]


class _Layer(nn.Module):
    def __init__(self, scale: float):
        super().__init__()
        self.scale = scale

    def forward(self, x):
        return (x * self.scale,)  # decoder layers return tuples


class _Model(nn.Module):
    def __init__(self, scales):
        super().__init__()
        self.layers = nn.ModuleList(_Layer(s) for s in scales)

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)[0]
        return x


def test_overflow_guard_names_the_layer_and_the_fix():
    model = _Model([1.0, 1000.0, 1000.0]).half()
    guard = guard_overflow(model, model.layers, torch.float16)
    x = torch.full((2, 4), 60.0, dtype=torch.float16)  # 60 -> 60 000 (fits) -> 6e7 (inf)
    with pytest.raises(Fp16OverflowError, match=r"layer 2 .*--dtype float32"):
        model(x)
    assert guard is not None and not guard.flags


def test_overflow_guard_checks_the_first_pass_only():
    model = _Model([1.0, 2.0])
    guard_overflow(model, model.layers, torch.float16)
    model(torch.ones(2, dtype=torch.float16))  # finite: passes, and the hooks go away
    assert not model._forward_hooks and not any(layer._forward_hooks for layer in model.layers)
    assert math.isinf(float(model(torch.full((1,), 60000.0, dtype=torch.float16))[0]))  # not checked again
    assert guard_overflow(model, model.layers, torch.bfloat16) is None


@pytest.mark.slow
def test_fp16_compute_matches_fp32_on_the_default_model(default_store, eval_data):
    """fp16 compute (what a T4 gets for this bf16 store) against fp32 on CPU: PPL on a quick slice within 0.5 %."""
    from airquant.engine.runner import Engine
    from airquant.eval.perplexity import run_perplexity

    ppl = {}
    for dtype in ("float16", "bfloat16", "float32"):
        engine = Engine.open(default_store, device="cpu", dtype=dtype, resident=True)
        ppl[dtype] = run_perplexity(engine, limit_tokens=1024, max_length=256, stride=128).ppl
        engine.close()
    assert abs(ppl["float16"] / ppl["float32"] - 1) < 0.005, ppl
    assert abs(ppl["bfloat16"] / ppl["float32"] - 1) < 0.01, ppl  # bf16 has 3 fewer mantissa bits than fp16


def test_plan_prints_the_compute_line(monkeypatch):
    from airquant.engine.capability import compute_line

    monkeypatch.setenv(kernels.FORCE_ENV, "7.5")
    assert compute_line("bfloat16", None, "auto").startswith("compute   : float16 (sm_75; store bfloat16)")
    assert compute_line("bfloat16", None, "cpu") == "compute   : bfloat16 (cpu; store bfloat16)"


def test_the_tq_attention_path_names_the_history_kernel_and_its_switch(monkeypatch):
    """Ampere and later with head size 128: the Gluon history kernel for K4/V2 decode is named, as chosen
    (AIRQUANT_TQ_HISTORY) or as the switch that turns it on; a T4 or another head size never names it."""
    monkeypatch.delenv("AIRQUANT_TQ_HISTORY", raising=False)
    monkeypatch.setattr("airquant.kv.triton_kernel.HISTORY_KERNEL", "triton")
    assert _paths(capability_plan((9, 0), "bfloat16"))["tq-attn"].endswith("AIRQUANT_TQ_HISTORY=gluon")
    monkeypatch.setenv("AIRQUANT_TQ_HISTORY", "gluon")
    assert _paths(capability_plan((8, 0), "bfloat16"))["tq-attn"].endswith("gluon (tensor cores)")
    assert "gluon" not in _paths(capability_plan((7, 5), "bfloat16", head_dim=64))["tq-attn"]
    assert "gluon" not in _paths(capability_plan((9, 0), "bfloat16", head_dim=64))["tq-attn"]
