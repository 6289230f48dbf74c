"""The planner's host-RAM figure is what the engine allocates: the host embedding table, the read-ahead staging
buffers, the RAM tier and a routed MoE run's expert staging, part by part, on synthetic 70B- and Mixtral-shaped
NF4 stores cut down to a few tiny layers.

The planner counts shard files (``entry.bytes``); the engine holds their data sections (the embedding table
cast to the compute dtype). The difference is exactly the safetensors headers, so the tests check both sides
to the byte."""

import sys

import pytest
import torch

from airquant.config import EngineConfig, GenerateConfig
from airquant.engine.cuda_ops import HostMemory, pinned_allocator_bytes
from airquant.engine.memory.placement import fixed_bytes
from airquant.engine.memory.planner import GIB, ModelDims, reserve_of, workload_for
from airquant.engine.moe.pool import ExpertPool
from airquant.engine.runner import Engine, placement_for
from airquant.engine.skeleton import load_config
from airquant.engine.streamer import read_layout
from airquant.store.manifest import load_manifest

TINY = (("hidden", 256), ("intermediate", 512), ("heads", 4), ("kv_heads", 2), ("vocab", 4096))
LAYERS = 6


def _wl(**fields):
    """A Workload whose KV cache stays on the device unless a test asks otherwise."""
    return workload_for(EngineConfig(kv_offload=False), **fields)


def _synth(tmp_path_factory, tokenizer, shape: str, overrides=TINY):
    pytest.importorskip("bitsandbytes")
    from airquant.store.synth import SynthSpec, synth

    store = tmp_path_factory.mktemp("host-ram") / f"{shape}-nf4"
    synth(SynthSpec(shape, "nf4", layers=LAYERS, overrides=overrides), store, device="cpu", progress=False,
          tokenizer=tokenizer)
    return store


@pytest.fixture(scope="module")
def nf4_store(tmp_path_factory, real_tokenizer):
    return _synth(tmp_path_factory, real_tokenizer, "llama3-70b")


@pytest.fixture(scope="module")
def moe_store(tmp_path_factory, real_tokenizer):
    """Mixtral's shape, tiny: 4 experts of which 2 routed per token, every layer a MoE layer."""
    return _synth(tmp_path_factory, real_tokenizer, "mixtral-8x7b", TINY + (("experts", 4), ("top_k", 2)))


def _ram_gib(store, ram_layers: float, experts: str = "auto") -> float:
    """A --max-ram (CPU) that holds the host parts, the staging buffers and ``ram_layers`` layers."""
    manifest = load_manifest(store)
    wl = _wl(batch_size=2, context=32, host_embedding=True, experts=experts)
    reserve = reserve_of(manifest, ModelDims.of(load_config(store)), wl, "none", 4, gpu=False).total
    fixed = sum(fixed_bytes(manifest.shards, manifest.tied_lm_head, True, 4))  # the table held in fp32
    layer = max(manifest.layer_bytes)
    return (fixed + reserve + wl.staging * layer + ram_layers * layer) / GIB


def _file_and_data(store, file: str) -> tuple[int, int]:
    lay = read_layout(store / file)
    return lay.data_offset + lay.nbytes, lay.nbytes


def _run_and_measure(store, experts: str, ram_layers: float, tiers: list[str]):
    """Open ``store`` on CPU under the --max-ram that holds ``ram_layers`` layers, generate, and return the
    plan, its host parts and what the engine's buffers hold."""
    manifest = load_manifest(store)
    cfg = EngineConfig(device="cpu", max_ram_gb=_ram_gib(store, ram_layers, experts), batch_size=2, context=32,
                       host_embedding=True, dtype="float32", experts=experts)
    engine = Engine.open(store, cfg)
    try:
        plan = engine.plan
        assert plan.tiers == tiers
        ids = torch.randint(17, 4096, (2, 8), generator=torch.Generator().manual_seed(0))
        engine.generate_requests([engine.request(row, GenerateConfig(max_new_tokens=2, ignore_eos=True))
                                  for row in ids.tolist()])
        if experts == "routed":  # the pool ran, and is the planner's (sized once, in planner.plan)
            assert engine.experts.bytes_copied > 0 and engine.experts.plan == plan.experts
        return plan, plan.host_parts(manifest.layer_bytes), engine.host_memory()
    finally:
        engine.close()


TIERS = [(2.5, ["ram"] * 2 + ["disk"] * 4), (LAYERS + 1, ["ram"] * LAYERS)]


@pytest.mark.parametrize("ram_layers, tiers", TIERS, ids=["ram+disk", "all-ram"])
def test_planned_host_parts_are_what_the_engine_holds(nf4_store, ram_layers, tiers):
    _check_parts(nf4_store, *_run_and_measure(nf4_store, "auto", ram_layers, tiers))


