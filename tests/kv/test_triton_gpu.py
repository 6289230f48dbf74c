"""Triton history kernel on CUDA: against the torch path and the float64 dequantized reference."""

import pytest
import torch

from airquant.kv import KVConfig, attention, kv_logits, make_cache
from airquant.kv.cache import TQLayer, context_of

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)
triton_kernel = pytest.importorskip("airquant.kv.triton_kernel")
if triton_kernel.triton is None:
    pytest.skip("needs triton", allow_module_level=True)


@pytest.fixture(autouse=True)
def _one_tile_config(monkeypatch):
    """Autotuning compiles every config per new key; one config keeps these tests to minutes."""
    monkeypatch.setattr(triton_kernel._split_tuned, "configs", triton_kernel._split_tuned.configs[:1])


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
    ("bits_k", "bits_v", "dim", "prompt", "q_len", "sink", "center", "norm_bits", "masked"),
    [
        (4, 2, 128, 5000, 1, 0, False, 16, False),
        (4, 2, 128, 5000, 1, 0, False, 16, True),
        (3, 3, 64, 777, 1, 4, True, 8, True),
        (2, 1, 64, 300, 5, 0, True, 16, True),
        (1, 4, 128, 2100, 40, 2, False, 8, False),
    ],
)
def test_kernel_matches_torch_and_float64(
    dequantized_attention, bits_k, bits_v, dim, prompt, q_len, sink, center, norm_bits, masked
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
    keep = torch.ones(q_len, total, dtype=torch.bool, device="cuda").tril(total - q_len)  # causal
    keep = keep.expand(batch, 1, q_len, total).clone()
    mask = None
    if masked:
        keep[1, :, :, :37] = False  # left padding
        mask = keep
    query = torch.randn(batch, hkv * groups, q_len, dim, generator=gen).cuda()
    scale = dim**-0.5

    assert triton_kernel.applicable(query, ctx)
    out = attention.compressed_attention(query, plain, values, ctx, mask, scale)
    torch_path = attention.compressed_attention(query, plain, values, ctx, mask, scale, kernel=False)
    torch.testing.assert_close(out, torch_path, atol=1e-4, rtol=1e-4)
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


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_models_use_their_dtype_and_stay_close(dtype):
    """bf16/fp16 models get products in their own dtype: within that rounding of the fp32 path."""
    gen = torch.Generator().manual_seed(3)
    kv = KVConfig(backend="tq", bits_k=4, bits_v=2, window=16, block=8)
    keys, values, ctx = _layer_and_step(kv, 2, 2, 128, 3000, 1, gen)
    query = torch.randn(2, 8, 1, 128, generator=gen).cuda()
    plain = keys.as_subclass(torch.Tensor)
    exact = attention.compressed_attention(query, plain, values, ctx, None, 128**-0.5)
    half = attention.compressed_attention(query.to(dtype), plain.to(dtype), values.to(dtype), ctx, None, 128**-0.5)
    assert half.dtype == dtype
    torch.testing.assert_close(half.float(), exact, atol=2e-2, rtol=2e-2)
    fp32_products = triton_kernel.attention(query.to(dtype), plain.to(dtype), values.to(dtype), ctx, None, 128**-0.5, exact=True)
    assert not torch.equal(half, fp32_products)  # the half-precision products really ran


def test_codec_tables_and_rotations_reach_the_device_without_a_sync():
    """A loop's arenas make each layer's codecs at its first pass: their tables, byte tables (made at a layer's
    first kernel call, inside the layer-graph warm-up, where a sync turns static passes off for the run) and
    rotation go to the device from pinned memory, never through a synchronizing copy (kv_bench's trace: 4 syncs a
    layer before)."""
    from airquant.kv.codec import Codec

    codec = Codec(128, 4, seed=987_654_321)  # a seed no other test uses: its rotation is not cached yet
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        centroids, boundaries = codec.tables(torch.device("cuda"))
        half = codec.centroids(torch.device("cuda"), torch.bfloat16)
        byte = codec.byte_table(torch.device("cuda"), torch.bfloat16)
        rotation = codec.rotation.matrix(torch.device("cuda"), torch.float32)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert centroids.is_cuda and boundaries.is_cuda and half.dtype == torch.bfloat16
    assert torch.equal(centroids.cpu(), codec.codebook.centroids_tensor())
    assert torch.equal(byte.cpu(), codec.byte_table("cpu", torch.bfloat16))
    assert torch.equal(rotation.cpu(), codec.rotation.matrix("cpu", torch.float32))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_products_gather_from_tables_in_their_dtype_bit_for_bit(dtype, monkeypatch):
    """Centroid tables in the products' dtype give the same bits as fp32 tables converted in the kernel."""
    gen = torch.Generator().manual_seed(4)
    kv = KVConfig(backend="tq", bits_k=4, bits_v=2, window=16, block=8)
    keys, values, ctx = _layer_and_step(kv, 3, 2, 128, 2500, 1, gen)
    query = torch.randn(3, 8, 1, 128, generator=gen).cuda().to(dtype)
    plain, values = keys.as_subclass(torch.Tensor).to(dtype), values.to(dtype)
    got = {}
    for tables in (True, False):
        monkeypatch.setattr(triton_kernel, "TABLES_IN_PRODUCT_DTYPE", tables)
        got[tables] = triton_kernel.attention(query, plain, values, ctx, None, 128**-0.5, block_n=64)
    assert (str(query.device), dtype) in ctx.k_codec._centroids
    assert torch.equal(got[True], got[False])


@pytest.mark.parametrize("name", ["k4v2", "k3v3_centred_norm8_sink"])
def test_paged_kernel_reads_the_loop_arena_as_the_torch_ops_do(name):
    """The compiled kernel, flat and paged (the decode loop's arena through its page table), against the torch
    ops on the same arena, autotuned tiles (tests/kv/test_triton_interpreted.py runs the same on the CPU)."""
    from tests.kv.interpreted_tq_kernel import CASES, case

    kv, lengths, order, _ = CASES[name]
    r = case(name, kv, lengths, order, None, device="cuda")
    assert r["buckets"] >= 2 and r["interleaved"]
    assert r["flat"] < 1e-4 and r["paged"] < 1e-4, r


@pytest.mark.parametrize("tile", [(32, None), (16, 128)])
@pytest.mark.parametrize("variant", [(1, 0), (0, 1)])
@pytest.mark.parametrize("name", ["k4v2", "k3v3_centred_norm8_sink"])
def test_history_tile_variants_compiled_equal_the_torch_ops(name, variant, tile):
    """The compiled history-tile variants (codes in the packed bytes' column order; a byte's centroids gathered
    together: ``triton_kernel.VARIANTS``), at BLOCK_N 32 and at 16 under a 128-register cap, flat, paged, static and
    per-row, against the torch ops (the interpreter checks the same code on the CPU; this checks what Triton
    compiles of it)."""
    from tests.kv.interpreted_tq_kernel import CASES, case

    kv, lengths, order, _ = CASES[name]
    r = case(name, kv, lengths, order, tile[0], device="cuda", variant=variant, maxnreg=tile[1])
    assert r["buckets"] >= 2 and r["flat"] < 1e-4 and r["paged"] < 1e-4, r
    assert r["static"] < 1e-4 and r["rows"] < 1e-4 and r["static_own_same"] and r["rows_same"], r

