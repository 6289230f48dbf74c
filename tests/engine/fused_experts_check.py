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


def build_store(model_type: str, folder: Path, tokenizer_dir: str, double_quant: bool, method: str = "nf4") -> Path:
    """A tiny store of ``model_type`` in ``folder``: NF4, int2, or a hub GPTQ/AWQ checkpoint stacked at the split."""
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
    return folder / "store"


def check(model_type: str, folder: Path, tokenizer_dir: str, double_quant: bool, method: str = "nf4") -> dict:
    build_store(model_type, folder, tokenizer_dir, double_quant, method)
    row = {"type": model_type, "method": method, "double_quant": double_quant}
    from airquant.engine.moe import pool

    pool.DIRECT = False  # the pool's copy path with the fused kernels; direct reads: check_direct
    for mode in ("routed", "whole", "routed_chunks"):
        # routed_chunks: a prefill's fused calls in chunks of a few tokens (pool._run_fused_chunks), each
        # chunk's experts brought into the slots on their own
        rows, expert_compute.POOL_CHUNK_ROWS = expert_compute.POOL_CHUNK_ROWS, \
            1 if mode == "routed_chunks" else expert_compute.POOL_CHUNK_ROWS
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
        expert_compute.FUSED, expert_compute.POOL_CHUNK_ROWS = True, rows
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
    from airquant.engine.moe import direct, pool, sizing

    calls = {"direct": 0}
    real = direct.DirectReads.run

    def counted(self, *args, **kwargs):
        out = real(self, *args, **kwargs)
        calls["direct"] += out is not None
        return out

    old = direct.REFRESH_PASSES, pool.DIRECT
    old_spec = sizing.SPECULATE
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
        # speculative reads (sizing.SPECULATE on; auto never guesses on the CPU): each layer's experts guessed
        # from its input, copied into slots of their own and read from there where the guess was right
        sizing.SPECULATE = True
        engine = Engine.open(store, device="cpu", experts="routed", resident_layers=0,
                             expert_cache_gb=cache_bytes / 1e9)
        spec_tokens, spec_logits = decode(engine, 6)
        spec_report = engine.experts.report()
        engine.close()
    finally:
        direct.DirectReads.run, (direct.REFRESH_PASSES, pool.DIRECT) = real, old
        sizing.SPECULATE = old_spec
    expert_compute.FUSED = False
    engine = Engine.open(store, device="cpu", experts="routed", resident_layers=0)
    want_tokens, want_logits = decode(engine, 6)
    engine.close()
    expert_compute.FUSED = True
    scale = want_logits.abs().max().item()
    return {"direct_calls": calls["direct"], "tokens_equal": tokens == want_tokens, "report": report,
            "max_rel_diff": (logits - want_logits).abs().max().item() / scale,
            "spec": {"tokens_equal": spec_tokens == want_tokens, "report": spec_report,
                     "max_rel_diff": (spec_logits - want_logits).abs().max().item() / scale}}


def check_copied(model_type: str, folder: Path, tokenizer_dir: str, method: str = "nf4") -> dict:
    """Copied reads (pool ``_run_copied``, every eligible call: ``sizing.COPY_READS_MIN_BYTES`` 0; no cache): each
    decode call's experts copied into working slots in two parts and read there by the tiered kernels, each
    top-k column's down projection on its own, against the per-expert path (fused kernels off): one request, then
    three decoded together."""
    from airquant.engine.moe import pool, sizing

    store = build_store(model_type, folder, tokenizer_dir, False, method)
    calls = {"copied": 0}
    real = pool.ExpertPool._run_copied

    def counted(self, *args, **kwargs):
        calls["copied"] += 1
        return real(self, *args, **kwargs)

    def batch(engine: Engine) -> list[list[int]]:  # three prompts decoded together: calls of 3 tokens
        requests = [engine.request(PROMPT[:n], GenerateConfig(max_new_tokens=4, ignore_eos=True)) for n in (12, 7, 9)]
        return [list(o.token_ids) for o in engine.generate_requests(requests)]

    old = sizing.COPY_READS_MIN_BYTES, pool.DIRECT
    pool.ExpertPool._run_copied, sizing.COPY_READS_MIN_BYTES, pool.DIRECT = counted, 0, True
    try:
        engine = Engine.open(store, device="cpu", experts="routed", resident_layers=0, expert_cache_gb=0.0)
        tokens, logits = decode(engine, 4)
        report = engine.experts.report()
        layers = sum(1 for e in engine.manifest.shards.values() if e.experts)
        single = calls["copied"]
        batched = batch(engine)
        engine.close()
    finally:
        pool.ExpertPool._run_copied, (sizing.COPY_READS_MIN_BYTES, pool.DIRECT) = real, old
    expert_compute.FUSED = False
    engine = Engine.open(store, device="cpu", experts="routed", resident_layers=0)
    want_tokens, want_logits = decode(engine, 4)
    want_batched = batch(engine)
    engine.close()
    expert_compute.FUSED = True
    return {"type": model_type, "method": method, "copied_calls": single, "layers": layers,
            "report": {k: v for k, v in report.items() if k != "direct"}, "direct": report.get("direct"),
            "tokens_equal": tokens == want_tokens,
            "max_rel_diff": (logits - want_logits).abs().max().item() / want_logits.abs().max().item(),
            "batch3_copied_calls": calls["copied"] - single, "batch3_tokens_equal": batched == want_batched}


