from dataclasses import replace

import pytest
import torch

from airquant.engine.memory.placement import Budgets, PlanError, plan_layers
from tests.zoo import HYBRID_TYPES

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
    # lm_head 0.59 + slots 0.96 + reserve 0.82 leave 1.63 GB, less the allocator margin 0.27: 2 layers
    ("nf4", 4, True, 1, 136, 2),
    ("nf4", 15, True, 1, 2048, 22),  # 2048 tokens' activations with the RMSNorm's fp32 temporaries: 0.17 GB
    ("nf4", 15, False, 1, 2048, 18),  # the embedding on the GPU costs five layers (the margin 0.48 one less)
    ("nf4", 15, True, 64, 136, 17),  # the batch's KV cache and activations cost six
    ("nf4", 15, True, 32, 1024, "cannot hold"),
    ("bfloat16", 4, True, 1, 136, "cannot hold"),
    ("bfloat16", 15, True, 64, 136, 2),
    ("bfloat16", 15, False, 1, 2048, 3),
])
def test_engine_plan_for_70b_budgets(shapes, dtype, cap_gb, host_embedding, batch, context, resident):
    from airquant.config import EngineConfig
    from airquant.engine import skeleton
    from airquant.engine.memory.planner import allocator_margin
    from airquant.engine.runner import GIB, placement_for
    from airquant.store.manifest import load_manifest

    store = shapes[dtype]
    manifest, config = load_manifest(store), skeleton.load_config(store)
    cfg = EngineConfig(max_vram_gb=cap_gb * GB / GIB, host_embedding=host_embedding, batch_size=batch,
                       context=context, max_ram_gb=64, kv_offload=False)
    if isinstance(resident, str):
        with pytest.raises(PlanError, match=resident):
            placement_for(manifest, cfg, torch.device("cuda"), config, torch.bfloat16)
        return
    plan = placement_for(manifest, cfg, torch.device("cuda"), config, torch.bfloat16)  # no GPU touched: capped
    assert len(plan.vram_layers) == resident and plan.vram_layers == list(range(resident))
    peak = plan.fixed_bytes + plan.slots * plan.slot_bytes + plan.reserve_bytes + \
        sum(manifest.layer_bytes[i] for i in plan.vram_layers)
    budget = int(cap_gb * GB / GIB * GIB)
    fill = budget - allocator_margin(budget)  # the plan leaves the allocator its margin of the budget
    assert peak == plan.device_bytes <= fill < peak + manifest.layer_bytes[0]  # full, one more layer would not fit
    assert (plan.host_fixed_bytes > 0) == host_embedding
    assert "reserve (KV + activ.)" in plan.describe(manifest.layer_bytes)


def test_kv_cache_that_does_not_fit_vram_is_offloaded(shapes):
    """Batch 32 x 1024 tokens of 70B: the 10.7 GB cache leaves no room on 15 GB; in host RAM it fits."""
    from airquant.config import EngineConfig
    from airquant.engine import skeleton
    from airquant.engine.runner import GIB, placement_for
    from airquant.store.manifest import load_manifest

    store = shapes["nf4"]
    manifest, config = load_manifest(store), skeleton.load_config(store)
    base = EngineConfig(max_vram_gb=15 * GB / GIB, host_embedding=True, batch_size=32, context=1024, max_ram_gb=64)
    plan = placement_for(manifest, base, torch.device("cuda"), config, torch.bfloat16)
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
        placement_for(manifest, replace(base, kv_offload=False), torch.device("cuda"), config, torch.bfloat16)
    small = placement_for(manifest, replace(base, batch_size=1), torch.device("cuda"), config, torch.bfloat16)
    assert not small.kv_offload and "offloaded" not in small.describe(manifest.layer_bytes)
    forced = placement_for(manifest, replace(base, batch_size=1, kv_offload=True), torch.device("cuda"), config,
                      torch.bfloat16)
    assert forced.kv_offload and len(forced.vram_layers) <= len(small.vram_layers)
    assert "by request" in forced.describe(manifest.layer_bytes)


