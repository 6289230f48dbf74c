"""The decode loop's slot arena filled with random tokens, for the TurboQuant kernel tests."""

import torch

from airquant.engine.decode.tqslots import PAGE_TOKENS, SlotArena


def filled_arena(kv, lengths, heads: int, dim: int, gen: torch.Generator, dtype=torch.float32, device="cpu",
                 interleave: bool = False, key_shift: float = 0.0, cap: int | None = None) -> SlotArena:
    """A ``SlotArena`` (layer 1) whose slot ``i`` holds ``lengths[i]`` random tokens (keys shifted by
    ``key_shift``, as RoPE models' keys sit off the origin), drawn from ``gen`` on the CPU slot after slot, keys
    before values. ``interleave``: pages handed out a page at a time, slot after slot, so every slot's pages
    interleave with the others' (else each slot's are contiguous); ``cap``: the page table as wide as that."""
    arena = SlotArena(kv, layer_idx=1, slots=len(lengths), kv_heads=heads, head_dim=dim, device=device, dtype=dtype,
                      **({"cap": cap} if cap is not None else {}))
    targets = [kv.schedule.quantized_count(n + 1) for n in lengths]
    steps = range(1, max(targets) // PAGE_TOKENS + 2) if interleave else (None,)
    for step in steps:
        for slot, target in enumerate(targets):
            arena.reserve(slot, target if step is None else min(target, step * PAGE_TOKENS))
    for slot, n in enumerate(lengths):
        arena.prefill(slot, (torch.randn(1, heads, n, dim, generator=gen) + key_shift).to(device, dtype),
                      torch.randn(1, heads, n, dim, generator=gen).to(device, dtype))
    return arena
