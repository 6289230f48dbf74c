"""TurboQuant cache layer for the transformers Cache API.

Token layout of one layer (column order of the attention mask):
  [ sink tokens | quantized history | recent tokens ]
The sink and recent tokens live together in ``self.keys`` / ``self.values`` (compute dtype); the
history lives packed in a :class:`PackedStore`. ``update`` returns the unquantized tokens tagged with
a :class:`CompressedContext`, which the ``airquant_tq`` attention function reads to score the
history in rotated space; no fp copy of the history exists at any time.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from airquant.kv.codec import Codec
from airquant.kv.config import KVConfig, KVConfigError
from airquant.kv.rotation import layer_seed
from airquant.kv.store import History, PackedStore


@dataclass
class Receipt:
    """Set by the attention function when it read the context; checked at the next update."""

    consumed: bool = False


@dataclass(frozen=True)
class CompressedContext:
    """What the attention needs beyond the unquantized tokens it receives as ``key``/``value``."""

    history: History
    k_codec: Codec
    v_codec: Codec
    sink: int  # leading tokens of the unquantized tensor that precede the history in column order
    receipt: Receipt = field(default_factory=Receipt)


class TaggedKeys(torch.Tensor):
    """Plain tensor (every op returns plain tensors) that also carries a context attribute."""

    # The same opt-out nn.Parameter uses: no __torch_function__ dispatch, so no per-op overhead.
    __torch_function__ = torch._C._disabled_torch_function_impl

    def repeat(self, *sizes):
        """Tiled along heads, the keys keep their context and say how often: JetMoE tiles the keys the cache
        returned over its attention experts (``keys.repeat(1, top_k, 1, 1)``, query head h reads key head
        h mod Hkv), which an attention reading the context's keys must mirror."""
        out = torch.Tensor.repeat(self.as_subclass(torch.Tensor), *sizes)
        dims = sizes[0] if len(sizes) == 1 and not isinstance(sizes[0], int) else sizes
        if getattr(self, "kv_context", None) is None or len(dims) != 4 or tuple(dims[2:]) != (1, 1) or dims[0] != 1:
            return out
        out = tag(out, self.kv_context)
        out.kv_tiles = getattr(self, "kv_tiles", 1) * int(dims[1])
        return out


def tag(keys: torch.Tensor, context) -> TaggedKeys:
    out = keys.as_subclass(TaggedKeys)
    out.kv_context = context
    return out


def context_of(keys: torch.Tensor):
    return getattr(keys, "kv_context", None) if isinstance(keys, TaggedKeys) else None


def layer_codecs(kv: KVConfig, layer_idx: int, head_dim: int) -> tuple[Codec, Codec]:
    """The (K, V) codecs of one layer: its bits, and rotations seeded by (seed, layer, stream)."""
    bits_k, bits_v = kv.bits_for(layer_idx)
    return (
        Codec(head_dim, bits_k, layer_seed(kv.seed, layer_idx, "k"), kv.norm_bits, kv.unbiased, kv.rotation),
        Codec(head_dim, bits_v, layer_seed(kv.seed, layer_idx, "v"), kv.norm_bits, kv.unbiased, kv.rotation),
    )


class GrowingLayer(CacheLayerMixin):
    """A cache layer that grows only: ``n_seen`` tokens written, no fixed capacity; the mask covers them and the
    query (transformers' length methods of a cache layer)."""

    n_seen: int = 0

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.n_seen + query_length, 0

    def get_seq_length(self) -> int:
        return self.n_seen

    def get_max_length(self) -> int:
        return -1


