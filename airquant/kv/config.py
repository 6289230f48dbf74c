"""KV-cache configuration: one frozen dataclass, one field per CLI flag (``--kv-<field>``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from airquant.errors import AirQuantError
from airquant.kv.codebook import SUPPORTED_BITS


class KVConfigError(AirQuantError, ValueError):
    """A KV-cache setting is out of range or unsupported for this model; the message gives the fix."""


Backend = Literal["none", "tq", "turboquant"]
_BACKENDS = ("none", "tq", "turboquant")


@dataclass(frozen=True)
class Schedule:
    """When tokens leave the unquantized window; shared by the cache and the fake-quant path."""

    window: int
    block: int = 1
    sink: int = 0

    def quantized_count(self, n_tokens: int) -> int:
        """Tokens held quantized once ``n_tokens`` are cached.

        The residual keeps at least ``window - 1`` non-sink tokens so that the next query, with its
        own token, sees ``window`` unquantized ones; tokens leave ``block`` at a time.
        """
        movable = n_tokens - self.sink - (self.window - 1)
        return max(0, movable // self.block * self.block)

    def quantized_pairs(self, length: int, device=None) -> torch.Tensor:
        """Bool ``[L, L]``: query ``i`` (``i`` tokens cached before it) sees key ``j`` quantized."""
        counts = torch.tensor([self.quantized_count(i) for i in range(length)], device=device)
        cols = torch.arange(length, device=device).unsqueeze(0)
        return (cols >= self.sink) & (cols < self.sink + counts.unsqueeze(1))


def mixed_layer_bits(num_layers: int) -> tuple[tuple[int, int, int], ...]:
    """Per-layer (bits_k, bits_v) on top of K3/V2, by relative depth.

    Measured on SmolLM2-135M (30 layers, WikiText-2, one layer group at a time lowered from K4/V4):
    keys matter most in depth [1/2, 5/6) and [1/6, 1/3), values in [1/2, 2/3) and the first two
    layers. Those get one more bit: 22 upgrades over 30 layers, 2.87 code bits per element, so
    2.99 with 8-bit norms at head_dim 64. Other models keep the same depth profile untuned.
    """
    out = []
    for layer in range(num_layers):
        depth = layer / num_layers
        bits_k = 4 if (1 / 6 <= depth < 1 / 3 or 1 / 2 <= depth < 5 / 6) else 3
        bits_v = 3 if (1 / 2 <= depth < 2 / 3 or layer < 2) else 2
        if (bits_k, bits_v) != (3, 2):
            out.append((layer, bits_k, bits_v))
    return tuple(out)


@dataclass(frozen=True)
class KVConfig:
    """How the KV cache is stored.

    backend: ``none`` (plain fp cache), ``tq`` (AirQuant's TurboQuant), ``turboquant`` (the PyPI
        package ``turboquant`` 0.2.0, kept as a comparison backend; uses ``bits_k`` for K and V).
    bits_k, bits_v: Lloyd-Max bits per coordinate for keys and values (1-4 each).
    window: every decode query sees at least this many most recent tokens (itself included) in the
        compute dtype; older tokens are quantized.
    block: tokens leave the window ``block`` at a time, so a query sees between ``window`` and
        ``window + block - 1`` recent tokens unquantized (``block=1`` is the exact per-query window).
    seed: seeds the per-layer rotations.
    sink: mixed precision: the first ``sink`` tokens (attention sinks) are never quantized.
    center_k: mixed precision: subtract a per-head key mean before quantizing keys (RoPE keys carry
        a large constant part: 50-67 % of their energy in SmolLM2). It is measured once, at the first
        flush, over the exact tokens held then, and added back exactly in the attention: no bits.
    center_v: the same for values (11-27 % of their energy in SmolLM2).
    norm_bits: 16 (fp16 norms) or 8 (log2 code against a per-head reference, 1.3 % rms error).
    unbiased: store norm / <y, c> instead of the norm, so the codebook's shrink toward 0 does not
        bias attention against the history (see Codec.vector_scale). Same bytes.
    layer_bits: mixed precision: ``((layer, bits_k, bits_v), ...)`` overrides for the layers that
        carry most of the error (CLI form ``0:4:4,29:4:3``).
    rotation: ``auto`` (randomized Hadamard where head_dim is a power of two, else dense) or
        ``dense`` (a Haar rotation from QR, the paper's construction; same speed on CUDA).
    """

    backend: Backend = "none"
    bits_k: int = 4
    bits_v: int = 2
    window: int = 128
    seed: int = 0
    block: int = 32
    sink: int = 0
    center_k: bool = False
    center_v: bool = False
    norm_bits: int = 16
    unbiased: bool = False
    layer_bits: tuple[tuple[int, int, int], ...] = ()
    rotation: str = "auto"

    def __post_init__(self) -> None:
        if self.backend not in _BACKENDS:
            raise KVConfigError(f"kv backend {self.backend!r} is unknown; use one of {_BACKENDS}")
        for name in ("bits_k", "bits_v"):
            bits = getattr(self, name)
            if bits not in SUPPORTED_BITS:
                raise KVConfigError(f"{name}={bits} is out of range; use one of {SUPPORTED_BITS}")
        if self.window < 1:
            raise KVConfigError(f"window={self.window}: the current token is always exact, use window >= 1")
        if self.block < 1:
            raise KVConfigError(f"block={self.block}: use block >= 1 (1 = quantize every token as it leaves)")
        if self.sink < 0:
            raise KVConfigError(f"sink={self.sink}: use sink >= 0")
        if self.rotation not in ("auto", "dense"):
            raise KVConfigError(f"rotation={self.rotation!r}: use 'auto' (Hadamard where it applies) or 'dense'")
        if self.norm_bits not in (8, 16):
            raise KVConfigError(f"norm_bits={self.norm_bits}: use 16 (fp16) or 8 (log-coded)")
        for entry in self.layer_bits:
            if len(entry) != 3 or entry[0] < 0 or entry[1] not in SUPPORTED_BITS or entry[2] not in SUPPORTED_BITS:
                raise KVConfigError(
                    f"layer_bits entry {entry!r}: expected (layer >= 0, bits_k, bits_v) with bits in {SUPPORTED_BITS}"
                )

    def bits_for(self, layer_idx: int) -> tuple[int, int]:
        """(bits_k, bits_v) of one layer, overrides applied."""
        for layer, bits_k, bits_v in self.layer_bits:
            if layer == layer_idx:
                return bits_k, bits_v
        return self.bits_k, self.bits_v

    @classmethod
    def mixed(cls, num_layers: int = 30, **overrides) -> "KVConfig":
        """Mixed-precision preset, <= 3 bits per element with norms (see ``mixed_layer_bits``)."""
        base = dict(
            backend="tq",
            bits_k=3,
            bits_v=2,
            sink=4,
            center_k=True,
            center_v=True,
            norm_bits=8,
            unbiased=True,
            layer_bits=mixed_layer_bits(num_layers),
        )
        base.update(overrides)
        return cls(**base)

    @property
    def schedule(self) -> "Schedule":
        return Schedule(window=self.window, block=self.block, sink=self.sink)

    def bits_per_element(self, head_dim: int, num_layers: int = 1) -> float:
        """Average stored bits per K/V element of the quantized part, norms included."""
        per_layer = [sum(self.bits_for(i)) / 2 for i in range(max(num_layers, 1))]
        return sum(per_layer) / len(per_layer) + self.norm_bits / head_dim
