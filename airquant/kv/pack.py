"""Bit packing of b-bit codes along the last dimension into uint8.

Layouts (little-endian inside each byte, element ``i`` of a group in the lowest bits first):
  1-bit: 8 codes per byte; 2-bit: 4 per byte; 4-bit: 2 per byte;
  3-bit: 8 codes in 3 bytes (one 24-bit word, code ``i`` at bits ``3i..3i+2``).
The Triton kernel unpacks the same layouts, so they are part of the storage format.
"""

from __future__ import annotations

import torch

# Codes per packing group and bytes per group: every layout packs a group of 8 codes or fewer.
_GROUP = {1: (8, 1), 2: (4, 1), 3: (8, 3), 4: (2, 1)}


def packed_width(dim: int, bits: int) -> int:
    """Bytes holding ``dim`` codes of ``bits`` bits (dim must be a multiple of the group size)."""
    codes, nbytes = _GROUP[bits]
    if dim % codes:
        raise ValueError(f"dim={dim} is not a multiple of {codes}, the {bits}-bit packing group")
    return dim // codes * nbytes


def pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack integer codes in ``[0, 2**bits)`` (any int dtype) along the last dim into uint8."""
    group, nbytes = _GROUP[bits]
    lead, dim = codes.shape[:-1], codes.shape[-1]
    packed_width(dim, bits)
    c = codes.to(torch.int32).reshape(*lead, dim // group, group)
    shifts = torch.arange(group, device=codes.device, dtype=torch.int32) * bits
    word = (c << shifts).sum(dim=-1, dtype=torch.int32)  # [..., dim/group], < 2**24
    if nbytes == 1:
        return word.to(torch.uint8).reshape(*lead, -1)
    byte_shifts = torch.arange(nbytes, device=codes.device, dtype=torch.int32) * 8
    out = (word.unsqueeze(-1) >> byte_shifts) & 0xFF
    return out.to(torch.uint8).reshape(*lead, dim // group * nbytes)


def unpack(packed: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """Inverse of :func:`pack`: uint8 ``[..., packed_width]`` to int64 codes ``[..., dim]``."""
    group, nbytes = _GROUP[bits]
    lead = packed.shape[:-1]
    p = packed.to(torch.int32).reshape(*lead, dim // group, nbytes)
    if nbytes == 1:
        word = p[..., 0]
    else:
        byte_shifts = torch.arange(nbytes, device=packed.device, dtype=torch.int32) * 8
        word = (p << byte_shifts).sum(dim=-1, dtype=torch.int32)
    shifts = torch.arange(group, device=packed.device, dtype=torch.int32) * bits
    codes = (word.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)
    return codes.reshape(*lead, dim).long()
