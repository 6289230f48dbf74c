"""Logit parity of an engine against a reference engine on held-out text windows.

At every position that predicts a token (the same positions the perplexity windows score) both
engines' next-token logits are compared: cosine similarity of the raw logits, agreement of the
arg-max, and KL(reference || test) of the softmax distributions, in nats.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import torch
import torch.nn.functional as F

from airquant.errors import EvalConfigError
from airquant.eval.data import load_wikitext
from airquant.eval.perplexity import Window, batch_windows, check_window, plan_windows, tokenize_text
from airquant.eval.progress import steps
from airquant.eval.rows import RunInfo, collect_run_info, register_row, write_row

log = logging.getLogger(__name__)

__all__ = ["ParityRow", "logit_stats", "run_parity", "write_row"]


@register_row
@dataclass(frozen=True)
class ParityRow:
    metric: ClassVar[str] = "parity"
    run: RunInfo  # the engine under test
    reference_run: RunInfo
    cosine_mean: float
    cosine_min: float
    top1_agreement: float  # fraction of positions whose arg-max token matches
    kl_mean: float  # KL(reference || test), nats per position
    kl_max: float
    n_positions: int
    n_windows: int
    max_length: int
    stride: int
    limit_tokens: int | None
    batch_size: int
    data_source: str
    seconds: float


def logit_stats(test: torch.Tensor, ref: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per position ``(cosine, top-1 match, KL(ref || test))`` for logits ``[T, V]`` (upcast to float32)."""
    test, ref = test.float(), ref.float().to(test.device)
    cosine = F.cosine_similarity(test, ref, dim=-1)  # [T]
    agree = (test.argmax(-1) == ref.argmax(-1)).float()  # [T]
    kl = F.kl_div(F.log_softmax(test, -1), F.log_softmax(ref, -1), log_target=True, reduction="none").sum(-1)
    return cosine, agree, kl


@dataclass
class _Totals:
    cosine: float = 0.0
    agree: float = 0.0
    kl: float = 0.0
    cosine_min: float = float("inf")
    kl_max: float = 0.0
    n: int = 0

    def add(self, cosine: torch.Tensor, agree: torch.Tensor, kl: torch.Tensor) -> None:
        # float64 sums: hundreds of thousands of positions in float32 would lose the 4th digit.
        self.cosine += cosine.double().sum().item()
        self.agree += agree.double().sum().item()
        self.kl += kl.double().sum().item()
        self.cosine_min = min(self.cosine_min, cosine.min().item())
        self.kl_max = max(self.kl_max, kl.max().item())
        self.n += cosine.numel()


def _compare(engine: Any, reference: Any, ids: torch.Tensor, windows: list[Window], kv: Any, reference_kv: Any,
             batch_size: int) -> _Totals:
    totals = _Totals()
    with torch.inference_mode():
        for group in steps(list(batch_windows(windows, batch_size)), "parity", "batch"):
            inputs = torch.stack([ids[w.begin:w.end] for w in group])  # [B, S]
            test = engine.forward(inputs.to(engine.device), kv=kv)  # [B, S, V]
            ref = reference.forward(inputs.to(reference.device), kv=reference_kv)  # [B, S, V]
            for row, w in enumerate(group):
                sl = slice(w.target_begin - 1 - w.begin, w.end - 1 - w.begin)
                totals.add(*logit_stats(test[row, sl], ref[row, sl]))
    return totals


def run_parity(engine: Any, *, reference: Any = None, data: str | Path | None = None, limit_tokens: int | None = 8192,
               max_length: int = 512, stride: int | None = None, kv: Any = None, reference_kv: Any = None,
               batch_size: int = 1) -> ParityRow:
    """Compare ``engine`` (with ``kv``) against ``reference`` (with ``reference_kv``) on WikiText-2 test.

    Without ``reference`` the engine is compared with itself without a compressed KV cache, which
    isolates the KV scheme's effect. ``stride`` defaults to ``max_length`` (disjoint windows).
    """
    stride = stride or max_length
    check_window(engine, max_length, stride)
    if reference is None:
        if kv is None:
            raise EvalConfigError("parity of an engine with itself and no --kv compares nothing; pass a "
                                  "reference engine or a --kv scheme.")
        reference = engine
    if batch_size < 1 or (limit_tokens is not None and limit_tokens < 2):
        raise EvalConfigError(f"batch_size={batch_size} must be >= 1 and limit_tokens={limit_tokens} >= 2.")
    corpus = load_wikitext(data)
    ids = tokenize_text(engine.tokenizer, corpus.text, limit_tokens)
    windows = plan_windows(len(ids), max_length, stride)
    start = time.perf_counter()
    t = _compare(engine, reference, ids, windows, kv, reference_kv, batch_size)
    log.info("parity over %d positions: cosine %.5f, top-1 %.4f, KL %.5f", t.n, t.cosine / t.n, t.agree / t.n,
             t.kl / t.n)
    return ParityRow(run=collect_run_info(engine, kv=kv), reference_run=collect_run_info(reference, kv=reference_kv),
                     cosine_mean=t.cosine / t.n, cosine_min=t.cosine_min, top1_agreement=t.agree / t.n,
                     kl_mean=t.kl / t.n, kl_max=t.kl_max, n_positions=t.n, n_windows=len(windows),
                     max_length=max_length, stride=stride, limit_tokens=limit_tokens, batch_size=batch_size,
                     data_source=corpus.source, seconds=time.perf_counter() - start)
