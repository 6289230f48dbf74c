"""One planner: ``airquant plan`` and the engine place a store the same way with the same flags, and a plan
(expert pool included) never fills more than the VRAM budget less the allocator's margin."""

from dataclasses import replace

import pytest
import torch

from airquant.cli import main
from airquant.config import EngineConfig
from airquant.engine import skeleton
from airquant.engine.memory.placement import PlanError, fixed_bytes
from airquant.engine.memory.planner import (
    GIB,
    MARGIN_MIN_BYTES,
    READAHEAD,
    SLOTS,
    Hardware,
    ModelDims,
    allocator_margin,
    reserve_of,
    workload_for,
)
from airquant.engine.memory.router import Candidate, route
from airquant.engine.moe.sizing import ExpertsError
from airquant.engine.runner import Engine, placement_for
from airquant.store.manifest import load_manifest

GB = 10**9


def _wl(**fields):
    """A Workload whose KV cache stays on the device unless a test asks otherwise."""
    return workload_for(EngineConfig(kv_offload=False), **fields)


def test_allocator_margin_is_three_percent_or_256_mib():
    assert allocator_margin(15 * GIB) == int(15 * GIB * 0.03)
    assert allocator_margin(4 * GIB) == MARGIN_MIN_BYTES == 256 << 20  # 3 % of 4 GiB is only 123 MiB
    assert Hardware(15 * GIB, GB).plan_vram == 15 * GIB - int(15 * GIB * 0.03)
    assert Hardware(None, GB).plan_vram is None


def test_engine_defaults_are_the_planner_constants():
    assert (EngineConfig().slots, EngineConfig().readahead) == (SLOTS, READAHEAD)
    assert _wl().staging == READAHEAD + 1


def _plan_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.strip()]


@pytest.fixture(scope="module")
def six_layers(tmp_path_factory, real_tokenizer):
    from airquant.models import resolve
    from airquant.store.split import split
    from tests.conftest import make_tiny_model

    root = tmp_path_factory.mktemp("planner-cpu")
    split(resolve(str(make_tiny_model(root / "model", real_tokenizer, layers=6))), root / "store", dtype="float32",
          progress=False)
    return root / "store"


