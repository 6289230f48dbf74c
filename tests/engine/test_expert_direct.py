"""The hot set of direct reads (engine/moe/direct.py ``DirectReads.refresh``), without kernels: which experts the
device table points at after a refresh, by ``--expert-policy``, and that their slots hold their images.
The kernels that read through the table: tests/quant/test_nf4_moe_tiered.py, tests/engine/test_expert_fused.py."""

from __future__ import annotations

from pathlib import Path

import torch

from airquant.engine.moe.direct import DirectReads
from airquant.engine.moe.layout import HostArrangement, LayerExperts

EXPERTS, IMAGE = 4, 64  # one 64-byte tensor an expert


def _reads(policy: str, hot: int, spec: int = 0) -> tuple[DirectReads, torch.Tensor, HostArrangement]:
    ranges = [[(e * IMAGE, (e + 1) * IMAGE)] for e in range(EXPERTS)]
    arranged = HostArrangement.of(EXPERTS * IMAGE, [], 0, ranges)
    src = torch.arange(arranged.nbytes, dtype=torch.int64).remainder(251).to(torch.uint8)
    layers = {i: LayerExperts(index=i, top_k=1, module="mlp.experts", names=("w",), dtypes=(torch.uint8,),
                              shapes=((IMAGE,),), dense=(False,), offsets=(0,), ranges=tuple(map(tuple, ranges)),
                              key=f"k{i}", path=Path("x"), data_offset=0) for i in (0, 1)}
    mem = torch.zeros((2 + hot + spec, IMAGE), dtype=torch.uint8)  # 2 working slots, the hot set's, the guesses'
    reads = DirectReads(layers, {0, 1}, mem, range(2, 2 + hot), torch.device("cpu"), lambda i: (src, arranged),
                        policy, spec_slots=range(2 + hot, 2 + hot + spec))
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


def _guessing(monkeypatch, hot: int):
    """Direct reads with one hot slot and two speculative ones; layer 0's images known (it ran once); a gate
    whose top two logits on a one-token input are experts 3 and 1."""
    from airquant.engine.moe import sizing

    monkeypatch.setattr(sizing, "SPECULATE", True)
    reads, src, arranged = _reads("lfu", hot=hot, spec=2)
    reads._matrices[0] = ("images",)  # as after the layer's first direct call
    gate = torch.zeros(EXPERTS, 8)
    gate[3, 0], gate[1, 0] = 2.0, 1.0
    return reads, src, arranged, gate, torch.ones(1, 1, 8)


def test_a_guess_is_copied_into_its_own_slots_and_the_table_pointed_back_after_the_call(monkeypatch):
    """``speculate``: the gate's top-k experts over the normed input, copied into the speculative slots (never the
    working or hot slots) and pointed at; an expert of the hot set keeps its slot and is not copied; after the
    call (``_settle``) the guessed entries point at the RAM tier again, the hot one at its slot."""
    reads, src, arranged, gate, x = _guessing(monkeypatch, hot=1)
    _pass(reads, {(0, 1): 4})
    assert _hot(reads) == {(0, 1)}
    hot_slot = int(reads.table[0, 1])
    assert reads.speculate(0, x, lambda h: h, gate, top_k=2)
    assert int(reads.table[0, 1]) == hot_slot  # in the hot set: read from there, not copied again
    slot = int(reads.table[0, 3])
    assert slot in reads.spec_slots
    assert torch.equal(reads.mem[slot], src[arranged.expert_start(3):arranged.expert_start(3) + IMAGE])
    assert int(reads.spec_copied[0]) == 1 and reads.link_bytes() == reads.hot_bytes + IMAGE
    reads._settle(0, reads._join(0))
    assert int(reads.table[0, 3]) == -1 and int(reads.table[0, 1]) == hot_slot
    assert reads.report()["spec_calls"] == 1 and reads.report()["spec_bytes_copied"] == IMAGE


def test_no_guess_when_off_or_for_more_than_one_token_and_a_stale_one_is_undone(monkeypatch):
    from airquant.engine.moe import sizing

    reads, _, _, gate, x = _guessing(monkeypatch, hot=0)
    assert not reads.speculate(0, torch.ones(1, 2, 8), lambda h: h, gate, top_k=2)  # a prefill's call
    assert not reads.speculate(1, x, lambda h: h, gate, top_k=2)  # layer 1 has not run by direct reads yet
    assert reads.speculate(0, x, lambda h: h, gate, top_k=3)  # more top-k than slots: the top ones guessed
    assert {int(reads.table[0, e]) for e in (1, 3)} == set(reads.spec_slots)
    reads._settle(0, reads._join(0))
    assert (reads.table == -1).all()
    assert reads.speculate(0, x, lambda h: h, gate, top_k=2)
    assert {int(reads.table[0, e]) for e in (1, 3)} == set(reads.spec_slots)
    # the call never came (an aborted forward): the next guess first points layer 0's entries back
    reads._matrices[1] = ("images",)
    assert reads.speculate(1, x, lambda h: h, gate, top_k=2)
    assert (reads.table[0] == -1).all() and {int(reads.table[1, e]) for e in (1, 3)} == set(reads.spec_slots)
    monkeypatch.setattr(sizing, "SPECULATE", False)
    reads._settle(1, reads._join(1))
    assert not reads.speculate(0, x, lambda h: h, gate, top_k=2) and (reads.table == -1).all()


