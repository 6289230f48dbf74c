"""engine/moe_router.py: transformers' standard top-k router with its softmax, top-k and renormalization in one Triton
kernel; the kernel checked under Triton's interpreter on the CPU (fp32, fp16) and on CUDA (GPU test, bf16 too)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers.models.mixtral import modeling_mixtral
from transformers.models.olmoe import modeling_olmoe
from transformers.models.qwen3_moe import modeling_qwen3_moe

from airquant.engine import moe_router as router
from airquant.engine.moe_router import FusedRouter, fuse_routers, standard_router

REPO = Path(__file__).resolve().parents[2]


def test_only_the_standard_forward_is_recognised():
    assert standard_router(modeling_qwen3_moe.Qwen3MoeTopKRouter) and standard_router(modeling_olmoe.OlmoeTopKRouter)
    assert not standard_router(modeling_mixtral.MixtralTopKRouter)  # its softmax after the top-k, no renormalization
    assert not standard_router(torch.nn.Linear)


def test_a_model_gets_the_fused_call_only_when_on_and_computes_as_before(tmp_path, real_tokenizer, monkeypatch):
    from transformers import AutoModelForCausalLM

    from tests.zoo import make_model

    model = AutoModelForCausalLM.from_pretrained(make_model(tmp_path / "m", real_tokenizer, "qwen3_moe"),
                                                 dtype=torch.float32).eval()
    ids = torch.tensor([[1, 5, 9, 2, 7]])
    with torch.no_grad():
        want = model(ids).logits
    monkeypatch.setattr(router, "FUSED_ROUTER", False)
    assert fuse_routers(model) == 0
    monkeypatch.setattr(router, "FUSED_ROUTER", True)
    routers = sum(standard_router(type(m)) for m in model.modules())
    assert routers > 0 and fuse_routers(model) == routers and fuse_routers(model) == 0  # once
    assert all(isinstance(m.forward, FusedRouter) for m in model.modules() if standard_router(type(m)))
    with torch.no_grad():  # CPU tensors: the wrapper calls the module's own forward
        assert torch.equal(model(ids).logits, want)


def test_the_kernel_routes_as_the_eager_forward():
    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(REPO)}
    proc = subprocess.run([sys.executable, str(Path(__file__).with_name("moe_router_check.py"))], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert len(rows) == 10 and sum(r["tied"] for r in rows) < 4  # ties are rare, even in fp16
    for r in rows:
        assert r["logits_equal"] and r["experts_equal"] and r["weights_dtype"] and r["shapes"], r
        assert r["max_ulps"] <= 2, r


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_cuda_kernel_routes_as_the_eager_forward(dtype):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from tests.engine.moe_router_check import CASES, case

    for experts, top_k, norm in CASES:
        r = case(dtype, experts, top_k, norm, rows=64, device="cuda")
        assert r["logits_equal"] and r["experts_equal"] and r["weights_dtype"] and r["shapes"], r
        assert r["max_ulps"] <= 2, r
