"""Needle in a haystack: a sentence with a random number hidden at depths 0-100 % of filler text.

Each cell of the grid is (context length, depth, trial). The context length counts the whole prompt
(chat template included) plus the new tokens, so the longest cell fills the model's context exactly.
Recall is 1 when the needle's number appears, as a whole token, in the normalized answer.
"""

from __future__ import annotations

import logging
import random
import re
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Sequence

from airquant.errors import EvalConfigError
from airquant.eval import prompting
from airquant.eval.data import load_haystack
from airquant.eval.progress import bar
from airquant.eval.rows import RunInfo, collect_run_info, register_row, write_row

log = logging.getLogger(__name__)

__all__ = ["NiahCell", "NiahRow", "default_context_lengths", "normalize", "place_needle", "run_niah", "write_row"]

NEEDLE = "The special magic number mentioned in this text is {answer}."
QUESTION = "What is the special magic number mentioned in the text? Answer with the number only."
PREAMBLE = "Below is a long text. One sentence in it gives a special magic number. Read it, then answer."
DEFAULT_DEPTHS = tuple(float(d) for d in range(0, 101, 10))
_TOKEN_MARGIN = 4  # boundary re-tokenization after the needle is spliced in
_CHARS_PER_TOKEN_MAX = 8  # generous: English prose runs about 4 characters per token


@dataclass(frozen=True)
class NiahCell:
    context_length: int  # target: prompt tokens + max_new_tokens
    depth_percent: float  # requested depth
    trial: int
    prompt_tokens: int
    needle_position: float  # measured: fraction of haystack tokens before the needle
    answer: str
    response: str
    recall: float  # 1.0 when the answer appears in the normalized response
    exact: bool  # the response is the answer and nothing else


@register_row
@dataclass(frozen=True)
class NiahRow:
    metric: ClassVar[str] = "niah"
    run: RunInfo
    recall: float  # mean over all cells
    recall_at_longest: float
    longest_context: int
    context_lengths: tuple[int, ...]
    depths: tuple[float, ...]
    trials: int
    max_new_tokens: int
    batch_size: int
    chat: bool
    needle: str
    question: str
    data_source: str
    seconds: float
    cells: tuple[NiahCell, ...]


def default_context_lengths(limit: int, smallest: int = 1024) -> tuple[int, ...]:
    """Powers of two from ``smallest`` below ``limit``, then ``limit`` itself (1K, 2K, 4K, 8K for 8K)."""
    out, n = [], smallest
    while n < limit:
        out.append(n)
        n *= 2
    return tuple(out) + (limit,)


def normalize(text: str) -> str:
    """Lower case, punctuation to spaces; digit-group commas dropped so "482,913" reads as "482913"."""
    text = re.sub(r"(?<=\d),(?=\d{3}\b)", "", text.lower())
    return " ".join(re.sub(r"[^0-9a-z]+", " ", text).split())


def score_response(response: str, answer: str) -> tuple[float, bool]:
    hit = f" {normalize(answer)} " in f" {normalize(response)} "
    return float(hit), response.strip().rstrip(".").strip() == answer


def place_needle(haystack: str, needle: str, depth_percent: float) -> tuple[str, str]:
    """(text before, text after) the needle at ``depth_percent`` of the characters, at a sentence start."""
    if depth_percent <= 0:
        pos = 0
    elif depth_percent >= 100:
        pos = len(haystack)
    else:
        pos = int(len(haystack) * depth_percent / 100)
        cut = haystack.rfind(". ", 0, pos)
        pos = cut + 2 if cut >= 0 else 0
    return haystack[:pos].rstrip(), haystack[pos:].lstrip()


def build_prompt(before: str, needle: str, after: str) -> str:
    body = " ".join(part for part in (before, needle, after) if part)
    return f"{PREAMBLE}\n\n<text>\n{body}\n</text>\n\n{QUESTION}"


@dataclass(frozen=True)
class _Haystack:
    ids: list[int]
    tokenizer: Any
    chat: bool

    def prompt(self, n_tokens: int, needle: str, depth: float) -> tuple[str, float]:
        text = self.tokenizer.decode(self.ids[:n_tokens], skip_special_tokens=True)
        before, after = place_needle(text, needle, depth)
        position = len(self.tokenizer(before, add_special_tokens=False)["input_ids"]) / max(n_tokens, 1)
        return build_prompt(before, needle, after), min(position, 1.0)

    def fit(self, target: int, needle: str, depth: float) -> tuple[str, int, float]:
        """The prompt of at most ``target`` tokens with the most haystack, its size and needle position."""
        n = target - prompting.count_tokens(self.tokenizer, build_prompt("", needle, ""), self.chat) - _TOKEN_MARGIN
        for _ in range(4):
            if n < 1:
                break
            prompt, position = self.prompt(n, needle, depth)
            size = prompting.count_tokens(self.tokenizer, prompt, self.chat)
            if size <= target:
                return prompt, size, position
            n -= size - target + _TOKEN_MARGIN
        raise EvalConfigError(f"a {target}-token prompt cannot hold the needle and question; "
                              "use longer --context-lengths or fewer --max-new-tokens.")


