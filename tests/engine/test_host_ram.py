"""The planner's host-RAM figure is what the engine allocates: the host embedding table, the read-ahead staging
buffers and the RAM tier, part by part, on a synthetic 70B-shaped NF4 store cut down to a few tiny layers.

The planner counts shard files (``entry.bytes``); the engine holds their data sections (the embedding table
cast to the compute dtype). The difference is exactly the safetensors headers, so the tests check both sides
to the byte."""

import pytest
import torch

from airquant.config import EngineConfig, GenerateConfig
from airquant.engine.cuda_ops import HostMemory, pinned_allocator_bytes
from airquant.engine.plan import fixed_bytes
from airquant.engine.planner import GIB, ModelDims, Workload, reserve_of
from airquant.engine.runner import Engine
from airquant.engine.skeleton import load_config
from airquant.engine.streamer import read_layout
from airquant.store.manifest import load_manifest

TINY = (("hidden", 256), ("intermediate", 512), ("heads", 4), ("kv_heads", 2), ("vocab", 4096))
LAYERS = 6


@pytest.fixture(scope="module")
def nf4_store(tmp_path_factory, real_tokenizer):
    pytest.importorskip("bitsandbytes")
    from airquant.store.synth import SynthSpec, synth

    store = tmp_path_factory.mktemp("host-ram") / "llama3-70b-nf4"
    synth(SynthSpec("llama3-70b", "nf4", layers=LAYERS, overrides=TINY), store, device="cpu", progress=False,
          tokenizer=real_tokenizer)
    return store


def _ram_gib(store, ram_layers: float) -> float:
    """A --max-ram (CPU) that holds the host parts, the staging buffers and ``ram_layers`` layers."""
    manifest = load_manifest(store)
    wl = Workload(batch_size=2, context=32, host_embedding=True)
    reserve = reserve_of(manifest, ModelDims.of(load_config(store)), wl, "none", 4, gpu=False).total
    fixed = sum(fixed_bytes(manifest.shards, manifest.tied_lm_head, True, 4))  # the table held in fp32
    layer = max(manifest.layer_bytes)
    return (fixed + reserve + wl.staging * layer + ram_layers * layer) / GIB


def _file_and_data(store, file: str) -> tuple[int, int]:
    lay = read_layout(store / file)
    return lay.data_offset + lay.nbytes, lay.nbytes


@pytest.mark.parametrize("ram_layers, tiers", [(2.5, ["ram"] * 2 + ["disk"] * 4), (LAYERS + 1, ["ram"] * LAYERS)],
                         ids=["ram+disk", "all-ram"])
def test_planned_host_parts_are_what_the_engine_holds(nf4_store, ram_layers, tiers):
    manifest = load_manifest(nf4_store)
    cfg = EngineConfig(device="cpu", max_ram_gb=_ram_gib(nf4_store, ram_layers), batch_size=2, context=32,
                       host_embedding=True, dtype="float32")
    engine = Engine.open(nf4_store, cfg)
    try:
        plan = engine.plan
        assert plan.tiers == tiers
        ids = torch.randint(17, 4096, (2, 8), generator=torch.Generator().manual_seed(0))
        engine.generate_ids(ids, torch.ones_like(ids), GenerateConfig(max_new_tokens=2, ignore_eos=True))
        planned, held = plan.host_parts(manifest.layer_bytes), engine.host_memory()
    finally:
        engine.close()
    sizes = {i: _file_and_data(nf4_store, manifest.shards[f"layer.{i}"].file) for i in range(LAYERS)}
    ram = plan.ram_layers
    assert (planned["ram_tier"], held["ram_tier"]) == (sum(sizes[i][0] for i in ram), sum(sizes[i][1] for i in ram))
    staged = 3 if plan.disk_layers else 0  # READAHEAD + 1 buffers, each the largest layer
    assert planned["staging"] == staged * max(s[0] for s in sizes.values())
    assert held["staging"] == staged * max(s[1] for s in sizes.values())
    # The bf16 table is held in the fp32 compute dtype: twice its data, and counted so.
    embed = read_layout(nf4_store / manifest.shards["embed"].file)
    assert held["embedding"] == 2 * embed.nbytes and planned["embedding"] == embed.data_offset + 2 * embed.nbytes
    assert planned["kv_offload"] == held["kv_offload"] == 0
    assert held["other_pinned"] == held["pinned_rounding"] == 0  # nothing pinned on CPU
    # And the budget the planner filled holds what was allocated.
    assert sum(held.values()) <= sum(planned.values()) <= plan.ram_budget_bytes


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
