"""Routed NF4 experts computed by the fused kernels straight from the pool (expert_compute.run_fused,
quant/kernels/nf4_moe) and copied by one kernel from the pinned RAM tier (engine/moe/uva_copy).

On the CPU the kernels run under Triton's interpreter, in a process of their own (``TRITON_INTERPRET=1`` must be
set before Triton defines them): a batch-1 routed decode of tiny NF4 stores of four families (gated and
gpt-oss's biased, clamped experts; plain and double-quant absmax) equals the same decode with the fused path off
(per-expert bitsandbytes matmul or the stacked decode) within fp32 rounding, greedy tokens equal, every MoE layer
of every decode step computed by the fused path. On CUDA the same in bf16 at the module level, and the gather
copy against the copy engine. int2, GPTQ and AWQ experts take their fused GEMV at up to 8 tokens a call (the same
decode of the same stores in int2; GPTQ and AWQ experts of a hub checkpoint, stacked at the split).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.conftest import REPO, TOKENIZER_DIR, interpreter_env, run_interpreted
from tests.engine.test_expert_gemv import stores  # noqa: F401 - the tiny NF4 stores fixture

CHECK = Path(__file__).with_name("fused_experts_check.py")


def _interpreted(*args: str, timeout: int = 900) -> list[dict]:
    pytest.importorskip("triton")
    proc = subprocess.run([sys.executable, str(CHECK), str(TOKENIZER_DIR), *args], cwd=REPO, env=interpreter_env(),
                          capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]


@pytest.mark.slow
def test_fused_decode_equals_the_per_expert_decode():
    rows = _interpreted("mixtral", "qwen3_moe:dq", "gpt_oss", "deepseek_v3:dq")
    assert [r["type"] for r in rows] == ["mixtral", "qwen3_moe", "gpt_oss", "deepseek_v3"]
    for r in rows:
        # routed: every MoE layer of the one-token steps went fused, and the 12-token prefill too (over
        # FUSED_TOKENS: the grouped kernel from the pool's slots, pool._run_fused_chunks); whole layers: the
        # prefill too (sorted into grouped blocks), and every step
        assert r["routed"]["fused_calls"] >= 4 * r["routed"]["layers"], r
        assert r["whole"]["fused_calls"] >= 4 * r["whole"]["layers"], r
        # the prefill in chunks of num / top_k tokens (no cache: every chunk copies its experts again)
        assert r["routed_chunks"]["fused_calls"] >= 6 * r["routed"]["layers"], r
        for mode in ("routed", "whole", "routed_chunks", "direct"):
            assert r[mode]["tokens_equal"], r
            assert r[mode]["max_rel_diff"] <= 1e-5, r
        # direct reads (engine/moe/direct.py): every one-token step of every MoE layer (gpt-oss's bias rows read
        # from the image too), some pairs read from the hot set after its first refresh
        direct = r["direct"]
        assert direct["direct_calls"] >= 5 * r["routed"]["layers"], r
        assert direct["report"]["direct"]["hot_experts"] == 4 and direct["report"]["direct"]["direct_hits"] > 0, r
        # speculative reads (sizing.SPECULATE): the same tokens and logits; every one-token step guessed, bytes
        # copied for the guesses not in the hot set
        spec = direct["spec"]
        assert spec["tokens_equal"] and spec["max_rel_diff"] <= 1e-5, r
        assert spec["report"]["direct"]["spec_calls"] >= 4 * r["routed"]["layers"], r
        assert spec["report"]["direct"]["spec_bytes_copied"] > 0, r


def test_copied_reads_decode_as_the_per_expert_path():
    """Copied reads (engine/moe/pool.py ``_run_copied``, forced for every call): each one-token call's experts copied
    into working slots in two parts and read there by the tiered kernels, one down projection per top-k column,
    for NF4 (gated), int2 and GPTQ experts: the greedy tokens and logits of the per-expert path, every MoE layer
    of every one-token step copied, each call's distinct experts counted as routed and copied; three requests
    decoded together (calls of 3 tokens) give the per-expert path's tokens too."""
    rows = _interpreted("copied:mixtral", "copied:qwen3_moe:int2", "copied:mixtral:gptq")
    assert [(r["type"], r["method"]) for r in rows] == [("mixtral", "nf4"), ("qwen3_moe", "int2"), ("mixtral", "gptq")]
    for r in rows:
        assert r["copied_calls"] >= 3 * r["layers"], r  # 3 one-token steps after the prefill
        assert r["report"]["copied_calls"] == r["copied_calls"], r
        assert r["report"]["copied"] == r["report"]["routed"] > 0 and r["report"]["bytes_copied"] > 0, r
        assert r["direct"]["direct_pairs"] == 0, r  # none read from the RAM tier by the kernels
        assert r["tokens_equal"] and r["max_rel_diff"] <= 1e-5, r
        # three requests decoded together: calls of 3 tokens copied, column by column, the same greedy tokens
        assert r["batch3_copied_calls"] >= 3 * r["layers"] and r["batch3_tokens_equal"], r


