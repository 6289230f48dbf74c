"""Compressed KV cache: TurboQuant (Zandieh et al., arXiv 2504.19874) with AirQuant's extensions.

Public API (used by the engine, the CLI and the eval suite):
  KVConfig            frozen settings, one field per ``--kv-*`` flag
  make_cache(...)     a transformers Cache to pass as ``past_key_values`` (None for backend "none")
  kv_logits(...)      logits as decoding through the compressed cache would give them (perplexity)
  cache_nbytes(...)   bytes actually allocated by a cache's tensors
"""

from __future__ import annotations

import inspect
import logging

import torch

from airquant.kv.codec import fake_quantize
from airquant.kv.config import KVConfig, KVConfigError, Schedule
from airquant.kv.layers import ATTENTION, NONE, RECURRENT, LayerStates, layer_kind
from airquant.kv.turboquant_backend import make_turboquant_cache, turboquant_fake
from airquant.layout import upper_bound_config

logger = logging.getLogger(__name__)

__all__ = ["KVConfig", "KVConfigError", "Schedule", "LayerStates", "make_cache", "kv_logits", "cache_nbytes",
           "cache_kwarg", "model_dims", "state_layers"]


def model_dims(model_config, *, turboquant: bool = True) -> tuple[int, int, int]:
    """(num_layers, num_kv_heads, head_dim) of a decoder config; rejects layouts the cache can't hold.

    Hybrid stacks pass: their linear-attention / state-space / conv layers keep transformers' own fixed
    state beside the compressed attention layers (``make_cache``). Sliding-window attention does not.
    """
    cfg = upper_bound_config(model_config.get_text_config() if hasattr(model_config, "get_text_config")
                             else model_config)
    layer_types = getattr(cfg, "layer_types", None)
    # layer_types is authoritative where present (Qwen2 keeps a sliding_window value it does not use).
    if layer_types:
        unsupported = sorted({t for t in layer_types
                              if t != "full_attention" and layer_kind(t) not in (RECURRENT, NONE)})
    else:
        unsupported = ["sliding"] if getattr(cfg, "sliding_window", None) else []
    if not LayerStates.of(cfg).attention_layers:
        raise KVConfigError(f"{type(cfg).__name__} has no attention layers, so no KV cache to compress (its "
                            "state-space layers keep a fixed state): use kv backend 'none'")
    if unsupported and turboquant:  # a plain cache keeps sliding-window layers (the decode loop masks them)
        raise KVConfigError(
            f"{type(cfg).__name__} has {unsupported} layers; the TurboQuant KV cache supports full-attention "
            "layers (beside linear-attention / state-space ones) only: use kv backend 'none'"
        )
    heads = cfg.num_attention_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    kv_heads = getattr(cfg, "num_key_value_heads", None) or heads
    return cfg.num_hidden_layers, kv_heads, head_dim


def state_layers(model_config) -> dict[int, object]:
    """transformers' own cache layers for the layers without attention (fixed recurrent/conv state, or
    none): a compressed cache holds these beside its attention layers, uncompressed."""
    states = LayerStates.of(model_config)
    if not states.hybrid:
        return {}
    from transformers import DynamicCache

    own = DynamicCache(config=model_config).layers
    return {i: own[i] for i, kind in enumerate(states.kinds) if kind != ATTENTION}


def make_cache(model_config, kv: KVConfig, *, device=None, dtype=None):
    """A Cache for ``model.generate(past_key_values=...)`` or the streamed engine, or None.

    Backend "tq": returns a :class:`~airquant.kv.cache.TQCache` and SETS
    ``model_config._attn_implementation = "airquant_tq"`` (registered with transformers'
    AttentionInterface and AttentionMaskInterface). Pass the model's own config object
    (``model.config``), since the attention modules read the implementation name from it. Plain
    caches keep working afterwards: untagged keys go to transformers' sdpa path. The cache raises
    KVConfigError at the step after one where some other attention implementation bypassed it.
    Streamed engine: call make_cache before building the causal mask (``create_causal_mask`` picks
    the mask builder by the same name; ``airquant_tq`` uses sdpa's boolean mask), then pass the
    cache as ``past_key_values`` to each decoder layer as transformers' own model loop does.
    Hybrid stacks: only the attention layers are compressed; the others hold transformers' own
    recurrent/conv state layers (``state_layers``), untouched.
    Backend "turboquant": the package's cache (one bit-width, ``bits_k`` must equal ``bits_v``).
    ``device``/``dtype`` are taken from the first states written; they are accepted for API symmetry.
    """
    if kv.backend == "none":
        return None
    num_layers, _, head_dim = model_dims(model_config)
    if kv.backend == "turboquant":
        if LayerStates.of(model_config).hybrid:
            raise KVConfigError(f"kv backend 'turboquant' (the PyPI package) has no place for the recurrent state of "
                                f"{type(model_config).__name__}'s linear-attention/state-space layers; use 'tq'")
        return make_turboquant_cache(kv)
    from airquant.kv.cache import TQCache
    from airquant.kv.dispatch import use_tq_attention

    use_tq_attention(model_config)
    logger.debug("TQ cache: %d layers, head_dim %d, %s on %s/%s", num_layers, head_dim, kv, device, dtype)
    return TQCache(kv, num_layers, head_dim, state_layers(model_config))


