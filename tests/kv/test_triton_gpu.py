"""Triton history kernel on CUDA: against the torch path and the float64 dequantized reference."""

import pytest
import torch

from airquant.kv import KVConfig, kv_logits, make_cache
from airquant.kv import attention
from airquant.kv.cache import TQLayer, context_of

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)
triton_kernel = pytest.importorskip("airquant.kv.triton_kernel")
if triton_kernel.triton is None:
    pytest.skip("needs triton", allow_module_level=True)


def _layer_and_step(kv, batch, hkv, dim, prompt, q_len, gen):
    layer = TQLayer(kv, layer_idx=2, head_dim=dim)
    shift = 3.0 * torch.randn(dim, generator=gen)  # a key offset, as RoPE models have
    layer.update(
        (torch.randn(batch, hkv, prompt, dim, generator=gen) + shift).cuda(),
        torch.randn(batch, hkv, prompt, dim, generator=gen).cuda(),
    )
    keys, values = layer.update(
        torch.randn(batch, hkv, q_len, dim, generator=gen).cuda(), torch.randn(batch, hkv, q_len, dim, generator=gen).cuda()
    )
    return keys, values, context_of(keys)


@pytest.mark.parametrize(
    ("bits_k", "bits_v", "dim", "prompt", "q_len", "sink", "center", "norm_bits"),
    [
        (4, 2, 128, 5000, 1, 0, False, 16),
        (3, 3, 64, 777, 1, 4, True, 8),
        (2, 1, 64, 300, 5, 0, True, 16),
        (1, 4, 128, 2100, 40, 2, False, 8),
    ],
)
def test_kernel_matches_torch_and_float64(
    dequantized_attention, bits_k, bits_v, dim, prompt, q_len, sink, center, norm_bits
):
    gen = torch.Generator().manual_seed(bits_k * 7 + bits_v)
    batch, hkv, groups = 2, 2, 4
    kv = KVConfig(
        backend="tq", bits_k=bits_k, bits_v=bits_v, window=16, block=8, sink=sink, center_k=center, center_v=center,
        norm_bits=norm_bits, unbiased=center,
    )
    keys, values, ctx = _layer_and_step(kv, batch, hkv, dim, prompt, q_len, gen)
    plain = keys.as_subclass(torch.Tensor)
    total = keys.shape[2] + ctx.history.length
    keep = torch.ones(batch, 1, q_len, total, dtype=torch.bool, device="cuda")
    keep[1, :, :, :37] = False  # left padding
    keep[..., -q_len:] &= torch.ones(q_len, q_len, dtype=torch.bool, device="cuda").tril()
    query = torch.randn(batch, hkv * groups, q_len, dim, generator=gen).cuda()
    scale = dim**-0.5

    q = attention.group_rows(query.float(), hkv)
    hist_keep = attention._mask_rows(keep, hkv, groups)[..., sink : sink + ctx.history.length]
    assert triton_kernel.applicable(q, ctx)
    m_t, l_t, acc_t = triton_kernel.history_state(q, ctx, hist_keep, scale)
    m_r, l_r, acc_r = attention.history_state_torch(q, ctx, hist_keep, scale)
    torch.testing.assert_close(m_t, m_r, atol=1e-4, rtol=1e-4)
    # States are relative to each path's max; compare the normalized history output.
    torch.testing.assert_close(acc_t / l_t, acc_r / l_r, atol=1e-4, rtol=1e-4)

    out = attention.compressed_attention(query, plain, values, ctx, keep, scale)
    ref = dequantized_attention(query, keys, values, ctx, keep, scale)
    torch.testing.assert_close(out.double().cpu(), ref, atol=1e-4, rtol=1e-3)


def test_decode_on_cuda_matches_kv_logits(make_llama):
    model = make_llama(head_dim=32, layers=2).cuda()
    seq = torch.randint(2, 95, (2, 80), device="cuda")
    kv = KVConfig(
        backend="tq", bits_k=4, bits_v=2, window=8, block=4, sink=1, center_k=True, center_v=True, norm_bits=8
    )
    cache = make_cache(model.config, kv, device="cuda", dtype=torch.float32)
    with torch.no_grad():
        steps = [model(input_ids=seq[:, t : t + 1], past_key_values=cache).logits for t in range(seq.shape[1])]
    decoded = torch.cat(steps, dim=1)
    torch.testing.assert_close(decoded, kv_logits(model, seq, None, kv), atol=2e-4, rtol=1e-3)


def test_tf32_products_for_half_precision_models_stay_close():
    """bf16/fp16 models get TF32 products in the kernel: within bf16 rounding of the exact path."""
    gen = torch.Generator().manual_seed(3)
    kv = KVConfig(backend="tq", bits_k=4, bits_v=2, window=16, block=8)
    keys, values, ctx = _layer_and_step(kv, 2, 2, 128, 300, 1, gen)
    q = attention.group_rows(torch.randn(2, 8, 1, 128, generator=gen).cuda(), 2)
    keep = torch.ones(2, 1, 4, ctx.history.length, dtype=torch.bool, device="cuda")
    m_e, l_e, acc_e = triton_kernel.history_state(q, ctx, keep, 128**-0.5)
    m_t, l_t, acc_t = triton_kernel.history_state(q, ctx, keep, 128**-0.5, exact=False)
    torch.testing.assert_close(acc_t / l_t, acc_e / l_e, atol=1e-2, rtol=1e-2)
    assert not torch.equal(acc_t / l_t, acc_e / l_e)  # the TF32 path really ran