class TQLayer(GrowingLayer):
    """One decoder layer's compressed cache; see the module docstring for the layout."""

    is_compileable = False
    is_croppable = False
    is_sliding = False

    def __init__(self, kv: KVConfig, layer_idx: int, head_dim: int):
        super().__init__()
        self.kv = kv
        self.layer_idx = layer_idx
        self.store = PackedStore(*layer_codecs(kv, layer_idx, head_dim))
        self.n_seen = 0
        # Only the receipt of the last step's context is kept: its history views would hold device
        # memory between steps (an offloaded cache moves the store to the host after each step).
        self._last_receipt: Receipt | None = None

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.device, self.dtype = key_states.device, key_states.dtype
        self.keys = key_states[:, :, :0].clone()
        self.values = value_states[:, :, :0].clone()
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """Append ``[B, H, L, D]`` new states; return the unquantized tokens, keys tagged."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self._check_previous_context_used()
        hist_len = self.store.length
        full_k = torch.cat([self.keys, key_states], dim=-2)
        full_v = torch.cat([self.values, value_states], dim=-2)
        self.n_seen += key_states.shape[-2]
        self._flush(full_k, full_v)
        context = CompressedContext(
            history=self.store.view(hist_len),
            k_codec=self.store.k_codec,
            v_codec=self.store.v_codec,
            sink=min(self.kv.sink, full_k.shape[-2]),
        )
        self._last_receipt = context.receipt if hist_len else None
        return tag(full_k, context), full_v

    def _check_previous_context_used(self) -> None:
        receipt = self._last_receipt
        if receipt is not None and not receipt.consumed:
            raise KVConfigError(
                f"layer {self.layer_idx}: the attention did not read the compressed KV history, so it "
                "attended to the recent tokens only. Set model.config._attn_implementation = "
                "'airquant_tq' (make_cache(model.config, ...) does it) before running the model."
            )

    def _flush(self, full_k: torch.Tensor, full_v: torch.Tensor) -> None:
        """Quantize the tokens that left the window; keep sinks + recent tokens as a compact copy."""
        target = self.kv.schedule.quantized_count(self.n_seen)
        n_move = target - self.store.length
        if n_move <= 0:
            self.keys, self.values = full_k, full_v
            return
        s = self.kv.sink
        moving_k, moving_v = full_k[:, :, s : s + n_move], full_v[:, :, s : s + n_move]
        if self.store.length == 0:
            # Every non-sink token still held exactly (>= window of them): one token is no estimate.
            self.store.calibrate(full_k[:, :, s:], full_v[:, :, s:], self.kv.center_k, self.kv.center_v)
        self.store.append(moving_k, moving_v)
        # The clone drops the reference to the (possibly prompt-sized) concatenation.
        self.keys = torch.cat([full_k[:, :, :s], full_k[:, :, s + n_move :]], dim=-2).clone()
        self.values = torch.cat([full_v[:, :, :s], full_v[:, :, s + n_move :]], dim=-2).clone()

    def tensors(self) -> list[torch.Tensor]:
        """Every tensor this layer keeps between steps (for byte accounting)."""
        own = [t for t in (self.keys, self.values) if t is not None]
        return own + self.store.all_tensors()

    def _map(self, fn) -> None:
        if not self.is_initialized:
            return
        self.keys, self.values = fn(self.keys), fn(self.values)
        self.store.map_tensors(fn)

    def offload(self):
        self._map(lambda t: t.to("cpu", non_blocking=True))

    def prefetch(self):
        if self.is_initialized and self.keys.device != self.device:
            self._map(lambda t: t.to(self.device, non_blocking=True))

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self._map(lambda t: t.index_select(0, beam_idx.to(t.device)))

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._map(lambda t: t.repeat_interleave(repeats, dim=0))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._map(lambda t: t[indices.to(t.device)])

    def crop(self, tokens_to_remove: int) -> None:
        raise KVConfigError(
            "the TurboQuant KV cache cannot be cropped (quantized tokens cannot be restored); "
            "disable assisted/speculative decoding or use kv backend 'none'"
        )

    def reset(self) -> None:
        self.keys = self.values = None
        self.is_initialized = False
        self.store = PackedStore(self.store.k_codec, self.store.v_codec)
        self.n_seen = 0
        self._last_receipt = None


class TQCache(Cache):
    """A transformers Cache of :class:`TQLayer`, one per attention layer; ``others`` (layer index -> a
    transformers cache layer) take the places of layers without attention (a hybrid stack's
    linear-attention / state-space layers keep their fixed state there, uncompressed)."""

    def __init__(self, kv: KVConfig, num_layers: int, head_dim: int, others: dict[int, object] | None = None):
        others = others or {}
        super().__init__(layers=[others[i] if i in others else TQLayer(kv, i, head_dim) for i in range(num_layers)])
        self.kv = kv
