"""The one table of metrics: name -> how to run it and which settings it takes.

``airquant eval METRIC`` (the CLI's flags) and ``airquant.pipeline.suite.evaluate`` (the notebooks' quick and
full sizes) both run a metric through ``METRICS[name].run``; only where the settings come from differs.
The CLI keeps its flag definitions (help, defaults) itself: importing this module imports torch, and
``airquant --help`` should not.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping

from airquant.errors import EvalConfigError
from airquant.eval.kvmem import run_kv_memory
from airquant.eval.niah import run_niah
from airquant.eval.parity import run_parity
from airquant.eval.perf import run_perf_sweep
from airquant.eval.perplexity import run_perplexity
from airquant.eval.rouge import run_rouge

__all__ = ["METRICS", "MetricSpec", "metric_spec"]


def _same_fields(settings: dict) -> dict:
    return dict(settings)


@dataclass(frozen=True)
class MetricSpec:
    name: str
    # (engine, *, data, kv, **settings) -> rows; a sweep gives one row per point, the others one row.
    run: Callable[..., list]
    params: tuple[str, ...]  # settings keywords ``run`` takes besides data, kv (and parity's reference)
    sized: Callable[[Any], dict]  # settings from an ``airquant.pipeline.sizes.Sizes`` (quick or full)
    # Row fields that record the settings: the suite reuses a row only when they match.
    recorded: Callable[[dict], dict] = _same_fields
    takes_reference: bool = False  # ``run`` also takes ``reference``, an engine to compare with (or None)


def _ppl_sized(s: Any) -> dict:
    return dict(limit_tokens=s.ppl_tokens, max_length=s.ppl_max_length, stride=s.ppl_stride, batch_size=s.batch)


def _parity_sized(s: Any) -> dict:
    # Disjoint windows: parity compares every logit once, so no context-only overlap is needed.
    return dict(limit_tokens=s.parity_tokens, max_length=s.ppl_max_length, stride=s.ppl_max_length,
                batch_size=s.batch)


def _rouge_sized(s: Any) -> dict:
    return dict(limit=s.rouge_samples, max_new_tokens=s.rouge_new_tokens, max_length=s.rouge_max_length,
                batch_size=s.rouge_batch)


def _rouge_recorded(settings: dict) -> dict:
    # The row keeps how many articles it scored, not the limit asked for.
    return {**{k: v for k, v in settings.items() if k != "limit"}, "n_samples": settings["limit"]}


def _niah_sized(s: Any) -> dict:
    return dict(context_lengths=tuple(s.niah_contexts), depths=tuple(float(d) for d in s.niah_depths), trials=1,
                max_new_tokens=s.niah_new_tokens, batch_size=s.batch)


def _perf_sized(s: Any) -> dict:
    return dict(batch_sizes=tuple(s.perf_batches), prompt_length=s.perf_prompt, max_new_tokens=s.perf_new_tokens,
                warmup=1, repeats=s.perf_repeats)


def _perf_recorded(settings: dict) -> dict:
    # One row per batch size: each records its own batch_size, not the sweep.
    return {k: v for k, v in settings.items() if k != "batch_sizes"}


def _kvmem_sized(s: Any) -> dict:
    return dict(context_lengths=tuple(s.kv_contexts), vram_budget_gb=s.kv_budget_gb, batch_size=1)


METRICS: Mapping[str, MetricSpec] = {spec.name: spec for spec in (
    MetricSpec("ppl", lambda engine, **kw: [run_perplexity(engine, **kw)],
               ("limit_tokens", "max_length", "stride", "batch_size"), _ppl_sized),
    MetricSpec("rouge", lambda engine, **kw: [run_rouge(engine, **kw)],
               ("limit", "max_new_tokens", "max_length", "batch_size"), _rouge_sized, _rouge_recorded),
    MetricSpec("niah", lambda engine, **kw: [run_niah(engine, **kw)],
               ("context_lengths", "depths", "trials", "max_length", "max_new_tokens", "batch_size", "seed"),
               _niah_sized),
    MetricSpec("perf", run_perf_sweep, ("batch_sizes", "prompt_length", "max_new_tokens", "warmup", "repeats"),
               _perf_sized, _perf_recorded),
    MetricSpec("parity", lambda engine, **kw: [run_parity(engine, **kw)],
               ("limit_tokens", "max_length", "stride", "batch_size"), _parity_sized, takes_reference=True),
    MetricSpec("kvmem", lambda engine, **kw: [run_kv_memory(engine, **kw)],
               ("context_lengths", "batch_size", "vram_budget_gb"), _kvmem_sized),
)}


def metric_spec(name: str) -> MetricSpec:
    try:
        return METRICS[name]
    except KeyError:
        raise EvalConfigError(f"metric {name!r} is not one of {tuple(METRICS)}.") from None
