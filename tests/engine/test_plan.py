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
# dequantized MLP weight of a multi-token matmul), batch 64 x 136 5.7 GB (KV 2.9 GB).
@pytest.mark.parametrize("dtype, cap_gb, host_embedding, batch, context, resident", [
    ("nf4", 4, False, 1, 136, "cannot hold"),  # embed + lm_head 2.69 + slots 0.96 + reserve 0.82 > 4
    ("nf4", 4, True, 1, 136, 3),  # lm_head 0.59 + slots 0.96 + reserve 0.82 leave 1.63 GB: 3 layers
    ("nf4", 15, True, 1, 2048, 23),
    ("nf4", 15, False, 1, 2048, 19),  # the embedding on the GPU costs four layers
    ("nf4", 15, True, 64, 136, 16),  # the batch's KV cache and activations cost seven
    ("nf4", 15, True, 32, 1024, "cannot hold"),
    ("bfloat16", 4, True, 1, 136, "cannot hold"),
    ("bfloat16", 15, True, 64, 136, 2),
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
                       context=context, max_ram_gb=64)
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


def test_reserve_grows_with_batch_and_context():
    from types import SimpleNamespace

    from airquant.engine.plan import kv_bytes_per_token, max_batch_for, reserve_for

    cfg = SimpleNamespace(num_hidden_layers=80, hidden_size=8192, intermediate_size=28672, num_attention_heads=64,
                          num_key_value_heads=8, vocab_size=128256)
    assert kv_bytes_per_token(cfg, 2) == 2 * 80 * 8 * 128 * 2  # K and V, 8 heads of 128, every layer
    one = reserve_for(cfg, batch=1, context=1000, dtype_bytes=2)
    assert reserve_for(cfg, batch=4, context=1000, dtype_bytes=2).kv == 4 * one.kv
    assert reserve_for(cfg, batch=1, context=2000, dtype_bytes=2).activations == 2 * one.activations
    fits = max_batch_for(cfg, free_bytes=10 * GB, context=1000, dtype_bytes=2)
    assert reserve_for(cfg, batch=fits, context=1000, dtype_bytes=2).total <= 10 * GB
    assert reserve_for(cfg, batch=fits + 1, context=1000, dtype_bytes=2).total > 10 * GB
