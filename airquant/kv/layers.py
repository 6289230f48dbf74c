"""What each decoder layer keeps between decoding steps: a KV cache, a fixed recurrent state, or nothing.

Hybrid stacks (Qwen3-Next / Qwen3.5, LFM2, Nemotron-H, Jamba, Bamba, ...) put attention layers, whose
keys and values grow with every token, beside linear-attention / state-space / short-convolution
layers, whose state has one fixed size per sequence. The planner counts KV bytes for the first kind
and state bytes for the second; the compressed KV cache compresses only the first.

Read from a transformers config (the router reads ``config.json`` through the type's config class,
which derives ``layer_types`` from the older fields some checkpoints still carry).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

logger = logging.getLogger(__name__)

ATTENTION, RECURRENT, BOTH, NONE = "attention", "recurrent", "attention+recurrent", "none"
# transformers' layer type names -> what the layer caches. Sliding and chunked attention keep at most
# a window, but are counted whole, as before (an upper bound). Unknown names count as attention.
_KINDS = {"full_attention": ATTENTION, "sliding_attention": ATTENTION, "chunked_attention": ATTENTION,
          "attention": ATTENTION, "linear_attention": RECURRENT, "conv": RECURRENT, "mamba": RECURRENT,
          "hybrid": BOTH, "hybrid_sliding": BOTH, "moe": NONE, "mlp": NONE}
# Recurrent states are float32 in transformers whatever the model dtype (the gated delta rule and the
# Mamba scans accumulate in fp32; Nemotron-H's mamba_ssm_cache_dtype defaults to it); conv states
# hold inputs, in the model dtype.
RECURRENT_BYTES = 4


@dataclass(frozen=True)
class LayerStates:
    """Per layer, what it caches; and the fixed state of one sequence over every recurrent layer."""

    kinds: tuple[str, ...]  # ATTENTION, RECURRENT, BOTH or NONE per decoder layer
    state_elems: int = 0  # in the model dtype: convolution windows, MiniMax's linear-attention state
    fp32_elems: int = 0  # in float32: Gated DeltaNet and Mamba recurrent states

    @classmethod
    def of(cls, config) -> "LayerStates":
        """From a transformers config (a multimodal one's text part), or any object with its attributes."""
        cfg = _text_part(config)
        types = _layer_types(cfg)
        kinds = tuple(layer_kind(t) for t in types)
        elems = fp32 = 0
        for t, kind in zip(types, kinds):
            if kind in (RECURRENT, BOTH):
                e, f = _state_elems(cfg, t)
                elems, fp32 = elems + e, fp32 + f
        return cls(kinds, elems, fp32)

    @property
    def attention_layers(self) -> tuple[int, ...]:
        return tuple(i for i, k in enumerate(self.kinds) if k in (ATTENTION, BOTH))

    @property
    def recurrent_layers(self) -> tuple[int, ...]:
        return tuple(i for i, k in enumerate(self.kinds) if k in (RECURRENT, BOTH))

    @property
    def hybrid(self) -> bool:
        return any(k != ATTENTION for k in self.kinds)

    def state_bytes(self, dtype_bytes: int) -> int:
        """The fixed state of one sequence, every recurrent layer."""
        return self.state_elems * dtype_bytes + self.fp32_elems * RECURRENT_BYTES

    def describe(self, dtype_bytes: int) -> str:
        """E.g. ``KV for 6 of 24 layers (attention) + 1.2 MB fixed state per sequence``."""
        text = f"KV for {len(self.attention_layers)} of {len(self.kinds)} layers (attention)"
        if self.recurrent_layers:
            n = len(self.recurrent_layers)
            text += (f" + {self.state_bytes(dtype_bytes) / 1e6:.3g} MB fixed state per sequence in {n} "
                     f"layer{'s' if n > 1 else ''}")
        return text


def layer_kind(layer_type: str) -> str:
    """ATTENTION, RECURRENT, BOTH or NONE for one of transformers' layer type names."""
    return _KINDS.get(layer_type, ATTENTION)


def _get(cfg, name: str, default=None):
    value = getattr(cfg, name, None)
    return default if value is None else value


def _first(cfg, *names: str, default=None):
    return next((_get(cfg, n) for n in names if _get(cfg, n) is not None), default)


def _text_part(config):
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def _layer_types(cfg) -> list[str]:
    """transformers' layer type names, one per decoder layer (all "full_attention" when none are given).

    The config classes derive ``layer_types`` from older fields (Nemotron-H's pattern string, Qwen3-Next's
    attention interval, LFM2's attention indices, ...): read a config.json through its class first.
    """
    n = _get(cfg, "num_hidden_layers")
    types = _first(cfg, "layer_types", "layers_block_type")
    if types is None:
        return ["full_attention"] * int(n or 0)
    return list(types)[: n or len(types)]


def _state_elems(cfg, layer_type: str) -> tuple[int, int]:
    """(model-dtype, float32) state elements of one sequence in one layer, from the config's dimensions.

    * LFM2 short convolution: a window of ``conv_L_cache`` inputs over ``hidden_size`` channels.
    * Gated DeltaNet (Qwen3-Next, Qwen3.5, OLMo-hybrid): a window of ``linear_conv_kernel_dim`` over
      the q, k and v channels (2 x key heads x key dim + value heads x value dim), and per value head
      a key dim x value dim state.
    * Mamba-2 (Nemotron-H, Bamba, Falcon-H1, Mamba2; has groups): a window of the conv kernel over the
      inner channels (heads x head dim) plus 2 x groups x state size (B and C), and an inner x state
      size state.
    * Mamba-1 (Mamba, Jamba; no groups): a conv window over the inner channels (expand x hidden) and
      an inner x state size state.
    * MiniMax lightning attention: per head a head dim x head dim state, in the model dtype.
    """
    hidden = _get(cfg, "hidden_size", 0)
    if layer_type == "conv":
        return hidden * _get(cfg, "conv_L_cache", 3), 0
    if _get(cfg, "linear_num_value_heads"):
        nk, dk = _get(cfg, "linear_num_key_heads"), _get(cfg, "linear_key_head_dim")
        nv, dv = _get(cfg, "linear_num_value_heads"), _get(cfg, "linear_value_head_dim")
        return (2 * nk * dk + nv * dv) * _get(cfg, "linear_conv_kernel_dim", 4), nv * dk * dv
    if _get(cfg, "linear_attn_alpha_factor") is not None:
        heads = _get(cfg, "num_attention_heads")
        head_dim = _get(cfg, "head_dim") or hidden // heads
        return heads * head_dim * head_dim, 0
    d_state = _first(cfg, "ssm_state_size", "mamba_d_state", "state_size")
    if d_state is None:
        logger.warning("%s layers of model type %s: no state size found in the config; their fixed state is "
                       "left out of the plan", layer_type, _get(cfg, "model_type"))
        return 0, 0
    kernel = _first(cfg, "conv_kernel", "mamba_d_conv", "d_conv", default=4)
    expand = _first(cfg, "mamba_expand", "expand", default=2)
    groups = _first(cfg, "n_groups", "mamba_n_groups")
    if groups is None:  # Mamba-1
        inner = expand * hidden
        return inner * kernel, inner * d_state
    heads = _first(cfg, "mamba_num_heads", "mamba_n_heads", "num_heads")
    head_dim = _first(cfg, "mamba_head_dim", "mamba_d_head", "head_dim")
    inner = _first(cfg, "mamba_d_ssm", default=heads * head_dim if heads and head_dim else expand * hidden)
    return (inner + 2 * groups * d_state) * kernel, inner * d_state