def test_grouped_kernel_blocks_of_every_width_equal_the_dense_product():
    """The grouped NF4 kernels at 16, 64 and 128 rows of one expert a block (``nf4_moe.block_rows``: the widest
    that a call's rows an expert need, so a prefill decodes each expert's tile about once) give the dense
    product of the decoded experts, plain and double-quant absmax; the width follows the rows."""
    from airquant.engine.moe import compute as expert_compute
    from airquant.quant.kernels import nf4_moe

    assert nf4_moe.BLOCK_M_WIDE[-1] == expert_compute.POOL_CHUNK_ROWS  # the pool's chunks fill the widest block
    rows = _interpreted("blocks", "blocks:dq", timeout=300)
    assert [r["double_quant"] for r in rows] == [False, True]
    for r in rows:
        assert r["chosen"] == [16, 16, 64, 64, 128, 128, 128], r
        for width in ("16", "64", "128"):
            assert r[width]["up"] <= 1e-5 and r[width]["down"] <= 1e-5, r


@pytest.mark.gpu
def test_cuda_grouped_kernel_blocks_of_every_width_equal_the_dense_product():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from tests.engine.fused_experts_check import check_blocks

    for double_quant in (False, True):
        r = check_blocks(double_quant, "cuda")
        for width in ("16", "64", "128"):  # fp32 inputs: IEEE products
            assert r[width]["up"] <= 1e-5 and r[width]["down"] <= 1e-5, r


@pytest.mark.parametrize("method, types", [
    pytest.param("int2", ("mixtral", "qwen3_moe", "gpt_oss", "deepseek_v3"), marks=pytest.mark.slow),
    ("gptq", ("qwen3_moe", "mixtral")), ("awq", ("qwen3_moe",))])
def test_fused_int2_gptq_and_awq_decode_equal_the_per_expert_decode(method, types):
    """int2 experts (2-bit codes, group scales, fp16 outlier residuals; gpt-oss's biases) through the fused int2
    GEMV (quant/kernels/int2_moe), and GPTQ (act-order groups) and AWQ experts of a hub checkpoint (each expert's
    linears stacked at the split) through the fused GPTQ/AWQ GEMV (gptq_moe): routed from the pool's slots and from a whole
    layer's buffers, every one-token step of every MoE layer, as the per-expert decode; direct reads (their
    ``_tiered_kernel``: each expert from the hot set or the RAM tier) every one-token step of every MoE layer,
    some pairs from the hot set."""
    rows = _interpreted(*(f"{t}:{method}" for t in types))
    assert [(r["type"], r["method"]) for r in rows] == [(t, method) for t in types]
    for r in rows:
        for mode in ("routed", "whole"):  # the 12-token prefill is over the GEMVs' 8 tokens: per expert
            assert r[mode]["fused_calls"] >= 3 * r[mode]["layers"], r
        for mode in ("routed", "whole", "direct"):
            assert r[mode]["tokens_equal"], r
            assert r[mode]["max_rel_diff"] <= 1e-5, r
        direct = r["direct"]
        assert direct["direct_calls"] >= 5 * r["routed"]["layers"], r
        assert direct["report"]["direct"]["hot_experts"] == 4 and direct["report"]["direct"]["direct_hits"] > 0, r
        # speculative reads (sizing.SPECULATE): the same tokens and logits; every one-token step guessed, bytes
        # copied for the guesses not in the hot set
        spec = direct["spec"]
        assert spec["tokens_equal"] and spec["max_rel_diff"] <= 1e-5, r
        assert spec["report"]["direct"]["spec_calls"] >= 4 * r["routed"]["layers"], r
        assert spec["report"]["direct"]["spec_bytes_copied"] > 0, r


