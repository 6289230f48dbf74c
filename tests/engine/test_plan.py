from dataclasses import replace

import pytest
import torch

from airquant.engine.plan import Budgets, PlanError, plan_layers

GB = 10**9


@pytest.mark.parametrize("vram, ram, override, tiers", [
    # CPU: nothing in VRAM; RAM decides what is pinned and what is read from disk
    (None, 10 * GB, None, ["ram"] * 4),
    (None, 2 * GB, None, ["ram", "ram", "disk", "disk"]),
    (None, 0, None, ["disk"] * 4),
    # fixed 1 GB + 2 slots x 1 GB + reserve 1 GB = 4 GB floor; the rest holds leading layers
    (4 * GB, 10 * GB, None, ["ram"] * 4),
    (6 * GB, 10 * GB, None, ["vram", "vram", "ram", "ram"]),
    (6 * GB, 1 * GB, None, ["vram", "vram", "ram", "disk"]),
    (100 * GB, 0, None, ["vram"] * 4),
    (100 * GB, 10 * GB, 1, ["vram", "ram", "ram", "ram"]),
])
def test_placement_table(vram, ram, override, tiers):
    plan = plan_layers([GB] * 4, GB, Budgets(vram_bytes=vram, ram_bytes=ram, resident_layers=override,
                                             reserve_bytes=GB if vram else 0))
    assert plan.tiers == tiers
    assert plan.slot_bytes == GB
    text = plan.describe([GB] * 4)
    assert "why:" in text


def test_all_resident_needs_no_slots():
    plan = plan_layers([GB] * 2, GB, Budgets(vram_bytes=100 * GB, ram_bytes=0))
    assert plan.slots == 0 and plan.vram_layers == [0, 1]


def test_budget_below_floor_is_a_clear_error():
    with pytest.raises(PlanError, match=r"cannot hold .* raise --max-vram"):
        plan_layers([GB] * 4, GB, Budgets(vram_bytes=2 * GB, ram_bytes=0))


# -- the engine's plan for real shapes: host embedding, NF4 lm_head, KV/activation reserve ------------
@pytest.fixture(scope="module")
def shapes(tmp_path_factory, real_tokenizer):
    from airquant.store.synth import SynthSpec, synth

    root = tmp_path_factory.mktemp("plan-shapes")
    return {dtype: synth(SynthSpec("llama3-70b", dtype), root / dtype, manifest_only=True, tokenizer=real_tokenizer,
                         progress=False) and root / dtype for dtype in ("bfloat16", "nf4")}


# Llama-3-70B: a layer is 1.71 GB bf16 / 0.48 GB nf4; embed 2.10 GB; lm_head 2.10 GB bf16 / 0.59 GB in NF4
# row chunks. Caps are decimal GB. Batch 1 x 136 tokens reserves 0.82 GB with NF4 layers (0.47 GB of it the
# dequantized MLP weight of a multi-token matmul), batch 64 x 136 4.6 GB (KV 2.9 GB; the MLP runs 2048
# tokens at a time, so its intermediates stop growing past 2048 tokens).
@pytest.mark.parametrize("dtype, cap_gb, host_embedding, batch, context, resident", [
    ("nf4", 4, False, 1, 136, "cannot hold"),  # embed + lm_head 2.69 + slots 0.96 + reserve 0.82 > 4
    ("nf4", 4, True, 1, 136, 3),  # lm_head 0.59 + slots 0.96 + reserve 0.82 leave 1.63 GB: 3 layers
    ("nf4", 15, True, 1, 2048, 23),
    ("nf4", 15, False, 1, 2048, 19),  # the embedding on the GPU costs four layers
    ("nf4", 15, True, 64, 136, 18),  # the batch's KV cache and activations cost five
    ("nf4", 15, True, 32, 1024, "cannot hold"),
    ("bfloat16", 4, True, 1, 136, "cannot hold"),
    ("bfloat16", 15, True, 64, 136, 3),
    ("bfloat16", 15, False, 1, 2048, 3),
])
def test_engine_plan_for_70b_budgets(shapes, dtype, cap_gb, host_embedding, batch, context, resident):
    from airquant.config import EngineConfig
    from airquant.engine import skeleton
    from airquant.engine.runner import GIB, plan_for
    from airquant.store.manifest import load_manifest

    store = shapes[dtype]
    manifest, config = load_manifest(store), skeleton.load_config(store)
    cfg = EngineConfig(max_vram_gb=cap_gb * GB / GIB, host_embedding=host_embedding, batch_size=batch,
                       context=context, max_ram_gb=64, kv_offload=False)
    if isinstance(resident, str):
        with pytest.raises(PlanError, match=resident):
            plan_for(manifest, cfg, torch.device("cuda"), config, torch.bfloat16)
        return
    plan = plan_for(manifest, cfg, torch.device("cuda"), config, torch.bfloat16)  # no GPU touched: capped
    assert len(plan.vram_layers) == resident and plan.vram_layers == list(range(resident))
    peak = plan.fixed_bytes + plan.slots * plan.slot_bytes + plan.reserve_bytes + \
        sum(manifest.layer_bytes[i] for i in plan.vram_layers)
    assert peak <= cap_gb * GB < peak + manifest.layer_bytes[0]  # full, and one more layer would not fit
    assert (plan.host_fixed_bytes > 0) == host_embedding
    assert "reserve (KV + activ.)" in plan.describe(manifest.layer_bytes)


