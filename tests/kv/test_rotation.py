"""Rotations: orthogonal, forward/inverse consistent with the dense matrix, seeded."""

import pytest
import torch

from airquant.kv.rotation import Rotation, fwht, layer_seed


@pytest.mark.parametrize(("dim", "kind"), [(64, "hadamard"), (128, "hadamard"), (48, "dense")])
def test_orthogonal_and_consistent(dim, kind):
    rot = Rotation(dim, seed=3)
    assert rot.kind == kind
    pi = rot.matrix(dtype=torch.float64)
    assert torch.allclose(pi @ pi.T, torch.eye(dim, dtype=torch.float64), atol=1e-12)
    x = torch.randn(5, dim, dtype=torch.float64)
    assert torch.allclose(rot.forward(x), x @ pi.T, atol=1e-12)
    assert torch.allclose(rot.inverse(rot.forward(x)), x, atol=1e-12)


def test_fwht_matches_sylvester_matrix():
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < 16:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    x = torch.randn(3, 16, dtype=torch.float64)
    assert torch.allclose(fwht(x), x @ h.T)


def test_layers_and_streams_get_different_rotations():
    seeds = {layer_seed(0, layer, kind) for layer in range(40) for kind in ("k", "v")}
    assert len(seeds) == 80
    a, b = Rotation(64, layer_seed(0, 0, "k")), Rotation(64, layer_seed(0, 1, "k"))
    assert not torch.equal(a.signs, b.signs)