@pytest.mark.parametrize("ram_layers, tiers", TIERS, ids=["ram+disk", "all-ram"])
def test_routed_moe_host_parts_are_what_the_engine_holds(moe_store, ram_layers, tiers):
    """A routed MoE run on CPU: the layers' parts as for a dense store, and the expert pool's host staging
    (none on CPU: disk-tier experts are read straight into the pool's slots) planned and held alike."""
    plan, planned, held = _run_and_measure(moe_store, "routed", ram_layers, tiers)
    assert planned["expert_staging"] == held["expert_staging"] == 0
    _check_parts(moe_store, plan, planned, held)


def _check_parts(store, plan, planned: dict, held: dict) -> None:
    """Each part planned (shard files) and held (their data sections, the table in fp32) to the byte."""
    manifest = load_manifest(store)
    sizes = {i: _file_and_data(store, manifest.shards[f"layer.{i}"].file) for i in range(LAYERS)}
    ram = plan.ram_layers
    assert (planned["ram_tier"], held["ram_tier"]) == (sum(sizes[i][0] for i in ram), sum(sizes[i][1] for i in ram))
    staged = 3 if plan.disk_layers else 0  # READAHEAD + 1 buffers, each the largest layer
    assert planned["staging"] == staged * max(s[0] for s in sizes.values())
    assert held["staging"] == staged * max(s[1] for s in sizes.values())
    # The bf16 table is held in the fp32 compute dtype: twice its data, and counted so.
    embed = read_layout(store / manifest.shards["embed"].file)
    assert held["embedding"] == 2 * embed.nbytes and planned["embedding"] == embed.data_offset + 2 * embed.nbytes
    assert planned["kv_offload"] == held["kv_offload"] == 0
    assert held["other_pinned"] == held["pinned_rounding"] == 0  # nothing pinned on CPU
    # And the budget the planner filled holds what was allocated.
    assert sum(held.values()) <= sum(planned.values()) <= plan.ram_budget_bytes


class FakeOps:
    """The device side of ``ExpertPool`` (its slot memory) on the CPU: the host side is what is measured."""

    stream = None

    def alloc(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8)


def _gpu_plan(store, ram_gib: float):
    """The plan of a routed run with every layer streamed, for a 64 GiB GPU (none touched)."""
    cfg = EngineConfig(max_vram_gb=64, max_ram_gb=ram_gib, resident_layers=0, batch_size=2, context=32,
                       host_embedding=True, dtype="float32", experts="routed")
    return placement_for(load_manifest(store), cfg, torch.device("cuda"), load_config(store), torch.float32)


