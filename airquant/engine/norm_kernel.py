"""The one-kernel RMSNorm of ``engine/norms.py`` (``ONE_KERNEL``; imported only where it runs: Triton on CUDA, or
its interpreter).

transformers' standard forward rounds twice: the scaled row to the input's dtype, then the weight's product to
the promoted dtype. ``rms_norm`` plus the weight multiply is two kernels a call; this kernel does both roundings
in one pass over the row: the statistic in fp32, the scaled row rounded to the input's dtype, the product of the
weight and that row in fp32, rounded to the output's. Triton's interpreter casts fp32 to bfloat16 by truncation
where the GPU rounds to nearest even: bfloat16 is checked on the GPU only.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

MAX_WIDTH = 1 << 16  # a row in one program's registers


@triton.jit
def rms_norm_kernel(x_ptr, w_ptr, out_ptr, n, stride_x, stride_o, eps, BLOCK: tl.constexpr):
    """Program r: row r of ``x`` [R, n] normalized by its root mean square, times the weight [n]."""
    row = tl.program_id(0).to(tl.int64)
    i = tl.arange(0, BLOCK)
    mask = i < n
    x = tl.load(x_ptr + row * stride_x + i, mask=mask, other=0.0)
    xf = x.to(tl.float32)
    variance = tl.sum(xf * xf, axis=0) / n
    normed = (xf * tl.math.rsqrt(variance + eps)).to(x.dtype)  # the forward's cast back to the input's dtype
    w = tl.load(w_ptr + i, mask=mask, other=0.0)
    out = w.to(tl.float32) * normed.to(tl.float32)
    tl.store(out_ptr + row * stride_o + i, out.to(out_ptr.dtype.element_ty), mask=mask)


def rms_norm_applies(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether ``rms_norm`` takes the call: a contiguous last dimension of at most ``MAX_WIDTH`` that the weight
    matches, float dtypes, one device."""
    return x.dim() >= 1 and weight.dim() == 1 and weight.shape[0] == x.shape[-1] <= MAX_WIDTH and \
        x.dtype in (torch.float16, torch.bfloat16, torch.float32) and \
        weight.dtype in (torch.float16, torch.bfloat16, torch.float32) and x.device == weight.device and \
        weight.stride(0) == 1 and x.numel() > 0


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``weight * (x / rms(x)).to(x.dtype)`` in ``torch.promote_types(weight.dtype, x.dtype)``, by one launch
    (``rms_norm_applies`` must hold)."""
    n = x.shape[-1]
    rows = x.reshape(-1, n)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    out = torch.empty(rows.shape, dtype=torch.promote_types(weight.dtype, x.dtype), device=x.device)
    block = triton.next_power_of_2(n)
    rms_norm_kernel[(rows.shape[0],)](rows, weight, out, n, rows.stride(0), out.stride(0), eps, BLOCK=block,
                                      num_warps=min(16, max(1, block // 256)))
    return out.view(*x.shape[:-1], n)
