"""Lloyd-Max codebooks for one coordinate of a randomly rotated unit vector.

After a uniform random rotation, each coordinate ``x`` of a unit vector in ``R^d`` has density
``f(x) ∝ (1 - x^2)^((d-3)/2)`` on ``[-1, 1]`` (a Beta((d-1)/2, (d-1)/2) law stretched to [-1, 1]).
TurboQuant (Zandieh et al., arXiv 2504.19874) quantizes every coordinate with the MSE-optimal scalar
quantizer for that density, found here by Lloyd's iteration (continuous k-means): boundaries at
midpoints of neighbouring centroids, centroids at the conditional mean of their cell.

The integrals are taken on the substitution ``x = sin(phi)``: ``f(x) dx ∝ cos(phi)^(d-2) dphi`` has
no endpoint singularity for any ``d >= 2``, so one fixed grid serves every head_dim.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import numpy as np
import torch

# A uniform phi grid this fine keeps > 100 points per standard deviation up to d ~ 10^5;
# Lloyd iterations then converge to ~1e-12 on the centroids, far below fp16 resolution.
_GRID_POINTS = 200_001
_MAX_ITERS = 2000
_TOL = 1e-12

SUPPORTED_BITS = (1, 2, 3, 4)


@dataclass(frozen=True)
class Codebook:
    """Scalar quantizer for one rotated coordinate: ``2**bits`` sorted centroids, their cell edges."""

    dim: int
    bits: int
    centroids: tuple[float, ...]
    boundaries: tuple[float, ...]  # 2**bits - 1 interior edges
    mse_per_coord: float  # E[(x - Q(x))^2] for one coordinate

    @property
    def mse_per_vector(self) -> float:
        """Expected squared error of a whole unit vector: d independent-ish coordinates."""
        return self.dim * self.mse_per_coord

    def centroids_tensor(self, device=None, dtype=torch.float32) -> torch.Tensor:
        return torch.tensor(self.centroids, device=device, dtype=dtype)

    def boundaries_tensor(self, device=None, dtype=torch.float32) -> torch.Tensor:
        return torch.tensor(self.boundaries, device=device, dtype=dtype)


class _Moments:
    """Cumulative integrals of the density and of x * density along x = sin(phi)."""

    def __init__(self, dim: int):
        phi = np.linspace(-math.pi / 2, math.pi / 2, _GRID_POINTS)
        cos = np.clip(np.cos(phi), 0.0, None)
        with np.errstate(divide="ignore"):
            log_w = (dim - 2) * np.log(cos) if dim > 2 else np.zeros_like(phi)
        w = np.exp(log_w - log_w.max())
        x = np.sin(phi)
        self.x = x
        self.mass = _cumtrapz(w, phi)
        self.first = _cumtrapz(x * w, phi)
        self.second = _cumtrapz(x * x * w, phi)
        total = self.mass[-1]
        self.mass /= total
        self.first /= total
        self.second /= total

    def at(self, edges: np.ndarray, table: np.ndarray) -> np.ndarray:
        # x = sin(phi) is increasing on the grid, so interpolating in x is exact up to the grid.
        return np.interp(edges, self.x, table)


def _cumtrapz(y: np.ndarray, t: np.ndarray) -> np.ndarray:
    # Written out: np.trapz is gone from numpy >= 2.4 and scipy is not a dependency.
    out = np.zeros_like(y)
    out[1:] = np.cumsum(0.5 * (y[1:] + y[:-1]) * np.diff(t))
    return out


def _initial_edges(moments: _Moments, levels: int) -> np.ndarray:
    """Equal-probability edges: the starting point that turboquant 0.2.0 stops at."""
    targets = np.arange(1, levels) / levels
    return np.interp(targets, moments.mass, moments.x)


def _lloyd(moments: _Moments, levels: int) -> tuple[np.ndarray, np.ndarray]:
    edges = _initial_edges(moments, levels)
    centroids = np.zeros(levels)
    for _ in range(_MAX_ITERS):
        full = np.concatenate([[-1.0], edges, [1.0]])
        mass = np.diff(moments.at(full, moments.mass))
        first = np.diff(moments.at(full, moments.first))
        new = first / np.maximum(mass, 1e-300)
        new_edges = 0.5 * (new[1:] + new[:-1])
        delta = np.abs(new - centroids).max()
        centroids, edges = new, new_edges
        if delta < _TOL:
            break
    # The density is symmetric: symmetrize away the last rounding asymmetry.
    centroids = 0.5 * (centroids - centroids[::-1])
    return centroids, 0.5 * (centroids[1:] + centroids[:-1])


def _cell_mse(moments: _Moments, centroids: np.ndarray, edges: np.ndarray) -> float:
    full = np.concatenate([[-1.0], edges, [1.0]])
    m0 = np.diff(moments.at(full, moments.mass))
    m1 = np.diff(moments.at(full, moments.first))
    m2 = np.diff(moments.at(full, moments.second))
    # sum over cells of E[(x - c)^2 ; cell] = m2 - 2 c m1 + c^2 m0
    return float(np.sum(m2 - 2 * centroids * m1 + centroids**2 * m0))


@functools.lru_cache(maxsize=None)
def lloyd_max_codebook(dim: int, bits: int) -> Codebook:
    """MSE-optimal ``bits``-bit codebook for a coordinate of a rotated unit vector in ``R^dim``."""
    if bits not in SUPPORTED_BITS:
        raise ValueError(f"bits={bits} is not supported; use one of {SUPPORTED_BITS}")
    if dim < 2:
        raise ValueError(f"dim={dim}: a rotated unit vector needs at least 2 coordinates")
    moments = _Moments(dim)
    centroids, edges = _lloyd(moments, 2**bits)
    return Codebook(
        dim=dim,
        bits=bits,
        centroids=tuple(float(c) for c in centroids),
        boundaries=tuple(float(e) for e in edges),
        mse_per_coord=_cell_mse(moments, centroids, edges),
    )


def equal_probability_codebook(dim: int, bits: int) -> Codebook:
    """The codebook turboquant 0.2.0 ships (quantile cells, conditional-mean centroids): for comparison."""
    moments = _Moments(dim)
    edges = _initial_edges(moments, 2**bits)
    full = np.concatenate([[-1.0], edges, [1.0]])
    mass = np.diff(moments.at(full, moments.mass))
    centroids = np.diff(moments.at(full, moments.first)) / mass
    return Codebook(
        dim=dim,
        bits=bits,
        centroids=tuple(float(c) for c in centroids),
        boundaries=tuple(float(e) for e in edges),
        mse_per_coord=_cell_mse(moments, centroids, edges),
    )