def test_reserve_grows_with_batch_and_context():
    from types import SimpleNamespace

    from airquant.engine.memory.placement import kv_bytes_per_token, reserve_for

    cfg = SimpleNamespace(num_hidden_layers=80, hidden_size=8192, intermediate_size=28672, num_attention_heads=64,
                          num_key_value_heads=8, vocab_size=128256)
    assert kv_bytes_per_token(cfg, 2) == 2 * 80 * 8 * 128 * 2  # K and V, 8 heads of 128, every layer
    one = reserve_for(cfg, batch=1, context=1000, dtype_bytes=2)
    assert reserve_for(cfg, batch=4, context=1000, dtype_bytes=2).kv == 4 * one.kv
    assert reserve_for(cfg, batch=1, context=2000, dtype_bytes=2).activations == 2 * one.activations


def test_mlp_chunk_is_a_constant_part_of_the_reserve():
    from types import SimpleNamespace

    from airquant.config import MLP_CHUNK_TOKENS
    from airquant.engine.memory.placement import reserve_for

    cfg = SimpleNamespace(hidden_size=8192, intermediate_size=28672, num_attention_heads=64, num_key_value_heads=8,
                          num_hidden_layers=80, vocab_size=128256)
    one, eight = (reserve_for(cfg, batch=b, context=8192, dtype_bytes=2) for b in (1, 8))
    assert one.mlp == eight.mlp == MLP_CHUNK_TOKENS * 3 * 28672 * 2
    # residual, normed input, q/k/v/attention output (4 x H) or, larger in bf16, the input and an RMSNorm's
    # fp32 upcast and square (2 + 2 x 4 bytes a value)
    assert eight.activations == 8 * one.activations == 8 * 8192 * 8192 * (2 + 2 * 4)
    assert "MLP chunk 0.35" in one.describe()


# -- hybrid stacks: KV for the attention layers, a fixed state per sequence for the others ------------
# Qwen3-Next-80B-A3B's published config: 48 layers, full attention at every fourth (its config.json gives
# full_attention_interval, not layer_types), 2 KV heads of 256; Gated DeltaNet layers of 16 key heads x 128
# and 32 value heads x 128 with a 4-wide conv window.
QWEN3_NEXT_80B = dict(hidden_size=2048, intermediate_size=5120, num_hidden_layers=48, num_attention_heads=16,
                      num_key_value_heads=2, head_dim=256, vocab_size=151936, full_attention_interval=4,
                      linear_num_value_heads=32, linear_num_key_heads=16, linear_key_head_dim=128,
                      linear_value_head_dim=128, linear_conv_kernel_dim=4)
# Per sequence, bf16: 36 conv windows of (2 x 16 x 128 + 32 x 128) channels x 4 (bf16) and 36 fp32 states
# of 32 x 128 x 128: 2.36 + 75.5 = 77.9 MB.
QWEN3_NEXT_STATE = 36 * (2 * 16 * 128 + 32 * 128) * 4 * 2 + 36 * 32 * 128 * 128 * 4


def test_hybrid_kv_counts_attention_layers_and_a_fixed_state_per_sequence():
    from transformers import AutoConfig

    from airquant.engine.memory.placement import kv_bytes_per_token, reserve_for
    from airquant.kv import LayerStates

    cfg = AutoConfig.for_model("qwen3_next", **QWEN3_NEXT_80B)
    states = LayerStates.of(cfg)
    assert states.attention_layers == tuple(range(3, 48, 4)) and len(states.recurrent_layers) == 36
    assert kv_bytes_per_token(cfg, 2) == 2 * 12 * 2 * 256 * 2  # K and V of the 12 attention layers only
    assert states.state_bytes(2) == QWEN3_NEXT_STATE
    one, four = (reserve_for(cfg, batch=b, context=4096, dtype_bytes=2) for b in (1, 4))
    assert one.kv == 4096 * 2 * 12 * 2 * 256 * 2 and one.state == QWEN3_NEXT_STATE and four.state == 4 * one.state
    assert one.total - reserve_for(cfg, batch=1, context=4096, dtype_bytes=2,
                                   states=replace(states, state_elems=0, fp32_elems=0)).total == QWEN3_NEXT_STATE
    assert "fixed state 0.08" in one.describe()
    assert states.describe(2) == "KV for 12 of 48 layers (attention) + 77.9 MB fixed state per sequence in 36 layers"
    # Nemotron-H's older pattern string (M Mamba-2, * attention, - MLP): 8 x 128 heads x 64, state 128, 4-wide conv.
    nemotron = AutoConfig.for_model("nemotron_h", hybrid_override_pattern="M-M*-M-", mamba_num_heads=128,
                                    mamba_head_dim=64, ssm_state_size=128, n_groups=8, conv_kernel=4)
    states = LayerStates.of(nemotron)
    assert states.kinds == ("recurrent", "none", "recurrent", "attention", "none", "recurrent", "none")
    assert states.state_bytes(2) == 3 * ((128 * 64 + 2 * 8 * 128) * 4 * 2 + 128 * 64 * 128 * 4)


