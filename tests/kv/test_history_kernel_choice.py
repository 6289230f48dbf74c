"""Which kernel reads a TurboQuant call's packed history (CPU: the launches are recorded, not run): the Gluon
kernel takes the history splits of calls it can read and the Triton kernel then runs only the window's splits, the
merge reads them all; the choice follows ``history=``, AIRQUANT_TQ_HISTORY and ``HISTORY_KERNEL``; bad choices
are refused with the fix."""

import pytest
import torch

from airquant.kv.config import KVConfig

triton = pytest.importorskip("triton")
from airquant.engine.decode.tqslots import decode_plan  # noqa: E402
from airquant.kv import triton_kernel  # noqa: E402
from tests.kv.arenas import filled_arena  # noqa: E402

# the split kernel's positional arguments by name (its constexprs come as keywords)
SPLIT_ARGS = [p.name for p in triton_kernel._split_kernel.params if not p.is_constexpr]


class _Grid:
    """Stands for a kernel: ``kernel[grid](*args, **kw)`` records (name, grid, args, kw)."""

    def __init__(self, name, calls):
        self.name, self.calls = name, calls
        self.best_config = triton.Config({"BLOCK_N": 32}, num_warps=4, num_stages=1)

    def __getitem__(self, grid):
        return lambda *args, **kw: self.calls.append((self.name, grid, args, kw))


def _bucket(kv, lengths=(700, 300)):
    gen = torch.Generator().manual_seed(0)
    heads, dim = 2, 128
    arena = filled_arena(kv, lengths, heads, dim, gen, dtype=torch.bfloat16)
    plan = decode_plan(kv, len(lengths), [(slot, n, slot) for slot, n in enumerate(lengths)], "cpu")
    bucket = next(b for b in plan.buckets if b.hist_len)
    keys, values, ctx = arena.context(plan, bucket)
    query = torch.randn(keys.shape[0], heads * 4, 1, dim, generator=gen).bfloat16()
    return query, keys, values, ctx, bucket.keep


@pytest.fixture
def recorded(monkeypatch):
    calls: list = []
    monkeypatch.setattr(triton_kernel, "_split_kernel", _Grid("split", calls))
    monkeypatch.setattr(triton_kernel, "_split_tuned", _Grid("split", calls))
    monkeypatch.setattr(triton_kernel, "_merge_kernel", _Grid("merge", calls))
    monkeypatch.setattr(triton_kernel, "_CHOSEN", {})
    monkeypatch.setattr(triton_kernel, "gluon_history", lambda *a: True)  # as on a GPU that can
    gluon_kernel = pytest.importorskip("airquant.kv.gluon_kernel")

    def launch(*args):
        shape = args[13]
        calls.append(("gluon", (args[0].shape[0] * shape[0], shape[6]), args, {"block_n": args[15]}))

    monkeypatch.setattr(gluon_kernel, "launch", launch)
    monkeypatch.delenv("AIRQUANT_TQ_HISTORY", raising=False)
    return calls


def test_gluon_history_takes_the_history_splits_and_triton_the_window(recorded):
    kv = KVConfig(backend="tq", bits_k=4, bits_v=2, window=200, block=8)
    query, keys, values, ctx, keep = _bucket(kv)
    triton_kernel.attention(query, keys, values, ctx, keep, 128**-0.5, history="gluon")
    (_, split_grid, split_args, split_kw), (_, gluon_grid, gluon_args, _), (_, merge_grid, merge_args, _) = recorded
    hkv, groups, q_len, kv_len, full, n_splits, hist_splits, per_split = gluon_args[13]
    assert full >= 1 and hist_splits >= 1 and n_splits == full + hist_splits
    assert split_grid == (query.shape[0] * hkv, full, 1)  # the window's splits only
    assert gluon_grid == (query.shape[0] * hkv, hist_splits)
    assert all(split_kw[k] == v for k, v in triton_kernel.WINDOW_TILES.items())  # fixed tiles, not tuned
    assert merge_grid == (query.shape[0] * hkv, 1) and merge_args[-2:] == (n_splits, full)
    assert hist_splits * per_split >= ctx.history.length > (hist_splits - 1) * per_split
    # the split kernel places its states n_splits a row apart though its grid holds only the window's splits
    named = dict(zip(SPLIT_ARGS, split_args, strict=True))
    assert (named["full_splits"], named["n_splits"], named["per_split"]) == (full, n_splits, per_split)


def test_the_choice_follows_the_argument_then_the_environment_then_the_default(recorded, monkeypatch):
    kv = KVConfig(backend="tq", bits_k=4, bits_v=2, window=200, block=8)
    query, keys, values, ctx, keep = _bucket(kv)

    def kernels(**kw):
        recorded.clear()
        triton_kernel.attention(query, keys, values, ctx, keep, 128**-0.5, **kw)
        return [c[0] for c in recorded]

    monkeypatch.setattr(triton_kernel, "HISTORY_KERNEL", "triton")
    assert kernels() == ["split", "merge"]
    assert kernels(history="gluon") == ["split", "gluon", "merge"]
    monkeypatch.setenv("AIRQUANT_TQ_HISTORY", "gluon")
    assert kernels() == ["split", "gluon", "merge"]
    assert kernels(history="triton") == ["split", "merge"]
    monkeypatch.setenv("AIRQUANT_TQ_HISTORY", "tensor-cores")
    with pytest.raises(ValueError, match="AIRQUANT_TQ_HISTORY='tensor-cores'"):
        kernels()
    monkeypatch.delenv("AIRQUANT_TQ_HISTORY")
    monkeypatch.setattr(triton_kernel, "HISTORY_KERNEL", "gluon")
    assert kernels() == ["split", "gluon", "merge"]
    with pytest.raises(ValueError, match="history='cuda'"):
        kernels(history="cuda")
    assert kernels(block_n=64) == ["split", "merge"]  # a Triton tile named: the Triton kernel's history
    assert kernels(history="gluon", block_n=16) == ["split", "gluon", "merge"]
    for tile in (8, 48, 128):
        with pytest.raises(ValueError, match=f"block_n={tile} for the Gluon history kernel: 16, 32 or 64"):
            kernels(history="gluon", block_n=tile)


def test_calls_the_gluon_kernel_cannot_read_are_refused_with_the_fix():
    kv = KVConfig(backend="tq", bits_k=4, bits_v=2, window=16, block=8)
    query, keys, values, ctx, keep = _bucket(kv)
    assert not triton_kernel.gluon_history(query, ctx, 1, 4)  # no GPU here
    with pytest.raises(ValueError, match="use history='triton'"):
        triton_kernel.attention(query, keys, values, ctx, keep, 128**-0.5, history="gluon")
    # fp32 products (dot 0), more than 16 query rows a kv-head, other code widths: never
    assert not triton_kernel.gluon_history(query, ctx, 0, 4)
    assert not triton_kernel.gluon_history(query, ctx, 1, 17)
