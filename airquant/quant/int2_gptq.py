"""Optional int2 quantizer with GPTQ-style error feedback onto the Lloyd-Max grid.

Same on-disk format and module as plain int2 (``airquant.quant.int2``); only the choice of codes
changes. Columns are visited in order; at the first column of each group the group's (scale, zero)
is fitted exactly as in plain int2 (Lloyd-Max assignment + OLS) on the *current*, error-updated
weights; each column is then rounded to its row's nearest grid value, and the rounding error is
spread onto the not-yet-quantized columns through the Cholesky factor of the inverse Hessian
(Frantar et al., GPTQ, 2022). Outlier channels are stored exactly as fp16 residuals, so they absorb
the error sent to them and pass none on.
"""

from __future__ import annotations

import torch

from airquant.quant.int2 import LLOYD_MAX_4, assign_codes, check_shape, finish_tensors, fit_scale_zero, select_outliers

# GPTQ's defaults: 1 % of the mean diagonal as damping, lazy batch updates every 128 columns.
DAMP = 0.01
BLOCK = 128


def _inverse_hessian_factor(hessian: torch.Tensor, damp: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Upper Cholesky factor of the damped inverse Hessian, and the mask of dead (never active) inputs."""
    h = hessian.double().clone()
    dead = torch.diag(h) == 0
    h[dead, dead] = 1.0
    h += damp * torch.diag(h).mean() * torch.eye(h.shape[0], dtype=h.dtype)
    hinv = torch.cholesky_inverse(torch.linalg.cholesky(h))
    return torch.linalg.cholesky(hinv, upper=True).float(), dead


def _fit_group(w: torch.Tensor, keep: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """fp16-rounded (scale, zero) of one [out, group] slice, as stored."""
    mask = keep[None, :].expand_as(w)
    codes = assign_codes(w, mask)
    scale, zero = fit_scale_zero(w, codes, mask)
    return scale.half().float(), zero.half().float()


def quantize_int2_gptq(
    weight: torch.Tensor,
    hessian: torch.Tensor,
    group: int,
    outliers: float,
    act_scale: torch.Tensor | None = None,
    *,
    damp: float = DAMP,
) -> tuple[dict[str, torch.Tensor], dict]:
    """Error-feedback int2 of an [out, in] weight given H = X^T X / n of its inputs ([in, in])."""
    out_f, in_f = weight.shape
    check_shape(in_f, group)
    if hessian.shape != (in_f, in_f):
        raise ValueError(f"hessian has shape {tuple(hessian.shape)}, expected ({in_f}, {in_f})")
    w = weight.float().clone()
    idx = select_outliers(w, act_scale, outliers)
    keep = torch.ones(in_f)
    keep[idx] = 0.0
    hinv, dead = _inverse_hessian_factor(hessian, damp)
    w[:, dead] = 0.0
    table = torch.tensor(LLOYD_MAX_4)
    codes = torch.zeros(out_f, in_f, dtype=torch.uint8)
    scales, zeros = torch.zeros(out_f, in_f // group), torch.zeros(out_f, in_f // group)
    final = w.clone()  # outlier columns end up holding their error-updated values
    block = max(group, BLOCK // group * group)
    for b0 in range(0, in_f, block):
        b1 = min(b0 + block, in_f)
        w1, err1, hi = w[:, b0:b1].clone(), torch.zeros(out_f, b1 - b0), hinv[b0:b1, b0:b1]
        for j in range(b1 - b0):
            col = b0 + j
            if col % group == 0:
                g = col // group
                scales[:, g], zeros[:, g] = _fit_group(w1[:, j : j + group], keep[col : col + group])
                grid = scales[:, g, None] * table[None, :] + zeros[:, g, None]  # [out, 4]
            col_w = w1[:, j]
            code = (col_w[:, None] - grid).abs().argmin(dim=1)
            codes[:, col] = code.to(torch.uint8)
            final[:, col] = col_w
            if keep[col]:
                err = (col_w - grid.gather(1, code[:, None])[:, 0]) / hi[j, j]
                w1[:, j + 1 :] -= err[:, None] * hi[j, j + 1 :][None, :]
                err1[:, j] = err
        w[:, b1:] -= err1 @ hinv[b0:b1, b1:]
    tensors, meta = finish_tensors(final, codes, scales, zeros, idx, group)
    meta["error_feedback"] = True
    return tensors, meta
