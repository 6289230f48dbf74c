"""Compressed attention == float64 attention over the dequantized cache."""

import pytest
import torch

from airquant.kv import attention
from airquant.kv.cache import TQLayer, context_of
from airquant.kv.config import KVConfig


def _filled_layer(kv, batch, heads, dim, prompt, gen):
    layer = TQLayer(kv, layer_idx=1, head_dim=dim)
    k = torch.randn(batch, heads, prompt, dim, generator=gen) + 2.0 * torch.randn(dim, generator=gen)
    layer.update(k, torch.randn(batch, heads, prompt, dim, generator=gen))
    return layer


@pytest.mark.parametrize(
    ("bits_k", "bits_v", "dim", "q_len", "sink", "center", "norm_bits"),
    [
        (4, 2, 64, 1, 0, False, 16),
        (3, 3, 48, 3, 2, True, 8),
        (1, 4, 32, 2, 1, False, 8),
        (2, 1, 64, 1, 4, True, 16),
    ],
)
def test_matches_float64_dequantized_attention(
    monkeypatch, dequantized_attention, bits_k, bits_v, dim, q_len, sink, center, norm_bits
):
    monkeypatch.setattr(attention, "HISTORY_CHUNK", 7)  # several chunks + a ragged last one
    gen = torch.Generator().manual_seed(bits_k * 10 + bits_v)
    batch, hkv, groups = 2, 2, 3
    kv = KVConfig(
        backend="tq", bits_k=bits_k, bits_v=bits_v, window=5, block=4, sink=sink, center_k=center, center_v=center,
        norm_bits=norm_bits, unbiased=center,
    )
    layer = _filled_layer(kv, batch, hkv, dim, prompt=40, gen=gen)
    keys, values = layer.update(
        torch.randn(batch, hkv, q_len, dim, generator=gen), torch.randn(batch, hkv, q_len, dim, generator=gen)
    )
    ctx = context_of(keys)
    assert ctx.history.length > 14
    total = keys.shape[2] + ctx.history.length
    keep = torch.ones(batch, 1, q_len, total, dtype=torch.bool)
    keep[1, :, :, :9] = False  # sequence 1 is left-padded by 9 tokens
    keep[..., -q_len:] &= torch.ones(q_len, q_len, dtype=torch.bool).tril()
    query = torch.randn(batch, hkv * groups, q_len, dim, generator=gen)
    scale = dim**-0.5
    out = attention.compressed_attention(query, keys.as_subclass(torch.Tensor), values, ctx, keep, scale)
    ref = dequantized_attention(query, keys, values, ctx, keep, scale)
    assert out.shape == (batch, q_len, hkv * groups, dim)
    torch.testing.assert_close(out.double(), ref, atol=2e-5, rtol=1e-4)


def test_no_mask_means_bottom_right_causal():
    keep = attention.keep_mask(None, batch=1, q_len=2, kv_len=5, device="cpu")
    assert keep[0, 0].tolist() == [[True] * 4 + [False], [True] * 5]