def check_blocks(double_quant: bool, device: str = "cpu") -> dict:
    """The grouped NF4 kernels (``nf4_moe.up``/``down`` over stacked buffers) at every block width a call may take
    (``nf4_moe.block_rows``: 16, 64, 128 rows of one expert a block) against the dense product of the decoded
    experts, fp32: 40 tokens routed to 2 of 4 experts (20 rows an expert on average, 33 at most here)."""
    from airquant.quant.experts import ExpertWeights, quantize_experts
    from airquant.quant.kernels import nf4_moe

    torch.manual_seed(0)
    experts, hidden, inter, tokens, top_k = 4, 64, 128, 40, 2
    mats = {}
    for name, (n, k) in (("up", (2 * inter, hidden)), ("down", (hidden, inter))):
        tensors, meta = quantize_experts(QuantSpec(method="nf4", double_quant=double_quant),
                                         torch.randn(experts, n, k) * 0.1, transposed=False)
        with torch.device("meta"):
            module = ExpertWeights(meta, compute_dtype=torch.float32)
        module.load_state_dict(tensors, assign=True)
        module.to(device)
        mats[name] = (module, nf4_moe.stacked_operand({s: getattr(module, s) for s in module.suffixes}, n, k,
                                                      module.one[0].blocksize, double_quant))
    x = torch.randn(tokens, hidden)
    ids = torch.stack([torch.randperm(experts)[:top_k] for _ in range(tokens)])
    ids[:30, 0] = 1  # one expert with more rows than a 16-row block
    ids[:30, 1] = torch.where(ids[:30, 1] == 1, 2, ids[:30, 1])
    weights = torch.softmax(torch.randn(tokens, top_k), -1)
    x, ids, weights = x.to(device), ids.to(device), weights.to(device)
    up_w, down_w = (mats[m][0].stacked() for m in ("up", "down"))  # [E, n, k] decoded
    h_ref = torch.stack([torch.stack([up_w[ids[t, j]] @ x[t] for j in range(top_k)]) for t in range(tokens)])
    h_ref = h_ref.reshape(tokens * top_k, -1)
    act = h_ref[:, :inter].contiguous()  # the down projection's input: any [P, inter] rows
    out_ref = torch.stack([sum(weights[t, j] * (down_w[ids[t, j]] @ act[t * top_k + j]) for j in range(top_k))
                           for t in range(tokens)])
    row = {"double_quant": double_quant}
    for width in (nf4_moe.BLOCK_M, *nf4_moe.BLOCK_M_WIDE):
        pairs = nf4_moe.sort_pairs(ids, experts, width)
        h = nf4_moe.up(x, ids, mats["up"][1], pairs)
        out = nf4_moe.down(act, ids, weights, mats["down"][1], torch.float32, pairs)
        row[str(width)] = {"up": (h - h_ref).abs().max().item() / h_ref.abs().max().item(),
                           "down": (out - out_ref).abs().max().item() / out_ref.abs().max().item()}
    row["chosen"] = [nf4_moe.block_rows(r) for r in (1, 16, 17, 64, 65, 128, 500)]
    return row


if __name__ == "__main__":
    tokenizer_dir = sys.argv[1]
    # TYPE, TYPE:dq (NF4 double quant), TYPE:int2, TYPE:gptq, TYPE:awq; blocks[:dq]; copied:TYPE[:int2|gptq|awq]
    for spec in sys.argv[2:]:
        model_type, _, option = spec.partition(":")
        if model_type == "blocks":
            print(json.dumps(check_blocks(option == "dq")), flush=True)
            continue
        if model_type == "copied":
            model_type, _, method = option.partition(":")
            with tempfile.TemporaryDirectory() as tmp:
                print(json.dumps(check_copied(model_type, Path(tmp), tokenizer_dir, method or "nf4")), flush=True)
            continue
        with tempfile.TemporaryDirectory() as tmp:
            print(json.dumps(check(model_type, Path(tmp), tokenizer_dir, option == "dq",
                                   option if option in ("int2", "gptq", "awq") else "nf4")), flush=True)
