"""``stream_bench.pass_breakdown``: the last decode-loop pass of a profiler trace against the device's busy time
in it (moe_bench and kv_bench ``--trace`` rows record it)."""

from __future__ import annotations

from types import SimpleNamespace

import torch
from torch.profiler import ProfilerActivity, profile

from airquant.config import GenerateConfig
from airquant.engine.decode.loop import PASS_MARK
from airquant.engine.runner import Engine
from benchmarks.stream_bench import pass_breakdown

CPU, CUDA = torch.autograd.DeviceType.CPU, torch.autograd.DeviceType.CUDA


def _event(name: str, device, start: int, duration: int, annotation: bool = False):
    return SimpleNamespace(name=lambda: name, device_type=lambda: device, start_ns=lambda: start,
                           duration_ns=lambda: duration, is_user_annotation=lambda: annotation)


def test_the_last_pass_counts_overlapping_device_work_once():
    events = [_event(PASS_MARK, CPU, 0, 1_000_000),  # an earlier pass, ignored
              _event("gemv", CUDA, 100, 500_000),
              _event(PASS_MARK, CPU, 2_000_000, 10_000_000),
              _event(PASS_MARK, CUDA, 2_000_000, 10_000_000, annotation=True),  # the device's mirror of the mark
              _event("Memcpy HtoD (Pinned -> Device)", CUDA, 3_000_000, 4_000_000),
              _event("kernel_a", CUDA, 5_000_000, 1_000_000),  # under the copy: counted once
              _event("kernel_b", CUDA, 11_000_000, 2_000_000),  # cut at the pass's end
              _event("aten::mm", CPU, 4_000_000, 1_000_000)]
    got = pass_breakdown(events)
    assert got["last_pass_wall_ms"] == 10.0
    assert got["last_pass_device_busy_ms"] == 5.0 and got["last_pass_busy_fraction"] == 0.5
    assert (got["last_pass_kernel_ms"], got["last_pass_memcpy_htod_ms"], got["last_pass_memcpy_other_ms"]) == \
        (2.0, 4.0, 0.0)
    assert pass_breakdown([_event("aten::mm", CPU, 0, 10)]) == {}


def test_a_decode_under_the_profiler_shows_its_passes(tiny_store):
    """The decode loop marks each pass: a traced decode of the tiny store has one a token."""
    engine = Engine.open(tiny_store, device="cpu", resident_layers=0)
    try:
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            engine.generate_requests([engine.request([5, 6, 7], GenerateConfig(max_new_tokens=4, ignore_eos=True))])
    finally:
        engine.close()
    events = prof.profiler.kineto_results.events()
    assert sum(e.name() == PASS_MARK for e in events) == 4
    got = pass_breakdown(events)
    assert got["last_pass_wall_ms"] > 0 and got["last_pass_device_busy_ms"] == 0.0
