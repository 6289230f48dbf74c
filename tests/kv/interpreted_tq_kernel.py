"""Run by tests/kv/test_triton_interpreted.py in a process of its own with ``TRITON_INTERPRET=1``: the
TurboQuant Triton kernels on the CPU (Triton's interpreter), flat and paged, against the torch ops, over the
decode loop's slot arena. Prints one JSON line of the largest differences per case.

Triton 3.6's interpreter turns a scalar into a Python int with ``int(array)``, which numpy 2.x refuses for
the one-element 1-D arrays its program ids are; the ``__index__`` it installs is replaced by one that takes
the element (nothing else of the interpreter changes)."""

import json
from dataclasses import replace

import triton.runtime.interpreter as interpreter

_patch = interpreter._patch_lang_tensor


def _patch_lang_tensor(tensor, scope):
    _patch(tensor, scope)
    scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))


interpreter._patch_lang_tensor = _patch_lang_tensor

import torch  # noqa: E402

from airquant.engine.decode.tqslots import PAGE_TOKENS, SlotArena, decode_plan, keep_columns  # noqa: E402
from airquant.kv import attention, triton_kernel  # noqa: E402
from airquant.kv.config import KVConfig  # noqa: E402


def case(name: str, kv: KVConfig, lengths: list[int], order: list[int], block_n: int | None,
         device: str = "cpu", variant: tuple[int, int] = (0, 0), maxnreg: int | None = None) -> dict:
    """Largest differences of the flat and the paged kernel from the torch ops (fp32, IEEE products) over an
    arena whose slots' pages interleave; ``block_n`` None: the autotuned tiles (CUDA); ``maxnreg``: a register cap
    (CUDA)."""
    gen = torch.Generator().manual_seed(len(name))
    heads, dim, groups = 2, 64, 3
    arena = SlotArena(kv, layer_idx=1, slots=len(lengths), kv_heads=heads, head_dim=dim, device=device,
                      dtype=torch.float32, cap=max(lengths) + 40)  # cap: the page table as wide as a full slot
    targets = [kv.schedule.quantized_count(n + 1) for n in lengths]
    # Pages handed out a page at a time, slot after slot: every slot's pages interleave with the others'.
    for step in range(1, max(targets) // PAGE_TOKENS + 2):
        for slot, target in enumerate(targets):
            arena.reserve(slot, min(target, step * PAGE_TOKENS))
    for slot, n in enumerate(lengths):
        arena.prefill(slot, (torch.randn(1, heads, n, dim, generator=gen) + 1.5).to(device),
                      torch.randn(1, heads, n, dim, generator=gen).to(device))
    plan = decode_plan(kv, len(lengths), [(slot, lengths[slot], row) for row, slot in enumerate(order)], device)
    new = torch.randn(1, heads, len(order), dim, generator=gen).to(device)
    arena.write_decode(plan, new, 0.5 * new)
    out = {"flat": 0.0, "paged": 0.0, "buckets": 0, "interleaved": any(
        b - a != 1 for pages in arena.pages for a, b in zip(pages, pages[1:]))}
    for bucket in plan.buckets:
        if not bucket.hist_len:
            continue
        query = torch.randn(len(bucket.rows), heads * groups, 1, dim, generator=gen).to(device)
        keys, values, ctx = arena.context(plan, bucket)
        ref = attention.compressed_attention(query, keys, values, ctx, bucket.keep, dim**-0.5, kernel=False)
        flat = triton_kernel.attention(query, keys, values, ctx, bucket.keep, dim**-0.5, block_n=block_n, variant=variant, maxnreg=maxnreg)
        win_k, win_v, pctx, paged = arena.paged(plan, bucket)
        got = triton_kernel.attention(query, win_k, win_v, pctx, bucket.keep, dim**-0.5, block_n=block_n, variant=variant, maxnreg=maxnreg,
                                      paged=paged)
        out["flat"] = max(out["flat"], (flat - ref).abs().max().item())
        out["paged"] = max(out["paged"], (got - ref).abs().max().item())
        out["buckets"] += 1
    out.update(static_pass(arena, kv, plan, lengths, order, heads * groups, dim, block_n, gen, device, variant, maxnreg))
    # every row in one launch, each reading only its own pages (plan.rows, Paged.lengths), against the torch ops
    # over all rows padded to the longest history, and bit for bit the same launch reading every row that far
    query = torch.randn(len(order), heads * groups, 1, dim, generator=gen).to(device)
    keys, values, ctx = arena.static_context(plan.slots, plan.hist_len)
    keys, values = keys[:, :, : plan.win_len], values[:, :, : plan.win_len]
    ref = attention.compressed_attention(query, keys, values, ctx, plan.rows.keep, dim**-0.5, kernel=False)
    win_k, win_v, pctx, paged = arena.rows_paged(plan)
    own = triton_kernel.attention(query, win_k, win_v, pctx, plan.rows.keep, dim**-0.5, block_n=block_n, variant=variant, maxnreg=maxnreg, paged=paged)
    padded = triton_kernel.attention(query, win_k, win_v, pctx, plan.rows.keep, dim**-0.5, block_n=block_n, variant=variant, maxnreg=maxnreg,
                                     paged=replace(paged, lengths=None))
    out.update(rows=(own - ref).abs().max().item(), rows_same=torch.equal(own, padded),
               rows_lengths=plan.hist.tolist())
    return out


def static_pass(arena, kv, plan, lengths, order, hq, dim, block_n, gen, device, variant=(0, 0),
                maxnreg=None) -> dict:
    """A static pass's attention (every row, whole windows, the history rounded up past the longest, the mask from
    the rows' lengths) against the bucketed one for the same queries (torch ops), and the paged kernel against it."""
    count = kv.schedule.quantized_count
    hist = [count(lengths[s]) for s in order]
    win = [lengths[s] + 1 - h for s, h in zip(order, hist)]
    span = min(max(hist) + 7, count(max(lengths) + 40))  # past the longest, not a page multiple, within the cap
    slots = torch.tensor(order, device=device)
    keep = keep_columns(torch.tensor(hist, device=device)[:, None], torch.tensor(win, device=device)[:, None],
                       min(kv.sink, arena.win_cap), arena.win_cap, span)
    query = torch.randn(len(order), hq, 1, dim, generator=gen).to(device)
    keys, values, ctx = arena.static_context(slots, span)
    ref = attention.compressed_attention(query, keys, values, ctx, keep, dim**-0.5, kernel=False)
    win_k, win_v, pctx, paged = arena.static_paged(slots, span)
    got = triton_kernel.attention(query, win_k, win_v, pctx, keep, dim**-0.5, block_n=block_n, variant=variant, maxnreg=maxnreg, paged=paged)
    _, _, _, own = arena.static_paged(slots, span, torch.tensor(hist, device=device))  # each row its own history
    got_own = triton_kernel.attention(query, win_k, win_v, pctx, keep, dim**-0.5, block_n=block_n, variant=variant, maxnreg=maxnreg, paged=own)
    bucketed = 0.0
    for bucket in plan.buckets:
        if bucket.hist_len:
            k, v, c = arena.context(plan, bucket)
            part = attention.compressed_attention(query[bucket.rows], k, v, c, bucket.keep, dim**-0.5, kernel=False)
            bucketed = max(bucketed, (part - ref[bucket.rows]).abs().max().item())
    return {"static": (got - ref).abs().max().item(), "static_vs_buckets": bucketed,
            "static_own_same": torch.equal(got, got_own)}


CASES = {
    "k4v2": (KVConfig(backend="tq", bits_k=4, bits_v=2, window=16, block=8), [300, 70, 140, 29, 5], [2, 0, 4, 3, 1],
             64),  # slot 4: no history yet
    "k3v3_centred_norm8_sink": (KVConfig(backend="tq", bits_k=3, bits_v=3, window=12, block=4, sink=2, center_k=True,
                                         center_v=True, norm_bits=8, unbiased=True), [200, 333, 90], [1, 2, 0], 32),
}


def half_tables() -> dict:
    """fp16 arena and queries (products in fp16): the paged kernel gathering from fp16 centroid tables equals,
    bit for bit, the one gathering fp32 and converting in the kernel; both near the torch ops in fp32. (Triton
    3.6's interpreter computes bf16 wrongly, either way: the GPU tests cover bf16.)"""
    kv, lengths, order, _ = CASES["k4v2"]
    gen = torch.Generator().manual_seed(3)
    heads, dim, groups, dtype = 2, 64, 3, torch.float16
    arena = SlotArena(kv, layer_idx=1, slots=len(lengths), kv_heads=heads, head_dim=dim, device="cpu", dtype=dtype,
                      cap=max(lengths) + 40)
    for slot, n in enumerate(lengths):
        arena.reserve(slot, kv.schedule.quantized_count(n + 1))
        arena.prefill(slot, (torch.randn(1, heads, n, dim, generator=gen) + 1.5).to(dtype),
                      torch.randn(1, heads, n, dim, generator=gen).to(dtype))
    plan = decode_plan(kv, len(lengths), [(slot, lengths[slot], row) for row, slot in enumerate(order)], "cpu")
    out = {"half_same": True, "half_err": 0.0, "half_buckets": 0}
    for bucket in plan.buckets:
        if not bucket.hist_len:
            continue
        query = torch.randn(len(bucket.rows), heads * groups, 1, dim, generator=gen).to(dtype)
        keys, values, ctx = arena.context(plan, bucket)
        ref = attention.compressed_attention(query.float(), keys.float(), values.float(), ctx, bucket.keep,
                                             dim**-0.5, kernel=False)
        win_k, win_v, pctx, paged = arena.paged(plan, bucket)
        got = {}
        for tables in (True, False):
            triton_kernel.TABLES_IN_PRODUCT_DTYPE = tables
            got[tables] = triton_kernel.attention(query, win_k, win_v, pctx, bucket.keep, dim**-0.5, block_n=64,
                                                  paged=paged)
        triton_kernel.TABLES_IN_PRODUCT_DTYPE = True
        out["half_tables"] = ("cpu", dtype) in pctx.k_codec._centroids  # the fp16 table was the one gathered
        out["half_same"] &= torch.equal(got[True], got[False])
        out["half_err"] = max(out["half_err"], (got[True].float() - ref).abs().max().item())
        out["half_buckets"] += 1
    return out


def main() -> None:
    # every history-tile variant the autotuner may pick (codes in dimension or byte-column order, or a byte's
    # centroids gathered together): the 3-bit case takes the dimension order and each code's gather whatever the
    # variant asks
    cases = {f"{name}/{cols}{tab}": case(name, *args, variant=(cols, tab))
             for name, args in CASES.items() for cols, tab in triton_kernel.VARIANTS}
    print(json.dumps({**cases, "half": half_tables()}))


if __name__ == "__main__":
    main()
