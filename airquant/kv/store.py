"""Growable packed storage for the quantized history of one layer (keys and values together).

Capacity grows in whole chunks of tokens, so appending is amortized O(1) while the slack stays
below one chunk (the compression figures count allocated bytes, slack included).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from airquant.kv.codec import NORM_DTYPE, Codec, Encoded

# 256 tokens: a 32K-token history reallocates 128 times (cheap: packed bytes), and the slack of at
# most 255 tokens is < 3 % of the history at 8K tokens.
CHUNK_TOKENS = 256


@dataclass(frozen=True)
class History:
    """The first ``length`` quantized tokens as views into the store (no copies)."""

    k: Encoded
    v: Encoded
    k_mean: torch.Tensor | None  # [B, H, 1, D] fp32, added back to every history key
    v_mean: torch.Tensor | None  # same for values
    k_ref: torch.Tensor | None  # [B, H, 1] log2 norm reference of 8-bit norms (None: fp16 norms)
    v_ref: torch.Tensor | None
    length: int


def statistics(k_codec, v_codec, keys: torch.Tensor, values: torch.Tensor, center_k: bool,
               center_v: bool) -> dict[str, torch.Tensor | None]:
    """The per-head statistics a history is encoded with, from exact tokens ``[B, H, n, D]``: the means
    (None when not centred) and the codecs' norm references. Shared by ``PackedStore`` and the decode
    loop's slot arena (engine/decode/tqslots.py)."""
    k_mean = keys.float().mean(dim=-2, keepdim=True) if center_k else None
    v_mean = values.float().mean(dim=-2, keepdim=True) if center_v else None
    return {"k_mean": k_mean, "v_mean": v_mean, "k_ref": k_codec.norm_ref(keys, k_mean),
            "v_ref": v_codec.norm_ref(values, v_mean)}


class PackedStore:
    """Packed K/V codes and fp16 norms, ``[B, H, capacity, ...]``, the first ``length`` in use."""

    STATS = ("k_mean", "v_mean", "k_ref", "v_ref")  # per-head statistics fixed by ``calibrate``

    def __init__(self, k_codec: Codec, v_codec: Codec):
        self.k_codec = k_codec
        self.v_codec = v_codec
        self.length = 0
        self.tensors: dict[str, torch.Tensor] = {}
        self.k_mean: torch.Tensor | None = None
        self.v_mean: torch.Tensor | None = None
        self.k_ref: torch.Tensor | None = None
        self.v_ref: torch.Tensor | None = None

    @property
    def capacity(self) -> int:
        return self.tensors["k_codes"].shape[2] if self.tensors else 0

    def _allocate(self, batch: int, heads: int, capacity: int, device) -> dict[str, torch.Tensor]:
        def codes(width):
            return torch.zeros(batch, heads, capacity, width, dtype=torch.uint8, device=device)

        def norms(codec):
            dtype = NORM_DTYPE if codec.norm_bits == 16 else torch.uint8
            return torch.zeros(batch, heads, capacity, dtype=dtype, device=device)

        return {
            "k_codes": codes(self.k_codec.width),
            "k_norms": norms(self.k_codec),
            "v_codes": codes(self.v_codec.width),
            "v_norms": norms(self.v_codec),
        }

    def _ensure_capacity(self, needed: int, batch: int, heads: int, device) -> None:
        if needed <= self.capacity:
            return
        capacity = -(-needed // CHUNK_TOKENS) * CHUNK_TOKENS
        grown = self._allocate(batch, heads, capacity, device)
        for name, old in self.tensors.items():
            grown[name][:, :, : self.length] = old[:, :, : self.length]
        self.tensors = grown

    def append(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Quantize ``[B, H, n, D]`` keys/values and append them after the stored ones."""
        batch, heads, n, _ = keys.shape
        if n == 0:
            return
        self._ensure_capacity(self.length + n, batch, heads, keys.device)
        k = self.k_codec.encode(keys, self.k_mean, self.k_ref)
        v = self.v_codec.encode(values, self.v_mean, self.v_ref)
        end = self.length + n
        self.tensors["k_codes"][:, :, self.length : end] = k.codes
        self.tensors["k_norms"][:, :, self.length : end] = k.norms
        self.tensors["v_codes"][:, :, self.length : end] = v.codes
        self.tensors["v_norms"][:, :, self.length : end] = v.norms
        self.length = end

    def view(self, length: int | None = None) -> History:
        n = self.length if length is None else length
        t = self.tensors
        if not t:
            empty = Encoded(codes=torch.empty(0, dtype=torch.uint8), norms=torch.empty(0, dtype=NORM_DTYPE))
            return History(empty, empty, self.k_mean, self.v_mean, self.k_ref, self.v_ref, length=0)
        return History(
            k=Encoded(codes=t["k_codes"][:, :, :n], norms=t["k_norms"][:, :, :n]),
            v=Encoded(codes=t["v_codes"][:, :, :n], norms=t["v_norms"][:, :, :n]),
            k_mean=self.k_mean,
            v_mean=self.v_mean,
            k_ref=self.k_ref,
            v_ref=self.v_ref,
            length=n,
        )

    def map_tensors(self, fn) -> None:
        """Apply ``fn`` to every stored tensor (batch reorder, device moves)."""
        self.tensors = {name: fn(t) for name, t in self.tensors.items()}
        for name in self.STATS:
            value = getattr(self, name)
            setattr(self, name, None if value is None else fn(value))

    def all_tensors(self) -> list[torch.Tensor]:
        stats = [m for m in (self.k_mean, self.v_mean, self.k_ref, self.v_ref) if m is not None]
        return list(self.tensors.values()) + stats

    def calibrate(self, keys: torch.Tensor, values: torch.Tensor, center_k: bool, center_v: bool) -> None:
        """Per-head statistics fixed at the first flush from the exact tokens ``[B, H, n, D]``."""
        stats = statistics(self.k_codec, self.v_codec, keys, values, center_k, center_v)
        if center_k:
            self.k_mean = stats["k_mean"]
        if center_v:
            self.v_mean = stats["v_mean"]
        self.k_ref, self.v_ref = stats["k_ref"], stats["v_ref"]
