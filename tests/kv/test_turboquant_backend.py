"""The turboquant 0.2.0 comparison backend: dependency error, shims, per-query window parity."""

import sys

import numpy as np
import pytest
import torch

from airquant.errors import DependencyError
from airquant.kv import KVConfig, kv_logits, make_cache, turboquant_backend
from airquant.kv.config import KVConfigError


def test_missing_package_names_the_pip_command(monkeypatch, make_llama):
    turboquant_backend.load.cache_clear()
    monkeypatch.setitem(sys.modules, "turboquant", None)  # import of it now raises ImportError
    monkeypatch.setitem(sys.modules, "turboquant.cache", None)
    try:
        with pytest.raises(DependencyError, match="pip install turboquant==0.2.0"):
            make_cache(make_llama().config, KVConfig(backend="turboquant", bits_k=3, bits_v=3))
    finally:
        turboquant_backend.load.cache_clear()


def test_one_bit_width_only():
    with pytest.raises(KVConfigError, match="one bit-width"):
        turboquant_backend.check_bits(KVConfig(backend="turboquant", bits_k=4, bits_v=2))


def test_numpy_shim_adds_trapz_without_touching_numpy():
    shim = turboquant_backend._NumpyWithTrapz()
    x = np.linspace(0.0, 1.0, 101)
    assert shim.trapz(x, x) == pytest.approx(0.5)
    assert shim.linspace is np.linspace


def test_decode_through_package_cache_matches_kv_logits(make_llama):
    pytest.importorskip("turboquant")
    pytest.importorskip("scipy")
    model = make_llama(head_dim=32)
    kv = KVConfig(backend="turboquant", bits_k=3, bits_v=3, window=6)
    cache = make_cache(model.config, kv)
    seq = torch.randint(2, 95, (1, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        steps = [model(input_ids=seq[:, t : t + 1], past_key_values=cache).logits for t in range(seq.shape[1])]
    torch.testing.assert_close(torch.cat(steps, dim=1), kv_logits(model, seq, None, kv), atol=2e-5, rtol=1e-4)
    assert cache.layers[0]._key_indices.shape[-2] == 24 - 6  # window of 6 exact tokens