@pytest.mark.parametrize("disk", [True, False], ids=["ram+disk", "all-ram"])
def test_expert_staging_is_planned_inside_the_host_budget_and_held_exactly(moe_store, monkeypatch, disk):
    """On a GPU a routed layer read from disk has its experts read into host staging buffers, one per working
    slot of the pool: the planner counts them in --max-ram (the RAM tier gives way) and the pool pins exactly
    that; with every layer in the RAM tier there are none."""
    manifest = load_manifest(moe_store)
    layer = max(manifest.layer_bytes)
    roomy = _gpu_plan(moe_store, 1.0)
    pool = roomy.experts
    assert roomy.ram_layers == list(range(LAYERS)) and pool.staging == 0  # nothing from disk: no staging
    host_fixed = roomy.host_fixed_bytes
    expert_staging = pool.work * pool.slot_bytes
    if disk:  # the read-ahead buffers, the expert staging and 1.1 layers: less than every layer
        assert 3 * layer + expert_staging + layer * 11 // 10 < sum(manifest.layer_bytes)
        plan = _gpu_plan(moe_store, (host_fixed + 3 * layer + expert_staging + layer * 11 // 10) / GIB)
        assert plan.tiers == ["ram"] + ["disk"] * (LAYERS - 1)
        assert plan.experts.staging == pool.work and plan.expert_staging_bytes == expert_staging
    else:
        plan = roomy
    planned = plan.host_parts(manifest.layer_bytes)
    assert planned["expert_staging"] == plan.experts.staging_bytes
    assert sum(planned.values()) <= plan.ram_budget_bytes
    fake = FakeCudart()
    monkeypatch.setattr(torch.cuda, "cudart", lambda: fake)
    memory = HostMemory(pinned=True)
    made = ExpertPool({}, plan.experts, torch.device("cpu"), torch.float32, FakeOps(), memory, lambda i: None, {})
    assert made.staging_held() == memory.pinned_bytes()["registered"] == planned["expert_staging"]
    memory.close()


def test_plan_prints_its_host_ram_buffers(nf4_store):
    manifest = load_manifest(nf4_store)
    cfg = EngineConfig(device="cpu", max_ram_gb=_ram_gib(nf4_store, 2.5), batch_size=2, context=32,
                       host_embedding=True, dtype="float32")
    engine = Engine.open(nf4_store, cfg)
    try:
        text = engine.plan.describe(manifest.layer_bytes)
    finally:
        engine.close()
    line = next(line for line in text.splitlines() if line.startswith("host RAM buffers"))
    assert "embedding" in line and "staging" in line and "ram_tier" in line and "budget" in line


def test_pinned_allocator_rounds_up_to_a_power_of_two():
    assert pinned_allocator_bytes(481_000_000) == 512 << 20  # a 70B NF4 layer: 31 MB more than asked
    assert pinned_allocator_bytes(1 << 29) == 1 << 29
    assert pinned_allocator_bytes(1) == 1 and pinned_allocator_bytes(0) == 0


class FakeCudart:
    """``torch.cuda.cudart()``'s registration calls, recorded (no GPU here)."""

    def __init__(self):
        self.registered: dict[int, int] = {}

    def cudaHostRegister(self, ptr, nbytes, flags):
        self.registered[ptr] = nbytes
        return 0

    def cudaHostUnregister(self, ptr):
        del self.registered[ptr]
        return 0


def test_host_memory_registers_exact_sizes_and_counts_them(monkeypatch):
    fake = FakeCudart()
    monkeypatch.setattr(torch.cuda, "cudart", lambda: fake)
    memory = HostMemory(pinned=True)
    a, b = memory.empty(1000), memory.empty(3000)
    memory.empty(500, pinned=False)  # pageable: neither registered nor counted
    assert sorted(fake.registered.values()) == [1000, 3000]
    assert memory.pinned_bytes() == {"registered": 4000, "allocator": 0, "rounding": 0}
    memory.free(a)
    assert memory.pinned_bytes()["registered"] == 3000 and list(fake.registered.values()) == [3000]
    memory.close()
    assert fake.registered == {} and memory.pinned_bytes()["registered"] == 0
    del b


def test_huge_page_buffers_start_on_2_mb_and_are_advised_before_registration(monkeypatch):
    """``HostMemory.empty(huge_pages=True)`` (measured against the RAM tier's 4 KB pages by ``uva_bench.py
    --host-memory``): the buffer starts on a 2 MB boundary, Linux accepts its ``MADV_HUGEPAGE`` advice, and it is
    registered at its exact size after the advice."""
    from airquant.engine import cuda_ops

    fake, order = FakeCudart(), []
    monkeypatch.setattr(torch.cuda, "cudart", lambda: fake)
    advise = cuda_ops.advise_huge_pages
    monkeypatch.setattr(cuda_ops, "advise_huge_pages", lambda buf: order.append(("advise", advise(buf))) or True)
    register = fake.cudaHostRegister
    monkeypatch.setattr(fake, "cudaHostRegister", lambda *a: order.append(("register",)) or register(*a))
    memory = HostMemory(pinned=True)
    buf = memory.empty(5 << 20, huge_pages=True)
    assert buf.data_ptr() % (2 << 20) == 0 and buf.numel() == 5 << 20
    assert order == [("advise", sys.platform.startswith("linux")), ("register",)]
    assert list(fake.registered.values()) == [5 << 20]
    memory.close()


@pytest.mark.parametrize("refused", [False, True], ids=["registered", "refused"])
def test_a_host_embedding_table_is_page_locked_at_its_exact_size(monkeypatch, refused):
    """``--host-embedding`` on CUDA: the table is copied into host memory registered at its exact size (torch's
    ``pin_memory`` would hold the next power of two: 4 GB for a 70B model's 2.1 GB table), so the GPU can read the
    rows of ids it holds; where the host refuses to lock it, the table stays as it was, pageable."""
    from airquant.engine.skeleton import _page_locked

    fake = FakeCudart()
    if refused:
        monkeypatch.setattr(fake, "cudaHostRegister", lambda *a: 2)
    fake.cudaGetLastError = lambda: 0
    monkeypatch.setattr(torch.cuda, "cudart", lambda: fake)
    table = torch.randn(1000, 24, dtype=torch.bfloat16)
    locked, memory = _page_locked(table)
    if refused:
        assert locked is table and memory is None and fake.registered == {}
        return
    assert torch.equal(locked, table) and locked.data_ptr() != table.data_ptr() and locked.is_contiguous()
    assert list(fake.registered.values()) == [1000 * 24 * 2] and locked.data_ptr() in fake.registered
    assert memory.pinned_bytes() == {"registered": 48_000, "allocator": 0, "rounding": 0}
    memory.close()
    assert fake.registered == {}
