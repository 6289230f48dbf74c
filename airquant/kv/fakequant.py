"""Fake-quant attention: a whole sequence in one forward, each query seeing what it would see if the
sequence had been decoded token by token through the compressed cache.

Query ``i`` (``i`` tokens cached before it) sees key ``j`` quantized exactly when
``sink <= j < sink + quantized_count(i)``, and unquantized otherwise. Scores and values pick the
quantized or exact version per (query, key) pair, so perplexity reflects the per-query window
instead of quantizing the whole prompt (which overstates the loss several times).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from transformers.cache_utils import Cache

from airquant.kv.cache import GrowingLayer, tag
from airquant.kv.config import Schedule
from airquant.kv.masks import keep_mask

# fake(x [B, H, N, D], layer_idx) -> same-shape reconstruction
FakeFn = Callable[[torch.Tensor, int], torch.Tensor]


@dataclass(frozen=True)
class FakeQuantContext:
    k_hat: torch.Tensor  # [B, Hkv, L, D] reconstruction of every key
    v_hat: torch.Tensor
    quantized: torch.Tensor  # [L, L] bool


class FakeQuantLayer(GrowingLayer):
    """Holds nothing between calls: one forward over a fresh sequence is all it supports."""

    is_compileable = False
    is_sliding = False

    def __init__(self, layer_idx: int, schedule: Schedule, fake_k: FakeFn, fake_v: FakeFn):
        super().__init__()
        self.layer_idx, self.schedule = layer_idx, schedule
        self.fake_k, self.fake_v = fake_k, fake_v
        self.n_seen = 0

    def lazy_initialization(self, key_states, value_states) -> None:
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if self.n_seen:
            raise RuntimeError("FakeQuantLayer runs one forward per fresh sequence (kv_logits makes a new one)")
        self.is_initialized = True
        self.n_seen = key_states.shape[-2]
        ctx = FakeQuantContext(
            k_hat=self.fake_k(key_states, self.layer_idx),
            v_hat=self.fake_v(value_states, self.layer_idx),
            quantized=self.schedule.quantized_pairs(self.n_seen, key_states.device),
        )
        return tag(key_states, ctx), value_states


class FakeQuantCache(Cache):
    """``others`` (layer index -> a transformers cache layer) hold the fixed state of a hybrid stack's
    layers without attention, as in :class:`~airquant.kv.cache.TQCache`."""

    def __init__(self, num_layers: int, schedule: Schedule, fake_k: FakeFn, fake_v: FakeFn,
                 others: dict[int, object] | None = None):
        others = others or {}
        layers = [others[i] if i in others else FakeQuantLayer(i, schedule, fake_k, fake_v)
                  for i in range(num_layers)]
        super().__init__(layers=layers)


def fake_attention(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    ctx: FakeQuantContext,
    mask: torch.Tensor | None,
    scale: float,
) -> torch.Tensor:
    """Per-(query, key) choice of exact or quantized K and V; returns ``[B, L, Hq, D]``."""
    batch, hq, q_len, dim = query.shape
    kv_len = keys.shape[2]
    keep = keep_mask(mask, batch, q_len, kv_len, query.device)  # [B, 1|Hq, L, K]
    quant = ctx.quantized[-q_len:, -kv_len:]
    # One fused sdpa call over [quantized keys ; exact keys]: each query's mask picks, per key, the
    # version it would have seen. Twice the scores, but far fewer passes than explicit where/softmax.
    both_mask = torch.cat([keep & quant, keep & ~quant], dim=-1)
    k = torch.cat([ctx.k_hat, keys], dim=2).to(query.dtype)
    v = torch.cat([ctx.v_hat, values], dim=2).to(query.dtype)
    out = torch.nn.functional.scaled_dot_product_attention(
        query, k, v, attn_mask=both_mask, scale=scale, enable_gqa=query.shape[1] != k.shape[1]
    )
    # Fully masked rows (left padding) come out NaN from sdpa; they are never read, zero them.
    return out.nan_to_num_(0.0).transpose(1, 2)
