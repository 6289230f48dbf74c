"""transformers' ``Cache`` over the decode loop's ``SlotKV``, for the stacks ``fallback`` runs through ``generate``.

The attention layers keep their keys and values in the loop's store (its KV offload, its TurboQuant arenas: one
implementation of each); the layers the store does not hold stay transformers' own: recurrent/conv state
(``LinearAttentionLayer``), ``DummyLayer``, and cache kinds beyond keys and values (an indexer, DeepSeek-V4's
compressed cache, a sliding window that drops tokens). Falcon-H1 and Zamba keep keys/values and a Mamba state in one
layer: its keys/values go to the store, its state stays in transformers' class. A fixed state is not offloaded: the
plan counts it in the device reserve (``placement.Reserve.state``).

``generate`` hands a layer a left-padded batch ``[B, H, T, D]``; row ``b`` is the store's slot ``b`` and a pass is
the loop's packed row of the B rows (segment ``b`` at offset ``b * T``), begun at the first layer the store holds.

- Plain: the store in prefix mode keeps every row whole, padding included, and ``update`` returns the rows'
  prefixes ``[B, Hkv, L, D]``: the model's own attention and mask run on them as on a ``DynamicLayer`` (the stacks
  whose attention is module code, GPT-Neo or BLOOM, run so).
- TurboQuant: a row's slot starts at its first real token (the padding is neither calibrated on nor quantized)
  and the attention is the loop's (``slots.ATTN_NAME``, set by ``fallback``): each row decodes as its prompt
  does alone in the loop.
"""

from __future__ import annotations

import torch
from transformers import DynamicCache, cache_utils
from transformers.cache_utils import Cache, CacheLayerMixin, DynamicLayer

from airquant.engine.decode.slots import Segment, SlotKV
from airquant.errors import AirQuantError
from airquant.kv.cache import GrowingLayer, context_of, tag
from airquant.kv.config import KVConfig, KVConfigError

# The linear-attention layer classes are newer than some transformers 5.x releases (5.17 has none).
LinearAttentionLayer = getattr(cache_utils, "LinearAttentionLayer", None)
LinearAttentionAndFullAttentionLayer = getattr(cache_utils, "LinearAttentionAndFullAttentionLayer", None)


class KVOffloadError(AirQuantError):
    """KV offload was asked for a layer whose cache the loop's store does not hold."""


class SlotLayer(GrowingLayer):
    """One attention layer of a ``SlotCache``: its keys/values live in the cache's store."""

    is_compileable = False

    def __init__(self, cache: "SlotCache", layer_idx: int):
        super().__init__()
        self.cache, self.layer_idx, self.n_seen = cache, layer_idx, 0  # n_seen: tokens of a row, padding included

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.is_initialized = True  # the store allocates its buffers at the first write

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        self.is_initialized = True
        out = self.cache.write(key_states, value_states, self.layer_idx, self.n_seen)
        self.n_seen += key_states.shape[-2]
        return out

    def crop(self, tokens_to_remove: int) -> None:
        raise KVConfigError("the fallback's KV cache grows only (no assisted or speculative decoding)")


if LinearAttentionLayer is not None:
    class SlotAndStateLayer(SlotLayer, LinearAttentionLayer):
        """Keys/values in the store, the Mamba state in transformers' ``LinearAttentionLayer`` (Falcon-H1)."""

        def __init__(self, cache: "SlotCache", layer_idx: int, number_of_states: int):
            SlotLayer.__init__(self, cache, layer_idx)
            LinearAttentionLayer.__init__(self, number_of_states=number_of_states)

        def lazy_initialization(self, *args, **kwargs) -> None:
            if args:  # the attention's (key_states, value_states)
                SlotLayer.lazy_initialization(self, *args)
            else:  # update_conv_state / update_recurrent_state name what they initialize
                LinearAttentionLayer.lazy_initialization(self, **kwargs)


class SlotCache(Cache):
    """``generate``'s cache: ``rows`` sequences (``pads``: each row's left padding) of up to ``cap`` tokens;
    ``kv``: TurboQuant settings (None: plain keys/values); ``offload``: layers kept in host memory."""

    def __init__(self, config, *, rows: int, cap: int, device: torch.device, dtype: torch.dtype,
                 kv: KVConfig | None = None, offload: set[int] | frozenset = frozenset(),
                 pads: list[int] | None = None):
        text = config.get_text_config() if hasattr(config, "get_text_config") else config
        own = DynamicCache(config=text).layers
        self.store = SlotKV(len(own), rows, cap, device, dtype, kv=kv, offload=offload, pin=device.type == "cuda")
        if not self.store.tq:
            self.store.use_prefix()
        self.rows, self.pads = rows, list(pads) if pads is not None else [0] * rows
        layers = [self._take(layer, i) for i, layer in enumerate(own)]
        kept = {i: type(layer).__name__ for i, layer in enumerate(layers) if _keeps_tokens(layer)}
        if kv is not None and kept:
            raise KVConfigError(f"{type(text).__name__}'s cache layers {kept} hold more than keys and values (or "
                                "drop tokens), which the TurboQuant cache does not keep: use kv backend 'none'")
        if offloaded := {i: name for i, name in kept.items() if i in offload}:
            raise KVOffloadError(f"KV offload holds keys and values; {type(text).__name__}'s cache layers {offloaded} "
                                 "keep more (or drop tokens): use --no-kv-offload")
        super().__init__(layers=layers)
        self.first = next((i for i, layer in enumerate(layers) if isinstance(layer, SlotLayer)), None)

    def _take(self, layer, i: int):
        """The store's layer in place of transformers' ``layer`` where the store holds what it holds."""
        if type(layer) is DynamicLayer:
            return SlotLayer(self, i)
        if LinearAttentionAndFullAttentionLayer is not None and type(layer) is LinearAttentionAndFullAttentionLayer:
            return SlotAndStateLayer(self, i, layer.number_of_states)
        return layer

    def write(self, key: torch.Tensor, value: torch.Tensor, i: int, seen: int):
        """Layer ``i``'s new ``[B, H, T, D]`` keys/values into the store; what the layer's attention reads."""
        rows, t = key.shape[0], key.shape[2]
        assert rows == self.rows, f"the cache holds {self.rows} rows, the pass has {rows}"
        if i == self.first:
            self.store.begin(self._segments(t, seen))
        packed = [x.transpose(0, 1).reshape(1, x.shape[1], rows * t, x.shape[3]) for x in (key, value)]
        keys, values = self.store.update(*packed, i)
        if self.store.prefix:
            return keys, values  # [B, Hkv, L, D]: every row's prefix
        ctx = context_of(keys)
        ctx.returned = value  # the attention gets the batch's own values, packed again there
        return tag(key, ctx), value

    def _segments(self, t: int, seen: int) -> list[Segment]:
        """The pass's rows as the loop's segments; TurboQuant leaves a row's padding out of its slot."""
        pads = [0] * self.rows if self.store.prefix else self.pads
        return [Segment(r, max(seen - p, 0), t - max(p - seen, 0), r * t + max(p - seen, 0))
                for r, p in enumerate(pads)]


def _keeps_tokens(layer) -> bool:
    """Whether a layer left to transformers caches tokens: a fixed state (``LinearAttentionLayer``) or a
    ``DummyLayer`` is no ``CacheLayerMixin``."""
    return isinstance(layer, CacheLayerMixin) and not isinstance(layer, SlotLayer)
