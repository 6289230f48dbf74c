"""The PyPI package ``turboquant`` (0.2.0) as a comparison backend.

Its weaknesses are the reason AirQuant has its own codec (equal-probability codebook, one byte per
index, one bit-width for K and V, a full dequantized copy rebuilt every step). Two shims make it run
here, both scoped to the package's own modules:
  * numpy >= 2.4 removed ``np.trapz``, which its codebook code calls: its module-level ``np`` is
    replaced by a proxy that forwards to numpy and adds ``trapz = numpy.trapezoid``.
  * transformers >= 5.24 passes ``kwargs=`` to ``Cache.update``; its ``update`` does not take it.
"""

from __future__ import annotations

import functools
import types

import numpy as np
import torch

from airquant.errors import DependencyError
from airquant.kv.config import KVConfig, KVConfigError

PIP_COMMAND = "pip install turboquant==0.2.0 scipy"
# turboquant.cache seeds every quantizer with 42; the fake-quant path must use the same ones.
TURBOQUANT_SEED = 42


class _NumpyWithTrapz(types.ModuleType):
    """numpy, plus the ``trapz`` alias numpy 2.4 dropped."""

    def __init__(self):
        super().__init__("numpy")
        self.trapz = getattr(np, "trapz", None) or np.trapezoid

    def __getattr__(self, name):
        return getattr(np, name)


@functools.lru_cache(maxsize=1)
def load() -> types.SimpleNamespace:
    """Import turboquant with the shims applied; DependencyError with the pip command if missing."""
    try:
        import turboquant.cache as tq_cache
        import turboquant.core as tq_core
    except ImportError as exc:
        raise DependencyError(f"kv backend 'turboquant' needs the turboquant package ({exc}): {PIP_COMMAND}") from exc
    tq_core.np = _NumpyWithTrapz()

    class CompatCache(tq_cache.TurboQuantCache):
        """TurboQuantCache whose update takes any extra arguments and whose window is configurable."""

        def __init__(self, bits: int, window: int):
            super().__init__(bits=bits)
            self.window = window

        def update(self, key_states, value_states, layer_idx, *args, **kwargs):
            while len(self.layers) <= layer_idx:
                self.layers.append(tq_cache.TurboQuantLayer(bits=self.bits, residual_len=self.window))
            return self.layers[layer_idx].update(key_states, value_states)

    return types.SimpleNamespace(cache=tq_cache, core=tq_core, CompatCache=CompatCache)


def check_bits(kv: KVConfig) -> int:
    if kv.bits_k != kv.bits_v:
        raise KVConfigError(
            f"turboquant 0.2.0 has one bit-width for K and V, got bits_k={kv.bits_k} bits_v={kv.bits_v}; "
            "pass the same value for both (or use kv backend 'tq', which takes them separately)"
        )
    if kv.sink or kv.center_k or kv.center_v or kv.layer_bits:
        raise KVConfigError("sink / center_* / layer_bits are AirQuant 'tq' options; turboquant 0.2.0 has none")
    return kv.bits_k


def make_turboquant_cache(kv: KVConfig):
    return load().CompatCache(bits=check_bits(kv), window=kv.window)


def turboquant_fake(kv: KVConfig):
    """``fake(x, layer_idx)``: round trip through the package's own quantizer (same seed as its cache)."""
    bits = check_bits(kv)
    mod = load()

    def fake(x: torch.Tensor, layer_idx: int) -> torch.Tensor:
        quantizer = mod.cache._get_quantizer(x.shape[-1], bits, str(x.device))
        flat = x.reshape(-1, x.shape[-1])
        idx, norms = quantizer.quantize(flat)
        return quantizer.dequantize(idx, norms).reshape(x.shape).to(x.dtype)

    return fake


def quantizer_mse(dim: int, bits: int, n: int = 4096, seed: int = 0) -> float:
    """Mean squared error per random unit vector of the package's quantizer."""
    quantizer = load().core.TurboQuantMSE(dim, bits=bits, device="cpu", seed=TURBOQUANT_SEED)
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, dim, generator=gen)
    x = x / x.norm(dim=-1, keepdim=True)
    idx, norms = quantizer.quantize(x)
    return float(((quantizer.dequantize(idx, norms) - x) ** 2).sum(-1).mean())
