"""``--experts auto``: routed streaming while a decode step routes few of a layer's experts, whole layers once
it routes most of them (engine/moe/sizing.py ``choose_experts``), one rule for the planner, the engine, ``airquant
plan`` and batch jobs; ``--experts routed`` and ``whole`` force a mode whatever the batch."""

from __future__ import annotations

import json

import pytest
import torch

from airquant.cli import main
from airquant.config import EngineConfig, GenerateConfig
from airquant.engine import skeleton
from airquant.engine.memory.planner import GIB, MARGIN_MIN_BYTES, workload_for
from airquant.engine.moe.sizing import ROUTED_BELOW, choose_experts, first_whole_batch, routed_share, use_routed
from airquant.engine.runner import Engine, placement_for
from airquant.jobs import batch as batch_jobs
from airquant.store.manifest import load_manifest

PROMPTS = ["The quick brown fox", "Once upon a time in a land far far away there lived", "Hi"]


def _wl(**fields):
    """A Workload whose KV cache stays on the device unless a test asks otherwise."""
    return workload_for(EngineConfig(kv_offload=False), **fields)


@pytest.fixture(scope="module")
def mixtral(tmp_path_factory, real_tokenizer):
    """A tiny Mixtral of Mixtral's routing, 8 experts and top-2: auto streams routed up to batch 3."""
    from airquant.models import resolve
    from airquant.store.split import split
    from tests.zoo import make_model

    root = tmp_path_factory.mktemp("experts-auto")
    folder = make_model(root / "model", real_tokenizer, "mixtral", layers=8, num_local_experts=8, num_experts=8)
    split(resolve(str(folder)), root / "store", dtype="float32", progress=False)
    return root / "store"


@pytest.mark.parametrize("top_k, num, batch, share", [
    (2, 8, 1, 0.25), (2, 8, 8, 0.8999), (2, 8, 64, 1.0),  # Mixtral-8x7B
    (8, 128, 1, 0.0625), (8, 128, 16, 0.6439), (8, 128, 64, 0.9839),  # Qwen3-30B-A3B
    (8, 8, 1, 1.0), (2, 8, 0, 0.0),
])
def test_routed_share_of_near_uniform_routing(top_k, num, batch, share):
    assert routed_share(top_k, num, batch) == pytest.approx(share, abs=1e-4)


def test_auto_routes_below_the_threshold_and_the_flags_force_a_mode(mixtral):
    manifest = load_manifest(mixtral)
    assert routed_share(2, 8, 3) < ROUTED_BELOW <= routed_share(2, 8, 4)
    assert [use_routed("auto", manifest, True, b) for b in (1, 2, 3, 4, 64, 256)] == [True] * 3 + [False] * 3
    assert first_whole_batch("auto", manifest) == 4
    assert first_whole_batch("routed", manifest) is None and first_whole_batch("whole", manifest) is None
    assert use_routed("auto", manifest, True, None)  # the batch not known: routed, as before the rule
    assert use_routed("routed", manifest, True, 256)  # forced: no silent override
    assert not use_routed("whole", manifest, True, 1)
    resident = choose_experts("auto", manifest, False, 1)
    assert not resident.routed and resident.why == ""


def _plan(store, **cfg):
    """The plan of a streamed run (no resident layer) under a mocked 64 GiB GPU budget."""
    config = EngineConfig(max_vram_gb=64, max_ram_gb=1, resident_layers=0, context=64, **cfg)
    return placement_for(load_manifest(store), config, torch.device("cuda"), skeleton.load_config(store), torch.float32)


def test_plan_streams_routed_at_batch_one_and_whole_layers_at_64(mixtral):
    layers = load_manifest(mixtral).layer_bytes
    one, many, forced = _plan(mixtral), _plan(mixtral, batch_size=64), _plan(mixtral, batch_size=64, experts="routed")
    assert one.experts is not None and forced.experts is not None and many.experts is None
    assert one.slot_bytes < many.slot_bytes == max(layers)  # whole layers go through the slots
    text = one.describe(layers)
    assert "experts   : routed" in text
    assert ("why: experts routed: batch 1 routes ~25 % of 8 experts per step (top-2 per token); "
            f"auto streams routed below {ROUTED_BELOW * 100:.0f} %") in text
    text = many.describe(layers)
    assert "experts   : routed" not in text
    assert "why: experts whole layers: batch 64 routes ~100 % of 8 experts per step" in text
    text = forced.describe(layers)
    assert "experts   : routed" in text
    assert "why: experts routed (--experts routed): batch 64 routes ~100 %" in text
    assert "so auto would stream whole layers" in text


