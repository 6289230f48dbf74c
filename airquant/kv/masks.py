"""The attention mask as every KV attention path reads it: boolean, True = attend.

Its own module because the torch path (``airquant.kv.attention``), the Triton kernel
(``airquant.kv.triton_kernel``), fake quantization and the decode loop's slots all read masks this way,
and the torch path calls the kernel: the kernel cannot take it from there without an import cycle.
"""

from __future__ import annotations

import torch

__all__ = ["keep_mask"]


def keep_mask(mask: torch.Tensor | None, batch: int, q_len: int, kv_len: int, device) -> torch.Tensor:
    """Boolean ``[B, 1|H, L, kv_len]`` (True = attend) from a bool/additive mask or None (causal)."""
    if mask is None:
        # Bottom-right causal: query i sits at absolute position kv_len - q_len + i.
        rows = torch.arange(q_len, device=device).unsqueeze(1) + (kv_len - q_len)
        cols = torch.arange(kv_len, device=device).unsqueeze(0)
        return (cols <= rows).view(1, 1, q_len, kv_len).expand(batch, 1, q_len, kv_len)
    if mask.dtype != torch.bool:
        mask = mask > torch.finfo(mask.dtype).min / 2
    return mask[..., -q_len:, -kv_len:]