def _answers(context_lengths: Sequence[int], depths: Sequence[float], trials: int, seed: int) -> list[tuple]:
    """Every cell's (context, depth, trial, answer); the answer depends only on the cell, not run order."""
    cells = []
    for ctx in context_lengths:
        for depth in depths:
            for trial in range(trials):
                rng = random.Random(f"{seed}-{ctx}-{depth}-{trial}")
                cells.append((ctx, float(depth), trial, str(rng.randint(100_000, 999_999))))
    return cells


def _load_haystack(engine: Any, data: str | Path | None, longest: int, chat: bool) -> tuple[_Haystack, str]:
    corpus = load_haystack(data)
    # Tokenizing the whole novel costs seconds; a prefix that surely holds enough tokens is enough.
    text = corpus.text[:longest * _CHARS_PER_TOKEN_MAX]
    ids = engine.tokenizer(text, add_special_tokens=False)["input_ids"]
    if len(ids) < longest:
        raise EvalConfigError(f"{corpus.source} holds only {len(ids)} tokens, fewer than the {longest}-token "
                              "context asked for; pass a longer --data file.")
    return _Haystack(ids, engine.tokenizer, chat), corpus.source


def _check_grid(context_lengths: Sequence[int], depths: Sequence[float], trials: int, batch_size: int,
                limit: int) -> None:
    if not context_lengths or not depths or trials < 1 or batch_size < 1:
        raise EvalConfigError("niah needs at least one context length and depth, trials >= 1 and batch_size >= 1.")
    if max(context_lengths) > limit or any(not 0 <= d <= 100 for d in depths):
        raise EvalConfigError(f"context lengths {list(context_lengths)} must be <= {limit} (the context) and depths "
                              f"{list(depths)} within 0-100.")


def run_niah(engine: Any, *, data: str | Path | None = None, context_lengths: Sequence[int] | None = None,
             depths: Sequence[float] = DEFAULT_DEPTHS, trials: int = 1, max_length: int | None = None,
             max_new_tokens: int = 32, batch_size: int = 1, seed: int = 0, kv: Any = None) -> NiahRow:
    """Recall over the (context length x depth) grid; contexts default to 1K, 2K, ... up to ``max_length``."""
    limit = prompting.context_limit(engine, max_length)
    context_lengths = tuple(sorted(context_lengths or default_context_lengths(limit)))
    _check_grid(context_lengths, depths, trials, batch_size, limit)
    chat = prompting.chat_available(engine.tokenizer)
    haystack, source = _load_haystack(engine, data, max(context_lengths), chat)
    answers = _answers(context_lengths, depths, trials, seed)
    cells, start = [], time.perf_counter()
    progress = bar(len(answers), "niah", "cell")
    for ctx in context_lengths:
        grid = [c for c in answers if c[0] == ctx]
        built = [haystack.fit(ctx - max_new_tokens, NEEDLE.format(answer=a), d) for _, d, _, a in grid]
        for i in range(0, len(grid), batch_size):
            outs = prompting.engine_generate(engine, [p for p, _, _ in built[i:i + batch_size]], kv=kv,
                                               max_new_tokens=max_new_tokens, temperature=0.0, chat=chat)
            for (c, d, t, a), (_, size, pos), out in zip(grid[i:i + batch_size], built[i:i + batch_size], outs):
                recall, exact = score_response(out.text, a)
                cells.append(NiahCell(c, d, t, size, pos, a, out.text[:200], recall, exact))
            progress.update(len(outs))
        done = [c.recall for c in cells if c.context_length == ctx]
        log.info("niah %d tokens: recall %.2f over %d cells", ctx, statistics.fmean(done), len(done))
    progress.close()
    longest = max(context_lengths)
    return NiahRow(
        run=collect_run_info(engine, kv=kv), recall=statistics.fmean(c.recall for c in cells),
        recall_at_longest=statistics.fmean(c.recall for c in cells if c.context_length == longest),
        longest_context=longest, context_lengths=context_lengths, depths=tuple(float(d) for d in depths),
        trials=trials, max_new_tokens=max_new_tokens, batch_size=batch_size, chat=chat, needle=NEEDLE,
        question=QUESTION, data_source=source, seconds=time.perf_counter() - start, cells=tuple(cells))
