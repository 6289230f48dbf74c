"""Lloyd-Max codebooks against closed forms, published figures and Monte Carlo."""

import math

import pytest
import torch

from airquant.kv.codebook import equal_probability_codebook, lloyd_max_codebook


def test_one_bit_centroids_match_closed_form():
    # For large d the coordinate is ~N(0, 1/d); the 1-bit optimum is +-E|x| = +-sqrt(2/(pi d)).
    d = 4096
    cb = lloyd_max_codebook(d, 1)
    assert cb.centroids[1] == pytest.approx(math.sqrt(2 / (math.pi * d)), rel=1e-3)
    assert cb.centroids[0] == pytest.approx(-cb.centroids[1], abs=1e-12)
    assert cb.boundaries == pytest.approx((0.0,), abs=1e-12)


def test_two_bit_centroids_match_gaussian_lloyd_max():
    d = 4096
    scaled = [c * math.sqrt(d) for c in lloyd_max_codebook(d, 2).centroids]
    assert scaled == pytest.approx([-1.510, -0.4528, 0.4528, 1.510], abs=2e-3)


@pytest.mark.parametrize(
    ("dim", "bits", "mse"),
    [(64, 2, 0.1147), (64, 4, 0.0092), (128, 4, 0.0093), (128, 1, 0.361), (128, 3, 0.034)],
)
def test_mse_per_unit_vector(dim, bits, mse):
    assert lloyd_max_codebook(dim, bits).mse_per_vector == pytest.approx(mse, rel=0.02)


def test_lloyd_max_beats_equal_probability_cells():
    # turboquant 0.2.0's quantile codebook: 4-bit d=128 MSE ~0.02 against ~0.0093.
    assert equal_probability_codebook(128, 4).mse_per_vector > 2 * lloyd_max_codebook(128, 4).mse_per_vector


@pytest.mark.parametrize("bits", [2, 3])
def test_centroids_are_conditional_means_of_sampled_coordinates(bits):
    # Monte Carlo: coordinates of Haar-random unit vectors; each centroid is its cell's sample mean.
    dim = 48
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(200_000, dim, generator=gen, dtype=torch.float64)
    coords = (x / x.norm(dim=-1, keepdim=True)).flatten()
    cb = lloyd_max_codebook(dim, bits)
    cells = torch.bucketize(coords, torch.tensor(cb.boundaries, dtype=torch.float64))
    for i, c in enumerate(cb.centroids):
        assert coords[cells == i].mean().item() == pytest.approx(c, rel=0.01, abs=1e-4)
    centroids = torch.tensor(cb.centroids, dtype=torch.float64)
    empirical = ((coords - centroids[cells]) ** 2).mean().item() * dim
    assert empirical == pytest.approx(cb.mse_per_vector, rel=0.02)


def test_rejects_unsupported_bits():
    with pytest.raises(ValueError, match="bits=5"):
        lloyd_max_codebook(64, 5)
