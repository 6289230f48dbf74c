"""engine/rope.py: transformers' standard rotary embedding of query and key as one kernel, equal to the eager ops.

The kernel runs on CPU under Triton's interpreter in a process of its own (``TRITON_INTERPRET=1`` must be set
before Triton defines it: rope_check.py): fp32 and fp16 equal the eager result bit for bit, row-major and
transposed; bfloat16 only on the GPU (the interpreter casts to bfloat16 by truncation).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers.models.gpt_oss import modeling_gpt_oss
from transformers.models.llama import modeling_llama
from transformers.models.qwen3_moe import modeling_qwen3_moe

from airquant.engine import rope
from airquant.engine.rope import FusedRope, fuse_rope, standard_rotary

REPO = Path(__file__).resolve().parents[2]


def test_only_the_standard_functions_are_recognised():
    assert standard_rotary(modeling_llama) and standard_rotary(modeling_qwen3_moe)
    assert not standard_rotary(modeling_gpt_oss)  # its own rotary (split halves, no rotate_half)
    assert not standard_rotary(rope)  # no such functions at all


def test_a_model_gets_the_fused_call_only_when_on_and_computes_as_before(tiny_llama, monkeypatch):
    from transformers import AutoModelForCausalLM

    current = modeling_llama.apply_rotary_pos_emb  # an engine opened earlier in the process may have wrapped it
    monkeypatch.setattr(modeling_llama, "apply_rotary_pos_emb", getattr(current, "original", current))  # restored
    monkeypatch.setattr(rope, "FUSED_ROPE", False)
    model = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()
    ids = torch.tensor([[1, 5, 9, 2, 7]])
    with torch.no_grad():
        want = model(ids).logits
    assert fuse_rope(model) == 0 and not isinstance(modeling_llama.apply_rotary_pos_emb, FusedRope)  # off
    monkeypatch.setattr(rope, "FUSED_ROPE", True)
    assert fuse_rope(model) == 1 and isinstance(modeling_llama.apply_rotary_pos_emb, FusedRope)
    assert fuse_rope(model) == 0  # once
    assert standard_rotary(modeling_llama)  # still recognised through the wrapper
    with torch.no_grad():  # CPU tensors: the wrapper calls the original
        assert torch.equal(model(ids).logits, want)


def _interpreted() -> list[dict]:
    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(REPO)}
    proc = subprocess.run([sys.executable, str(Path(__file__).with_name("rope_check.py"))], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]


def test_the_kernel_equals_the_eager_rotation():
    rows = _interpreted()
    checked = [r for r in rows if r["dtype"] != "torch.bfloat16"]
    assert len(checked) == 4 and {r["transposed"] for r in checked} == {False, True}
    for r in checked:
        assert r["equal"] and r["strides_as_eager"], r


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_cuda_kernel_equals_the_eager_rotation(dtype):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from tests.engine.rope_check import case

    for transposed in (False, True):
        r = case(dtype, transposed, device="cuda")
        assert r["equal"] and r["strides_as_eager"], r
