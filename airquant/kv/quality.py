"""KV-cache quality measurements of the codec and the cache alone: codec MSE, allocated bytes.

``benchmarks/kv_quality.py`` records them; perplexity through the cache is
``airquant.eval.kv_perplexity`` (it shares the eval suite's windows, and kv must not import eval).
"""

from __future__ import annotations

import torch

from airquant.kv import KVConfig, LayerStates, cache_nbytes, make_cache, model_dims
from airquant.kv.codec import Codec


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
