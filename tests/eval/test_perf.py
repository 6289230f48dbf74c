"""Performance rows: derived numbers against hand arithmetic on an engine with scripted timings."""

from __future__ import annotations

import math
import mmap
import statistics
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from airquant.errors import EvalConfigError
from airquant.eval.perf import BandwidthMeasurement, measure_link_bandwidth, run_perf, run_perf_sweep
from airquant.eval.rows import read_rows, write_row

LINK = BandwidthMeasurement(device="cpu", kind="cpu_memcpy", gb_per_s=10.0, nbytes=1, seconds=1.0)


class ScriptedEngine:
    """Reports the timings it is given, one dict per call, and counts what the metric asks of it."""

    def __init__(self, tokenizer, timings: list[dict], bytes_per_step: int = 10**9):
        self.tokenizer, self.timings, self.bytes_per_step = tokenizer, list(timings), bytes_per_step
        self.config = SimpleNamespace(max_position_embeddings=2048)
        self.device, self.dtype = torch.device("cpu"), torch.float32
        self.calls, self.resets, self.last_timings = [], 0, {}

    def generate(self, prompts, **kw):
        self.calls.append((len(prompts), kw))
        self.last_timings = self.timings.pop(0)
        return [SimpleNamespace(text="x", prompt_tokens=100, new_tokens=11) for _ in prompts]

    def reset_stats(self):
        self.resets += 1

    def stats(self):
        return {"bytes_streamed": 123, "peak_vram_allocated_gb": 9.9}

    def describe(self):
        return {"model": "scripted", "store_scheme": "nf4", "dtype": "float32", "device_name": "cpu",
                "streamed": True, "bytes_per_decode_step": self.bytes_per_step}


def timing(ttft, decode, steps=10):
    return {"ttft_s": ttft, "prefill_s": ttft, "decode_s": decode, "decode_steps": steps, "batch_size": 0}


def test_derived_numbers_are_medians_of_the_repeats(tokenizer, small_text_file):
    warm = timing(99.0, 99.0)
    engine = ScriptedEngine(tokenizer, [warm, warm, timing(0.5, 2.0), timing(0.4, 4.0), timing(0.6, 1.0)])
    row = run_perf(engine, data=small_text_file, prompt_length=100, max_new_tokens=11, batch_size=2, warmup=2,
                   repeats=3, bandwidth=LINK)
    assert len(engine.calls) == 5 and engine.resets == 3
    assert all(kw == {"max_new_tokens": 11, "temperature": 0.0, "chat": False} for _, kw in engine.calls)
    assert row.ttft_s == pytest.approx(0.5)
    assert row.prefill_tokens_per_s == pytest.approx(200 / 0.5)
    assert row.decode_tokens_per_s == pytest.approx(statistics.median([20 / 2.0, 20 / 4.0, 20 / 1.0]))
    assert row.decode_step_s == pytest.approx(0.2)
    assert row.achieved_gb_per_s == pytest.approx(1e9 / 0.2 / 1e9)
    assert row.mbu == pytest.approx(0.5)
    # The CPU has no VRAM, whatever the engine's counters say.
    assert row.peak_vram_allocated_gb is None and row.samples[0].bytes_streamed == 123
    assert row.host_rss_peak_gb > 0.01 and row.host_maxrss_gb >= row.host_rss_peak_gb * 0.5


def test_prompts_are_real_distinct_text_of_the_requested_length(tokenizer, small_text_file):
    engine = ScriptedEngine(tokenizer, [timing(0.1, 1.0)] * 2)
    seen = []
    engine.generate = lambda prompts, **kw: seen.append(prompts) or \
        ScriptedEngine.generate(engine, prompts, **kw)
    run_perf(engine, data=small_text_file, prompt_length=64, batch_size=3, warmup=1, repeats=1, bandwidth=LINK)
    prompts = seen[-1]
    assert len(set(prompts)) == 3
    assert all(60 <= len(tokenizer(p, add_special_tokens=False)["input_ids"]) <= 68 for p in prompts)


def test_sweep_shares_one_bandwidth_measurement(tokenizer, small_text_file):
    engine = ScriptedEngine(tokenizer, [timing(0.1, 1.0)] * 6)
    rows = run_perf_sweep(engine, batch_sizes=(1, 2), data=small_text_file, prompt_length=32, max_new_tokens=4,
                          warmup=1, repeats=2, bandwidth=LINK)
    assert [r.batch_size for r in rows] == [1, 2] and all(r.bandwidth is LINK for r in rows)


def test_cpu_memcpy_bandwidth_agrees_with_numpy():
    nbytes = 32 << 20
    bw = measure_link_bandwidth("cpu", nbytes=nbytes, repeats=5)
    src, dst = np.full(nbytes, 0xA5, dtype=np.uint8), np.empty(nbytes, dtype=np.uint8)
    times = []
    for _ in range(5):
        t0 = time.perf_counter()
        np.copyto(dst, src)
        times.append(time.perf_counter() - t0)
    numpy_gbps = 2 * nbytes / statistics.median(times) / 1e9
    assert bw.kind == "cpu_memcpy" and bw.nbytes == nbytes
    assert bw.gb_per_s == pytest.approx(2 * nbytes / bw.seconds / 1e9)
    assert 0.2 < bw.gb_per_s / numpy_gbps < 5, (bw.gb_per_s, numpy_gbps)


def test_bandwidth_kind_must_fit_the_device():
    with pytest.raises(EvalConfigError):
        measure_link_bandwidth("cpu", kind="h2d_pinned", nbytes=1024)


def test_tiny_model_run(tiny_engine, small_text_file, tmp_path):
    row = run_perf(tiny_engine, data=small_text_file, prompt_length=48, max_new_tokens=6, batch_size=2, repeats=2,
                   bandwidth=measure_link_bandwidth("cpu", nbytes=4 << 20, repeats=3))
    assert row.ttft_s > 0 and row.decode_tokens_per_s > 0 and math.isfinite(row.mbu) and row.mbu > 0
    assert all(90 <= s.prompt_tokens <= 100 for s in row.samples)
    assert row.peak_vram_reserved_gb is None and row.run.device == "cpu"
    assert read_rows(write_row(row, tmp_path / "perf.json")) == [row]


def test_context_overflow_is_refused(tiny_engine, small_text_file):
    with pytest.raises(EvalConfigError, match="exceed the context"):
        run_perf(tiny_engine, data=small_text_file, prompt_length=2040, max_new_tokens=64)


@pytest.mark.skipif(not Path("/proc/self/status").is_file(), reason="the parts come from Linux's /proc/self/status")
def test_rss_sampler_keeps_the_parts_at_its_peak_and_marks():
    from airquant.eval.perf import RssSampler

    with RssSampler(interval_s=0.001) as rss:
        before = rss.mark("before")
        # A fresh anonymous mapping, touched: 64 MiB of new anonymous memory (a heap allocation could reuse pages
        # an earlier test left resident and not grow RSS at all).
        buf = mmap.mmap(-1, 64 << 20, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        buf.write(b"\x01" * (64 << 20))
        after = rss.mark("after")
        buf.close()
    assert set(before) == {"rss", "anon", "file", "shmem"}
    assert after["anon"] - before["anon"] >= 60 << 20
    assert rss.peak >= after["rss"] and rss.peak_parts["rss"] == rss.peak
    assert rss.peak_parts["anon"] + rss.peak_parts["file"] + rss.peak_parts["shmem"] == rss.peak
    assert [label for label, _ in rss.marks] == ["before", "after"]
