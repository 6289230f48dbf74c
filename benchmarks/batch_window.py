"""The measured windows of benchmarks/batch_bench.py: static and continuous batching under a wall-time budget.

A ``Window`` counts every pass a run made (useful tokens, wall) and its steady state, from the first pass in which
every slot produced a token. The budget is checked between passes, so nothing is cut inside a pass and nothing
is extrapolated past what ran.
"""

from __future__ import annotations

import math
import statistics
import time
from dataclasses import dataclass, field

from airquant.engine.decode import Request


def longest_first(requests: list[Request]) -> list[Request]:
    """The order ``airquant batch`` feeds both its paths: longest prompt first (stable)."""
    return sorted(requests, key=lambda r: -len(r.prompt_ids))


@dataclass
class Window:
    """What a run measured within its time budget: every pass it made, and the steady state, which starts at
    the first pass in which every one of ``slots`` slots produced a token (all slots busy)."""

    slots: int
    start: float = field(default_factory=time.perf_counter)
    end: float | None = None
    passes: int = 0
    useful: int = 0
    steady_start: float | None = None
    steady_from_pass: int | None = None
    steady_passes: int = 0
    steady_useful: int = 0
    last_pass_s: float = 0.0
    stopped_by_budget: bool = False

    def add(self, made: int, t0: float, t1: float) -> None:
        self.passes, self.useful, self.end, self.last_pass_s = self.passes + 1, self.useful + made, t1, t1 - t0
        if self.steady_start is None and made >= self.slots:
            self.steady_start, self.steady_from_pass = t0, self.passes - 1
        if self.steady_start is not None:
            self.steady_passes, self.steady_useful = self.steady_passes + 1, self.steady_useful + made

    def spent(self, deadline: float) -> bool:
        """Whether the next pass would end past ``deadline`` (by the last pass's time); never before the first."""
        self.stopped_by_budget = bool(self.passes) and time.perf_counter() + self.last_pass_s > deadline
        return self.stopped_by_budget

    def keys(self, prefix: str, budget: float) -> dict:
        """``{prefix}_useful_tok_s`` etc.: the whole window (the keys), and ``{prefix}_steady_*``."""
        wall = (self.end or self.start) - self.start
        steady_wall = (self.end - self.steady_start) if self.steady_start is not None else 0.0
        return {f"{prefix}_useful_tok_s": self.useful / wall if wall else 0.0, f"{prefix}_wall_s": wall,
                f"{prefix}_passes": self.passes, f"{prefix}_useful_tokens": self.useful,
                f"{prefix}_budget_s": budget, f"{prefix}_stopped_by_budget": self.stopped_by_budget,
                f"{prefix}_slot_utilization": utilization(self.useful, self.slots, self.passes),
                f"{prefix}_steady_from_pass": self.steady_from_pass, f"{prefix}_steady_passes": self.steady_passes,
                f"{prefix}_steady_wall_s": steady_wall,
                f"{prefix}_steady_useful_tok_s": self.steady_useful / steady_wall if steady_wall else None,
                f"{prefix}_steady_slot_utilization": utilization(self.steady_useful, self.slots,
                                                                 self.steady_passes)}


def utilization(useful: int, slots: int, passes: int) -> float | None:
    return useful / (slots * passes) if passes else None


def step_within(loop, window: Window, deadline: float) -> bool:
    """Step ``loop`` until it is idle (True) or the next pass would end past ``deadline`` by the last pass's time
    (False): the budget is checked between passes, so a window overshoots by at most one pass, and a window's
    first pass always runs (a budget of 0 measures one pass)."""
    while not loop.idle:
        if window.spent(deadline):
            return False
        step_once(loop, window)
    return True


def step_once(loop, window: Window) -> None:
    before, t0 = loop.stats.passes, time.perf_counter()
    made = loop.stats.useful_tokens
    loop.step()  # ends with the engine's sync: the pass is over on the device
    if loop.stats.passes == before:
        raise RuntimeError("the decode loop scheduled nothing with requests left (a scheduler bug)")
    window.add(loop.stats.useful_tokens - made, t0, time.perf_counter())


