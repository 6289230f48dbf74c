"""Speed and memory: TTFT, prefill and decode throughput, peak VRAM and host RAM, bandwidth utilization.

Each measurement is one greedy ``generate`` call on real text (never zeros), after warm-up
calls that are not counted; the engine's peak-memory counters are reset before each one and CUDA is
synchronized around it. The row keeps the median of the repeats and every repeat as a sample.

MBU = bytes the engine moves per decode step / median step time / the bandwidth of the link those
bytes cross, measured in the same run: pinned host->device for a streamed CUDA engine, device memory
for a resident one, RAM for the CPU.
"""

from __future__ import annotations

import logging
import math
import resource
import statistics
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Literal, Sequence

import psutil
import torch

from airquant.errors import EvalConfigError
from airquant.eval import prompting
from airquant.eval.data import load_wikitext
from airquant.eval.progress import steps
from airquant.eval.rows import GB, RunInfo, collect_run_info, register_row, write_row

log = logging.getLogger(__name__)

__all__ = ["BandwidthMeasurement", "PerfRow", "PerfSample", "copy_seconds", "link_buffers", "measure_link_bandwidth",
           "run_perf", "run_perf_sweep", "write_row"]

BandwidthKind = Literal["auto", "h2d_pinned", "d2d", "cpu_memcpy"]


@dataclass(frozen=True)
class BandwidthMeasurement:
    device: str
    kind: str  # "h2d_pinned", "d2d" or "cpu_memcpy"
    gb_per_s: float  # bytes of traffic per second / 1e9
    nbytes: int  # size of one copy
    seconds: float  # median time of one copy


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def copy_seconds(dst: torch.Tensor, src: torch.Tensor, repeats: int, before=None) -> list[float]:
    """Seconds of each of ``repeats`` copies of ``src`` into ``dst`` after one warm-up copy (the first pays for
    lazy allocation and mapping): CUDA events on a GPU, the wall clock on the CPU. ``before``: called before
    each timed copy (a barrier that starts copies on several GPUs at once)."""
    cuda = dst.device.type == "cuda"
    dst.copy_(src, non_blocking=cuda)
    if cuda:
        torch.cuda.synchronize(dst.device)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(repeats):
        if before is not None:
            before()
        if cuda:
            start.record()
            dst.copy_(src, non_blocking=True)
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            dst.copy_(src)
            times.append(time.perf_counter() - t0)
    return times


