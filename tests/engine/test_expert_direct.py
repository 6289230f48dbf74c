"""The hot set of direct reads (engine/moe/direct.py ``DirectReads.refresh``), without kernels: which experts the
device table points at after a refresh, by ``--expert-policy``, and that their slots hold their images.
The kernels that read through the table: tests/quant/test_nf4_moe_tiered.py, tests/engine/test_expert_fused.py."""

from __future__ import annotations

from pathlib import Path

import torch

from airquant.engine.moe.direct import DirectReads
from airquant.engine.moe.layout import HostArrangement, LayerExperts

EXPERTS, IMAGE = 4, 64  # one 64-byte tensor an expert


def _reads(policy: str, hot: int) -> tuple[DirectReads, torch.Tensor, HostArrangement]:
    ranges = [[(e * IMAGE, (e + 1) * IMAGE)] for e in range(EXPERTS)]
    arranged = HostArrangement.of(EXPERTS * IMAGE, [], 0, ranges)
    src = torch.arange(arranged.nbytes, dtype=torch.int64).remainder(251).to(torch.uint8)
    layers = {i: LayerExperts(index=i, top_k=1, module="mlp.experts", names=("w",), dtypes=(torch.uint8,),
                              shapes=((IMAGE,),), dense=(False,), offsets=(0,), ranges=tuple(map(tuple, ranges)),
                              key=f"k{i}", path=Path("x"), data_offset=0) for i in (0, 1)}
    mem = torch.zeros((2 + hot, IMAGE), dtype=torch.uint8)  # 2 working slots, then the hot set's
    reads = DirectReads(layers, {0, 1}, mem, range(2, 2 + hot), torch.device("cpu"), lambda i: (src, arranged),
                        policy)
    return reads, src, arranged


def _pass(reads: DirectReads, routed: dict[tuple[int, int], int]) -> None:
    """One pass: the kernel's counts for ``routed`` ((layer, expert) -> pairs), then the refresh."""
    for (i, e), n in routed.items():
        reads.counts[i, e] += n
    reads.passes += 1
    reads.refresh()


def _hot(reads: DirectReads) -> set[tuple[int, int]]:
    return {(i, e) for i in range(2) for e in range(EXPERTS) if reads.table[i, e] >= 0}


def test_lfu_keeps_the_often_routed_expert_lru_the_last_one():
    routes = [{(0, 1): 8}, {(1, 2): 1}]  # expert (0, 1) routed 8 times, then (1, 2) once
    lfu, _, _ = _reads("lfu", hot=1)
    lru, _, _ = _reads("lru", hot=1)
    for r in routes:
        _pass(lfu, r)
        _pass(lru, r)
    assert _hot(lfu) == {(0, 1)}  # 8 * 0.5 against 1
    assert _hot(lru) == {(1, 2)}


def test_a_refresh_copies_the_entering_images_and_points_the_leaving_back_at_the_host():
    reads, src, arranged = _reads("lru", hot=2)
    _pass(reads, {(0, 3): 1, (1, 0): 2})
    assert _hot(reads) == {(0, 3), (1, 0)}
    for (i, e), slot in reads.hot.items():
        assert int(reads.table[i, e]) == slot and slot >= 2  # never a working slot
        start = arranged.expert_start(e)
        assert torch.equal(reads.mem[slot], src[start:start + IMAGE])
    _pass(reads, {(1, 1): 1})  # lru: (1, 1) enters, the older of the two leaves... both are older: one stays
    assert (1, 1) in _hot(reads) and len(_hot(reads)) == 2
    left = {(0, 3), (1, 0)} - _hot(reads)
    assert len(left) == 1 and all(int(reads.table[k]) == -1 for k in left)
    assert reads.hot_bytes == 3 * IMAGE


def test_code_books_are_shared_only_where_every_image_holds_the_same():
    """Direct reads pass the kernel device copies of the NF4 code books when every expert image of the layer
    holds the same ones (bitsandbytes writes the same tables), and none when one image differs."""
    from types import SimpleNamespace

    from airquant.quant.kernels.nf4_moe import BUFFERS
    from tests.quant.test_nf4_moe_tiered import expert_images

    images, _, _, m = expert_images(3, 8, 64, 64, True)
    start, stride = 128, images.shape[1] + 128
    src = torch.zeros(start + 3 * stride, dtype=torch.uint8)
    for e in range(3):
        src[start + e * stride:start + e * stride + images.shape[1]] = images[e]
    arranged = SimpleNamespace(experts_start=start, stride=stride, expert_ranges=[()] * 3)
    reads, _, _ = _reads("lfu", hot=1)
    books = reads.code_books(src, arranged, (m, m))
    for name, size in (("quant_map", 16), ("nested_quant_map", 256)):
        off = m.offsets[BUFFERS.index(name)]
        assert torch.equal(books[name], images[0, off:off + 4 * size].view(torch.float32))
    off = start + 2 * stride + m.offsets[BUFFERS.index("quant_map")]
    src[off:off + 4] = 0  # expert 2's first code differs
    assert reads.code_books(src, arranged, (m, m)) == {}
