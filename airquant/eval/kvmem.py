"""KV-cache memory against context: bytes the cache really allocates, and the largest batch it leaves room for.

For each context length the engine prefills that many tokens of real text into a fresh cache (the plain
one, or the compressed one ``kv`` describes) and ``airquant.kv.cache_nbytes`` counts the storage the
cache keeps. The largest batch is the router's plan (``airquant.engine.memory.router``) for this store on a GPU
of ``vram_budget_gb`` at each context, with this KV scheme: arithmetic from the manifest, not a run.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Sequence

import torch

from airquant.config import EngineConfig
from airquant.engine.memory.router import Hardware, RouteError, plan_route, workload_for
from airquant.errors import AirQuantError, EvalConfigError
from airquant.eval import prompting
from airquant.eval.data import load_wikitext
from airquant.eval.progress import steps
from airquant.eval.rows import RunInfo, collect_run_info, register_row, write_row
from airquant.kv import cache_kwarg, cache_nbytes, make_cache

log = logging.getLogger(__name__)

__all__ = ["KVMemoryRow", "markdown_section", "run_kv_memory", "write_row"]


@register_row
@dataclass(frozen=True)
class KVMemoryRow:
    metric: ClassVar[str] = "kvmem"
    run: RunInfo
    batch_size: int
    context_lengths: tuple[int, ...]
    cache_bytes: tuple[int, ...]  # measured, one per context length
    bytes_per_token: tuple[float, ...]  # cache_bytes / (batch_size * context)
    vram_budget_gb: float | None
    planned_max_batch: tuple[int | None, ...]  # router's largest batch per context (None: scheme not plannable)
    data_source: str
    seconds: float


def _new_cache(engine: Any, kv: Any):
    if kv is not None and kv.backend != "none":
        return make_cache(engine.model.config, kv, device=engine.device, dtype=engine.dtype)
    from transformers import DynamicCache

    return DynamicCache(config=engine.model.config)


@torch.inference_mode()
def prefill_bytes(engine: Any, ids: torch.Tensor, kv: Any) -> int:
    """Bytes a fresh cache holds after ``ids`` [B, S] went through the model (one prefill)."""
    from transformers import GenerationConfig

    from airquant.engine.runner import attention_backends

    cache = _new_cache(engine, kv)
    config = GenerationConfig(max_new_tokens=1, do_sample=False, pad_token_id=engine.tokenizer.pad_token_id)
    ids = ids.to(engine.device)
    try:
        with attention_backends():
            engine.model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), generation_config=config,
                                  **{cache_kwarg(engine.model): cache})
    except BaseException:
        if getattr(engine, "streamer", None) is not None:  # a forward cut short leaves layers in flight
            engine.streamer.reset()
        raise
    return cache_nbytes(cache)


def planned_max_batch(store: Path, kv: Any, context: int, vram_budget_gb: float) -> int | None:
    """The router's largest batch for ``store`` on a GPU of ``vram_budget_gb`` GiB (0: nothing fits)."""
    scheme = "none" if kv is None or kv.backend == "none" else kv.backend
    if scheme not in ("none", "tq"):
        return None
    try:
        route = plan_route([store], Hardware.detect("cuda", max_vram_gb=vram_budget_gb),
                           workload_for(EngineConfig(kv_offload=False), context=context, kv_schemes=(scheme,)))
    except RouteError:
        return 0
    return route.max_batch


def run_kv_memory(engine: Any, *, context_lengths: Sequence[int] = (512, 1024, 2048), kv: Any = None,
                  batch_size: int = 1, vram_budget_gb: float | None = 4.0,
                  data: str | Path | None = None) -> KVMemoryRow:
    """Measured cache bytes after prefilling each of ``context_lengths`` tokens (``kv``: the compressed cache)."""
    limit = prompting.context_limit(engine, None)
    contexts = tuple(sorted(context_lengths))
    if not contexts or contexts[0] < 1 or contexts[-1] > limit or batch_size < 1:
        raise EvalConfigError(f"context lengths {list(contexts)} must be within 1-{limit} (the model's context) "
                              f"and batch_size={batch_size} >= 1.")
    corpus = load_wikitext(data)
    ids = torch.tensor(engine.tokenizer(corpus.text[:contexts[-1] * batch_size * 8])["input_ids"])  # [N]
    if len(ids) < contexts[-1] * batch_size:
        raise EvalConfigError(f"{corpus.source} holds {len(ids)} tokens, fewer than {batch_size} x {contexts[-1]}.")
    start, measured = time.perf_counter(), []
    for ctx in steps(contexts, "kv memory", "context"):
        batch = ids[:ctx * batch_size].reshape(batch_size, ctx)  # [B, S]
        measured.append(prefill_bytes(engine, batch, kv))
        log.info("kv memory at %d tokens: %.2f MB", ctx, measured[-1] / 1e6)
    plans: tuple[int | None, ...] = tuple(None for _ in contexts)
    if vram_budget_gb is not None:
        try:
            plans = tuple(planned_max_batch(Path(engine.store), kv, ctx, vram_budget_gb) for ctx in contexts)
        except AirQuantError as exc:  # a store the router cannot read (an engine without a store, say)
            log.warning("no largest-batch plan: %s", exc)
    return KVMemoryRow(run=collect_run_info(engine, kv=kv), batch_size=batch_size, context_lengths=contexts,
                       cache_bytes=tuple(measured),
                       bytes_per_token=tuple(b / (batch_size * c) for b, c in zip(measured, contexts)),
                       vram_budget_gb=vram_budget_gb, planned_max_batch=plans, data_source=corpus.source,
                       seconds=time.perf_counter() - start)


def markdown_section(rows: list, table) -> list[str]:
    """The report's KV-memory section; ``table`` is the report's markdown-table builder."""
    if not rows:
        return []
    out = ["## KV cache memory", "", "Bytes the cache allocates after a prefill of that many tokens "
           "(`airquant.kv.cache_nbytes`), and the router's largest batch at that context on a GPU of the "
           "budget shown.", ""]
    for r in sorted(rows, key=lambda r: (r.run.model, r.run.store_scheme, r.run.kv_scheme)):
        budget = "—" if r.vram_budget_gb is None else f"{r.vram_budget_gb:g} GiB"
        out += [f"**{r.run.model}, {r.run.store_scheme}, KV {r.run.kv_scheme}** (batch {r.batch_size}):", ""]
        out += table(["context"] + [str(c) for c in r.context_lengths],
                     [["cache MB"] + [f"{b / 1e6:.2f}" for b in r.cache_bytes],
                      ["bytes/token"] + [f"{b:.0f}" for b in r.bytes_per_token],
                      [f"max batch ({budget})"] + ["—" if m is None else str(m) for m in r.planned_max_batch]])
        out.append("")
    return out
