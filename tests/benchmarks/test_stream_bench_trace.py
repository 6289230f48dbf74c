"""``stream_bench.pass_breakdown``: the last decode-loop pass of a profiler trace against the device's busy time
in it (moe_bench and kv_bench ``--trace`` rows record it)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from airquant.config import GenerateConfig
from airquant.engine.decode.loop import PASS_MARK
from airquant.engine.runner import Engine
from benchmarks.stream_bench import chrome_copy_bytes, pass_breakdown, sync_sources

CPU, CUDA = torch.autograd.DeviceType.CPU, torch.autograd.DeviceType.CUDA


def _event(name: str, device, start: int, duration: int, annotation: bool = False, thread: int = 1,
           meta: str = ""):
    return SimpleNamespace(name=lambda: name, device_type=lambda: device, start_ns=lambda: start,
                           duration_ns=lambda: duration, is_user_annotation=lambda: annotation,
                           start_thread_id=lambda: thread, nbytes=lambda: 0, metadata_json=lambda: meta)


def test_each_sync_is_named_by_the_host_ops_around_it():
    """Syncs grouped by their innermost three enclosing host ops (on their own thread), most host time first;
    an op that ended before a sync, another thread's op and a device event do not enclose it."""
    events = [_event(PASS_MARK, CPU, 0, 100),
              _event("aten::item", CPU, 10, 20), _event("aten::_local_scalar_dense", CPU, 11, 18),
              _event("cudaStreamSynchronize", CPU, 12, 10),
              _event("aten::to", CPU, 40, 30), _event("aten::_to_copy", CPU, 41, 28), _event("aten::copy_", CPU, 42, 26),
              _event("cudaMemcpy", CPU, 43, 5), _event("cudaMemcpy", CPU, 50, 4),
              _event("aten::mm", CPU, 55, 40, thread=2),  # another thread: encloses nothing of thread 1
              _event("kernel", CUDA, 60, 30),
              _event("cudaStreamSynchronize", CPU, 80, 3)]  # under the pass mark only
    assert sync_sources(events) == [
        {"where": f"aten::_local_scalar_dense < aten::item < {PASS_MARK} < cudaStreamSynchronize", "count": 1,
         "host_ms": 10e-6},
        {"where": "aten::copy_ < aten::_to_copy < aten::to < cudaMemcpy", "count": 2, "host_ms": 9e-6},
        {"where": f"{PASS_MARK} < cudaStreamSynchronize", "count": 1, "host_ms": 3e-6}]


def test_the_last_pass_counts_overlapping_device_work_once():
    events = [_event(PASS_MARK, CPU, 0, 1_000_000),  # an earlier pass, ignored
              _event("gemv", CUDA, 100, 500_000),
              _event(PASS_MARK, CPU, 2_000_000, 10_000_000),
              _event(PASS_MARK, CUDA, 2_000_000, 10_000_000, annotation=True),  # the device's mirror of the mark
              _event("Memcpy HtoD (Pinned -> Device)", CUDA, 3_000_000, 4_000_000,
                     meta='"device": 0, "stream": 7, "bytes": 200000000, "memory bandwidth (GB/s)": 50.0'),
              _event("Memcpy DtoH (Device -> Pinned)", CUDA, 10_000_000, 4_000_000,  # half of it in the pass
                     meta='"bytes": 80000000'),
              _event("kernel_a", CUDA, 5_000_000, 1_000_000),  # under the copy: counted once
              _event("kernel_b", CUDA, 11_000_000, 2_000_000),  # cut at the pass's end
              _event("aten::mm", CPU, 4_000_000, 1_000_000)]
    got = pass_breakdown(events)
    assert got["last_pass_wall_ms"] == 10.0
    assert got["last_pass_device_busy_ms"] == 6.0 and got["last_pass_busy_fraction"] == 0.6
    assert (got["last_pass_kernel_ms"], got["last_pass_memcpy_htod_ms"], got["last_pass_memcpy_other_ms"]) == \
        (2.0, 4.0, 2.0)
    assert (got["last_pass_memcpy_htod_gb"], got["last_pass_memcpy_other_gb"]) == (0.2, 0.04)
    assert got["last_pass_memcpy_htod_gbps"] == 50.0
    assert pass_breakdown([_event("aten::mm", CPU, 0, 10)]) == {}


def test_copies_without_bytes_give_none_and_the_timeline_gives_them():
    """torch's device events carry no copy bytes: the pass's byte keys are None, not 0, and the exported timeline
    (CUPTI's args) gives them for the last pass, a copy cut at its edge by its share."""
    events = [_event(PASS_MARK, CPU, 0, 10_000_000), _event("Memcpy HtoD (Pinned -> Device)", CUDA, 0, 4_000_000)]
    got = pass_breakdown(events)
    assert got["last_pass_memcpy_htod_gb"] is None and got["last_pass_memcpy_htod_gbps"] is None
    trace = {"traceEvents": [
        {"ph": "X", "cat": "user_annotation", "name": PASS_MARK, "ts": 100.0, "dur": 50.0},  # an earlier pass
        {"ph": "X", "cat": "user_annotation", "name": PASS_MARK, "ts": 1000.0, "dur": 1000.0},
        {"ph": "X", "cat": "gpu_user_annotation", "name": PASS_MARK, "ts": 1000.0, "dur": 1000.0},
        {"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy HtoD (Pinned -> Device)", "ts": 1100.0, "dur": 400.0,
         "args": {"stream": 7, "bytes": 20_000_000, "memory bandwidth (GB/s)": 50.0}},
        {"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy HtoD (Pinned -> Device)", "ts": 120.0, "dur": 10.0,
         "args": {"bytes": 999}},  # in the earlier pass
        {"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy DtoH (Device -> Pinned)", "ts": 1900.0, "dur": 200.0,
         "args": {"bytes": 8_000_000}},  # half inside
        {"ph": "X", "cat": "kernel", "name": "gemv", "ts": 1200.0, "dur": 10.0, "args": {}}]}
    got = chrome_copy_bytes(trace, htod_ms=0.4)
    assert got == {"last_pass_memcpy_htod_gb": 0.02, "last_pass_memcpy_other_gb": 0.004,
                   "last_pass_memcpy_htod_gbps": pytest.approx(50.0)}
    assert chrome_copy_bytes({"traceEvents": []}, 1.0) == {}


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
    assert sync_sources(events) == []  # the real events read (no CUDA here: no sync calls)


def test_the_profiler_marks_the_process_and_takes_python_spans_when_asked(monkeypatch):
    """Every trace goes through ``profiler``: it marks the process (rows after it say ``after_profiler``) and takes
    the Python functions' spans only with ``TRACE_STACKS`` (moe_bench --trace-stacks)."""
    from benchmarks import stream_bench

    for stacks in (False, True):
        monkeypatch.setattr(stream_bench, "PROFILED", False)
        monkeypatch.setattr(stream_bench, "TRACE_STACKS", stacks)
        with stream_bench.profiler(torch.device("cpu")) as prof:
            torch.ones(4).sum()
        assert stream_bench.PROFILED and prof.with_stack is stacks
