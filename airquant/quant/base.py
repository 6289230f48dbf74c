"""What every compressed linear module shares."""

from __future__ import annotations

import torch
from torch import nn


class QuantLinear(nn.Module):
    """A linear computed from packed tensors. ``weight`` is the dense [out, in] matrix, decoded on read:
    some blocks use a linear's weight directly rather than calling it (Jamba's Mamba mixer reads
    ``dt_proj.weight``), and they keep working, at the cost of a decode."""

    compute_dtype: torch.dtype

    def dequantize(self) -> torch.Tensor:
        raise NotImplementedError

    @property
    def weight(self) -> torch.Tensor:
        return self.dequantize().to(self.compute_dtype)
