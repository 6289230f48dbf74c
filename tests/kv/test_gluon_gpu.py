"""The Gluon history kernel (kv/gluon_kernel.py) on CUDA against the Triton split kernel: the same attention, within
the half-precision products' rounding, over the decode loop's arena (flat, paged, rows reading their own
histories), with and without a mask, plain and centred/8-bit-norm/sink caches. Gluon has no interpreter: only a GPU
runs it."""

import pytest
import torch

from airquant.kv import KVConfig

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)
triton_kernel = pytest.importorskip("airquant.kv.triton_kernel")
pytest.importorskip("triton.experimental.gluon")

from airquant.engine.decode.tqslots import decode_plan  # noqa: E402
from tests.kv.arenas import filled_arena  # noqa: E402

CASES = {
    "k4v2": KVConfig(backend="tq", bits_k=4, bits_v=2, window=16, block=8),
    "k4v2_centred_norm8_sink": KVConfig(backend="tq", bits_k=4, bits_v=2, window=12, block=4, sink=2, center_k=True,
                                        center_v=True, norm_bits=8, unbiased=True),
}


def _arena(kv, lengths, heads, dim, dtype, gen):
    """Every slot's pages interleaved with the others' (the page table is read, not a contiguous stride)."""
    return filled_arena(kv, lengths, heads, dim, gen, dtype=dtype, device="cuda", interleave=True, key_shift=1.5,
                        cap=max(lengths) + 40)


def _errors(calls: dict, ref: torch.Tensor) -> dict:
    return {name: (got.float() - ref.float()).abs().max().item() for name, got in calls.items()}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("groups", [4, 8, 3])
@pytest.mark.parametrize("name", list(CASES))
def test_gluon_history_equals_the_triton_kernel_within_rounding(name, groups, dtype):
    kv, dim = CASES[name], 128
    gen = torch.Generator().manual_seed(groups * dim)
    heads, lengths, order = 2, [1300, 70, 640, 29, 5], [2, 0, 4, 3, 1]
    arena = _arena(kv, lengths, heads, dim, dtype, gen)
    plan = decode_plan(kv, len(lengths), [(slot, lengths[slot], row) for row, slot in enumerate(order)], "cuda")
    new = torch.randn(1, heads, len(order), dim, generator=gen).to("cuda", dtype)
    arena.write_decode(plan, new, 0.5 * new)
    scale, checked = dim**-0.5, 0
    for bucket in plan.buckets:
        if not bucket.hist_len:
            continue
        query = torch.randn(len(bucket.rows), heads * groups, 1, dim, generator=gen).to("cuda", dtype)
        keys, values, ctx = arena.context(plan, bucket)
        assert triton_kernel.gluon_history(query, ctx, triton_kernel._DOT[dtype], groups)
        win_k, win_v, pctx, paged = arena.paged(plan, bucket)
        ref = triton_kernel.attention(query, keys, values, ctx, bucket.keep, scale, exact=True, history="triton")
        calls = {f"{kernel}_{where}": triton_kernel.attention(*args, bucket.keep, scale, history=kernel, paged=p)
                 for kernel in ("triton", "gluon")
                 for where, args, p in (("flat", (query, keys, values, ctx), None),
                                        ("paged", (query, win_k, win_v, pctx), paged))}
        err = _errors(calls, ref)
        for where in ("flat", "paged"):
            # the Triton kernel's half-precision products set the scale of the rounding
            assert err[f"gluon_{where}"] <= 2 * err[f"triton_{where}"] + 2e-3, err
        assert torch.isfinite(calls["gluon_paged"]).all()
        checked += 1
    assert checked >= 2

    # every row in one launch, each reading only its own pages, and the causal rule with no mask at all
    query = torch.randn(len(order), heads * groups, 1, dim, generator=gen).to("cuda", dtype)
    win_k, win_v, pctx, paged = arena.rows_paged(plan)
    keep = plan.rows.keep
    ref = triton_kernel.attention(query, win_k, win_v, pctx, keep, scale, paged=paged, exact=True, history="triton")
    got = {kernel: triton_kernel.attention(query, win_k, win_v, pctx, keep, scale, paged=paged, history=kernel)
           for kernel in ("triton", "gluon")}
    err = _errors(got, ref)
    assert err["gluon"] <= 2 * err["triton"] + 2e-3, err
    keys, values, ctx = arena.context(plan, next(b for b in plan.buckets if b.hist_len))
    q1 = query[: keys.shape[0]]
    ref = triton_kernel.attention(q1, keys, values, ctx, None, scale, exact=True, history="triton")
    got = {kernel: triton_kernel.attention(q1, keys, values, ctx, None, scale, history=kernel)
           for kernel in ("triton", "gluon")}
    err = _errors(got, ref)
    assert err["gluon"] <= 2 * err["triton"] + 2e-3, err


@pytest.mark.parametrize(("bits", "dim"), [((3, 3), 128), ((4, 2), 64)])
def test_gluon_history_is_refused_where_it_cannot_apply(bits, dim):
    kv = KVConfig(backend="tq", bits_k=bits[0], bits_v=bits[1], window=16, block=8)
    gen = torch.Generator().manual_seed(0)
    arena = _arena(kv, [300, 200], 2, dim, torch.bfloat16, gen)
    plan = decode_plan(kv, 2, [(0, 300, 0), (1, 200, 1)], "cuda")
    keys, values, ctx = arena.context(plan, next(b for b in plan.buckets if b.hist_len))
    query = torch.randn(keys.shape[0], 8, 1, dim, generator=gen).to("cuda", torch.bfloat16)
    assert not triton_kernel.gluon_history(query, ctx, 1, 4)
    with pytest.raises(ValueError, match="history='triton'"):
        triton_kernel.attention(query, keys, values, ctx, None, dim**-0.5, history="gluon")
