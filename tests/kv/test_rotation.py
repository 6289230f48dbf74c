"""Rotations: orthogonal, forward/inverse consistent with the dense matrix, seeded."""

import pytest
import torch

from airquant.kv.rotation import Rotation, fwht, layer_seed


@pytest.mark.parametrize(("dim", "asked", "kind"),
                         [(64, "auto", "hadamard"), (128, "auto", "hadamard"), (48, "auto", "dense"),
                          (128, "dense", "dense")])
def test_orthogonal_and_consistent(dim, asked, kind):
    rot = Rotation(dim, seed=3, kind=asked)
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


def test_dense_rotation_through_the_config_and_the_cache():
    from airquant.kv import KVConfig
    from airquant.kv.cache import layer_codecs
    from airquant.kv.config import KVConfigError

    k_auto, _ = layer_codecs(KVConfig(backend="tq"), 0, 64)
    k_dense, v_dense = layer_codecs(KVConfig(backend="tq", rotation="dense"), 0, 64)
    assert (k_auto.rotation.kind, k_dense.rotation.kind, v_dense.rotation.kind) == ("hadamard", "dense", "dense")
    x = torch.randn(1, 2, 7, 64)
    assert torch.allclose(k_dense.decode(k_dense.encode(x)), x, atol=0.35 * x.abs().max().item())
    with pytest.raises(KVConfigError, match="rotation='haar'"):
        KVConfig(backend="tq", rotation="haar")
