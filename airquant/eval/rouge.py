"""ROUGE-L on CNN/DailyMail: greedy summaries through the chat template, scored by ``rouge-score``.

``rougeL`` is the LCS F-measure over the whole text; ``rougeLsum`` splits prediction and reference into
one sentence per line and takes the union LCS per reference sentence (the summary-level variant that
CNN/DM papers quote). Both use the Porter stemmer, as the standard setup does.
"""

from __future__ import annotations

import logging
import re
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from airquant.errors import DependencyError, EvalConfigError
from airquant.eval import prompting
from airquant.eval.data import SummaryExample, load_cnn_dailymail
from airquant.eval.progress import steps
from airquant.eval.rows import RunInfo, collect_run_info, register_row, write_row

log = logging.getLogger(__name__)

__all__ = ["RougeRow", "RougeSample", "run_rouge", "score_summaries", "split_sentences", "write_row"]

INSTRUCTION = "Summarize the following news article in three sentences."
# Re-tokenizing the truncated article next to the instruction can shift a few tokens.
_TOKEN_MARGIN = 8
_SENTENCE_END = re.compile(r"(?<=[.!?])\s+(?=[\"'A-Z0-9(])")


@dataclass(frozen=True)
class RougeSample:
    id: str
    prediction: str
    rougeL: float
    rougeLsum: float
    prompt_tokens: int
    new_tokens: int
    truncated: bool


@register_row
@dataclass(frozen=True)
class RougeRow:
    metric: ClassVar[str] = "rouge"
    run: RunInfo
    rougeL: float  # mean F-measure, 0..1
    rougeLsum: float
    n_samples: int
    n_truncated: int  # articles cut to fit the context
    max_new_tokens: int
    max_length: int  # context the prompts were fitted into
    batch_size: int
    chat: bool
    mean_prompt_tokens: float
    mean_new_tokens: float
    instruction: str
    data_source: str
    seconds: float
    samples: tuple[RougeSample, ...]


def split_sentences(text: str) -> str:
    """One sentence per line, the layout ``rougeLsum`` expects (reference bullets keep their lines)."""
    lines = [s.strip() for line in text.strip().splitlines() for s in _SENTENCE_END.split(line)]
    return "\n".join(s for s in lines if s)


def _scorer():
    try:
        from rouge_score import rouge_scorer
    except ImportError as exc:
        raise DependencyError("ROUGE needs rouge-score: pip install rouge-score==0.1.2") from exc
    return rouge_scorer.RougeScorer(["rougeL", "rougeLsum"], use_stemmer=True)


def score_summaries(predictions: list[str], references: list[str]) -> list[tuple[float, float]]:
    """``(rougeL, rougeLsum)`` F-measures per pair."""
    scorer = _scorer()
    out = []
    for pred, ref in zip(predictions, references, strict=True):
        s = scorer.score(split_sentences(ref), split_sentences(pred))  # score(target, prediction)
        out.append((s["rougeL"].fmeasure, s["rougeLsum"].fmeasure))
    return out


def summary_prompt(article: str) -> str:
    return f"{INSTRUCTION}\n\n{article}"


def fit_prompts(engine: Any, examples: list[SummaryExample], *, context: int, max_new_tokens: int,
                chat: bool) -> list[tuple[str, bool]]:
    """Each example's prompt with the article cut so prompt + summary fit ``context``."""
    tok = engine.tokenizer
    budget = context - max_new_tokens - prompting.count_tokens(tok, summary_prompt(""), chat) - _TOKEN_MARGIN
    if budget < 64:
        raise EvalConfigError(f"a context of {context} leaves {budget} tokens for the article after "
                              f"{max_new_tokens} new tokens; raise --max-length or lower --max-new-tokens.")
    out = []
    for ex in examples:
        article, cut = prompting.truncate_tokens(tok, ex.article, budget)
        out.append((summary_prompt(article), cut))
    return out


def _summarize(engine: Any, prompts: list[str], *, batch_size: int, max_new_tokens: int, chat: bool,
               kv: Any) -> list:
    completions = []
    for i in steps(range(0, len(prompts), batch_size), "rouge", "batch"):
        completions += prompting.engine_generate(engine, prompts[i:i + batch_size], kv=kv,
                                                   max_new_tokens=max_new_tokens, temperature=0.0, chat=chat)
        log.info("rouge: %d/%d summaries", len(completions), len(prompts))
    return completions


def run_rouge(engine: Any, *, data: str | Path | None = None, limit: int | None = None, max_new_tokens: int = 128,
              max_length: int | None = None, batch_size: int = 8, kv: Any = None) -> RougeRow:
    """Mean ROUGE-L / ROUGE-Lsum of greedy summaries of CNN/DailyMail test (or ``data``, a JSONL).

    ``limit`` takes the first N articles; ``max_length`` caps the context (default: the model's).
    """
    if batch_size < 1 or max_new_tokens < 1 or (limit is not None and limit < 1):
        raise EvalConfigError(f"batch_size={batch_size}, max_new_tokens={max_new_tokens}, limit={limit}: "
                              "each must be 1 or more.")
    examples, source = load_cnn_dailymail(data, limit)
    chat = prompting.chat_available(engine.tokenizer)
    if not chat:
        log.warning("the tokenizer has no chat template; sending the instruction as plain text")
    context = prompting.context_limit(engine, max_length)
    fitted = fit_prompts(engine, examples, context=context, max_new_tokens=max_new_tokens, chat=chat)
    start = time.perf_counter()
    completions = _summarize(engine, [p for p, _ in fitted], batch_size=batch_size, max_new_tokens=max_new_tokens,
                             chat=chat, kv=kv)
    seconds = time.perf_counter() - start
    scores = score_summaries([c.text for c in completions], [ex.highlights for ex in examples])
    samples = tuple(RougeSample(id=ex.id, prediction=c.text, rougeL=rl, rougeLsum=rls, prompt_tokens=c.prompt_tokens,
                                new_tokens=c.new_tokens, truncated=cut)
                    for ex, c, (rl, rls), (_, cut) in zip(examples, completions, scores, fitted, strict=True))
    return RougeRow(
        run=collect_run_info(engine, kv=kv, extra_packages=("rouge-score",)),
        rougeL=statistics.fmean(s.rougeL for s in samples), rougeLsum=statistics.fmean(s.rougeLsum for s in samples),
        n_samples=len(samples), n_truncated=sum(s.truncated for s in samples), max_new_tokens=max_new_tokens,
        max_length=context, batch_size=batch_size, chat=chat,
        mean_prompt_tokens=statistics.fmean(s.prompt_tokens for s in samples),
        mean_new_tokens=statistics.fmean(s.new_tokens for s in samples), instruction=INSTRUCTION,
        data_source=source, seconds=seconds, samples=samples)
