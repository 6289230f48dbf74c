"""The throughput planner (engine/memory/throughput.py): admission counted against a pass-by-pass simulation, and the
choice flipping with the job and the budgets, on a manifest-only Llama-3-70B NF4 store (arithmetic only)."""

from __future__ import annotations

import random

import pytest

from airquant.config import EngineConfig
from airquant.engine.memory.router import Candidate, Hardware
from airquant.engine.memory.throughput import JobShape, ThroughputError, admit, choose_mix
from airquant.store.synth import SynthSpec, synth

LINK = 55.0  # GB/s, the H200's pinned link in batch_bench


@pytest.fixture(scope="module")
def nf4_70b(tmp_path_factory, real_tokenizer) -> Candidate:
    store = tmp_path_factory.mktemp("tp") / "nf4"
    synth(SynthSpec("llama3-70b", "nf4"), store, manifest_only=True, tokenizer=real_tokenizer, progress=False)
    return Candidate.open(store)


def _stepped(job: JobShape, slots: int) -> tuple[int, int]:
    """(passes, most tokens cached at once) stepping the slots one pass at a time: the reference for ``admit``."""
    order = sorted(zip(job.prompt_tokens, job.new_tokens), key=lambda r: -r[0])
    running, t, peak, i = [], 0, 0, 0
    while i < len(order) or running:
        while len(running) < slots and i < len(order):
            running.append((*order[i], t))
            i += 1
        peak = max(peak, sum(p + t - start for p, _, start in running))
        running = [r for r in running if r[2] + r[1] - 1 > t]
        t += 1
    return t, peak


@pytest.mark.parametrize("seed", range(40))
def test_admission_matches_a_pass_by_pass_simulation(seed):
    rng = random.Random(seed)
    n = rng.randint(1, 30)
    job = JobShape(tuple(rng.randint(1, 60) for _ in range(n)), tuple(rng.randint(1, 25) for _ in range(n)))
    for slots in range(1, 9):
        a = admit(job, slots)
        assert (a.passes, a.peak_tokens) == _stepped(job, slots)


def _job(requests: int, prompt: tuple[int, int], new: int, seed: int = 0) -> JobShape:
    rng = random.Random(seed)
    return JobShape(tuple(rng.randint(*prompt) for _ in range(requests)), (new,) * requests)


def test_long_contexts_choose_turboquant_for_its_slots(nf4_70b):
    """15 GB for a 38.5 GB stack: a plain slot at a 1 500-token context takes 0.5 GB, a TurboQuant one about a
    fifth, so TQ runs several times the slots for the same pass and wins (the cache kept on the device)."""
    mix = choose_mix(nf4_70b, Hardware(int(15e9), 100 * 10**9), EngineConfig(host_embedding=True, kv_offload=False),
                     _job(512, (128, 1024), 400), link_gbps=LINK)
    by = {(o.kv, o.offload): o for o in mix.options}
    plain, tq = by["none", False], by["tq", False]
    assert (mix.choice.kv, mix.choice.offload) == ("tq", False)
    assert tq.slots >= 2 * plain.slots and tq.slot_bytes < plain.slot_bytes / 3
    assert tq.tok_s > 2 * plain.tok_s and tq.pass_s <= plain.pass_s  # fewer slots than fit can buy a resident layer
    assert plain.pass_s == pytest.approx(sum(nf4_70b.layer_bytes) / (LINK * 1e9), rel=0.01)  # nothing resident


def test_a_few_short_requests_keep_the_plain_cache(nf4_70b):
    """Three requests fill three slots either way: the estimates tie, and the plain cache (no codec work) wins."""
    mix = choose_mix(nf4_70b, Hardware(int(15e9), 100 * 10**9), EngineConfig(host_embedding=True),
                     _job(3, (100, 200), 50), link_gbps=LINK)
    assert all(o.slots == 3 for o in mix.options)
    assert (mix.choice.kv, mix.choice.offload) == ("none", False)
    assert "* plain    on device: 3 slots" in mix.describe()


def test_offload_wins_with_room_in_host_ram_and_loses_without(nf4_70b):
    """The plain cache only. With host RAM to spare, offloading holds more slots (their cache crosses the link
    each pass and still pays). With host RAM that just holds the layers pinned, a larger offloaded cache would
    push layers to a 2 GB/s disk: offload keeps few slots and loses; with less RAM than one sequence's cache and
    the staging buffers it is refused."""
    job = _job(512, (128, 1024), 400)
    plain = dict(link_gbps=LINK, kv_schemes=("none",))
    roomy = choose_mix(nf4_70b, Hardware(int(15e9), 100 * 10**9), EngineConfig(host_embedding=True), job, **plain)
    assert (roomy.choice.kv, roomy.choice.offload) == ("none", True)
    on_device = next(o for o in roomy.options if not o.offload)
    assert roomy.choice.slots > on_device.slots and roomy.choice.kv_link_bytes > 0
    tight = choose_mix(nf4_70b, Hardware(int(15e9), 42 * 10**9), EngineConfig(host_embedding=True), job,
                       disk_gbps=2.0, **plain)
    offloaded = next(o for o in tight.options if o.offload)
    assert offloaded.slots < roomy.choice.slots / 2 and offloaded.tok_s < tight.choice.tok_s
    assert (tight.choice.kv, tight.choice.offload) == ("none", False)
    refused = choose_mix(nf4_70b, Hardware(int(15e9), int(1.5e9)), EngineConfig(), job, **plain)
    offloaded = next(o for o in refused.options if o.offload)
    assert "host RAM 1.50 GB cannot hold the offloaded KV cache" in offloaded.rejected
    assert refused.choice.offload is False


