"""Expert images for the fused expert kernels' tests (tests/quant/test_int2_moe.py, test_gptq_moe.py): every
expert's packed buffers in pool slots, as the expert pool holds them, and in a host buffer with a hot set, as
direct reads find them."""

from __future__ import annotations

import torch

from airquant.quant.kernels.tiered import Tiers


def slot_images(stacked: dict[str, torch.Tensor], bias_rows: torch.Tensor | None, order: list[int]):
    """(pool ``[experts, slot_bytes]`` uint8, byte offsets and dtypes of the buffers, the bias row's offset, the
    slot bytes): each of ``stacked``'s ``[E, ...]`` buffers at a 64-byte aligned offset of a slot, then the fp32
    bias row if any; expert e in slot ``order[e]``, the slots' other bytes 7."""
    num = len(order)
    offsets, dtypes, at = {}, {}, 0
    for s, t in stacked.items():
        offsets[s], dtypes[s] = at, t.dtype
        at += -(-t[0].numel() * t.element_size() // 64) * 64
    bias_at = at
    slot_bytes = at + (-(-bias_rows.shape[1] * 4 // 64) * 64 if bias_rows is not None else 0)
    pool = torch.full((num, slot_bytes), 7, dtype=torch.uint8)
    for e in range(num):
        for s, t in stacked.items():
            raw = t[e].contiguous().reshape(-1).view(torch.uint8)
            pool[order[e], offsets[s]:offsets[s] + raw.numel()] = raw
        if bias_rows is not None:
            pool[order[e], bias_at:bias_at + bias_rows.shape[1] * 4] = bias_rows[e].view(torch.uint8)
    return pool, offsets, dtypes, bias_at, slot_bytes


def direct_tiers(pool: torch.Tensor, order: list[int], device: str) -> Tiers:
    """Expert e's image in a host buffer at ``64 + e * slot_bytes``; experts 1 and 3 also in hot slots 2 and 0
    of three (the third holds junk); the table, counters and hits on ``device``."""
    num, slot_bytes = len(order), pool.shape[1]
    host = torch.zeros(64 + num * slot_bytes, dtype=torch.uint8)
    for e in range(num):
        host[64 + e * slot_bytes:64 + (e + 1) * slot_bytes] = pool[order[e]]
    hot = torch.full((3, slot_bytes), 9, dtype=torch.uint8)
    hot[2], hot[0] = pool[order[1]], pool[order[3]]
    table = torch.full((num,), -1, dtype=torch.int32)
    table[1], table[3] = 2, 0
    return Tiers(host.to(device), 64, slot_bytes, hot.to(device), table.to(device),
                 torch.zeros(num, dtype=torch.int32, device=device), torch.zeros(1, dtype=torch.int64, device=device))


def routed_products(dense: torch.Tensor, bias: torch.Tensor, ids: torch.Tensor, x: torch.Tensor, h: torch.Tensor,
                    w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """What up and down must give for pairs ``ids`` ``[T, k]`` of experts ``dense`` ``[E, n, K]`` (+ ``bias``
    ``[E, n]``): each pair's product with its token's ``x`` row, and each token's ``k`` rows of ``h`` through
    their experts, weighted by ``w`` and summed."""
    top, flat = ids.shape[1], ids.reshape(-1)
    up = torch.stack([dense[flat[p]] @ x[p // top] + bias[flat[p]] for p in range(flat.numel())])
    down = torch.stack([sum(w[t, j] * (dense[ids[t, j]] @ h[t * top + j] + bias[ids[t, j]]) for j in range(top))
                        for t in range(ids.shape[0])])
    return up, down


def check_pair(label, up: torch.Tensor, down: torch.Tensor, want: tuple[torch.Tensor, torch.Tensor]) -> None:
    """``up`` and ``down`` (on the CPU) within fp32 rounding of ``routed_products``'."""
    for got, exp, name in ((up, want[0], "up"), (down, want[1], "down")):
        assert (got - exp).abs().max() <= 1e-5 * exp.abs().max(), (label, name, (got - exp).abs().max())


def check_counted(tiers: Tiers, ids: torch.Tensor, experts: int) -> None:
    """The up launch counted each pair's expert, and as hits the pairs of experts 1 and 3 (``direct_tiers``)."""
    assert tiers.counts.cpu().tolist() == torch.bincount(ids.reshape(-1), minlength=experts).tolist()
    assert int(tiers.hits) == sum(int(e) in (1, 3) for e in ids.reshape(-1))
