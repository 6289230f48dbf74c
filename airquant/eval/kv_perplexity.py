"""Perplexity through a compressed KV cache on a resident HF model, and its logits against the exact cache.

``benchmarks/kv_quality.py`` records these rows in ``results/kv_quality.json``. The windows are
``airquant.eval.perplexity.plan_windows``'s; unlike ``run_perplexity`` this scores a plain HF model
through ``airquant.kv.kv_logits`` (fake quant per query window) and keeps the scored logits, so that
each cache setting can be compared with the exact one token by token.
"""

from __future__ import annotations

import logging
import math
from dataclasses import asdict, dataclass

import torch

from airquant.eval.perplexity import plan_windows
from airquant.kv import KVConfig, kv_logits

log = logging.getLogger(__name__)

__all__ = ["KVPerplexityRow", "compare_logits", "kv_perplexity"]


@dataclass(frozen=True)
class KVPerplexityRow:
    label: str
    kv: dict
    ppl: float
    tokens_scored: int
    logit_cosine: float | None  # mean cosine of logits vs the exact cache (None for the exact one)
    top1_agreement: float | None
    bits_per_element: float | None


@torch.no_grad()
def kv_perplexity(
    model, input_ids: torch.Tensor, kv: KVConfig, *, max_length: int = 1024, stride: int = 512, label: str = ""
) -> tuple[KVPerplexityRow, list[torch.Tensor]]:
    """Sliding-window perplexity of ``input_ids`` ``[1, N]`` with ``kv_logits``; also the scored logits."""
    nll, count, scored = 0.0, 0, []
    for w in plan_windows(input_ids.shape[1], max_length, stride):
        ids = input_ids[:, w.begin:w.end]  # [1, S]
        logits = kv_logits(model, ids, None, kv)[0, :-1].float()  # [S - 1, V], predicts ids[1:]
        first = w.target_begin - 1 - w.begin  # logits before it predict context-only tokens
        # log_softmax + gather (not cross_entropy): the figures in results/kv_quality.json were made so.
        logp = torch.log_softmax(logits[first:], dim=-1)  # [T, V]
        nll -= logp.gather(-1, ids[0, w.target_begin - w.begin:, None]).sum().item()
        count += w.end - w.target_begin
        scored.append(logits[first:])
        log.info("%s window %d-%d ppl so far %.3f", label, w.begin, w.end, math.exp(nll / count))
    row = KVPerplexityRow(label, asdict(kv), math.exp(nll / count), count, None, None, None)
    return row, scored


def compare_logits(
    row: KVPerplexityRow, scored: list[torch.Tensor], exact: list[torch.Tensor], head_dim: int, num_layers: int
) -> KVPerplexityRow:
    """Fill in logit cosine / top-1 agreement against the exact cache's logits."""
    a, b = torch.cat(scored), torch.cat(exact)
    cosine = torch.nn.functional.cosine_similarity(a, b, dim=-1).mean().item()
    top1 = (a.argmax(-1) == b.argmax(-1)).float().mean().item()
    kv = dict(row.kv, layer_bits=tuple(tuple(e) for e in row.kv["layer_bits"]))
    bits = KVConfig(**kv).bits_per_element(head_dim, num_layers) if kv["backend"] != "none" else None
    return KVPerplexityRow(row.label, row.kv, row.ppl, row.tokens_scored, cosine, top1, bits)