def test_plan_and_engine_agree_on_cpu(six_layers, capsys):
    """A RAM budget that holds the read-ahead buffers and one and a half layers: resident does not fit, so
    ``airquant plan`` streams; the engine opened with the same flags places the layers identically."""
    tiny_store = six_layers
    manifest = load_manifest(tiny_store)
    dims = ModelDims.of(skeleton.load_config(tiny_store))
    wl = _wl(batch_size=2, context=64)
    reserve = reserve_of(manifest, dims, wl, "none", 4, gpu=False).total
    fixed = sum(manifest.shards[g].bytes for g in ("embed", "norm", "lm_head") if g in manifest.shards)
    layer = max(manifest.layer_bytes)
    ram_gib = (fixed + reserve + (READAHEAD + 1) * layer + 3 * layer // 2) / GIB
    flags = ["--device", "cpu", "--max-ram", repr(ram_gib), "--context", "64"]
    assert main(["plan", str(tiny_store), "--kv", "none", "--batch", "2"] + flags) == 0
    out = capsys.readouterr().out
    engine = Engine.open(tiny_store, device="cpu", max_ram_gb=ram_gib, batch_size=2, context=64)
    try:
        plan = engine.plan
        assert plan.tiers == ["ram"] + ["disk"] * (manifest.num_layers - 1)  # 1.5 layers of RAM tier: one
        text = plan.describe(manifest.layer_bytes)
        assert "streamed" in out and all(line in out for line in _plan_lines(text))  # the same plan, printed
        assert plan.reserve_bytes == reserve and not plan.kv_offload
        assert engine.generate(["Hi"], max_new_tokens=2)  # and it runs with that plan
    finally:
        engine.close()


@pytest.fixture(scope="module")
def llama8b(tmp_path_factory):
    from test_router import manifest_store  # tests/engine is on sys.path

    return manifest_store(tmp_path_factory.mktemp("planner") / "8b", "llama3-8b", "bfloat16")


@pytest.mark.parametrize("cap, batch, context, offload", [
    ("6", 1, 2048, False),  # some layers resident, the rest from the RAM tier
    ("10", 28, 2048, True),  # the plain cache does not fit beside the weights: offloaded
    ("24", 1, 2048, False),  # streamed by request (--resident-layers unset): every layer fits in VRAM
])
def test_plan_and_engine_agree_under_a_mocked_gpu_budget(llama8b, capsys, cap, batch, context, offload):
    """``airquant plan --max-vram`` (planned for that GPU without one) and the engine's plan for a capped
    CUDA device (no GPU touched) from the same flags: same tiers, slots, reserve, KV offload."""
    flags = ["--max-vram", cap, "--max-ram", "64", "--context", str(context), "--kv", "none"]
    assert main(["plan", str(llama8b), "--batch", str(batch)] + flags) == 0
    out = capsys.readouterr().out
    cfg = EngineConfig(max_vram_gb=float(cap), max_ram_gb=64, batch_size=batch, context=context)
    plan = placement_for(load_manifest(llama8b), cfg, torch.device("cuda"), skeleton.load_config(llama8b),
                    torch.bfloat16)
    assert plan.kv_offload == offload
    if cap == "24":  # the router keeps every layer resident without streaming; the engine streams none
        assert plan.slots == 0 and len(plan.vram_layers) == 32 and "resident" in out
        return
    assert all(line in out for line in _plan_lines(plan.describe(load_manifest(llama8b).layer_bytes)))
    assert plan.device_bytes <= Hardware(int(float(cap) * GIB), 64 * GIB).plan_vram


# -- the expert pool inside the budget --------------------------------------------------------------
@pytest.fixture(scope="module")
def mixtral(tmp_path_factory, real_tokenizer):
    from airquant.models import resolve
    from airquant.store.split import split
    from tests.zoo import make_model

    root = tmp_path_factory.mktemp("planner-moe")
    split(resolve(str(make_model(root / "model", real_tokenizer, "mixtral", layers=8))), root / "store", dtype="float32",
          progress=False)
    return root / "store"


def _floor(store) -> int:
    """The smallest budget a routed streamed plan of ``store`` needs with no resident layer, no dense part kept
    resident and no cache."""
    cfg = EngineConfig(max_vram_gb=64, max_ram_gb=1, resident_layers=0, expert_cache_gb=0.0, context=64,
                       dense_resident=False)
    plan = placement_for(load_manifest(store), cfg, torch.device("cuda"), skeleton.load_config(store), torch.float32)
    return plan.device_bytes


@pytest.mark.parametrize("cache_gb", [None, 0.0, 0.001])
@pytest.mark.parametrize("extra_layers", [0, 0.5, 1, 2, 3, 10])
def test_plan_bytes_never_exceed_the_budget(mixtral, cache_gb, extra_layers):
    """fixed + slots + reserve + resident layers + expert arena + cache <= budget less the margin, over
    budgets from the bare floor to everything resident; the arena comes before resident layers."""
    manifest = load_manifest(mixtral)
    layer = max(manifest.layer_bytes)
    fill = _floor(mixtral) + int(extra_layers * layer) + (int(cache_gb * GIB) if cache_gb else 0)
    budget = fill + MARGIN_MIN_BYTES  # small budgets: the margin is its 256 MiB floor
    cfg = EngineConfig(max_vram_gb=budget / GIB, max_ram_gb=1, context=64, expert_cache_gb=cache_gb)
    plan = placement_for(manifest, cfg, torch.device("cuda"), skeleton.load_config(mixtral), torch.float32)
    hw = Hardware(int(budget / GIB * GIB), GIB)
    assert plan.experts_fit and plan.margin_bytes == allocator_margin(hw.vram_bytes)
    streamed = [i for i, t in enumerate(plan.tiers) if t != "vram"]
    if streamed:  # a routed run: its pool is planned, and counted
        assert plan.experts is not None and plan.expert_bytes == plan.experts.arena_bytes
    assert plan.device_bytes == (plan.fixed_bytes + plan.slots * plan.slot_bytes + plan.reserve_bytes
                                 + sum(manifest.layer_bytes[i] for i in plan.vram_layers) + plan.expert_bytes
                                 + plan.dense_bytes)
    assert plan.device_bytes <= hw.plan_vram <= hw.vram_bytes
    if extra_layers == 0 and not cache_gb:  # the floor itself: no layer resident, the arena got the room
        assert plan.vram_layers == []
    text = plan.describe(manifest.layer_bytes)
    assert "device total" in text and ("experts   : routed" in text) == bool(streamed)


def test_resident_layers_give_way_to_the_expert_arena(mixtral):
    """Half a layer above the routed floor (dense slots + the arena of one call): the whole-layer plan keeps
    a layer resident in that VRAM, the routed plan keeps none and plans its arena there instead."""
    manifest, config = load_manifest(mixtral), skeleton.load_config(mixtral)
    fill = _floor(mixtral) + max(manifest.layer_bytes) // 2
    cfg = EngineConfig(max_vram_gb=(fill + MARGIN_MIN_BYTES) / GIB, max_ram_gb=1, context=64)
    whole = placement_for(manifest, replace(cfg, experts="whole"), torch.device("cuda"), config, torch.float32)
    routed = placement_for(manifest, cfg, torch.device("cuda"), config, torch.float32)
    assert whole.vram_layers and whole.experts is None
    assert routed.vram_layers == [] and routed.experts is not None and routed.experts_fit
    assert routed.expert_bytes >= routed.experts.work * routed.experts.slot_bytes + routed.experts.gather_bytes
    assert routed.device_bytes <= fill


def _plan_of(store, **settings):
    cfg = EngineConfig(max_ram_gb=1, context=64, **settings)
    return placement_for(load_manifest(store), cfg, torch.device("cuda"), skeleton.load_config(store), torch.float32)


def _dense_of(store) -> list[int]:
    """Each layer's dense part: what a routed run streams through the slots (planner.stream_bytes)."""
    from airquant.engine.moe.sizing import dense_bytes

    manifest = load_manifest(store)
    return [dense_bytes(manifest.shards[f"layer.{i}"]) for i in range(manifest.num_layers)]


def test_dense_parts_of_routed_layers_stay_in_vram_before_the_expert_cache(mixtral):
    """With room, every streamed routed layer's dense part is planned in VRAM (counted in the device total), and
    the expert cache, which takes what is left, is that much smaller; --no-dense-resident streams them."""
    dense = _dense_of(mixtral)
    budget = (_floor(mixtral) + sum(dense) + 40 * max(dense) + MARGIN_MIN_BYTES) / GIB
    on = _plan_of(mixtral, max_vram_gb=budget, resident_layers=0)
    off = _plan_of(mixtral, max_vram_gb=budget, resident_layers=0, dense_resident=False)
    assert off.dense_layers == [] and off.dense_bytes == 0
    assert on.dense_layers == list(range(8)) and on.dense_bytes == sum(dense)
    assert on.experts.cache < off.experts.cache  # the cache gave way
    assert off.expert_bytes - on.expert_bytes <= on.dense_bytes
    for plan in (on, off):
        assert plan.device_bytes <= Hardware(int(budget * GIB), GIB).plan_vram
    text = on.describe(load_manifest(mixtral).layer_bytes)
    assert "MoE dense parts in VRAM : layers 0-7" in text and "kept in VRAM" in "\n".join(on.reasons)
    assert "MoE dense parts" not in off.describe(load_manifest(mixtral).layer_bytes)


def test_dense_parts_stream_where_kept_they_would_starve_the_hot_set(mixtral):
    """A cache left to the planner: dense parts kept in VRAM only where the hot set then still holds every expert a
    step routes (8 layers x top-2 = 16 here); below that they stream, the hot set the larger by their bytes, and the
    plan says why. A cache of a given size takes nothing from them: they stay."""
    dense = _dense_of(mixtral)

    def budget(slots_of_dense: int) -> float:
        return (_floor(mixtral) + sum(dense) + slots_of_dense * max(dense) + MARGIN_MIN_BYTES) / GIB

    tight, roomy = budget(20), budget(40)
    starved = _plan_of(mixtral, max_vram_gb=tight, resident_layers=0)
    streaming = _plan_of(mixtral, max_vram_gb=tight, resident_layers=0, dense_resident=False)
    assert starved.dense_layers == [] and starved.experts.cache == streaming.experts.cache < 16
    why = "\n".join(starved.reasons)
    assert "MoE dense parts streamed" in why and "fewer than the 16 experts a step routes" in why
    kept = _plan_of(mixtral, max_vram_gb=roomy, resident_layers=0)
    assert kept.dense_layers == list(range(8)) and kept.experts.cache >= 16
    fixed = _plan_of(mixtral, max_vram_gb=tight, resident_layers=0, expert_cache_gb=0.0)
    assert fixed.dense_layers == list(range(8))


@pytest.fixture(scope="module")
def mixtral_nf4(tmp_path_factory, real_tokenizer):
    """8 layers of NF4 experts the fused kernels take (every matrix's inputs a multiple of the 64-blocks)."""
    from airquant.models import resolve
    from airquant.quant import QuantSpec
    from airquant.store.quantize import make_transform
    from airquant.store.split import split
    from tests.zoo import make_model

    root = tmp_path_factory.mktemp("planner-moe-nf4")
    source = resolve(str(make_model(root / "model", real_tokenizer, "mixtral", layers=8, hidden_size=64,
                                    intermediate_size=128)))
    transform, record = make_transform(source, QuantSpec(method="nf4"))
    split(source, root / "store", dtype="float32", quant=record, transform=transform, progress=False)
    return root / "store"


def test_fused_prefill_gives_the_prefill_arena_to_a_starved_decode(mixtral_nf4, monkeypatch):
    """On a GPU whose Triton runs the fused kernels, a routed plan whose gather and stacked decode would leave the
    hot set short of the experts a step routes (so its dense parts would stream) plans the prefill by the fused
    kernels from the slots instead: no gather, no stacked decode, dense parts kept, a hot set that holds a step,
    and a ``why`` line; with room for both, the stacked prefill (faster) stays; without Triton, never."""
    from airquant.engine.moe import sizing
    from airquant.engine.moe.sizing import CACHE_FRACTION
    from airquant.quant import kernels

    store, need = mixtral_nf4, 8 * 2  # 8 layers x top-2
    dense = _dense_of(store)
    slot = sizing.plan_experts(load_manifest(store), None).slot_bytes

    def budget(slots: int) -> float:
        return (_floor(store) + sum(dense) + slots * slot / CACHE_FRACTION + MARGIN_MIN_BYTES) / GIB

    tight, roomy = budget(need - 2), budget(need + 4)
    plain = _plan_of(store, max_vram_gb=tight, resident_layers=0)
    assert not plain.experts.fused and plain.dense_layers == []  # no Triton here: dense parts streamed
    monkeypatch.setattr(kernels, "triton_available", lambda: True)
    fused = _plan_of(store, max_vram_gb=tight, resident_layers=0)
    assert fused.experts.fused and (fused.experts.gather_bytes, fused.experts.decode_bytes) == (0, 0)
    assert fused.dense_layers == list(range(8)) and fused.experts.cache >= need
    assert fused.device_bytes <= Hardware(int(tight * GIB), GIB).plan_vram
    why = "\n".join(fused.reasons)
    assert "routed prefills by the fused kernels" in why
    assert "8 dense parts of streamed MoE layers would not stay" in why
    assert "prefill by the fused kernels" in fused.describe(load_manifest(store).layer_bytes)
    kept = _plan_of(store, max_vram_gb=roomy, resident_layers=0)
    assert not kept.experts.fused and kept.experts.gather_bytes > 0 and kept.dense_layers == list(range(8))


def test_dense_parts_come_before_resident_whole_layers_and_fill_what_is_left(mixtral):
    """A budget that holds a whole layer beside the routed floor: the whole layer gives way to the dense parts
    (each read every step); a budget with room for some dense parts only keeps those that fit, in layer order."""
    manifest, dense = load_manifest(mixtral), _dense_of(mixtral)
    roomy = (_floor(mixtral) + max(manifest.layer_bytes) + MARGIN_MIN_BYTES) / GIB
    assert _plan_of(mixtral, max_vram_gb=roomy, expert_cache_gb=0.0, dense_resident=False).vram_layers
    plan = _plan_of(mixtral, max_vram_gb=roomy, expert_cache_gb=0.0)
    assert len(plan.dense_layers) + len(plan.vram_layers) == 8 and plan.dense_layers
    assert plan.device_bytes <= Hardware(int(roomy * GIB), GIB).plan_vram
    tight = (_floor(mixtral) + 3 * max(dense) + max(dense) // 2 + MARGIN_MIN_BYTES) / GIB
    some = _plan_of(mixtral, max_vram_gb=tight, resident_layers=0, expert_cache_gb=0.0)
    assert some.dense_layers == [0, 1, 2] and any("the rest do not fit" in why for why in some.reasons)
    assert some.device_bytes <= Hardware(int(tight * GIB), GIB).plan_vram


def test_no_dense_parts_are_kept_with_an_offloaded_cache_or_whole_layers(mixtral):
    """An offloaded KV cache moves with each streamed layer's copy, and whole-layer streaming has no dense part of
    its own: neither plan keeps dense parts in VRAM."""
    assert _plan_of(mixtral, max_vram_gb=64, resident_layers=0, kv_offload=True).dense_layers == []
    assert _plan_of(mixtral, max_vram_gb=64, resident_layers=0, experts="whole").dense_layers == []


def test_experts_on_the_host_keep_the_dense_parts_on_the_gpu(mixtral):
    """--experts cpu: the routed experts are computed from the RAM tier, the layers' dense parts stay in VRAM."""
    plan = _plan_of(mixtral, max_vram_gb=64, resident_layers=0, experts="cpu")
    assert plan.experts_host and plan.dense_layers == list(range(8)) and plan.dense_bytes == sum(_dense_of(mixtral))


def test_plan_and_engine_agree_on_a_routed_moe_store(mixtral, capsys):
    budget = _floor(mixtral) + MARGIN_MIN_BYTES + max(load_manifest(mixtral).layer_bytes) // 2
    flags = ["--max-vram", repr(budget / GIB), "--max-ram", "1", "--context", "64", "--kv", "none"]
    assert main(["plan", str(mixtral), "--device", "cpu"] + flags) == 0
    out = capsys.readouterr().out
    cfg = EngineConfig(max_vram_gb=budget / GIB, max_ram_gb=1, context=64)
    plan = placement_for(load_manifest(mixtral), cfg, torch.device("cuda"), skeleton.load_config(mixtral),
                         torch.float32)
    assert plan.experts is not None and "streamed" in out and "experts   : routed" in out
    assert all(line in out for line in _plan_lines(plan.describe(load_manifest(mixtral).layer_bytes)))
    assert Candidate.open(mixtral).dims == ModelDims.of(skeleton.load_config(mixtral))  # one ModelDims


def test_the_engine_refuses_a_plan_whose_expert_arena_does_not_fit(mixtral):
    """The planner decides whether the arena fits; the engine takes its figures and refuses with the fix
    rather than re-sizing the pool against a second spare-VRAM figure of its own."""
    manifest, config = load_manifest(mixtral), skeleton.load_config(mixtral)
    floor = EngineConfig(max_vram_gb=64, max_ram_gb=1, resident_layers=0, expert_cache_gb=0.0, context=64)
    arena = placement_for(manifest, floor, torch.device("cuda"), config, torch.float32).expert_bytes
    budget = _floor(mixtral) - arena // 2 + MARGIN_MIN_BYTES  # the layers' floor fits, not the arena beside it
    cfg = replace(floor, max_vram_gb=budget / GIB)
    plan = placement_for(manifest, cfg, torch.device("cuda"), config, torch.float32)
    assert not plan.experts_fit and "does NOT fit" in plan.describe(manifest.layer_bytes)
    with pytest.raises(ExpertsError, match=r"do not fit the .* GB the layer plan leaves; lower --expert-cache"):
        Engine.open(mixtral, EngineConfig(device="cpu", context=64, expert_cache_gb=0.0), placement=plan)


def test_the_engine_refuses_a_plan_without_an_expert_pool(mixtral):
    manifest, config = load_manifest(mixtral), skeleton.load_config(mixtral)
    cfg = EngineConfig(max_vram_gb=64, max_ram_gb=1, resident_layers=0, context=64, experts="whole")
    whole = placement_for(manifest, cfg, torch.device("cuda"), config, torch.float32)
    assert whole.experts is None
    with pytest.raises(ExpertsError, match="no expert pool.*--experts"):
        Engine.open(mixtral, EngineConfig(device="cpu", context=64, experts="routed"), placement=whole)


def test_route_counts_the_host_embedding_in_the_compute_dtype(mixtral):
    """--host-embedding computing in bf16 from an fp32 store: the table is held, and planned, in bf16. The
    router's resident option and the planner's streamed one count it with the same function."""
    manifest = load_manifest(mixtral)
    held = fixed_bytes(manifest.shards, manifest.tied_lm_head, True, 2)[1]
    assert held < manifest.shards["embed"].bytes  # narrower than stored
    hw = Hardware(64 * GIB, GIB)
    for mode in ("resident", "streamed"):
        wl = _wl(context=64, mode=mode, host_embedding=True, dtype="bfloat16", kv_schemes=("none",))
        found = route([Candidate.open(mixtral)], hw, wl)
        assert found.mode == mode and found.plan.host_fixed_bytes == held


def test_the_engine_plans_the_reserve_in_the_kv_format_it_was_sized_for(llama8b):
    """A batch sized for TurboQuant K4/V2 (the router's arithmetic) and opened as plain asked for the plain
    cache's reserve: under 15 GB a 70B NF4 job's engine stopped at open (issue 38). Planned with the format it
    runs, the reserve holds the compressed cache and the batch fits where the plain one does not."""
    from airquant.engine.memory.router import Candidate, route, workload_for

    manifest, config = load_manifest(llama8b), skeleton.load_config(llama8b)
    hw = Hardware(int(10 * GIB), 64 * GIB)
    base = EngineConfig(max_vram_gb=10, max_ram_gb=64, context=8192, kv_offload=False)
    tq_batch = route([Candidate.open(llama8b)], hw, workload_for(base, kv_schemes=("tq",), kv_offload=False)).max_batch
    cfg = replace(base, batch_size=tq_batch)
    with pytest.raises(PlanError, match="reserve"):
        placement_for(manifest, cfg, torch.device("cuda"), config, torch.bfloat16, hardware=hw)
    tq = placement_for(manifest, replace(cfg, kv_cache="tq"), torch.device("cuda"), config, torch.bfloat16, hardware=hw)
    assert tq_batch > 1 and tq.device_bytes <= hw.plan_vram
