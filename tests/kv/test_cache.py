"""Window/block boundaries, what each update hands the attention, and allocated bytes."""

import pytest
import torch

from airquant.kv import cache_nbytes
from airquant.kv.cache import TQCache, TQLayer, context_of
from airquant.kv.codec import Codec
from airquant.kv.config import KVConfig, KVConfigError
from airquant.kv.store import CHUNK_TOKENS

R, BLOCK, DIM = 8, 4, 32


def _expected_quantized(n, sink=0):
    # Keep >= R-1 non-sink tokens so the next query sees R exact ones; move whole blocks.
    return max(0, (n - sink - (R - 1)) // BLOCK * BLOCK)


@pytest.mark.parametrize("length", [1, R - 1, R, R + 1, R + BLOCK - 1, R + BLOCK, 10 * R + 3])
@pytest.mark.parametrize("step", [1, 3, None])  # token by token, ragged chunks, one prefill
def test_boundaries(length, step):
    kv = KVConfig(backend="tq", bits_k=4, bits_v=2, window=R, block=BLOCK)
    layer = TQLayer(kv, 0, DIM)
    k = torch.randn(1, 2, length, DIM)
    v = torch.randn(1, 2, length, DIM)
    step = step or length
    for start in range(0, length, step):
        seen_before = layer.get_seq_length()
        hist_before = layer.store.length
        keys, values = layer.update(k[:, :, start : start + step], v[:, :, start : start + step])
        ctx = context_of(keys)
        ctx.receipt.consumed = True  # stands in for the attention function
        # The attention gets the history as it was before this step, everything newer exact.
        assert ctx.history.length == hist_before == _expected_quantized(seen_before)
        assert torch.equal(keys.as_subclass(torch.Tensor), k[:, :, hist_before : start + step])
        assert torch.equal(values, v[:, :, hist_before : start + step])
    assert layer.get_seq_length() == length
    assert layer.store.length == _expected_quantized(length)
    assert torch.equal(layer.keys, k[:, :, layer.store.length :])  # the exact residual


def test_every_decode_query_sees_at_least_window_exact_tokens():
    kv = KVConfig(backend="tq", window=R, block=BLOCK)
    layer = TQLayer(kv, 0, DIM)
    for _ in range(60):
        keys, _ = layer.update(torch.randn(1, 1, 1, DIM), torch.randn(1, 1, 1, DIM))
        context_of(keys).receipt.consumed = True
        exact = keys.shape[2]
        assert min(R, layer.get_seq_length()) <= exact <= R + BLOCK - 1


def test_sink_tokens_stay_exact():
    kv = KVConfig(backend="tq", window=R, block=BLOCK, sink=3)
    layer = TQLayer(kv, 0, DIM)
    k, v = torch.randn(1, 2, 50, DIM), torch.randn(1, 2, 50, DIM)
    layer.update(k, v)
    assert layer.store.length == _expected_quantized(50, sink=3)
    assert torch.equal(layer.keys[:, :, :3], k[:, :, :3])
    assert torch.equal(layer.keys[:, :, 3:], k[:, :, 3 + layer.store.length :])


def test_history_decodes_close_to_the_input():
    kv = KVConfig(backend="tq", bits_k=4, bits_v=4, window=R, block=BLOCK)
    layer = TQLayer(kv, 0, 64)
    k = torch.randn(2, 2, 100, 64)
    layer.update(k, k.clone())
    hist = layer.store.view()
    k_hat = layer.store.k_codec.decode(hist.k)
    ref = k[:, :, : hist.length]
    rel = ((k_hat - ref).norm(dim=-1) ** 2 / ref.norm(dim=-1) ** 2).mean()
    assert rel.item() == pytest.approx(layer.store.k_codec.codebook.mse_per_vector, rel=0.15)


def test_nbytes_counts_packed_store_and_residual():
    kv = KVConfig(backend="tq", bits_k=4, bits_v=2, window=R, block=BLOCK)
    cache = TQCache(kv, num_layers=3, head_dim=DIM)
    batch, heads, n = 2, 2, 300
    for layer_idx in range(3):
        cache.update(torch.randn(batch, heads, n, DIM), torch.randn(batch, heads, n, DIM), layer_idx)
    q = _expected_quantized(n)
    capacity = -(-q // CHUNK_TOKENS) * CHUNK_TOKENS
    per_token = Codec(DIM, 4, 0).bytes_per_vector() + Codec(DIM, 2, 0).bytes_per_vector()  # 18 + 10
    residual = 2 * (n - q) * DIM * 4  # K and V, fp32 inputs
    expected = 3 * batch * heads * (capacity * per_token + residual)
    assert cache_nbytes(cache) == expected


def test_unread_history_is_reported_at_the_next_step():
    layer = TQLayer(KVConfig(backend="tq", window=2, block=1), 0, DIM)
    layer.update(torch.randn(1, 1, 6, DIM), torch.randn(1, 1, 6, DIM))
    layer.update(torch.randn(1, 1, 1, DIM), torch.randn(1, 1, 1, DIM))  # has history; nobody reads it
    with pytest.raises(KVConfigError, match="airquant_tq"):
        layer.update(torch.randn(1, 1, 1, DIM), torch.randn(1, 1, 1, DIM))


def test_crop_is_refused_with_a_fix():
    layer = TQLayer(KVConfig(backend="tq"), 0, DIM)
    with pytest.raises(KVConfigError, match="cannot be cropped"):
        layer.crop(-1)


def test_mixed_preset_stays_within_three_bits():
    kv = KVConfig.mixed(num_layers=30)
    assert kv.bits_per_element(head_dim=64, num_layers=30) <= 3.0
    assert kv.bits_for(16) == (4, 3) and kv.bits_for(12) == (3, 2)


@pytest.mark.parametrize("bits", [2, 4])
def test_unbiased_scale_keeps_projection_on_the_input(bits):
    # Reference: plain float64 projection <x_hat, x> / |x|^2, 1 - MSE for the plain codec. A mean over 20000
    # vectors: its own generator, so the draw does not depend on which tests ran before (the global one did).
    x = torch.randn(1, 1, 20000, 64, generator=torch.Generator().manual_seed(0))
    plain, unbiased = Codec(64, bits, 5), Codec(64, bits, 5, unbiased=True)
    for codec, expected in ((plain, 1 - plain.codebook.mse_per_vector), (unbiased, 1.0)):
        x_hat = codec.decode(codec.encode(x)).double()
        proj = (x_hat * x.double()).sum(-1) / (x.double() ** 2).sum(-1)
        assert proj.mean().item() == pytest.approx(expected, abs=2e-3)
    assert unbiased.bytes_per_vector() == plain.bytes_per_vector()


def test_eight_bit_norms_are_within_half_a_step():
    codec = Codec(64, 4, 0, norm_bits=8)
    x = torch.randn(1, 2, 500, 64) * torch.logspace(-1, 2, 500).view(1, 1, 500, 1)
    ref = codec.norm_ref(x)
    enc = codec.encode(x, ref=ref)
    assert enc.norms.dtype == torch.uint8 and codec.bytes_per_vector() == 32 + 1
    rel = codec.load_norms(enc.norms, ref) / x.norm(dim=-1) - 1
    assert rel.abs().max() <= 2 ** (1 / 32) - 1 + 1e-6  # half of a 1/16-octave step


@pytest.mark.parametrize(
    ("field", "value", "match"),
    [
        ("bits_k", 5, "bits_k=5"),
        ("window", 0, "window"),
        ("backend", "x", "unknown"),
        ("block", 0, "block"),
        ("norm_bits", 12, "norm_bits"),
        ("layer_bits", ((0, 4, 9),), "layer_bits"),
    ],
)
def test_config_validation(field, value, match):
    with pytest.raises(KVConfigError, match=match):
        KVConfig(**{field: value})
