"""How much each metric measures: the pipeline's profiles.

``full`` is the reference settings the headline table of ``results/RESULTS.md`` is published at
(``airquant.eval.references.REFERENCE``: PPL on 8 192 WikiText-2 tokens, window 1 024, stride 512;
ROUGE-L on the 250 CNN/DailyMail pairs; NiAH up to the model's context; speed at stated batches and
prompt). ``quick`` is every metric in minutes on a 2-core CPU: the report shows it as the smoke run.
Overrides of a profile's measuring fields make another profile: its rows are labelled ``custom`` (or
the label given) and never pass for the full profile's.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from typing import Literal

from airquant.errors import EvalConfigError
from airquant.eval.references import REFERENCE, HeadlineSettings

log = logging.getLogger(__name__)

Profile = Literal["quick", "full"]
Metric = Literal["ppl", "rouge", "niah", "perf", "parity", "kvmem"]


@dataclass(frozen=True)
class Sizes:
    """Settings of every metric; the defaults are the ``full`` profile (the reference settings)."""

    gen_new_tokens: int = 64
    batch: int = 16  # windows / prompts per weight pass for ppl, parity, niah
    ppl_tokens: int | None = REFERENCE.ppl_tokens  # None: the whole WikiText-2 test set
    ppl_max_length: int = REFERENCE.ppl_max_length
    ppl_stride: int = REFERENCE.ppl_stride
    parity_tokens: int | None = REFERENCE.ppl_tokens
    rouge_samples: int = REFERENCE.rouge_samples
    rouge_new_tokens: int = REFERENCE.rouge_new_tokens
    rouge_max_length: int = REFERENCE.rouge_max_length
    rouge_batch: int = 50  # summaries per generate call: 5 weight passes per token for the 250 pairs
    niah_contexts: tuple[int, ...] = REFERENCE.niah_contexts
    niah_depths: tuple[float, ...] = REFERENCE.niah_depths
    niah_new_tokens: int = REFERENCE.niah_new_tokens
    perf_prompt: int = REFERENCE.perf_prompt
    perf_new_tokens: int = REFERENCE.perf_new_tokens
    perf_batches: tuple[int, ...] = REFERENCE.perf_batches
    perf_repeats: int = 2
    kv_contexts: tuple[int, ...] = (1024, 2048, 4096, 8192)
    kv_window: int = 128
    kv_budget_gb: float = 4.0  # the GPU the largest-batch plan is made for
    label: str = "full"  # row files of other profiles carry it: ppl__...__quick.json

    @classmethod
    def preset(cls, profile: Profile | bool = "full", overrides: dict | None = None) -> "Sizes":
        """A profile's sizes with ``overrides``; ``profile`` True / False mean quick / full (older callers)."""
        name = ("quick" if profile else "full") if isinstance(profile, bool) else profile
        if name not in PROFILES:
            raise EvalConfigError(f"profile {profile!r} is unknown; choose one of {', '.join(PROFILES)}.")
        base = PROFILES[name]
        # Papermill hands lists over where the fields hold tuples (JSON has no tuples).
        given = {k: tuple(v) if isinstance(v, list) else v for k, v in (overrides or {}).items()}
        try:
            sizes = dataclasses.replace(base, **given)
        except TypeError as exc:
            names = ", ".join(f.name for f in dataclasses.fields(cls))
            raise EvalConfigError(f"size overrides {overrides}: {exc}; the fields are {names}.") from exc
        if name == "full" and "label" not in given and sizes.measures_differently(base):
            log.warning("overrides %s change what the full profile measures: rows are labelled 'custom'", overrides)
            sizes = dataclasses.replace(sizes, label="custom")
        return sizes

    def measures_differently(self, other: "Sizes") -> bool:
        """Whether a row measured with these sizes could differ from one measured with ``other``."""
        quiet = {"label", "gen_new_tokens"}  # gen_new_tokens only sizes the notebooks' sample answers
        return any(getattr(self, f.name) != getattr(other, f.name) for f in dataclasses.fields(self)
                   if f.name not in quiet)

    def fit(self, context: int) -> "Sizes":
        """These sizes clamped to a model whose context is ``context`` tokens."""
        ppl_len = min(self.ppl_max_length, context)
        perf_prompt = min(self.perf_prompt, context - self.perf_new_tokens)
        if perf_prompt < 1:
            raise EvalConfigError(f"perf_new_tokens={self.perf_new_tokens} leaves no prompt in a context of {context}.")
        niah = self.niah_contexts
        if max(niah) >= context:  # the longest NiAH cell fills the model's context exactly
            niah = tuple(c for c in niah if c < context) + (context,)
        return dataclasses.replace(
            self, ppl_max_length=ppl_len, ppl_stride=min(self.ppl_stride, ppl_len),
            rouge_max_length=min(self.rouge_max_length, context), perf_prompt=perf_prompt, niah_contexts=niah,
            kv_contexts=tuple(c for c in self.kv_contexts if c <= context) or (context,))

    def headline_settings(self) -> HeadlineSettings:
        """The settings a headline table of these sizes' rows is built at (``REFERENCE`` for ``full``)."""
        return HeadlineSettings(
            name="reference" if self.label == "full" else self.label, ppl_tokens=self.ppl_tokens,
            ppl_max_length=self.ppl_max_length, ppl_stride=self.ppl_stride, rouge_samples=self.rouge_samples,
            rouge_new_tokens=self.rouge_new_tokens, rouge_max_length=self.rouge_max_length,
            niah_contexts=self.niah_contexts, niah_depths=self.niah_depths, niah_new_tokens=self.niah_new_tokens,
            perf_batches=self.perf_batches, perf_prompt=self.perf_prompt, perf_new_tokens=self.perf_new_tokens)


FULL = Sizes()
# Quick: every metric on every configuration of the default model in minutes on a 2-core CPU. NiAH keeps 16
# new tokens: SmolLM2 answers "The special magic number mentioned in the text is 248657", digit by digit.
QUICK = Sizes(gen_new_tokens=16, batch=2, ppl_tokens=1024, ppl_max_length=512, ppl_stride=512, parity_tokens=512,
              rouge_samples=2, rouge_new_tokens=24, rouge_max_length=512, rouge_batch=2, niah_contexts=(512,),
              niah_depths=(0.0, 50.0, 100.0), niah_new_tokens=16, perf_prompt=32, perf_new_tokens=6,
              perf_batches=(1, 4), perf_repeats=1, kv_contexts=(128, 256, 512), label="quick")
PROFILES: dict[str, Sizes] = {"quick": QUICK, "full": FULL}
