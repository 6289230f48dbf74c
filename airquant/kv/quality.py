"""KV-cache quality measurements: codec MSE, allocated bytes, perplexity through the cache.

Each function returns one typed row; ``benchmarks/kv_quality.py`` records them. (They belong to the
eval suite in spirit; they live here until ``airquant.eval`` grows a KV module.)
"""

from __future__ import annotations

import logging
import math
from dataclasses import asdict, dataclass

import torch

from airquant.kv import KVConfig, LayerStates, cache_nbytes, kv_logits, make_cache, model_dims
from airquant.kv.codec import Codec

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class PerplexityRow:
    label: str
    kv: dict
    ppl: float
    tokens_scored: int
    logit_cosine: float | None  # mean cosine of logits vs the exact cache (None for the exact one)
    top1_agreement: float | None
    bits_per_element: float | None


def codec_mse(dim: int, bits: int, n: int = 8192, seed: int = 0) -> float:
    """Mean ``||x - x_hat||^2`` over random unit vectors through AirQuant's codec (layer 0 rotation)."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, dim, generator=gen)
    x = x / x.norm(dim=-1, keepdim=True)
    codec = Codec(dim, bits, seed=12345)
    x_hat = codec.decode(codec.encode(x))
    return float(((x_hat - x) ** 2).sum(-1).mean())


def compression_vs_fp16(model_config, kv: KVConfig, n_tokens: int, batch: int = 1) -> float:
    """fp16 cache bytes / allocated compressed-cache bytes after a prefill of ``n_tokens``."""
    _, kv_heads, head_dim = model_dims(model_config)
    attention = LayerStates.of(model_config).attention_layers  # a hybrid stack's other layers hold no KV
    cache = make_cache(model_config, kv, device="cpu", dtype=torch.float16)
    gen = torch.Generator().manual_seed(0)
    shape = (batch, kv_heads, n_tokens, head_dim)
    for layer_idx in attention:
        k = torch.randn(shape, generator=gen).to(torch.float16)
        cache.update(k, k.clone(), layer_idx)  # one prefill per layer: nothing needs to attend
    fp16_bytes = 2 * len(attention) * batch * kv_heads * n_tokens * head_dim * 2
    return fp16_bytes / cache_nbytes(cache)


def _windows(n_tokens: int, max_length: int, stride: int):
    """HF 'perplexity of fixed-length models': (begin, end, number of new target tokens)."""
    prev_end = 0
    for begin in range(0, n_tokens, stride):
        end = min(begin + max_length, n_tokens)
        yield begin, end, end - prev_end
        prev_end = end
        if end == n_tokens:
            break


@torch.no_grad()
def perplexity(
    model, input_ids: torch.Tensor, kv: KVConfig, *, max_length: int = 1024, stride: int = 512, label: str = ""
) -> tuple[PerplexityRow, list[torch.Tensor]]:
    """Sliding-window perplexity with ``kv_logits``; also returns the scored logits for comparisons."""
    nll, count, scored = 0.0, 0, []
    for begin, end, target_len in _windows(input_ids.shape[1], max_length, stride):
        ids = input_ids[:, begin:end]
        logits = kv_logits(model, ids, None, kv)[0, :-1].float()  # predicts ids[1:]
        targets = ids[0, 1:]
        first = max(0, ids.shape[1] - target_len - 1)  # context-only tokens are the -100 ones
        logp = torch.log_softmax(logits[first:], dim=-1)
        nll -= logp.gather(-1, targets[first:, None]).sum().item()
        count += targets.shape[0] - first
        scored.append(logits[first:])
        logger.info("%s window %d-%d ppl so far %.3f", label, begin, end, math.exp(nll / count))
    row = PerplexityRow(label, asdict(kv), math.exp(nll / count), count, None, None, None)
    return row, scored


def compare_logits(
    row: PerplexityRow, scored: list[torch.Tensor], exact: list[torch.Tensor], head_dim: int, num_layers: int
) -> PerplexityRow:
    """Fill in logit cosine / top-1 agreement against the exact cache's logits."""
    a, b = torch.cat(scored), torch.cat(exact)
    cosine = torch.nn.functional.cosine_similarity(a, b, dim=-1).mean().item()
    top1 = (a.argmax(-1) == b.argmax(-1)).float().mean().item()
    kv = dict(row.kv, layer_bits=tuple(tuple(e) for e in row.kv["layer_bits"]))
    bits = KVConfig(**kv).bits_per_element(head_dim, num_layers) if kv["backend"] != "none" else None
    return PerplexityRow(row.label, row.kv, row.ppl, row.tokens_scored, cosine, top1, bits)