def _cli_plan(store, capsys, batch: int, experts: str = "auto") -> str:
    """``airquant plan --batch`` under the VRAM budget of the streamed plan with no resident layer: the eight
    layers do not fit resident, so the route streams."""
    budget = _plan(store, batch_size=batch, experts=experts, expert_cache_gb=0.0).device_bytes + MARGIN_MIN_BYTES
    assert main(["plan", str(store), "--device", "cpu", "--max-vram", repr(budget / GIB), "--max-ram", "1",
                 "--context", "64", "--kv", "none", "--resident-layers", "0", "--batch", str(batch),
                 "--experts", experts, "--expert-cache", "0"]) == 0
    return capsys.readouterr().out


def test_airquant_plan_batch_says_which_and_why(mixtral, capsys):
    out = _cli_plan(mixtral, capsys, 1)
    assert "streamed" in out and "experts   : routed;" in out and "why: experts routed: batch 1 routes ~25 %" in out
    out = _cli_plan(mixtral, capsys, 64)
    assert "streamed" in out and "experts   : routed;" not in out
    assert "why: experts whole layers: batch 64 routes ~100 %" in out
    # batch 4 (auto: whole layers) keeps the forced arena small beside these tiny layers, so the route streams
    out = _cli_plan(mixtral, capsys, 4, "routed")
    assert "experts   : routed;" in out and "why: experts routed (--experts routed): batch 4" in out


def test_route_max_batch_fits_with_the_mode_of_that_batch(mixtral):
    """Planned at batch 1 (routed, small slots), the largest batch is counted with whole-layer slots, the mode
    the rule picks there: a route at that batch fits."""
    from airquant.engine.memory.router import Candidate, Hardware, route

    budget = _plan(mixtral, batch_size=64).device_bytes + MARGIN_MIN_BYTES
    hw = Hardware(budget, GIB)
    wl = _wl(batch_size=1, context=64, kv_schemes=("none",), mode="streamed")
    largest = route([Candidate.open(mixtral)], hw, wl).max_batch
    assert largest >= first_whole_batch("auto", load_manifest(mixtral))
    at_largest = route([Candidate.open(mixtral)], hw, _wl(batch_size=largest, context=64, kv_schemes=("none",),
                                                                mode="streamed"))
    assert at_largest.plan.experts is None and at_largest.plan.slot_bytes == max(load_manifest(mixtral).layer_bytes)


def _greedy(engine: Engine) -> list[str]:
    return [c.text for c in engine.generate(PROMPTS, GenerateConfig(max_new_tokens=6))]


def test_engine_takes_the_mode_of_its_batch_and_greedy_output_is_equal(mixtral):
    runs = {}
    for name, cfg in (("auto_bs1", dict(batch_size=1)), ("auto_bs64", dict(batch_size=64)),
                      ("routed_bs64", dict(batch_size=64, experts="routed"))):
        engine = Engine.open(mixtral, device="cpu", context=64, **cfg)
        runs[name] = (engine.experts is not None, _greedy(engine))
        engine.close()
    assert [routed for routed, _ in runs.values()] == [True, False, True]
    assert runs["auto_bs1"][1] == runs["auto_bs64"][1] == runs["routed_bs64"][1]


@pytest.mark.parametrize("size", [1, None])  # None: the job's auto size (the throughput planner's slots)
def test_batch_job_opens_the_engine_for_the_batch_it_runs(mixtral, tmp_path, monkeypatch, size):
    opened = []
    real_open = Engine.open

    def spy(store, cfg=None, **kw):
        engine = real_open(store, cfg, **kw)
        opened.append((engine.cfg.batch_size, engine.experts is not None))
        return engine

    monkeypatch.setattr(Engine, "open", spy)
    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps({"id": k, "prompt": p}) + "\n" for k, p in enumerate(PROMPTS)))
    job = batch_jobs.BatchJob(src, tmp_path / "out.jsonl", batch_size=size, gen=GenerateConfig(max_new_tokens=6))
    report = batch_jobs.run_batch(mixtral, job, EngineConfig(device="cpu"), progress=False)
    # auto: the planner takes no more slots than the job has requests (engine/memory/throughput.choose_mix),
    # at most CPU_BATCH on the CPU
    want = size or min(len(PROMPTS), batch_jobs.CPU_BATCH)
    assert report.done == len(PROMPTS) and report.batch_sizes == [want]
    assert opened == [(want, want < first_whole_batch("auto", load_manifest(mixtral)))]
    outputs = {r["id"]: r["output"] for r in map(json.loads, (tmp_path / "out.jsonl").read_text().splitlines())}
    engine = real_open(mixtral, device="cpu", experts="whole", context=64)
    assert [outputs[k] for k in range(len(PROMPTS))] == _greedy(engine)
    engine.close()
