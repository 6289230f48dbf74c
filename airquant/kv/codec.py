"""TurboQuant-MSE codec for one stream (the keys or the values of one layer).

``encode``: optional centering (subtract a per-head mean), per-vector norm (kept in fp16), rotate the
unit vector with ``Pi``, map every coordinate to its Lloyd-Max cell, bit-pack the cell indices.
``decode`` is the exact inverse of the reconstruction the attention uses, so tests and the fake-quant
perplexity path share it with the compressed attention.

The attention never calls ``decode`` on the history: it rotates the query once
(``<q, Pi^T c> = <Pi q, c>``) and scores it against centroids, see :mod:`airquant.kv.attention`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from airquant.kv.codebook import Codebook, lloyd_max_codebook
from airquant.kv.pack import pack, packed_width, unpack
from airquant.kv.rotation import Rotation, rotation_for, to_device

# Norms are stored in fp16 (relative rounding error 5e-4) or, with norm_bits=8, as a uint8 log2
# code in [ref - 8, ref + 8) octaves, ref a per-head geometric-mean norm: steps of 1/16 octave,
# 1.3 % rms relative error, still far below the codebook error at 3-4 bits.
NORM_DTYPE = torch.float16
LOG_NORM_SPAN = 16.0
LOG_NORM_LEVELS = 256


@dataclass(frozen=True)
class Encoded:
    """Packed codes ``[B, H, N, packed_width]`` (uint8) and norms ``[B, H, N]`` (fp16)."""

    codes: torch.Tensor
    norms: torch.Tensor


class Codec:
    """Rotation + codebook for one (layer, K or V); holds no per-sequence state."""

    def __init__(self, dim: int, bits: int, seed: int, norm_bits: int = 16, unbiased: bool = False,
                 rotation: str = "auto"):
        self.dim = dim
        self.bits = bits
        self.norm_bits = norm_bits
        self.unbiased = unbiased
        self.codebook: Codebook = lloyd_max_codebook(dim, bits)
        self.rotation: Rotation = rotation_for(dim, seed, rotation)
        self.width = packed_width(dim, bits)
        self._tables: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}
        self._centroids: dict[tuple, torch.Tensor] = {}

    def bytes_per_vector(self) -> int:
        return self.width + self.norm_bits // 8

    def norm_ref(self, x: torch.Tensor, mean: torch.Tensor | None = None) -> torch.Tensor | None:
        """Per-head log2 reference ``[B, H, 1]`` (geometric-mean norm) for 8-bit norms, else None."""
        if self.norm_bits == 16:
            return None
        xf = x.float() if mean is None else x.float() - mean
        return xf.norm(dim=-1).clamp_min(torch.finfo(torch.float32).tiny).log2().mean(dim=-1, keepdim=True)

    def store_norms(self, norms: torch.Tensor, ref: torch.Tensor | None) -> torch.Tensor:
        """fp32 norms ``[..., N]`` to their stored form (fp16, or uint8 log codes against ``ref``)."""
        if self.norm_bits == 16:
            return norms.to(NORM_DTYPE)
        step = LOG_NORM_SPAN / LOG_NORM_LEVELS
        code = torch.round((norms.clamp_min(torch.finfo(torch.float32).tiny).log2() - ref + LOG_NORM_SPAN / 2) / step)
        return code.clamp_(0, LOG_NORM_LEVELS - 1).to(torch.uint8)

    def load_norms(self, stored: torch.Tensor, ref: torch.Tensor | None) -> torch.Tensor:
        """Stored norms ``[..., N]`` back to fp32."""
        if self.norm_bits == 16:
            return stored.float()
        step = LOG_NORM_SPAN / LOG_NORM_LEVELS
        return torch.exp2(ref - LOG_NORM_SPAN / 2 + stored.float() * step)

    def tables(self, device) -> tuple[torch.Tensor, torch.Tensor]:
        """(centroids, boundaries) as fp32 tensors on ``device``, cached."""
        key = str(device)
        if key not in self._tables:
            # Made on the host and copied without waiting: ``torch.tensor(..., device=cuda)`` copies pageable memory
            # and synchronizes the stream. A decode loop's arenas make each layer's codecs at its first pass, which
            # so waited for the GPU 4 times a layer (kv_bench's trace on an H100: 128 of the TQ case's syncs).
            self._tables[key] = tuple(to_device(t, device) for t in (self.codebook.centroids_tensor(),
                                                                 self.codebook.boundaries_tensor()))
        return self._tables[key]

    def preload(self, device, dtypes: tuple[torch.dtype, ...] = (torch.float32,)) -> None:
        """What a decode attention over a history reads of this codec, on ``device`` now: ``tables``, and in each
        of ``dtypes`` its ``centroids`` and (whole codes to a byte) ``byte_table``, and the rotation in fp32 and
        fp64 (kv/triton_kernel rotates the queries in fp64). Made lazily, the first history read of a later pass
        made them inside its layer: a host tensor pinned and copied on the compute stream behind the next
        layers' weight copies (tests/engine/test_gpu.py counted two such pins a layer after the byte tables)."""
        self.tables(device)
        for dtype in dtypes:
            self.centroids(device, dtype)
            if 8 % self.bits == 0:
                self.byte_table(device, dtype)
        for dtype in (torch.float32, torch.float64):
            self.rotation.matrix(device, dtype)

    def centroids(self, device, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The centroid table in ``dtype`` on ``device``, cached (the Triton kernel gathers its half-precision
        products' operands from a table already in their dtype)."""
        key = (str(device), dtype)
        if key not in self._centroids:
            self._centroids[key] = self.tables(device)[0].to(dtype)
        return self._centroids[key]

    def byte_table(self, device, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """``[256, 8 // bits]``: row ``b`` holds the centroids of the codes packed in byte ``b``, in dimension order
        (1-, 2- and 4-bit codes, whole codes to a byte), cached: the Triton kernel's byte-table tiles gather a
        byte's centroids in one load where the plain tiles unpack and gather each code."""
        if 8 % self.bits:
            raise ValueError(f"{self.bits}-bit codes straddle bytes: no byte table (1, 2 or 4 bits)")
        key = ("bytes", str(device), dtype)
        if key not in self._centroids:
            codes = unpack(torch.arange(256, dtype=torch.uint8).unsqueeze(1), self.bits, 8 // self.bits)
            # Made on the host and copied without waiting, as ``tables``: a pageable copy here synchronizes the
            # first kernel call of a layer's decode, inside its layer-graph warm-up (the likely cause of kv_bench's
            # static passes going off on an H200, 2026-12-06: TurboQuant steps 1.54x plain at batch 8).
            self._centroids[key] = to_device(self.codebook.centroids_tensor()[codes].to(dtype).contiguous(), device)
        return self._centroids[key]

    def encode(self, x: torch.Tensor, mean: torch.Tensor | None = None, ref: torch.Tensor | None = None) -> Encoded:
        """``x``: ``[B, H, N, D]`` in any float dtype; ``mean`` broadcasts against it (or None);
        ``ref``: the 8-bit norm reference ``[B, H, 1]`` (see :meth:`norm_ref`)."""
        xf = x.float()
        if mean is not None:
            xf = xf - mean
        norms = xf.norm(dim=-1, keepdim=True)
        # A zero vector stays zero after decode whatever its codes are; avoid 0/0.
        unit = xf / norms.clamp_min(torch.finfo(torch.float32).tiny)
        rotated = self.rotation.forward(unit)  # [..., D]
        centroids, boundaries = self.tables(x.device)
        codes = torch.bucketize(rotated, boundaries)
        scale = self.vector_scale(norms, rotated, centroids[codes])
        return Encoded(codes=pack(codes, self.bits), norms=self.store_norms(scale.squeeze(-1), ref))

    def vector_scale(self, norms: torch.Tensor, rotated: torch.Tensor, cent: torch.Tensor) -> torch.Tensor:
        """The stored per-vector scale: the norm, or with ``unbiased`` the norm / <y, c>.

        A Lloyd-Max reconstruction is shrunk along its input (``<x_hat, x> = <y, c> |x|^2``, with
        <y, c> ~ 1 - MSE): 11 % at 2 bits. In attention that shrink is a bias that does not average
        out over tokens (history values pulled toward 0, history scores toward 0 against the exact
        window). Dividing by <y, c> makes every inner product with the vector's own direction exact,
        as in RaBitQ's estimator, at the price of a slightly larger MSE.
        """
        if not self.unbiased:
            return norms
        dot = (rotated * cent).sum(dim=-1, keepdim=True)
        return norms / dot.clamp_min(1e-3)

    def centroids_of(self, codes: torch.Tensor) -> torch.Tensor:
        """Packed codes ``[..., W]`` to rotated-space unit vectors ``[..., D]`` (fp32, no norm)."""
        centroids, _ = self.tables(codes.device)
        return centroids[unpack(codes, self.bits, self.dim)]

    def decode(self, enc: Encoded, mean: torch.Tensor | None = None, ref: torch.Tensor | None = None) -> torch.Tensor:
        """Reconstruction ``mean + norm * Pi^T c[codes]`` in fp32."""
        rotated = self.centroids_of(enc.codes) * self.load_norms(enc.norms, ref).unsqueeze(-1)
        x = self.rotation.inverse(rotated)
        return x if mean is None else x + mean


def fake_quantize(
    codec: Codec, x: torch.Tensor, mean: torch.Tensor | None = None, ref: torch.Tensor | None = None
) -> torch.Tensor:
    """``decode(encode(x))`` in ``x``'s dtype, minus the pack/unpack round trip (identical values):
    what the attention sees for quantized tokens. Used by the whole-sequence perplexity path."""
    xf = x.float() if mean is None else x.float() - mean
    norms = xf.norm(dim=-1, keepdim=True)
    rotated = codec.rotation.forward(xf / norms.clamp_min(torch.finfo(torch.float32).tiny))
    centroids, boundaries = codec.tables(x.device)
    cent = centroids[torch.bucketize(rotated, boundaries)]
    scale = codec.vector_scale(norms, rotated, cent)
    stored = codec.load_norms(codec.store_norms(scale.squeeze(-1), ref), ref).unsqueeze(-1)
    x_hat = codec.rotation.inverse(cent * stored)
    return (x_hat if mean is None else x_hat + mean).to(x.dtype)