def test_only_the_most_confident_guesses_are_copied_when_limited(monkeypatch):
    """``SPECULATE_GUESSES``: of a call's top-k guesses only that many, the largest logits, are copied and pointed
    at; the others stay on the RAM tier."""
    from airquant.engine.moe import sizing

    reads, src, arranged, gate, x = _guessing(monkeypatch, hot=0)
    monkeypatch.setattr(sizing, "SPECULATE_GUESSES", 1)
    assert reads.speculate(0, x, lambda h: h, gate, top_k=2)
    assert int(reads.table[0, 1]) == -1 and int(reads.table[0, 3]) in reads.spec_slots
    assert int(reads.spec_copied[0]) == 1 and reads.report()["spec_bytes_copied"] == IMAGE
    reads._settle(0, reads._join(0))
    assert (reads.table == -1).all()


def test_an_image_is_copied_in_two_parts_the_down_matrix_bulk_last():
    """Copied reads copy each expert image in two parts (``layout.image_parts``): the down matrix's longest run of
    tensors (a shard orders tensors by dtype, then name: its absmax and packed weight sit side by side), and the
    rest, which holds all the up projection reads. Together they cover the image once; no down run: one part."""
    from airquant.engine.moe import sizing
    from airquant.engine.moe.layout import image_parts, slot_offsets

    sizes = {"down_proj.nested_absmax": 4, "down_proj.quant_map": 64, "gate_up_proj.nested_absmax": 4,
             "gate_up_proj.quant_map": 64, "down_proj.absmax": 128, "down_proj.weight_packed": 4096,
             "gate_up_proj.absmax": 256, "gate_up_proj.weight_packed": 8192}  # the order of a real NF4 shard
    names, at, ranges = tuple(sizes), 0, []
    for n in names:
        ranges.append((at, at + sizes[n]))
        at += sizes[n]
    offsets = slot_offsets(ranges)
    layer = LayerExperts(index=0, top_k=2, module="mlp.experts", names=names, dtypes=(torch.uint8,) * len(names),
                         shapes=tuple((sizes[n],) for n in names), dense=(False,) * len(names), offsets=offsets,
                         ranges=(tuple(ranges),), key="k", path=Path("x"), data_offset=0)
    image = offsets[-1] + sizes[names[-1]]
    first, second = image_parts(layer, "down_proj", image)
    place = dict(zip(names, offsets))
    assert second == ((place["down_proj.absmax"], place["down_proj.weight_packed"] + 4096),)
    covered = sorted((*first, *second))
    assert covered[0][0] == 0 and covered[-1][1] == image
    assert all(a[1] == b[0] for a, b in zip(covered, covered[1:]))  # no byte twice, none left out
    for n in names:  # every tensor the up projection reads (and the down matrix's small tables) is in the first
        if not n.startswith("down_proj.") or sizes[n] < 128:
            assert any(a <= place[n] and place[n] + sizes[n] <= b for a, b in first), n
    assert image_parts(layer, "w2", image) == (((0, image),), ())
    # which calls are copied: from the threshold up, never beside a hot set, never when off
    assert sizing.copy_reads(sizing.COPY_READS_MIN_BYTES, hot_set=False)
    assert not sizing.copy_reads(sizing.COPY_READS_MIN_BYTES - 1, hot_set=False)
    assert not sizing.copy_reads(2 * sizing.COPY_READS_MIN_BYTES, hot_set=True)
    # the plan says so: Mixtral-8x7B's two 99 MB experts without a cache, not with one, not Qwen3's eight 2.7 MB
    mixtral = sizing.ExpertPlan(slot_bytes=99_100_000, work=8, cache=0, gather_bytes=0, top_k=2)
    assert mixtral.copied and "198 MB) copied by the copy engine" in mixtral.describe()
    assert not sizing.ExpertPlan(slot_bytes=99_100_000, work=8, cache=4, gather_bytes=0, top_k=2).copied
    assert not sizing.ExpertPlan(slot_bytes=2_700_000, work=128, cache=0, gather_bytes=0, top_k=8).copied