def link_buffers(device: torch.device, kind: str, nbytes: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(source, destination) of a ``kind`` copy of ``nbytes`` to ``device``: a pinned host source for
    ``h2d_pinned``, else one on the device. A constant non-zero fill: copy engines do not compress, but the
    pages must really be touched."""
    if kind == "h2d_pinned":
        src = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True).fill_(0xA5)
    else:
        src = torch.empty(nbytes, dtype=torch.uint8, device=device).fill_(0xA5)
    return src, torch.empty(nbytes, dtype=torch.uint8, device=device)


def measure_link_bandwidth(device: torch.device | str, *, kind: BandwidthKind = "auto", nbytes: int = 256 << 20,
                           repeats: int = 5) -> BandwidthMeasurement:
    """Median copy bandwidth: pinned host->device on CUDA (``auto``), a memcpy in RAM on the CPU.

    A copy within one memory (``d2d``, ``cpu_memcpy``) reads and writes every byte, so its traffic is
    counted as ``2 * nbytes``, the way STREAM's Copy kernel counts it; host->device counts ``nbytes``.
    """
    device = torch.device(device)
    if kind == "auto":
        kind = "h2d_pinned" if device.type == "cuda" else "cpu_memcpy"
    if (kind == "cpu_memcpy") != (device.type == "cpu"):
        raise EvalConfigError(f"bandwidth kind {kind!r} does not apply to device {device}; use kind='auto'.")
    src, dst = link_buffers(device, kind, nbytes)
    seconds = statistics.median(copy_seconds(dst, src, repeats))
    traffic = nbytes if kind == "h2d_pinned" else 2 * nbytes
    return BandwidthMeasurement(device=str(device), kind=kind, gb_per_s=traffic / seconds / GB, nbytes=nbytes,
                                seconds=seconds)


# /proc/self/status fields of the resident set: total, anonymous (heap, pinned buffers), file-backed
# (mapped libraries and files), shared memory.
RSS_FIELDS = {"VmRSS": "rss", "RssAnon": "anon", "RssFile": "file", "RssShmem": "shmem"}


def rss_parts() -> dict[str, int]:
    """This process's resident set now (bytes): ``rss`` and, on Linux, its ``anon``, ``file`` and ``shmem``
    parts, which tell a heap or pinned buffer from mapped libraries and files (psutil's RSS is their sum)."""
    try:
        text = Path("/proc/self/status").read_text()
    except OSError:
        return {"rss": psutil.Process().memory_info().rss}
    out = {}
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key in RSS_FIELDS:
            out[RSS_FIELDS[key]] = int(value.split()[0]) * 1024  # kB
    return out if "rss" in out else {"rss": psutil.Process().memory_info().rss}


class RssSampler:
    """Peak resident set size of this process while the block runs (polled; ru_maxrss cannot be reset),
    with its parts at the peak (``peak_parts``) and at the points the caller ``mark``s."""

    def __init__(self, interval_s: float = 0.005):
        self.interval_s, self.peak, self._stop = interval_s, 0, threading.Event()
        self.peak_parts: dict[str, int] = {}
        self.marks: list[tuple[str, dict[str, int]]] = []
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _sample(self) -> dict[str, int]:
        parts = rss_parts()
        with self._lock:  # mark() samples from the caller's thread
            if parts["rss"] > self.peak:
                self.peak, self.peak_parts = parts["rss"], parts
        return parts

    def _run(self) -> None:
        while not self._stop.is_set():
            self._sample()
            self._stop.wait(self.interval_s)

    def mark(self, label: str) -> dict[str, int]:
        """The resident set now, kept under ``label`` (it counts toward the peak too)."""
        parts = self._sample()
        self.marks.append((label, parts))
        return parts

    def __enter__(self) -> "RssSampler":
        self._sample()
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self._sample()


def host_maxrss_gb() -> float | None:
    """Lifetime peak RSS of this process (the OS's own counter), or None where it does not exist."""
    if sys.platform == "win32":
        return None

    maxrss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return maxrss / GB if sys.platform == "darwin" else maxrss * 1024 / GB  # bytes on macOS, KiB on Linux


@dataclass(frozen=True)
class PerfSample:
    ttft_s: float
    prefill_s: float
    decode_s: float
    decode_steps: int
    prompt_tokens: int  # summed over the batch
    new_tokens: int
    wall_s: float
    peak_vram_allocated_gb: float | None
    peak_vram_reserved_gb: float | None
    host_rss_peak_gb: float
    bytes_streamed: int


@register_row
@dataclass(frozen=True)
class PerfRow:
    metric: ClassVar[str] = "perf"
    run: RunInfo
    batch_size: int
    prompt_length: int  # requested tokens per prompt; samples hold the measured counts
    max_new_tokens: int
    warmup: int
    repeats: int
    ttft_s: float  # medians over repeats from here on
    prefill_tokens_per_s: float
    decode_tokens_per_s: float  # all sequences of the batch together
    decode_step_s: float
    peak_vram_allocated_gb: float | None  # max over repeats; None on the CPU
    peak_vram_reserved_gb: float | None
    host_rss_peak_gb: float
    host_maxrss_gb: float | None
    bytes_per_decode_step: int
    bandwidth: BandwidthMeasurement
    achieved_gb_per_s: float  # bytes_per_decode_step / decode_step_s
    mbu: float  # achieved / bandwidth.gb_per_s
    data_source: str
    samples: tuple[PerfSample, ...]


def make_prompts(tokenizer: Any, text: str, prompt_length: int, batch_size: int) -> list[str]:
    """``batch_size`` different slices of ``text`` of ``prompt_length`` tokens each."""
    need = prompt_length * batch_size
    ids = tokenizer(text[:need * 8], add_special_tokens=False)["input_ids"]  # ~4 chars per token: 8 is ample
    if len(ids) < need:
        raise EvalConfigError(f"the text holds {len(ids)} tokens, fewer than {batch_size} prompts of {prompt_length}.")
    return [tokenizer.decode(ids[i * prompt_length:(i + 1) * prompt_length]) for i in range(batch_size)]


def _measure(engine: Any, prompts: list[str], kv: Any, gen: dict) -> PerfSample:
    device = torch.device(engine.device)
    engine.reset_stats()
    _sync(device)
    with RssSampler() as rss:
        t0 = time.perf_counter()
        completions = prompting.engine_generate(engine, prompts, kv=kv, **gen)
        _sync(device)
        wall = time.perf_counter() - t0
    t, stats = dict(engine.last_timings), engine.stats()
    vram = device.type == "cuda"
    return PerfSample(
        ttft_s=t["ttft_s"], prefill_s=t["prefill_s"], decode_s=t["decode_s"], decode_steps=int(t["decode_steps"]),
        prompt_tokens=sum(c.prompt_tokens for c in completions), new_tokens=sum(c.new_tokens for c in completions),
        wall_s=wall, peak_vram_allocated_gb=stats.get("peak_vram_allocated_gb") if vram else None,
        peak_vram_reserved_gb=stats.get("peak_vram_reserved_gb") if vram else None,
        host_rss_peak_gb=rss.peak / GB, bytes_streamed=int(stats.get("bytes_streamed", 0)))


def _ratio(num: float, den: float) -> float:
    return num / den if den > 0 else math.nan


def _max_or_none(values: list[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return max(present) if present else None


def default_bandwidth_kind(engine: Any) -> BandwidthKind:
    device = torch.device(engine.device)
    if device.type != "cuda":
        return "cpu_memcpy"
    return "h2d_pinned" if engine.describe().get("bytes_cross") == "host link" else "d2d"


def _summarize(engine: Any, samples: list[PerfSample], link: BandwidthMeasurement, batch_size: int) -> dict:
    step_s = statistics.median(_ratio(s.decode_s, s.decode_steps) for s in samples)
    bytes_per_step = int(engine.describe().get("bytes_per_decode_step") or 0)
    achieved = _ratio(bytes_per_step, step_s) / GB
    if any(s.decode_steps == 0 for s in samples):
        log.warning("a measurement stopped at the first token (EOS): decode speed is NaN; use another prompt")
    return dict(
        ttft_s=statistics.median(s.ttft_s for s in samples),
        prefill_tokens_per_s=statistics.median(_ratio(s.prompt_tokens, s.prefill_s) for s in samples),
        decode_tokens_per_s=statistics.median(_ratio(s.decode_steps * batch_size, s.decode_s) for s in samples),
        decode_step_s=step_s, peak_vram_allocated_gb=_max_or_none([s.peak_vram_allocated_gb for s in samples]),
        peak_vram_reserved_gb=_max_or_none([s.peak_vram_reserved_gb for s in samples]),
        host_rss_peak_gb=max(s.host_rss_peak_gb for s in samples), bytes_per_decode_step=bytes_per_step,
        achieved_gb_per_s=achieved, mbu=_ratio(achieved, link.gb_per_s))


def run_perf(engine: Any, *, data: str | Path | None = None, prompt_length: int = 512, max_new_tokens: int = 64,
             batch_size: int = 1, warmup: int = 1, repeats: int = 3, kv: Any = None,
             bandwidth: BandwidthMeasurement | None = None) -> PerfRow:
    """Time ``repeats`` greedy generations of ``batch_size`` prompts of ``prompt_length`` tokens.

    ``bandwidth`` reuses a link measurement (a sweep measures it once); by default it is measured here.
    """
    if min(prompt_length, max_new_tokens, batch_size, repeats) < 1 or warmup < 0:
        raise EvalConfigError(f"prompt_length={prompt_length}, max_new_tokens={max_new_tokens}, batch_size="
                              f"{batch_size}, repeats={repeats} must be >= 1 and warmup={warmup} >= 0.")
    limit = prompting.context_limit(engine, None)
    if prompt_length + max_new_tokens > limit:
        raise EvalConfigError(f"{prompt_length} prompt + {max_new_tokens} new tokens exceed the context of {limit}.")
    corpus = load_wikitext(data)
    prompts = make_prompts(engine.tokenizer, corpus.text, prompt_length, batch_size)
    gen = dict(max_new_tokens=max_new_tokens, temperature=0.0, chat=False)
    for _ in steps(range(warmup), f"perf bs={batch_size} warm-up", "run"):
        prompting.engine_generate(engine, prompts, kv=kv, **gen)
    samples = [_measure(engine, prompts, kv, gen) for _ in steps(range(repeats), f"perf bs={batch_size}", "run")]
    link = bandwidth or measure_link_bandwidth(engine.device, kind=default_bandwidth_kind(engine))
    summary = _summarize(engine, samples, link, batch_size)
    log.info("perf bs=%d: ttft %.3f s, decode %.1f tok/s, MBU %.2f", batch_size, summary["ttft_s"],
             summary["decode_tokens_per_s"], summary["mbu"])
    return PerfRow(run=collect_run_info(engine, kv=kv), batch_size=batch_size, prompt_length=prompt_length,
                   max_new_tokens=max_new_tokens, warmup=warmup, repeats=repeats, host_maxrss_gb=host_maxrss_gb(),
                   bandwidth=link, data_source=corpus.source, samples=tuple(samples), **summary)


def run_perf_sweep(engine: Any, *, batch_sizes: Sequence[int] = (1, 2, 4, 8), **kwargs) -> list[PerfRow]:
    """``run_perf`` at each batch size, with one link measurement shared by all rows."""
    if kwargs.get("bandwidth") is None:
        kwargs["bandwidth"] = measure_link_bandwidth(engine.device, kind=default_bandwidth_kind(engine))
    return [run_perf(engine, batch_size=b, **kwargs) for b in batch_sizes]
