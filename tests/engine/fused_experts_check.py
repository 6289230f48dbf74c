"""Run by tests/engine/test_expert_fused.py in a process of its own, with ``TRITON_INTERPRET=1`` set before Triton
defines the kernels (so they run on CPU tensors): a batch-1 routed decode of tiny NF4 or int2 MoE stores with the
fused kernels (``expert_compute.run_fused``) and with them off (per-expert ``run_gemv`` or the stacked decode), fp32;
a hub GPTQ or AWQ checkpoint's (TYPE:gptq, TYPE:awq) stacked at the split.
Prints one JSON line per store: greedy tokens, the largest logit difference, and how many calls each path made."""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

import torch

from airquant.config import GenerateConfig
from airquant.engine.moe import compute as expert_compute
from airquant.engine.runner import Engine
from airquant.models import resolve
from airquant.quant import QuantSpec
from airquant.store.quantize import make_transform
from airquant.store.split import split
from tests.zoo import make_model

# Every expert matrix's in_features a multiple of NF4's blocksize (64), as the fused kernels need.
SHAPES = {"mixtral": dict(hidden_size=64, intermediate_size=128),
          "qwen3_moe": dict(hidden_size=64, moe_intermediate_size=64),
          "gpt_oss": dict(hidden_size=64, intermediate_size=64),
          "deepseek_v3": dict(hidden_size=64, moe_intermediate_size=64, intermediate_size=128)}
PROMPT = [17, 254, 1033, 88, 512, 731, 42, 9, 300, 77, 4001, 12]  # 12 tokens: the prefill goes grouped


def decode(engine: Engine, steps: int) -> tuple[list[int], torch.Tensor]:
    logits = []
    hook = engine.model.get_output_embeddings().register_forward_hook(
        lambda _m, _a, out: logits.append(out[:, -1].float().cpu().clone()))
    try:
        out = engine.generate_requests([engine.request(PROMPT, GenerateConfig(max_new_tokens=steps, ignore_eos=True))])
    finally:
        hook.remove()
    return list(out[0].token_ids), torch.cat(logits)


def check(model_type: str, folder: Path, tokenizer_dir: str, double_quant: bool, method: str = "nf4") -> dict:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    if method in ("gptq", "awq"):  # a hub checkpoint (GPTQ: act-order groups): its experts stacked at the split
        from tests.quant.checkpoints import write_synthetic_gptq_moe_checkpoint

        model = write_synthetic_gptq_moe_checkpoint(folder / "model", tokenizer, model_type, method=method,
                                                    desc_act=method == "gptq", **SHAPES[model_type]).path
        spec = None
    else:
        model = make_model(folder / "model", tokenizer, model_type, **SHAPES[model_type])
        spec = QuantSpec(method="int2", group=16) if method == "int2" else \
            QuantSpec(method="nf4", double_quant=double_quant)
    source = resolve(str(model))
    transform, record = make_transform(source, spec)
    split(source, folder / "store", dtype="float32", quant=record, transform=transform, progress=False)
    row = {"type": model_type, "method": method, "double_quant": double_quant}
    from airquant.engine.moe import pool

    pool.DIRECT = False  # the pool's copy path with the fused kernels; direct reads: check_direct
    for mode in ("routed", "whole", "routed_chunks"):
        # routed_chunks: a prefill's fused calls in chunks of a few tokens (pool._run_fused_chunks), each
        # chunk's experts brought into the slots on their own
        rows, expert_compute.FUSED_WHOLE_ROWS = expert_compute.FUSED_WHOLE_ROWS, \
            1 if mode == "routed_chunks" else expert_compute.FUSED_WHOLE_ROWS
        engine = Engine.open(folder / "store", device="cpu", experts=mode.split("_")[0], resident_layers=0,
                             expert_cache_gb=0.0 if mode == "routed_chunks" else None)
        counts = {"fused": 0}
        real = expert_compute.run_fused

        def counted(*args, **kwargs):
            counts["fused"] += 1
            return real(*args, **kwargs)

        expert_compute.run_fused = counted
        tokens, logits = decode(engine, 4)
        expert_compute.run_fused, expert_compute.FUSED = real, False
        want_tokens, want_logits = decode(engine, 4)
        expert_compute.FUSED, expert_compute.FUSED_WHOLE_ROWS = True, rows
        moe_layers = sum(1 for e in engine.manifest.shards.values() if e.experts)
        engine.close()
        scale = want_logits.abs().max().item()
        row[mode] = {"fused_calls": counts["fused"], "layers": moe_layers, "tokens_equal": tokens == want_tokens,
                     "max_rel_diff": (logits - want_logits).abs().max().item() / scale}
    row["direct"] = check_direct(folder / "store")
    return row


def check_direct(store: Path) -> dict:
    """Direct reads (pool.DIRECT: the tiered kernels read each expert from the hot set or the RAM tier) against
    the per-expert path; the hot set refreshed every 2 passes, so that later steps read some experts from it."""
    from airquant.engine.moe import direct, pool

    calls = {"direct": 0}
    real = direct.DirectReads.run

    def counted(self, *args, **kwargs):
        out = real(self, *args, **kwargs)
        calls["direct"] += out is not None
        return out

    old = direct.REFRESH_PASSES, pool.DIRECT
    direct.DirectReads.run, direct.REFRESH_PASSES, pool.DIRECT = counted, 2, True
    try:
        # a cache of 4 experts: the hot set (CPU plans give none by default)
        engine = Engine.open(store, device="cpu", experts="routed", resident_layers=0, expert_cache_gb=1e-9)
        cache_bytes = 4 * engine.experts.plan.slot_bytes
        engine.close()
        engine = Engine.open(store, device="cpu", experts="routed", resident_layers=0,
                             expert_cache_gb=cache_bytes / 1e9)
        tokens, logits = decode(engine, 6)
        report = engine.experts.report()
        engine.close()
    finally:
        direct.DirectReads.run, (direct.REFRESH_PASSES, pool.DIRECT) = real, old
    expert_compute.FUSED = False
    engine = Engine.open(store, device="cpu", experts="routed", resident_layers=0)
    want_tokens, want_logits = decode(engine, 6)
    engine.close()
    expert_compute.FUSED = True
    return {"direct_calls": calls["direct"], "tokens_equal": tokens == want_tokens, "report": report,
            "max_rel_diff": (logits - want_logits).abs().max().item() / want_logits.abs().max().item()}


if __name__ == "__main__":
    tokenizer_dir = sys.argv[1]
    for spec in sys.argv[2:]:  # TYPE, TYPE:dq (NF4 double quant), TYPE:int2, TYPE:gptq or TYPE:awq
        model_type, _, option = spec.partition(":")
        with tempfile.TemporaryDirectory() as tmp:
            print(json.dumps(check(model_type, Path(tmp), tokenizer_dir, option == "dq",
                                   option if option in ("int2", "gptq", "awq") else "nf4")), flush=True)
