"""Run by tests/engine/test_rope.py in a process of its own with ``TRITON_INTERPRET=1`` (set before Triton defines the
kernel, so it runs on CPU tensors): the fused rotary kernel (engine/rope.py) against transformers' own
``apply_rotary_pos_emb``, per dtype and layout. Prints one JSON line per case."""

from __future__ import annotations

import json

import torch
from transformers.models.qwen3_moe import modeling_qwen3_moe

from airquant.engine import rope


def case(dtype: torch.dtype, transposed: bool, b: int = 2, hq: int = 4, hk: int = 2, t: int = 3, d: int = 64,
         device: str = "cpu") -> dict:
    torch.manual_seed(0)
    if transposed:  # as attention makes them: [B, T, H, D] viewed, then transposed
        q = (torch.randn(b, t, hq, d) * 2).to(dtype).transpose(1, 2)
        k = (torch.randn(b, t, hk, d) * 2).to(dtype).transpose(1, 2)
    else:
        q, k = (torch.randn(b, hq, t, d) * 2).to(dtype), (torch.randn(b, hk, t, d) * 2).to(dtype)
    angle = torch.randn(b, t, d // 2).repeat(1, 1, 2) * 3
    cos, sin = angle.cos().to(dtype), angle.sin().to(dtype)
    q, k, cos, sin = (x.to(device) for x in (q, k, cos, sin))  # a transposed view stays one
    want_q, want_k = modeling_qwen3_moe.apply_rotary_pos_emb(q, k, cos, sin)
    assert rope.applies(q, k, cos, sin)
    got_q, got_k = rope.rotate(q, k, cos, sin)
    return {"dtype": str(dtype), "transposed": transposed, "equal": torch.equal(got_q, want_q) and
            torch.equal(got_k, want_k), "max_diff": max((got_q.float() - want_q.float()).abs().max().item(),
                                                        (got_k.float() - want_k.float()).abs().max().item()),
            "strides_as_eager": got_q.stride() == want_q.stride() or got_q.is_contiguous() == want_q.is_contiguous()}


if __name__ == "__main__":
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        for transposed in (False, True):
            print(json.dumps(case(dtype, transposed)), flush=True)