def _fake_fns(kv: KVConfig, head_dim: int):
    """(fake_k, fake_v, schedule) reproducing the real cache's reconstruction per layer."""
    if kv.backend == "turboquant":
        fake = turboquant_fake(kv)
        return fake, fake, Schedule(window=kv.window, block=1, sink=0)
    from airquant.kv.cache import layer_codecs

    def fake_k(x: torch.Tensor, layer_idx: int) -> torch.Tensor:
        # The real cache measures the mean at its first flush, over the non-sink tokens it holds then.
        return _fake_stream(layer_codecs(kv, layer_idx, head_dim)[0], x, kv.center_k)

    def fake_v(x: torch.Tensor, layer_idx: int) -> torch.Tensor:
        return _fake_stream(layer_codecs(kv, layer_idx, head_dim)[1], x, kv.center_v)

    def _fake_stream(codec, x: torch.Tensor, center: bool) -> torch.Tensor:
        # The real cache calibrates at its first flush, over the non-sink tokens it holds then.
        first = x[:, :, kv.sink : kv.sink + kv.window - 1 + kv.block]
        if not first.shape[-2]:
            return x
        mean = first.float().mean(dim=-2, keepdim=True) if center else None
        return fake_quantize(codec, x, mean, codec.norm_ref(first, mean))

    return fake_k, fake_v, kv.schedule


@torch.no_grad()
def kv_logits(model, input_ids: torch.Tensor, attention_mask: torch.Tensor | None, kv: KVConfig) -> torch.Tensor:
    """``[B, S, V]`` logits where query ``i`` sees what token-by-token decoding through the cache
    would show it: its recent window exact, older tokens quantized (fake quant, one forward)."""
    if kv.backend == "none":
        return model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).logits
    from airquant.kv.dispatch import ATTN_NAME, use_tq_attention
    from airquant.kv.fakequant import FakeQuantCache

    num_layers, _, head_dim = model_dims(model.config)
    fake_k, fake_v, schedule = _fake_fns(kv, head_dim)
    cache = FakeQuantCache(num_layers, schedule, fake_k, fake_v, state_layers(model.config))
    previous = model.config._attn_implementation
    use_tq_attention(model.config)
    try:
        cache_arg = {cache_kwarg(model): cache}
        out = model(input_ids=input_ids, attention_mask=attention_mask, use_cache=True, **cache_arg)
    finally:
        if previous != ATTN_NAME:
            model.config._attn_implementation = previous
    return out.logits


def cache_kwarg(model) -> str:
    """transformers 5.24 renamed ``past_key_values`` to ``cache`` (the old name warns); 5.17 has only the old."""
    try:
        params = inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return "past_key_values"
    return "cache" if "cache" in params else "past_key_values"


def cache_nbytes(cache) -> int:
    """Bytes of every tensor storage a cache keeps between steps (allocated, slack included).

    Storages are counted once each, whole (a view into a larger buffer counts the buffer). A hybrid
    stack's fixed recurrent/conv states count too.
    """
    if cache is None:
        return 0
    seen: dict[int, int] = {}
    for layer in getattr(cache, "layers", []):
        tensors = layer.tensors() if hasattr(layer, "tensors") else _tensor_attrs(layer)
        for t in tensors:
            if t is None or t.numel() == 0:
                continue
            storage = t.untyped_storage()
            seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


def _tensor_attrs(obj) -> list[torch.Tensor]:
    """Tensor attributes, and the tensors of dict attributes (a linear-attention layer's conv/recurrent states)."""
    out = []
    for v in vars(obj).values():
        if isinstance(v, dict):
            out.extend(t for t in v.values() if isinstance(t, torch.Tensor))
        elif isinstance(v, torch.Tensor):
            out.append(v)
    return out
