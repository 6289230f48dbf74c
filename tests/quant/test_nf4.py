"""NF4 module vs bitsandbytes' own in-memory Linear4bit / matmul_4bit on the same weights."""

from __future__ import annotations

import logging

import pytest
import torch

from airquant.quant import QuantSpec, make_linear, quantize_linear

bnb = pytest.importorskip("bitsandbytes")
log = logging.getLogger(__name__)


def _module(w: torch.Tensor, double_quant: bool, blocksize: int = 64, bias: torch.Tensor | None = None):
    tensors, meta = quantize_linear(QuantSpec(method="nf4", blocksize=blocksize, double_quant=double_quant), w)
    module = make_linear(meta, w.shape[1], w.shape[0], bias is not None, compute_dtype=torch.float32)
    module.load_state_dict({**tensors, **({"bias": bias} if bias is not None else {})})
    return module


def _bnb_linear4bit(w: torch.Tensor, double_quant: bool, bias: torch.Tensor) -> torch.nn.Module:
    lin = bnb.nn.Linear4bit(w.shape[1], w.shape[0], bias=True, compute_dtype=torch.float32,
                            compress_statistics=double_quant, quant_type="nf4")
    lin.weight = bnb.nn.Params4bit(w.clone(), requires_grad=False, blocksize=64,
                                   compress_statistics=double_quant, quant_type="nf4")
    lin.bias = torch.nn.Parameter(bias.clone(), requires_grad=False)
    return lin.to("cpu")  # .to() is what quantizes Params4bit


@pytest.mark.parametrize("double_quant", [False, True])
def test_matches_bitsandbytes_in_memory(double_quant):
    torch.manual_seed(0)
    w, b = torch.randn(384, 576) * 0.02, torch.randn(384) * 0.01
    x = torch.randn(2, 7, 576)
    ours = _module(w, double_quant, bias=b)(x)

    packed, state = bnb.functional.quantize_4bit(w, blocksize=64, compress_statistics=double_quant, quant_type="nf4")
    torch.testing.assert_close(ours, bnb.matmul_4bit(x, packed, state, bias=b), rtol=0, atol=0)
    # Linear4bit repacks for its AVX512 CPU kernel, which sums in another order: equal to rounding.
    torch.testing.assert_close(ours, _bnb_linear4bit(w, double_quant, b)(x), rtol=1e-5, atol=1e-6)

    exact = x @ w.t() + b
    gap = ((ours - exact).norm() / (exact - b).norm()).item()
    log.info("nf4 double_quant=%s: relative output gap vs fp32 %.4f", double_quant, gap)
    assert 0.05 < gap < 0.13  # NF4 on Gaussian weights: ~9 % relative weight error


def _nf4_reference(w: torch.Tensor, blocksize: int) -> torch.Tensor:
    """Blockwise absmax + nearest NF4 level over the flattened weight, in float64."""
    code = bnb.functional.get_4bit_type("nf4", device="cpu").double()
    flat = w.double().flatten()
    pad = (-flat.numel()) % blocksize
    blocks = torch.cat([flat, flat.new_zeros(pad)]).reshape(-1, blocksize)
    absmax = blocks.abs().amax(1, keepdim=True)
    idx = (blocks / absmax)[..., None].sub(code).abs().argmin(-1)
    return (code[idx] * absmax.float().double()).flatten()[: flat.numel()].reshape(w.shape)


@pytest.mark.parametrize("shape", [(96, 160), (64, 192)])
def test_blocks_straddling_rows_decode_correctly(shape):
    """in_features % blocksize != 0 bypasses bnb's CPU kernel, which misreads such blocks."""
    torch.manual_seed(1)
    w = torch.randn(*shape)
    module = _module(w, double_quant=False)
    torch.testing.assert_close(module.dequantize().double(), _nf4_reference(w, 64), rtol=1e-6, atol=1e-6)
    x = torch.randn(3, shape[1])
    torch.testing.assert_close(module(x), x @ module.dequantize().t(), rtol=1e-5, atol=1e-5)
