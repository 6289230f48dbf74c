"""Seeded random orthogonal rotations of the head dimension.

A power-of-two head_dim gets a randomized Hadamard transform ``Pi = H diag(s) / sqrt(d)`` (random
signs ``s``): O(d log d), no matrix to store, and it spreads a single outlier channel evenly over all
coordinates, which is what the Lloyd-Max codebook assumes. Any other head_dim, or ``kind="dense"``,
gets a dense Haar rotation from the QR of a Gaussian matrix (the paper's construction).

Rotations act on the last dimension: ``forward(x) = x @ Pi^T`` (i.e. ``Pi x`` per vector) and
``inverse(y) = y @ Pi``.
"""

from __future__ import annotations

import functools

import torch

# auto: randomized Hadamard where head_dim is a power of two, dense elsewhere; dense: always Haar QR.
ROTATION_KINDS = ("auto", "dense")

# Distinct streams for keys and values of the same layer, so their errors are independent.
_KIND_OFFSET = {"k": 0, "v": 1}


def _is_power_of_two(n: int) -> bool:
    return n > 0 and (n & (n - 1)) == 0


def fwht(x: torch.Tensor) -> torch.Tensor:
    """Unnormalized fast Walsh-Hadamard transform over the last dim (a power of two)."""
    d = x.shape[-1]
    lead = x.shape[:-1]
    h = 1
    y = x.reshape(-1, d)
    while h < d:
        # Butterflies on pairs (i, i + h) inside blocks of 2h.
        y = y.view(-1, d // (2 * h), 2, h)
        a, b = y[:, :, 0, :], y[:, :, 1, :]
        y = torch.stack((a + b, a - b), dim=2)
        h *= 2
    return y.reshape(*lead, d)


class Rotation:
    """One orthogonal matrix ``Pi`` (d x d), applied as a transform on the last dim."""

    def __init__(self, dim: int, seed: int, kind: str = "auto"):
        if kind not in ROTATION_KINDS:
            raise ValueError(f"rotation kind {kind!r}: use one of {ROTATION_KINDS}")
        self.dim = dim
        self.seed = seed
        self.kind = "hadamard" if kind == "auto" and _is_power_of_two(dim) else "dense"
        gen = torch.Generator().manual_seed(seed)
        if self.kind == "hadamard":
            self.signs = torch.randint(0, 2, (dim,), generator=gen).to(torch.float64) * 2 - 1
            self._matrix = None
        else:
            gauss = torch.randn(dim, dim, generator=gen, dtype=torch.float64)
            q, r = torch.linalg.qr(gauss)
            # Sign fix makes Q Haar-distributed instead of biased by the QR convention.
            self._matrix = q * torch.sign(torch.diagonal(r)).unsqueeze(0)
        self._cache: dict[tuple, torch.Tensor] = {}

    def matrix(self, device=None, dtype=torch.float32) -> torch.Tensor:
        """``Pi`` as a dense tensor (cached per device/dtype): rows are the rotated basis."""
        key = (str(device), dtype)
        if key not in self._cache:
            if self.kind == "hadamard":
                eye = torch.eye(self.dim, dtype=torch.float64)
                mat = self._forward_hadamard(eye).T  # forward(e_i) is column i of Pi
            else:
                mat = self._matrix
            self._cache[key] = to_device(mat.to(dtype).contiguous(), device)
        return self._cache[key]

    def _forward_hadamard(self, x: torch.Tensor) -> torch.Tensor:
        signs = self.signs.to(device=x.device, dtype=x.dtype)
        return fwht(x * signs) * (self.dim**-0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``Pi x`` for every vector along the last dim."""
        # The Hadamard rotation is applied as its precomputed d x d matrix too: for head dims up to
        # 256 one matmul beats log2(d) butterfly passes in PyTorch (each a separate kernel/alloc),
        # and on GPU it runs on tensor cores. fwht() builds the matrix and stays the reference.
        return x @ self.matrix(x.device, x.dtype).T

    def inverse(self, y: torch.Tensor) -> torch.Tensor:
        """``Pi^T y`` for every vector along the last dim."""
        return y @ self.matrix(y.device, y.dtype)


def to_device(t: torch.Tensor, device) -> torch.Tensor:
    """A host tensor on ``device``; to a GPU through pinned memory, without a stream sync (``torch.tensor(...,
    device=cuda)`` and ``.to(cuda)`` of pageable memory wait for the GPU)."""
    if device is not None and torch.device(device).type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


def layer_seed(seed: int, layer_idx: int, kind: str, group: int = 0) -> int:
    """Seed for one (layer, K or V, channel group): a fixed mix so layers never share a rotation."""
    return (seed * 1_000_003 + layer_idx * 7919 + _KIND_OFFSET[kind] * 104_729 + group * 31) % (2**63)


@functools.lru_cache(maxsize=4096)
def rotation_for(dim: int, seed: int, kind: str = "auto") -> Rotation:
    """Rotations are pure functions of (dim, seed): share one object across caches."""
    return Rotation(dim, seed, kind)