def test_an_offloaded_cache_crosses_the_link_once_a_pass(nf4_70b):
    """An offloaded cache's pass: its streamed layers and the cache's host bytes over the link, once; a TurboQuant
    arena's copy back runs the link's other direction. batch_bench's job (an H100, wave3_kv27: 160 slots, a 0.90 s
    decode pass against 0.845 s for those bytes, 1.11 s when the copy back was counted again) then plans the
    offloaded TurboQuant cache, which ran 109 useful tok/s there against 98 for the cache on the device."""
    from benchmarks.batch_bench import MAX_NEW, MEAN_NEW, PROMPT_RANGE, workload

    reqs = workload(512, 128256, prompt_range=PROMPT_RANGE, mean_new=MEAN_NEW, max_new=MAX_NEW)
    job = JobShape(tuple(len(r.prompt_ids) for r in reqs), tuple(r.max_new_tokens for r in reqs))
    hw = Hardware(int(15e9), int(66.7e9))
    mix = choose_mix(nf4_70b, hw, EngineConfig(host_embedding=True), job, link_gbps=LINK)
    for o in (o for o in mix.options if o.offload and o.rejected is None):
        streamed = sum(nf4_70b.layer_bytes[i] for i in range(len(nf4_70b.layer_bytes)) if i not in o.plan.vram_layers)
        assert o.kv_link_bytes == o.plan.kv_host_bytes > 0
        assert o.pass_s == pytest.approx((streamed + o.kv_link_bytes) / (LINK * 1e9), rel=1e-6)
    assert (mix.choice.kv, mix.choice.offload) == ("tq", True)


def test_the_printed_arithmetic_names_the_numbers(nf4_70b):
    mix = choose_mix(nf4_70b, Hardware(int(15e9), 100 * 10**9), EngineConfig(host_embedding=True),
                     _job(64, (500, 500), 100), link_gbps=LINK)
    text = mix.describe()
    assert "job       : 64 requests (given figures): prompts 500-500 tokens" in text and "context 600" in text
    assert "link      : 55.0 GB/s" in text
    c = mix.choice
    line = next(row for row in text.splitlines() if row.startswith("  *"))
    for figure in (f"{c.slots} slots", f"{c.slot_tokens} tokens", f"pass {c.pass_s:.3f} s", f"{c.passes} passes",
                   f"est. {c.tok_s:.2f} useful tok/s", "at 55.0 GB/s"):
        assert figure in line
    assert text.count("\n    ") + 1 == len(mix.options)  # one line per option
    assert text.splitlines()[-1].startswith("choice    : ")


def test_nothing_fits_names_every_option(nf4_70b):
    with pytest.raises(ThroughputError, match="no KV format and placement fits") as err:
        choose_mix(nf4_70b, Hardware(int(1e9), 10**9), EngineConfig(), _job(4, (100, 100), 10), link_gbps=LINK)
    assert str(err.value).count("does not fit") == 4


def test_without_a_link_options_rank_by_tokens_per_pass(nf4_70b):
    mix = choose_mix(nf4_70b, Hardware(None, 200 * 10**9), EngineConfig(), _job(8, (100, 200), 20), link_gbps=None,
                     max_slots=4)
    assert [o.offload for o in mix.options] == [False, False]  # nothing to offload to on the CPU
    assert mix.choice.slots == 4 and mix.choice.tok_s is None and "pass time not modelled" in mix.describe()


def test_a_fixed_reserve_is_refused(nf4_70b):
    with pytest.raises(ThroughputError, match="drop --reserve"):
        choose_mix(nf4_70b, Hardware(int(15e9), 10**11), EngineConfig(reserve_gb=2), _job(4, (10, 10), 4),
                   link_gbps=LINK)


@pytest.mark.parametrize("kv", ["none", "tq"])
def test_a_chunked_prefill_fits_more_slots_and_the_plan_holds_them(nf4_70b, kv):
    """The decode loop holds one pass's activations (2 048 tokens), not every sequence's whole context: under
    15 GB at a 1 466-token context the router's largest batch grows, and the planner places that batch."""
    from airquant.engine.memory.planner import plan
    from airquant.engine.memory.router import route, workload_for

    hw = Hardware(int(15e9), 100 * 10**9)

    def largest(prefill: str) -> int:
        wl = workload_for(EngineConfig(host_embedding=True, kv_offload=False, prefill=prefill), batch_size=1,
                          context=1466, mode="streamed", kv_schemes=(kv,))
        return route([nf4_70b], hw, wl).max_batch

    whole, chunked = largest("whole"), largest("chunked")
    assert chunked > whole * (1.2 if kv == "none" else 1.6)
    wl = workload_for(EngineConfig(host_embedding=True, kv_offload=False, prefill="chunked", batch_size=chunked,
                                   context=1466))
    placed = plan(nf4_70b.manifest, nf4_70b.dims, hw, wl, kv=kv)
    assert placed.pass_tokens == 2048 and placed.device_bytes <= hw.plan_vram