def test_gather_copy_kernel_copies_each_slice_to_its_place():
    """uva_copy's descriptor table: slices of different lengths (one over a CHUNK, one of 4 bytes) land at
    their destinations and nothing else is written (interpreted on CPU tensors)."""
    script = """
import torch
from airquant.engine.moe import uva_copy
src = torch.randint(0, 256, (200_000,), dtype=torch.uint8)
dst = torch.zeros(300_000, dtype=torch.uint8)
rows = [(5, 1000, 70_001), (100_000, 200_000, 4), (71_000, 90_000, 3000)]
uva_copy.gather(src, dst, torch.tensor(rows, dtype=torch.int64), max(r[2] for r in rows))
want = torch.zeros_like(dst)
for s, d, n in rows:
    want[d:d + n] = src[s:s + n]
assert torch.equal(dst, want)
print("ok")
"""
    run_interpreted(script)


SPEC_KERNELS = """
import torch
from airquant.engine.moe import uva_copy

def check(src, start, stride, length, experts, device):
    mem = torch.zeros((6, stride), dtype=torch.uint8, device=device)
    table = torch.full((experts,), -1, dtype=torch.int32, device=device)
    table[7] = 1  # expert 7 in the hot set (slot 1)
    logits = torch.randn(experts)
    logits[2], logits[7], logits[9], logits[3] = float("nan"), 5.0, 4.0, 4.0
    logits = logits.to(device)
    slots = torch.tensor([3, 4, 5], dtype=torch.int32, device=device)
    guess = torch.empty(3, dtype=torch.int64, device=device)
    free = torch.empty(3, dtype=torch.int32, device=device)
    copied, calls = (torch.zeros(1, dtype=torch.int64, device=device) for _ in range(2))
    uva_copy.spec_plan(logits, table, slots, guess, free, copied, calls)
    assert guess.tolist() == [7, 3, 9], guess  # a tie: the first index; a NaN never
    assert free.tolist() == [0, 1, 1] and copied.item() == 2 and calls.item() == 1
    t = table.tolist()
    assert t[7] == 1 and t[3] == 4 and t[9] == 5 and {t[e] for e in (0, 1, 2, 4, 5, 6, 8)} == {-1}, t
    uva_copy.gather_images(src, mem, guess, free, slots, start, stride, length, experts)
    words = start % 16 == 0  # 16-byte loads: the run rounded up to 64 bytes of the source
    run = -(-length // 64) * 64 if words else length
    want = torch.zeros((6, stride), dtype=torch.uint8)
    for slot, e in ((4, 3), (5, 9)):
        want[slot, :run] = src[start + e * stride:start + e * stride + run].cpu()
    assert torch.equal(mem.cpu(), want), (start, (mem.cpu() != want).nonzero()[:5])
    table[9] = 0  # a hot-set refresh pointed expert 9 at its slot meanwhile
    uva_copy.spec_settle(table, guess, free, slots)
    assert table.tolist()[7] == 1 and table.tolist()[3] == -1 and table.tolist()[9] == 0

def run(src, device):
    for start in (256, 260):  # 16-byte aligned (words), 4 past (bytes)
        check(src, start, 4096 + 128, 4003, 10, device)
    check(src, 256, 300_032, 290_003, 10, device)  # over IMAGE_PROGRAMS chunks a guess: two rounds a program
    print("ok")
"""


def test_speculation_kernels_plan_copy_and_settle_the_guesses():
    """uva_copy's speculative-read kernels (interpreted on CPU tensors): ``spec_plan`` takes the largest logits
    (the first index on a tie, never a NaN), points the table at the guesses' slots but for one in the hot set,
    and counts; ``gather_images`` copies the images to be copied into their slots, by 16-byte loads of whole
    64-byte runs where aligned (the run's tail past the image: the source's next bytes) and by bytes where not,
    each program over one chunk or several;
    ``spec_settle`` points back only the entries still at their guess's slot."""
    script = SPEC_KERNELS + """
torch.manual_seed(0)
run(torch.randint(0, 256, (256 + 10 * 300_032,), dtype=torch.uint8), "cpu")
"""
    run_interpreted(script)


