"""Where every expert's copy of one quantized matrix sits, as the fused expert kernels take it (``nf4_moe``,
``int2_moe``): per buffer a base tensor and the elements from one expert's copy to the next, and the experts'
dense bias rows. A buffer the matrix does not use stands in as another of its buffers with stride 0 (the kernel
never reads it). The formats' ``Operand`` dataclasses add their own parameters (blocksize, group, outliers)."""

from __future__ import annotations

import torch


class Buffers:
    """What a format's ``Operand`` shares: ``bases``, ``strides`` and ``bias`` ([experts, n] or None)."""

    bases: tuple[torch.Tensor, ...]
    strides: tuple[int, ...]
    bias: torch.Tensor | None

    def args(self) -> list:
        """The kernel's (base, stride) arguments, buffer by buffer."""
        out = []
        for base, stride in zip(self.bases, self.strides):
            out += [base, stride]
        return out

    def bias_rows(self, ids: torch.Tensor) -> torch.Tensor | None:
        return None if self.bias is None else self.bias.index_select(0, ids.reshape(-1).long())


def in_slots(pool: torch.Tensor, offsets: dict[str, int], dtypes: dict[str, torch.dtype], names: tuple[str, ...],
             used, fallback: str) -> tuple[tuple[torch.Tensor, ...], tuple[int, ...]]:
    """(bases, strides) of buffers ``names`` sitting at ``offsets`` (bytes) inside every slot of ``pool``
    ``[slots, slot_bytes]`` (slot bytes and offsets multiples of 64, so every view is aligned); a name not in
    ``used`` stands in as ``fallback``, stride 0."""
    flat, slot_bytes = pool.reshape(-1), pool.shape[1]
    bases, strides = [], []
    for name in names:
        key = name if name in used else fallback
        dtype = dtypes[key]
        bases.append(flat[offsets[key]:].view(dtype))
        strides.append(slot_bytes // dtype.itemsize if name in used else 0)
    return tuple(bases), tuple(strides)


def slot_bias(pool: torch.Tensor, bias: tuple[int, torch.dtype] | None, n: int) -> torch.Tensor | None:
    """The experts' dense bias rows ``[slots, n]`` at (byte offset, dtype) ``bias`` of every slot, if any."""
    if bias is None:
        return None
    off, dtype = bias
    return pool[:, off:off + n * dtype.itemsize].view(dtype)


def stacked(buffers: dict[str, torch.Tensor], names: tuple[str, ...], used,
            fallback: str) -> tuple[tuple[torch.Tensor, ...], tuple[int, ...]]:
    """(bases, strides) of stacked ``[E, ...]`` tensors ``buffers`` (a quantized experts module's); a name not
    in ``used`` stands in as ``fallback``, stride 0."""
    bases, strides = [], []
    for name in names:
        t = buffers[name] if name in used else None
        bases.append(buffers[fallback] if t is None else t)
        strides.append(0 if t is None or not t.dim() else t.stride(0))
    return tuple(bases), tuple(strides)


def pairs_up(launch, x: torch.Tensor, ids: torch.Tensor, operand, n: int) -> torch.Tensor:
    """``[P, n]``: pair p (``ids`` ``[T, k]``, flat) is ``x[p // k]`` times its expert's matrix, by a format's
    ``launch(x, out, ids, weights, operand, top_k, down)`` (its GEMV or tiered kernel)."""
    out = torch.empty((ids.numel(), n), dtype=x.dtype, device=x.device)
    return launch(x.contiguous(), out, ids, None, operand, ids.shape[-1], down=False)


def tokens_down(launch, h: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, operand, n: int,
                out_dtype: torch.dtype) -> torch.Tensor:
    """``[T, n]``: each token's ``k`` rows of ``h`` ``[T * k, K]`` through their experts' matrices, weighted by
    ``weights`` ``[T, k]`` and summed in fp32 (``launch`` as for ``pairs_up``)."""
    tokens, top_k = weights.shape
    out = torch.empty((tokens, n), dtype=out_dtype, device=h.device)
    return launch(h.contiguous(), out, ids, weights.contiguous(), operand, top_k, down=True)