def test_kv_cache_that_does_not_fit_vram_is_offloaded(shapes):
    """Batch 32 x 1024 tokens of 70B: the 10.7 GB cache leaves no room on 15 GB; in host RAM it fits."""
    from airquant.config import EngineConfig
    from airquant.engine import skeleton
    from airquant.engine.runner import GIB, plan_for
    from airquant.store.manifest import load_manifest

    store = shapes["nf4"]
    manifest, config = load_manifest(store), skeleton.load_config(store)
    base = EngineConfig(max_vram_gb=15 * GB / GIB, host_embedding=True, batch_size=32, context=1024, max_ram_gb=64)
    plan = plan_for(manifest, base, torch.device("cuda"), config, torch.bfloat16)
    n = manifest.num_layers
    kv = 32 * 1024 * 2 * n * 8 * 128 * 2  # K and V of 8 heads of 128 per layer, bf16
    kv_layer = kv // n
    assert plan.kv_offload and plan.kv_host_bytes == kv_layer * (n - len(plan.vram_layers))
    peak = plan.fixed_bytes + plan.slots * plan.slot_bytes + plan.reserve_bytes + \
        sum(manifest.layer_bytes[i] + kv_layer for i in plan.vram_layers)
    assert peak <= 15 * GB
    assert plan.reserve_bytes < kv  # only the layers in flight keep their cache on the device
    text = plan.describe(manifest.layer_bytes)
    assert "KV cache                : offloaded" in text and "does not fit in VRAM" in text
    with pytest.raises(PlanError, match="--kv-offload"):
        plan_for(manifest, replace(base, kv_offload=False), torch.device("cuda"), config, torch.bfloat16)
    small = plan_for(manifest, replace(base, batch_size=1), torch.device("cuda"), config, torch.bfloat16)
    assert not small.kv_offload and "offloaded" not in small.describe(manifest.layer_bytes)
    forced = plan_for(manifest, replace(base, batch_size=1, kv_offload=True), torch.device("cuda"), config,
                      torch.bfloat16)
    assert forced.kv_offload and len(forced.vram_layers) <= len(small.vram_layers)
    assert "by request" in forced.describe(manifest.layer_bytes)


def test_reserve_grows_with_batch_and_context():
    from types import SimpleNamespace

    from airquant.engine.plan import kv_bytes_per_token, reserve_for

    cfg = SimpleNamespace(num_hidden_layers=80, hidden_size=8192, intermediate_size=28672, num_attention_heads=64,
                          num_key_value_heads=8, vocab_size=128256)
    assert kv_bytes_per_token(cfg, 2) == 2 * 80 * 8 * 128 * 2  # K and V, 8 heads of 128, every layer
    one = reserve_for(cfg, batch=1, context=1000, dtype_bytes=2)
    assert reserve_for(cfg, batch=4, context=1000, dtype_bytes=2).kv == 4 * one.kv
    assert reserve_for(cfg, batch=1, context=2000, dtype_bytes=2).activations == 2 * one.activations


def test_mlp_chunk_is_a_constant_part_of_the_reserve():
    from types import SimpleNamespace

    from airquant.engine.plan import MLP_CHUNK_TOKENS, reserve_for

    cfg = SimpleNamespace(hidden_size=8192, intermediate_size=28672, num_attention_heads=64, num_key_value_heads=8,
                          num_hidden_layers=80, vocab_size=128256)
    one, eight = (reserve_for(cfg, batch=b, context=8192, dtype_bytes=2) for b in (1, 8))
    assert one.mlp == eight.mlp == MLP_CHUNK_TOKENS * 3 * 28672 * 2
    assert eight.activations == 8 * one.activations == 8 * 8192 * 4 * 8192 * 2
    assert "MLP chunk 0.35" in one.describe()