@pytest.mark.gpu
def test_cuda_speculation_kernels_read_the_pinned_ram_tier():
    """The same kernels compiled, the images read from a pinned host buffer (the 16-byte loads' path and the
    bytes' path)."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from airquant.engine.cuda_ops import HostMemory

    namespace = {}
    exec(SPEC_KERNELS, namespace)
    memory = HostMemory(pinned=True)
    src = memory.empty(256 + 10 * 300_032)
    torch.manual_seed(0)
    src.copy_(torch.randint(0, 256, (src.numel(),), dtype=torch.uint8))
    namespace["run"](src, "cuda")
    memory.close()


@pytest.mark.gpu
@pytest.mark.parametrize("double_quant", [False, True])
@pytest.mark.parametrize("route", ["one-token", "two-rows", "four-rows", "many-rows"])
@pytest.mark.parametrize("kind", ["mixtral", "qwen3_moe"])
def test_cuda_fused_module_output_equals_the_per_expert_path(monkeypatch, kind, route, double_quant):
    """bf16 on CUDA: the fused kernels (GEMV, or grouped blocks for many rows) on the module's stacked buffers
    and on a pool of the same bytes, against the decoded experts' grouped forward: within bf16 rounding."""
    from airquant.engine.moe import compute as expert_compute
    from tests.engine.test_expert_gemv import ROUTES, _module, _stacked

    module = _module(kind, 4, torch.bfloat16, "cuda", double_quant)
    children = expert_compute.quantized_children(module)
    names, dtypes, offsets, pieces, at = [], [], [], [], 0
    for child_name, child in children.items():
        for suffix in child.suffixes:
            t = getattr(child, suffix)  # [E, ...]
            per = t[0].numel() * t.element_size()
            names.append(f"{child_name}.{suffix}")
            dtypes.append(t.dtype)
            offsets.append(at)
            pieces.append(t.reshape(t.shape[0], -1).view(torch.uint8).reshape(t.shape[0], per))
            at += -(-per // 64) * 64
    pool = torch.zeros((6, at), dtype=torch.uint8, device="cuda")  # slots 2..5 hold experts 0..3
    for off, piece in zip(offsets, pieces):
        pool[2:, off:off + piece.shape[1]] = piece
    routes = ROUTES.get(route) or torch.randint(0, 4, (40, 2)).tolist()
    index = torch.tensor(routes, device="cuda")
    hidden = torch.randn(index.shape[0], 128, device="cuda", dtype=torch.bfloat16)
    weights = torch.rand(index.shape, device="cuda", dtype=torch.bfloat16)
    want = _stacked(module, hidden, index, weights, monkeypatch).float()
    stacked = expert_compute.fused_experts(module)
    pooled = expert_compute.fused_experts(module, tuple(names), tuple(dtypes), tuple(offsets))
    got_stacked = expert_compute.run_fused(stacked, module, stacked.module_operands(module), hidden, index,
                                           weights, 4)
    got_pool = expert_compute.run_fused(pooled, module, pooled.pool_operands(pool), hidden, index + 2, weights, 6)
    scale = want.abs().max().item()
    for got in (got_stacked, got_pool):
        assert got.shape == want.shape and got.dtype == hidden.dtype
        assert (got.float() - want).abs().max().item() <= 0.02 * scale


@pytest.mark.gpu
def test_cuda_gather_copy_reads_the_pinned_ram_tier():
    from airquant.engine.cuda_ops import HostMemory
    from airquant.engine.moe import uva_copy

    memory = HostMemory(pinned=True)
    src = memory.empty(3_000_000)
    src.copy_(torch.randint(0, 256, (3_000_000,), dtype=torch.uint8))
    assert uva_copy.probe(src, torch.device("cuda"))
    dst = torch.zeros(4_000_000, dtype=torch.uint8, device="cuda")
    rows = [(7, 11, 1_500_001), (2_000_000, 3_000_000, 4), (1_600_000, 1_900_000, 999_999)]
    uva_copy.gather(src, dst, torch.tensor(rows, dtype=torch.int64, device="cuda"), max(r[2] for r in rows))
    want = torch.zeros_like(dst)
    for s, d, n in rows:
        want[d:d + n] = src[s:s + n].cuda()
    assert torch.equal(dst, want)
    memory.close()


@pytest.mark.gpu
@pytest.mark.parametrize("model_type", ["mixtral", "qwen3_moe"])
def test_cuda_routed_decode_by_fused_kernels_and_one_copy_kernel(stores, monkeypatch, model_type):  # noqa: F811
    """A bf16 routed decode on CUDA: the fused kernels ran, the copies went by the gather kernel when asked (the
    probe passed on the RAM tier), and the tokens and logits match the per-expert path with copy-engine copies."""
    from airquant.engine.moe import compute as expert_compute
    from airquant.engine.moe import pool as experts_mod
    from airquant.engine.runner import Engine
    from tests.engine.test_expert_gemv import _decode

    calls = []
    real = expert_compute.run_fused
    monkeypatch.setattr(expert_compute, "run_fused", lambda *a, **k: calls.append(1) or real(*a, **k))
    monkeypatch.setattr(experts_mod, "UVA_COPY", True)  # off by default (slower than the copy engine on an H200)
    monkeypatch.setattr(experts_mod, "DIRECT", False)  # the copy path: direct reads would take the decode calls
    engine = Engine.open(stores[model_type], device="cuda", dtype="bfloat16", experts="routed", resident_layers=0)
    tokens, logits = _decode(engine)
    assert calls and engine.experts.uva is True
    engine.close()
    monkeypatch.setattr(expert_compute, "FUSED", False)
    monkeypatch.setattr(experts_mod, "UVA_COPY", False)
    engine = Engine.open(stores[model_type], device="cuda", dtype="bfloat16", experts="routed", resident_layers=0)
    want_tokens, want_logits = _decode(engine)
    assert engine.experts.uva is False
    engine.close()
    same = next((i for i, (a, b) in enumerate(zip(tokens, want_tokens)) if a != b), len(tokens))
    assert same >= 2  # a bf16 near-tie may flip a later token; compare the logits up to it
    diff = (logits[:same + 1] - want_logits[:same + 1]).abs().max().item()
    assert diff <= 3e-2 * want_logits.abs().max().item()


def test_whole_layer_calls_take_the_fused_kernels_only_at_few_rows_an_expert(monkeypatch):
    """A whole layer's call runs fused up to FUSED_WHOLE_ROWS routed rows an expert on average; above, each
    16-row block would decode its expert again, so the module's own forward (one decode an expert) runs."""
    from types import SimpleNamespace

    from airquant.engine.moe import compute as ec

    module = SimpleNamespace(down_proj=SimpleNamespace(num_experts=8))
    spec = SimpleNamespace(down=SimpleNamespace(name="down_proj"), module_operands=lambda m: (), max_tokens=None)
    calls = []
    monkeypatch.setattr(ec, "fused_runs_on", lambda x: True)
    monkeypatch.setattr(ec, "fused_experts", lambda m, **kw: spec)
    monkeypatch.setattr(ec, "run_fused", lambda *a: calls.append("fused"))
    whole = ec.FusedWholeExperts(module, lambda *a: calls.append("module"))
    hidden, weights = torch.zeros(1, 4), torch.zeros(1, 2)
    for tokens in (1, ec.FUSED_WHOLE_ROWS * 8 // 2, ec.FUSED_WHOLE_ROWS * 8 // 2 + 1, 1000):
        whole(hidden.expand(tokens, 4), torch.zeros(tokens, 2, dtype=torch.long), weights.expand(tokens, 2))
    assert calls == ["fused", "fused", "module", "module"]
    # int2 (no grouped kernel): fused only up to its GEMV's tokens a call
    calls.clear()
    spec.max_tokens = 8
    whole = ec.FusedWholeExperts(module, lambda *a: calls.append("module"))
    for tokens in (8, 9):
        whole(hidden.expand(tokens, 4), torch.zeros(tokens, 2, dtype=torch.long), weights.expand(tokens, 2))
    assert calls == ["fused", "module"]


@pytest.mark.gpu
@pytest.mark.parametrize("model_type", ["mixtral", "qwen3_moe"])
def test_cuda_routed_decode_by_direct_reads(stores, monkeypatch, model_type):  # noqa: F811
    """A bf16 routed decode on CUDA with direct reads (engine/moe/direct.py): the tiered kernels read every
    one-token call's experts from the pinned RAM tier or the hot set (refreshed every 2 passes, so that some
    pairs hit it), and the tokens and logits match the per-expert path."""
    from airquant.engine.moe import compute as expert_compute
    from airquant.engine.moe import direct
    from airquant.engine.moe import pool as experts_mod
    from airquant.engine.runner import Engine
    from tests.engine.test_expert_gemv import _decode

    monkeypatch.setattr(experts_mod, "DIRECT", True)
    monkeypatch.setattr(direct, "REFRESH_PASSES", 2)
    engine = Engine.open(stores[model_type], device="cuda", dtype="bfloat16", experts="routed", resident_layers=0)
    tokens, logits = _decode(engine)
    report = engine.experts.report()
    assert engine.experts.direct is not None and report["direct"]["direct_pairs"] > 0, report
    assert report["direct"]["hot_experts"] > 0 and report["direct"]["direct_hits"] > 0, report
    engine.close()
    monkeypatch.setattr(experts_mod, "DIRECT", False)
    monkeypatch.setattr(expert_compute, "FUSED", False)
    engine = Engine.open(stores[model_type], device="cuda", dtype="bfloat16", experts="routed", resident_layers=0)
    want_tokens, want_logits = _decode(engine)
    engine.close()
    same = next((i for i, (a, b) in enumerate(zip(tokens, want_tokens)) if a != b), len(tokens))
    assert same >= 2  # a bf16 near-tie may flip a later token; compare the logits up to it
    diff = (logits[:same + 1] - want_logits[:same + 1]).abs().max().item()
    assert diff <= 3e-2 * want_logits.abs().max().item()


@pytest.mark.gpu
@pytest.mark.parametrize("model_type", ["mixtral", "qwen3_moe"])
def test_cuda_copied_reads_decode_as_reads_from_the_ram_tier(stores, monkeypatch, model_type):  # noqa: F811
    """Copied reads on CUDA (engine/moe/sizing.py COPY_READS_MIN_BYTES 0: every call): each one-token call's routing
    read to the host in an eager island between the layer graphs, its experts copied by the copy engine in two parts
    on the copy stream, the tiered kernels waiting on each part's event; the tokens and logits are those of direct
    reads from the RAM tier alone (no cache)."""
    from airquant.engine.moe import pool as experts_mod
    from airquant.engine.moe import sizing
    from airquant.engine.runner import Engine
    from tests.engine.test_expert_gemv import _decode

    monkeypatch.setattr(experts_mod, "DIRECT", True)
    runs = {}
    for copied in (None, 0):
        monkeypatch.setattr(sizing, "COPY_READS_MIN_BYTES", copied)
        engine = Engine.open(stores[model_type], device="cuda", dtype="bfloat16", experts="routed",
                             resident_layers=0, expert_cache_gb=0.0)
        runs[copied] = (*_decode(engine), engine.experts.report())
        engine.close()
    (tokens, logits, report), (want_tokens, want_logits, want_report) = runs[0], runs[None]
    assert report["copied_calls"] > 0 and report["direct"]["direct_pairs"] == 0, report
    assert want_report["copied_calls"] == 0 and want_report["direct"]["direct_pairs"] > 0, want_report
    assert tokens == want_tokens
    assert (logits - want_logits).abs().max().item() <= 1e-2 * want_logits.abs().max().item()


@pytest.mark.gpu
@pytest.mark.parametrize("model_type", ["mixtral", "qwen3_moe"])
def test_cuda_speculative_reads_decode_as_reads_from_the_ram_tier(stores, monkeypatch, model_type):  # noqa: F811
    """Speculative reads on CUDA (engine/moe/sizing.py SPECULATE): each one-token call's experts guessed before
    its attention on a side stream, copied by the gather kernel, joined before the tiered kernels (inside the
    layer graphs); the tokens and logits are those of direct reads from the RAM tier alone."""
    from airquant.engine.moe import pool as experts_mod
    from airquant.engine.moe import sizing
    from airquant.engine.runner import Engine
    from tests.engine.test_expert_gemv import _decode

    monkeypatch.setattr(experts_mod, "DIRECT", True)
    runs = {}
    for spec in (False, True):
        monkeypatch.setattr(sizing, "SPECULATE", spec)
        engine = Engine.open(stores[model_type], device="cuda", dtype="bfloat16", experts="routed",
                             resident_layers=0, expert_cache_gb=0.0)
        runs[spec] = (*_decode(engine), engine.experts.report()["direct"])
        engine.close()
    (tokens, logits, report), (want_tokens, want_logits, _) = runs[True], runs[False]
    assert report["spec_calls"] > 0 and report["spec_bytes_copied"] > 0, report
    assert tokens == want_tokens
    assert (logits - want_logits).abs().max().item() <= 1e-2 * want_logits.abs().max().item()


@pytest.mark.gpu
@pytest.mark.parametrize("model_type", ["mixtral", "qwen3_moe"])
def test_cuda_dense_parts_kept_in_vram_decode_as_streamed_ones(stores, model_type):  # noqa: F811
    """--dense-resident (the default): the routed layers' dense parts are copied to the device once and kept; the
    decode's tokens and logits are those of the same run with them streamed through the slots every pass."""
    from airquant.engine.runner import Engine
    from tests.engine.test_expert_gemv import _decode

    runs = {}
    for on in (True, False):
        engine = Engine.open(stores[model_type], device="cuda", dtype="bfloat16", experts="routed",
                             resident_layers=0, dense_resident=on)
        routed = set(engine.experts.layers)
        assert (engine.streamer.dense == routed) == on and bool(engine.plan.dense_layers) == on
        runs[on] = _decode(engine)
        if on:  # copied once, kept: no pass copies them through the slots
            assert set(engine.streamer._dense) == routed and set(engine.streamer.streamed).isdisjoint(routed)
        engine.close()
    assert runs[True][0] == runs[False][0]
    assert torch.equal(runs[True][1], runs[False][1])


@pytest.mark.gpu
@pytest.mark.parametrize("double_quant", [False, True])
def test_cuda_tiered_kernel_reads_pinned_host_and_pool(double_quant):
    """The tiered GEMV on CUDA: experts 1 and 3 in pool slots, the others read from a pinned (registered) host
    buffer; up and down equal the decoded weights' products, and the counters count pairs and hits."""
    from airquant.engine.cuda_ops import HostMemory
    from airquant.quant.kernels import nf4_moe
    from tests.quant.test_nf4_moe_tiered import expert_images

    imgs, dense, bias, m = expert_images(5, 96, 256, 64, double_quant, torch.bfloat16 if double_quant else None)
    b = bias.cuda() if bias is not None else torch.zeros(5, 96, device="cuda")
    memory = HostMemory(pinned=True)
    stride, start = imgs.shape[1] + 64, 192
    host = memory.empty(start + 5 * stride)
    for e in range(5):
        host[start + e * stride:start + e * stride + imgs.shape[1]] = imgs[e]
    pool = torch.zeros((4, imgs.shape[1]), dtype=torch.uint8, device="cuda")
    table = torch.full((5,), -1, dtype=torch.int32, device="cuda")
    for slot, e in ((0, 1), (2, 3)):
        pool[slot] = imgs[e].cuda()
        table[e] = slot
    counts = torch.zeros(5, dtype=torch.int32, device="cuda")
    hits = torch.zeros(1, dtype=torch.int64, device="cuda")
    tiers = nf4_moe.Tiers(host, start, stride, pool, table, counts, hits)
    ids = torch.tensor([[1, 0], [4, 3], [3, 2]], device="cuda")
    x = torch.randn(3, 256, device="cuda")
    up = nf4_moe.tiered_up(x, ids, m, tiers)
    w = dense.cuda()
    want = torch.stack([w[e] @ x[p // 2] + b[e] for p, e in enumerate(ids.reshape(-1).tolist())])
    assert (up - want).abs().max().item() <= 1e-3 * want.abs().max().item()
    h, weights = torch.randn(6, 256, device="cuda"), torch.rand(3, 2, device="cuda")
    down = nf4_moe.tiered_down(h, ids, weights, m, tiers, torch.float32)
    want_down = torch.stack([sum(weights[t, j] * (w[ids[t, j]] @ h[2 * t + j] + b[ids[t, j]]) for j in range(2))
                             for t in range(3)])
    assert (down - want_down).abs().max().item() <= 1e-3 * want_down.abs().max().item()
    assert counts.tolist() == [1, 1, 1, 2, 1] and hits.item() == 3
    memory.close()
