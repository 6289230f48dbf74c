"""What the TurboQuant Triton kernel needs to read the decode loop's paged arena in place (importing it needs no
triton: ``engine/decode/tqslots.py`` builds these on every machine)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["SPLIT_QUANTUM", "Paged"]

# The kernel's splits are whole multiples of this many tokens, so every autotuned BLOCK_N divides them; the
# arena's pages are a multiple of it, so a split never straddles a page.
SPLIT_QUANTUM = 64


@dataclass(frozen=True)
class Paged:
    """The decode loop's arena read in place (engine/decode/tqslots.py), nothing gathered per layer.

    ``slots`` ``[B]``: the slot each batch row reads; ``table`` ``[slots, pages]``: the pool page of each
    slot's j-th ``page`` history tokens; ``window``: how many of each slot's unquantized tokens to read. The
    attention's ``keys``/``values`` are then every slot's window ``[slots, Hkv, capacity, D]``, the history's
    codes and norms the page pools ``[pages, Hkv, page(, W)]`` and its statistics every slot's
    ``[slots, Hkv, 1(, D)]``; ``history.length`` is the longest history the batch rows read."""

    slots: torch.Tensor
    table: torch.Tensor
    window: int
    page: int
    # ``[B]`` on the device: each batch row's own history length (None: every row reads ``history.length``). The
    # kernel reads no tile past a row's own (a call over rows of very different lengths reads each its own pages).
    lengths: torch.Tensor | None = None
