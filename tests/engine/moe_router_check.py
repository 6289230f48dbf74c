"""Run by tests/engine/test_moe_router.py in a process of its own with ``TRITON_INTERPRET=1`` (set before Triton defines
the kernel, so it runs on CPU tensors), and by its CUDA test: the fused router (engine/moe_router.py) against the
eager forward of transformers' Qwen3-MoE router, per dtype, shape and renormalization. Prints one JSON line per
case."""

from __future__ import annotations

import json
import types

import torch
from transformers.models.qwen3_moe import modeling_qwen3_moe

from airquant.engine import moe_router as router


def case(dtype: torch.dtype, experts: int, top_k: int, norm: bool, rows: int = 6, hidden: int = 32,
         device: str = "cpu") -> dict:
    torch.manual_seed(experts + top_k)
    config = types.SimpleNamespace(num_experts_per_tok=top_k, num_experts=experts, norm_topk_prob=norm,
                                   hidden_size=hidden)
    module = modeling_qwen3_moe.Qwen3MoeTopKRouter(config).to(device=device, dtype=dtype)
    with torch.no_grad():
        module.weight.normal_(0, 0.5)
    h = torch.randn(2, rows // 2, hidden).to(device=device, dtype=dtype)
    with torch.no_grad():
        want = module(h)
        assert router.fusable(h, module.weight, top_k)
        got = router.FusedRouter(module, module.forward)
        router.FUSED_ROUTER, before = True, router.FUSED_ROUTER
        try:
            got = got(h)
        finally:
            router.FUSED_ROUTER = before
    diff = (got[1].float() - want[1].float()).abs().max().item()
    # Where two probabilities are equal (fp16 logits often are) torch's topk may take either expert, the kernel the
    # lower: the experts agree where they differ by their probabilities, which must be the same, in the same order.
    probs = torch.softmax(want[0], dtype=torch.float, dim=-1)
    return {"dtype": str(dtype), "experts": experts, "top_k": top_k, "norm": norm,
            "logits_equal": torch.equal(got[0], want[0]),
            "experts_equal": torch.equal(probs.gather(1, got[2]), probs.gather(1, want[2])),
            "tied": int((got[2] != want[2]).sum()),
            "weights_dtype": str(got[1].dtype) == str(want[1].dtype), "shapes": got[1].shape == want[1].shape,
            "max_diff": diff, "max_ulps": diff / torch.finfo(dtype).eps}


CASES = [(128, 8, True), (128, 8, False), (60, 4, True), (8, 2, False), (256, 1, True)]

if __name__ == "__main__":
    for dtype in (torch.float32, torch.float16):
        for experts, top_k, norm in CASES:
            print(json.dumps(case(dtype, experts, top_k, norm)), flush=True)
