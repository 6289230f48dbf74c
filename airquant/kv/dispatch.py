"""The ``airquant_tq`` attention implementation registered with transformers.

The model's attention modules call the function registered under ``config._attn_implementation``
right after ``cache.update``; the keys they pass are the tagged tensor the cache returned, so the
function finds the compressed history (or the fake-quant reconstruction) on them. Untagged keys
(another cache, or no history yet) go to transformers' own sdpa path unchanged, which keeps results
bit-identical to the sdpa implementation whenever nothing is quantized.
"""

from __future__ import annotations

import logging

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from airquant.kv.attention import compressed_attention
from airquant.kv.cache import CompressedContext, context_of
from airquant.kv.config import KVConfigError
from airquant.kv.fakequant import FakeQuantContext, fake_attention

logger = logging.getLogger(__name__)

ATTN_NAME = "airquant_tq"


def tq_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """AttentionInterface signature: returns ``(output [B, L, Hq, D], None)``."""
    ctx = context_of(key)
    plain_key = key.as_subclass(torch.Tensor) if ctx is not None else key
    if isinstance(ctx, CompressedContext):
        ctx.receipt.consumed = True
    has_history = isinstance(ctx, CompressedContext) and ctx.history.length > 0
    if ctx is None or not (has_history or isinstance(ctx, FakeQuantContext)):
        return sdpa_attention_forward(
            module, query, plain_key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    if kwargs.get("softcap") is not None or kwargs.get("sliding_window") is not None:
        raise KVConfigError(
            f"{type(module).__name__}: softcapping / sliding-window attention is not supported by the "
            "TurboQuant KV cache; use kv backend 'none' for this model"
        )
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    if isinstance(ctx, FakeQuantContext):
        return fake_attention(query, plain_key, value, ctx, attention_mask, scale), None
    return compressed_attention(query, plain_key, value, ctx, attention_mask, scale), None


def register_tq_attention() -> None:
    """Register the attention function and its (sdpa-style boolean) mask builder; idempotent."""
    AttentionInterface.register(ATTN_NAME, tq_attention)
    AttentionMaskInterface.register(ATTN_NAME, sdpa_mask)


def use_tq_attention(config) -> None:
    """Point a model config (and its sub-configs) at ``airquant_tq``."""
    register_tq_attention()
    if getattr(config, "_attn_implementation", None) != ATTN_NAME:
        logger.debug("setting attention implementation %r -> %r", config._attn_implementation, ATTN_NAME)
        config._attn_implementation = ATTN_NAME
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    if text is not config and getattr(text, "_attn_implementation", None) != ATTN_NAME:
        text._attn_implementation = ATTN_NAME
