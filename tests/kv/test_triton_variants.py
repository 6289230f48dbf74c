"""The TurboQuant kernel compiles once per model, not once per length combination (CPU: only the launch
arguments are computed; the kernels are replaced by recorders).

Triton specializes every integer argument on "equal to 1" and "divisible by 16" and compiles a variant per
combination; a decode loop's lengths grow by one token a step, so any length-dependent argument left
specialized means compiles in the middle of a run (seconds each on an H200)."""

import json

import pytest
import torch

from airquant.engine.decode.tqslots import decode_plan
from airquant.kv.config import KVConfig
from tests.kv.arenas import filled_arena

triton = pytest.importorskip("triton")
from triton.runtime.jit import native_specialize_impl  # noqa: E402

from airquant.kv import triton_kernel  # noqa: E402

_SPLIT, _MERGE = triton_kernel._split_kernel, triton_kernel._merge_kernel


class _Recorder:
    """Stands for a launched kernel: ``kernel[grid](*args, **constexprs)`` records the call (and for the
    autotuner, which tiles it chose: ``best_config``)."""

    def __init__(self, kernel, calls: list, via: str = "kernel"):
        self.kernel, self.calls, self.via = kernel, calls, via
        self.best_config = triton.Config({"BLOCK_N": 32}, num_warps=4, num_stages=1)

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.calls.append((self.kernel, args, self.via, kwargs))


def _variant(kernel, args) -> tuple:
    """What Triton keys a compiled variant on, for the integer arguments of one launch."""
    key = []
    for value, param in zip(args, kernel.params):
        if isinstance(value, int) and not isinstance(value, bool):
            key.append((param.name, native_specialize_impl(None, value, False, not param.do_not_specialize,
                                                           not param.do_not_specialize_on_alignment)))
    return tuple(key)


def _decode_launches(monkeypatch, kv: KVConfig, prompts: tuple[int, ...]) -> list:
    """The kernel launches of one decode step of the loop's arena, each slot at its prompt length."""
    calls: list = []
    monkeypatch.setattr(triton_kernel, "_split_tuned", _Recorder(_SPLIT, calls, "autotuner"))
    monkeypatch.setattr(triton_kernel, "_split_kernel", _Recorder(_SPLIT, calls))
    monkeypatch.setattr(triton_kernel, "_merge_kernel", _Recorder(_MERGE, calls))
    gen = torch.Generator().manual_seed(0)
    heads, dim = 2, 64
    arena = filled_arena(kv, prompts, heads, dim, gen)
    plan = decode_plan(kv, len(prompts), [(slot, n, slot) for slot, n in enumerate(prompts)], "cpu")
    new = torch.randn(1, heads, len(prompts), dim, generator=gen)
    arena.write_decode(plan, new, new)
    for bucket in plan.buckets:
        keys, values, ctx = arena.context(plan, bucket)
        query = torch.randn(len(bucket.rows), heads * 4, 1, dim, generator=gen)
        triton_kernel.attention(query, keys, values, ctx, bucket.keep, dim**-0.5)
    return calls


def test_decode_steps_of_any_length_share_one_compiled_variant(monkeypatch):
    kv = KVConfig(backend="tq", bits_k=4, bits_v=2, window=80, block=8)
    # Histories and windows of every residue: multiples of 16 and not, one split of the window and two,
    # one history split and many.
    steps = [(120,), (121,), (152,), (163,), (400,), (1000,), (1037,)]
    monkeypatch.setattr(triton_kernel, "_CHOSEN", {})
    variants = {}
    for prompts in steps:
        for kernel, args, _, _ in _decode_launches(monkeypatch, kv, prompts):
            variants.setdefault(kernel.fn.__name__, set()).add(_variant(kernel, args))
    assert set(variants) == {"_split_kernel", "_merge_kernel"}
    for name, seen in variants.items():
        assert len(seen) == 1, f"{name} would compile {len(seen)} variants for these lengths: {sorted(seen)}"


def test_the_autotuner_is_asked_once_per_launch_key(monkeypatch):
    """Its choice is kept: later launches of the same kind go straight to the kernel with those tiles (the
    autotuner's own lookup costs host time at every layer of every step)."""
    monkeypatch.setattr(triton_kernel, "_CHOSEN", {})
    kv = KVConfig(backend="tq", bits_k=4, bits_v=2, window=16, block=8)
    first = [c for c in _decode_launches(monkeypatch, kv, (300, 333)) if c[0] is _SPLIT]
    later = [c for c in _decode_launches(monkeypatch, kv, (500, 900)) if c[0] is _SPLIT]
    assert [c[2] for c in first] == ["autotuner"] + ["kernel"] * (len(first) - 1)
    assert later and all(c[2] == "kernel" and c[3]["BLOCK_N"] == 32 and c[3]["num_warps"] == 4 for c in later)

    # what a benchmark records of it: the launch key's fields and the tiles chosen, as JSON-ready values
    tiles = triton_kernel.chosen_tiles()
    assert len(tiles) == 1 and tiles[0]["config"]["BLOCK_N"] == 32 and tiles[0]["config"]["num_warps"] == 4
    assert (tiles[0]["dim"], tiles[0]["bits_k"], tiles[0]["bits_v"]) == (64, 4, 2) and tiles[0]["paged"] is False
    assert tiles[0]["query_dtype"] == "torch.float32" and json.dumps(tiles)