@pytest.mark.parametrize("model_type", HYBRID_TYPES)
def test_hybrid_estimate_equals_the_cache_transformers_allocates(real_tokenizer, model_type):
    """The arithmetic against the tensors transformers' own cache holds after a bf16 prefill."""
    from transformers import AutoModelForCausalLM

    from airquant.engine.memory.placement import kv_bytes_per_token
    from airquant.kv import LayerStates
    from tests.zoo import tiny_config

    cfg = tiny_config(model_type, real_tokenizer, **({"full_attn_idxs": [1]} if model_type == "lfm2" else {}))
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).eval()
    with torch.no_grad():
        cache = model(torch.ones(3, 7, dtype=torch.long), use_cache=True).past_key_values
    kv = sum(t.nbytes for layer in cache.layers for t in (getattr(layer, "keys", None), getattr(layer, "values", None))
             if isinstance(t, torch.Tensor))
    state = sum(t.nbytes for layer in cache.layers for group in ("conv_states", "recurrent_states")
                for t in getattr(layer, group, {}).values() if t is not None)
    states = LayerStates.of(cfg)
    assert states.hybrid and kv == 3 * 7 * kv_bytes_per_token(cfg, 2) and state == 3 * states.state_bytes(2)


def test_engine_plan_of_a_hybrid_store(tmp_path, real_tokenizer):
    """Qwen3-Next's tiny store: the engine reserves one fixed state per sequence, and offloaded, the one
    attention layer in flight holds the whole cache (not a quarter of it)."""
    from airquant.config import EngineConfig
    from airquant.engine import skeleton
    from airquant.engine.memory.placement import kv_bytes_per_token
    from airquant.engine.runner import placement_for, planned_reserve
    from airquant.kv import LayerStates
    from airquant.models import resolve
    from airquant.store.manifest import load_manifest
    from airquant.store.split import split
    from tests.zoo import make_model

    split(resolve(str(make_model(tmp_path / "model", real_tokenizer, "qwen3_next"))), tmp_path / "store",
          dtype="bfloat16", progress=False)
    manifest, config = load_manifest(tmp_path / "store"), skeleton.load_config(tmp_path / "store")
    cfg = EngineConfig(max_vram_gb=1, max_ram_gb=1, batch_size=8, context=128, kv_offload=True)
    sized = planned_reserve(manifest, cfg, config, torch.bfloat16)
    assert sized.state == 8 * LayerStates.of(config).state_bytes(2) > 0
    assert sized.kv == 8 * 128 * kv_bytes_per_token(config, 2) == 8 * 128 * 2 * 1 * 2 * 16 * 2  # 1 layer of 4
    plan = placement_for(manifest, cfg, torch.device("cuda"), config, torch.bfloat16)  # capped: no GPU touched
    assert plan.kv_offload and plan.reserve_bytes == sized.total - sized.kv + 3 * sized.kv


@pytest.mark.parametrize("model_type", ["llama", "gemma2", "mixtral"])
def test_dense_kv_is_unchanged(real_tokenizer, model_type):
    from airquant.engine.memory.placement import kv_bytes_per_token, reserve_for
    from airquant.kv import LayerStates
    from tests.zoo import tiny_config

    cfg = tiny_config(model_type, real_tokenizer, layers=5)
    states = LayerStates.of(cfg)
    assert not states.hybrid and states.attention_layers == tuple(range(5)) and states.state_bytes(2) == 0
    assert kv_bytes_per_token(cfg, 2) == 2 * 5 * cfg.num_key_value_heads * cfg.head_dim * 2
    one = reserve_for(cfg, batch=2, context=100, dtype_bytes=2)
    assert one.state == 0 and "fixed state" not in one.describe() and "(attention)" in states.describe(2)


