"""Perplexity with a sliding window, as in the transformers "perplexity of fixed-length models" guide.

Windows of ``max_length`` tokens start every ``stride`` tokens; each token is scored once, in the
first window that reaches it, with up to ``max_length - stride`` tokens of context before it; tokens
that are only context carry no loss. The result is the token-weighted mean NLL over all scored tokens.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import torch
import torch.nn.functional as F

from airquant.errors import EvalConfigError
from airquant.eval.data import load_wikitext
from airquant.eval.progress import steps
from airquant.eval.rows import RunInfo, collect_run_info, register_row, write_row

log = logging.getLogger(__name__)
_CHARS_PER_TOKEN_MAX = 16

__all__ = ["PerplexityRow", "Window", "plan_windows", "run_perplexity", "score_windows", "write_row"]


@register_row
@dataclass(frozen=True)
class PerplexityRow:
    metric: ClassVar[str] = "ppl"
    run: RunInfo
    ppl: float
    mean_nll: float  # nats per scored token
    n_tokens: int  # tokens of text evaluated
    n_scored: int  # tokens that carried a loss (n_tokens - 1: the first has no context)
    n_windows: int
    max_length: int
    stride: int
    limit_tokens: int | None
    batch_size: int
    data_source: str
    seconds: float


@dataclass(frozen=True)
class Window:
    begin: int  # first input token
    end: int  # one past the last input token
    target_begin: int  # first scored token; [begin, target_begin) is context only

    @property
    def length(self) -> int:
        return self.end - self.begin


def plan_windows(n_tokens: int, max_length: int, stride: int) -> list[Window]:
    """The guide's windows: ``begin`` every ``stride``, stopping at the first that reaches the end."""
    windows, prev_end = [], 0
    for begin in range(0, n_tokens, stride):
        end = min(begin + max_length, n_tokens)
        # A window's first token has no logit predicting it inside that window.
        windows.append(Window(begin, end, max(prev_end, begin + 1)))
        prev_end = end
        if end == n_tokens:
            break
    return windows


def check_window(engine: Any, max_length: int, stride: int) -> None:
    limit = getattr(engine.config, "max_position_embeddings", None)
    if max_length < 2:
        raise EvalConfigError(f"--max-length {max_length}: a window needs at least 2 tokens.")
    if not 1 <= stride <= max_length:
        raise EvalConfigError(f"--stride {stride} must be between 1 and --max-length {max_length}; "
                              "stride == max-length gives disjoint chunks, smaller strides add context.")
    if limit and max_length > limit:
        raise EvalConfigError(f"--max-length {max_length} exceeds the model's context of {limit}; "
                              f"use --max-length {limit} or less.")


def batch_windows(windows: list[Window], batch_size: int) -> list[list[Window]]:
    """Consecutive windows of equal length, ``batch_size`` at a time (only the last may be shorter)."""
    out: list[list[Window]] = []
    for w in windows:
        if out and len(out[-1]) < batch_size and out[-1][0].length == w.length:
            out[-1].append(w)
        else:
            out.append([w])
    return out


@torch.inference_mode()
def score_windows(engine: Any, ids: torch.Tensor, windows: list[Window], *, kv: Any = None,
                  batch_size: int = 1) -> tuple[float, int]:
    """Sum of NLL (nats) over every window's scored tokens, and how many tokens that is."""
    nll_sum, count = 0.0, 0
    groups = list(batch_windows(windows, batch_size))
    for i, group in enumerate(steps(groups, "ppl", "batch")):
        inputs = torch.stack([ids[w.begin:w.end] for w in group]).to(engine.device)  # [B, S]
        logits = engine.forward(inputs, kv=kv)  # [B, S, V]
        for row, w in enumerate(group):
            # Logit at position p predicts token p + 1; slice before upcasting to keep memory at [T, V].
            pred = logits[row, w.target_begin - 1 - w.begin:w.end - 1 - w.begin].float()  # [T, V]
            target = ids[w.target_begin:w.end].to(pred.device)  # [T]
            nll_sum += F.cross_entropy(pred, target, reduction="sum").item()
            count += w.end - w.target_begin
        log.debug("ppl batch %d: %d windows, running ppl %.3f", i, len(group), math.exp(nll_sum / max(count, 1)))
    return nll_sum, count


def tokenize_text(tokenizer: Any, text: str, limit_tokens: int | None) -> torch.Tensor:
    """Token ids of ``text`` as the guide makes them (special tokens included), cut to ``limit_tokens``."""
    if limit_tokens:
        # Tokenizing all of WikiText-2 takes seconds; a prefix of 16 characters per wanted token is ample
        # (English runs about 4) and gives the same first tokens, since BPE never merges across the
        # whitespace pre-tokenization far behind the cut.
        ids = tokenizer(text[:limit_tokens * _CHARS_PER_TOKEN_MAX])["input_ids"]
        if len(ids) > limit_tokens or len(text) <= limit_tokens * _CHARS_PER_TOKEN_MAX:
            return torch.tensor(ids[:limit_tokens], dtype=torch.long)  # [N]
    ids = torch.tensor(tokenizer(text)["input_ids"], dtype=torch.long)  # [N]
    return ids[:limit_tokens] if limit_tokens else ids


def run_perplexity(engine: Any, *, data: str | Path | None = None, limit_tokens: int | None = None,
                   max_length: int = 2048, stride: int = 512, kv: Any = None, batch_size: int = 1) -> PerplexityRow:
    """Sliding-window perplexity of WikiText-2 test (or ``data``) on ``engine``.

    ``batch_size`` windows go through one forward: a streamed engine then loads each layer once for
    all of them. ``kv`` (an ``airquant.kv.KVConfig``) runs attention through the compressed cache.
    """
    check_window(engine, max_length, stride)
    if limit_tokens is not None and limit_tokens < 2:
        raise EvalConfigError(f"--limit-tokens {limit_tokens}: perplexity needs at least 2 tokens.")
    if batch_size < 1:
        raise EvalConfigError(f"batch_size {batch_size}: use 1 or more.")
    corpus = load_wikitext(data)
    ids = tokenize_text(engine.tokenizer, corpus.text, limit_tokens)
    windows = plan_windows(len(ids), max_length, stride)
    start = time.perf_counter()
    nll_sum, count = score_windows(engine, ids, windows, kv=kv, batch_size=batch_size)
    seconds = time.perf_counter() - start
    mean_nll = nll_sum / count
    log.info("ppl %.4f over %d tokens in %d windows (%.1f s)", math.exp(mean_nll), count, len(windows), seconds)
    return PerplexityRow(run=collect_run_info(engine, kv=kv), ppl=math.exp(mean_nll), mean_nll=mean_nll,
                         n_tokens=len(ids), n_scored=count, n_windows=len(windows), max_length=max_length,
                         stride=stride, limit_tokens=limit_tokens, batch_size=batch_size,
                         data_source=corpus.source, seconds=seconds)