def run_static(engine, order, slots, kv, max_batches=None, seconds=math.inf, prefix="static"):
    """Static batching (``airquant batch`` before the loop; still its path on stacks the loop does not run):
    ``order`` in batches of ``slots``, each one loop as ``Engine.generate_requests`` makes it (a slot per request,
    every prompt prefilled in the first pass, nobody admitted later), so a batch holds its slots until its longest
    sequence ends; batches start until ``seconds`` are spent. Same kernels and cache as the continuous part."""
    batches = [order[i:i + slots] for i in range(0, len(order), slots)][:max_batches]
    window, seqs, completed = Window(slots), [], 0
    deadline = window.start + seconds
    for batch in batches:
        if window.spent(deadline):
            break
        loop = engine.decode_loop(len(batch), context=max(len(r.prompt_ids) + r.max_new_tokens for r in batch),
                                  kv=kv, token_budget=sum(len(r.prompt_ids) for r in batch))
        seqs += [loop.submit(r) for r in batch]
        if not step_within(loop, window, deadline):
            break
        completed += 1
    return {**window.keys(prefix, seconds), f"{prefix}_batches_run": -(-len(seqs) // slots),
            f"{prefix}_batches_completed": completed, f"{prefix}_batches_total": -(-len(order) // slots),
            f"{prefix}_requests_admitted": len(seqs), f"{prefix}_requests_finished": sum(s.done for s in seqs)}


ALLOCATOR = ("num_alloc_retries", "num_device_alloc", "num_device_free", "num_ooms")


def allocator_counts(device) -> dict | None:
    """The CUDA caching allocator's counters (None off CUDA): a retry frees the cache and synchronizes, and a
    device allocation or free is a driver call; a window with many of them waits on the allocator."""
    if getattr(device, "type", None) != "cuda":
        return None
    import torch

    stats = torch.cuda.memory_stats(device)
    return {key: stats.get(key, 0) for key in ALLOCATOR}


def run_continuous(engine, order, slots, kv, context, seconds=math.inf, prefix="continuous", trace_passes=0,
                   trace_dir=None, trace_ramp=0):
    """The same ``order`` through one decode loop of ``slots`` slots until it is done or ``seconds`` are spent.
    Beside the window's keys: the median pass before the first full one (the ramp: prompts admitted as slots
    fill) and the median seconds until the host had queued a decode pass (``decode_host``), and the allocator's
    counters over the window (CUDA), to say where a slow pass went. ``trace_passes``: that many more passes of the
    same loop after the window, under torch's profiler (``{prefix}_trace``: stream_bench.trace_summary).
    ``trace_ramp``: the window's passes 2 .. 1 + trace_ramp (the ramp: prompts admitted) under the profiler instead
    (``{prefix}_ramp_trace``); that window's figures then carry the profiler's overhead (``{prefix}_ramp_traced``):
    run it as a window of its own, written to a file of its own."""
    window = Window(slots)  # from before the loop is made, as for each static batch
    loop = engine.decode_loop(slots, context=context, kv=kv)
    seqs = [loop.submit(r) for r in order]
    before = allocator_counts(engine.device)
    ramp_trace = None
    if trace_ramp:
        step_once(loop, window)  # the first pass (first allocations, compiles) outside the trace
        ramp_trace = trace_loop(loop, trace_ramp, trace_dir, f"{prefix}-ramp", step=lambda: step_once(loop, window))
    step_within(loop, window, window.start + seconds)
    after = allocator_counts(engine.device)
    traced = trace_loop(loop, trace_passes, trace_dir, f"{prefix}-passes") if trace_passes else None
    ttft = [s.ttft_s for s in seqs if s.ttft_s is not None]
    out = window.keys(prefix, seconds)
    tag = "" if prefix == "continuous" else prefix.removeprefix("continuous_") + "_"  # the plain row's keys as before
    ramp = loop.stats.pass_s[: out[f"{prefix}_steady_from_pass"] or 0]
    return {**out, f"{tag}slot_utilization": out[f"{prefix}_slot_utilization"],
            f"{prefix}_requests_admitted": sum(s.slot is not None or s.done for s in seqs),
            f"{prefix}_requests_finished": sum(s.done for s in seqs),
            f"{tag}ttft_median_s": statistics.median(ttft) if ttft else None,
            f"{tag}decode_pass_median_s": statistics.median(loop.stats.decode_pass_s or [0.0]),
            f"{prefix}_ramp_pass_median_s": statistics.median(ramp) if ramp else None,
            f"{prefix}_decode_host_median_s": statistics.median(loop.stats.decode_host_s)
            if loop.stats.decode_host_s else None,
            f"{prefix}_allocator": {k: after[k] - before[k] for k in ALLOCATOR} if before is not None else None,
            **({f"{prefix}_trace": traced} if traced is not None else {}),
            **({f"{prefix}_ramp_trace": ramp_trace, f"{prefix}_ramp_traced": trace_ramp}
               if ramp_trace is not None else {})}


def trace_loop(loop, passes: int, trace_dir, name: str, step=None) -> dict | None:
    """``passes`` more passes of ``loop`` (fewer if it runs out of work) under torch's profiler, outside any window
    (``step``: how a pass is run, default ``loop.step``): the summary of stream_bench.trace_summary with the passes'
    kinds (decode only, or with prompts). None when the loop was idle."""
    from benchmarks.stream_bench import profiler, trace_summary

    if loop.idle:
        return None
    kinds, first = [], loop.stats.passes
    with profiler(loop.device) as prof:
        while len(kinds) < passes and not loop.idle:
            decode = len(loop.stats.decode_pass_s)
            (step or loop.step)()
            kinds.append("decode" if len(loop.stats.decode_pass_s) > decode else "with prompts")
    return {"passes": len(kinds), "kinds": kinds, "pass_s": loop.stats.pass_s[first:],
            **trace_summary(prof, trace_dir, name)}