@pytest.mark.parametrize("attention, vram, resident, host", [
    (None, 10, 1, 3 * GB),  # every layer holds 1 GB of the 4 GB cache: floor 1 + 2 + (5 - 4 + 3 x 1) = 7 GB
    ((3,), 10, "cannot hold", 0),  # the one attention layer holds all 4 GB: 3 in flight make the floor 16 GB
    ((3,), 17, 1, 4 * GB),  # 1 GB spare: layer 0 (no KV) fits; layer 3's 4 GB share goes to host RAM
    (None, 17, 4, 0),
])
def test_offloaded_kv_is_shared_by_the_attention_layers_only(attention, vram, resident, host):
    budgets = Budgets(vram_bytes=vram * GB, ram_bytes=64 * GB, reserve_bytes=5 * GB, kv_bytes=4 * GB,
                      kv_offload=True, attention_layers=attention)
    if isinstance(resident, str):
        with pytest.raises(PlanError, match=resident):
            plan_layers([GB] * 4, GB, budgets)
        return
    plan = plan_layers([GB] * 4, GB, budgets)
    assert plan.reserve_bytes == GB + 3 * max(budgets.kv_shares(4))  # 5 - 4 + the shares of 3 layers in flight
    assert len(plan.vram_layers) == resident and plan.kv_host_bytes == host


def test_dequant_workspace_counts_a_whole_quantized_expert():
    """A quantized expert is decoded whole: Mixtral's gate_up (2 x 14336 x 4096) outgrows the dense MLP term."""
    from types import SimpleNamespace

    from airquant.engine.memory.placement import dequant_elems
    from airquant.store.manifest import ShardEntry

    config = SimpleNamespace(hidden_size=4096, intermediate_size=14336, num_attention_heads=32, head_dim=128)
    nf4 = {"scheme": "nf4", "blocksize": 64, "double_quant": False}
    layer = ShardEntry(group="layer.0", file="layer_0000.safetensors", bytes=1, sha256="", tensors={},
                       modules={"self_attn.q_proj": nf4,
                                "mlp.experts.gate_up_proj": {**nf4, "experts": 8, "shape": [28672, 4096]},
                                "mlp.experts.down_proj": {**nf4, "experts": 8, "shape": [4096, 14336]}})
    assert dequant_elems({"layer.0": layer}, config) == 28672 * 4096
    dense_only = ShardEntry(group="layer.0", file="x", bytes=1, sha256="", tensors={}, modules={"self_attn.q_proj": nf4})
    assert dequant_elems({"layer.0": dense_only}, config) == 4096 * 14336


def test_a_moe_block_chunk_counts_its_routed_rows():
    """Mixtral-8x7B: 2048 tokens x top-2 rows of the fused gate/up, activation and product (4 x 14336 wide,
    bf16) and the weighted rows in fp32; a dense stack of the same widths: gate, up, product of 2048 tokens."""
    from types import SimpleNamespace

    from airquant.config import MLP_CHUNK_TOKENS
    from airquant.engine.memory.placement import mlp_chunk_bytes

    dense = SimpleNamespace(hidden_size=4096, intermediate_size=14336)
    moe = SimpleNamespace(hidden_size=4096, intermediate_size=14336, num_experts_per_tok=2)
    rows = MLP_CHUNK_TOKENS * 2
    assert mlp_chunk_bytes(dense, 10**6, 2) == MLP_CHUNK_TOKENS * 3 * 14336 * 2
    assert mlp_chunk_bytes(moe, 10**6, 2) == rows * 4 * 14336 * 2 + rows * 4096 * 8 + MLP_CHUNK_TOKENS * 4096 * 4
    qwen3 = SimpleNamespace(hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768, num_experts_per_tok=8)
    assert mlp_chunk_bytes(qwen3, 100, 2) == 100 * 8 * (4 * 768 * 2 + 2048 * 8) + 100 * 2048 * 4


def test_a_sampling_top_k_is_not_a_moe_top_k():
    """An older config's ``top_k`` (sampling's) leaves a dense stack's MLP term dense."""
    from types import SimpleNamespace

    from airquant.engine.memory.placement import mlp_chunk_bytes, top_k_of

    old = SimpleNamespace(hidden_size=4096, intermediate_size=11008, top_k=50)
    assert top_k_of(old) == 0 and mlp_chunk_bytes(old, 100, 2) == 100 * 3 * 11008 * 2
    assert top_k_of(SimpleNamespace(num_experts_per_tok=2)) == 2
