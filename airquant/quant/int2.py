"""2-bit Lloyd-Max weights with profile-guided FP16 outlier channels ("int2").

Format of one [out, in] linear (all on-disk tensors, 2-bit codes packed 4 per byte):

* ``codes``   uint8 [out, in/4]: input channel k of row n sits in byte k//4 at bits 2*(k%4); code i
  means centroid ``LLOYD_MAX_4[i]`` (ascending, so a code is also the rank of its centroid).
* ``scales``, ``zeros`` fp16 [out, in/group]: w ~= scale * centroid + zero per group of ``group``
  consecutive input weights.
* ``outlier_weight`` fp16 [out, outlier_cols(n_out)] and ``outlier_idx`` int32 [n_out] (absent when
  n_out == 0): the input channels with the largest ||W[:, c]|| * mean|X_c|. From 128 outliers up, rows
  are zero-padded to a multiple of 16 columns (``module_meta["outlier_cols"]``; stores written before the
  padding have no such key and unpadded rows) so the GPU kernels read them with aligned vector loads;
  column j < n_out belongs to channel outlier_idx[j]. We store the *residual*
  ``W[:, c] - dequant(codes)[:, c]`` rather than W[:, c] so the 2-bit part needs no mask at run time:
  y = dequant(codes) @ x + outlier_weight @ x[outlier_idx] reproduces W[:, c] to fp16 precision.

Group fit: normalise the group by its mean and std, assign each weight to the nearest centroid of the
4-level Lloyd-Max quantizer for a unit Gaussian, then fit (scale, zero) by ordinary least squares of
the weights on their assigned centroids. Outlier channels are left out of the statistics and the fit,
because the fp16 residual covers them exactly and they would otherwise stretch the group's scale.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from airquant.errors import UnsupportedModelError
from airquant.quant.base import QuantLinear
from airquant.quant.int2_levels import LLOYD_MAX_4, THRESHOLDS
from airquant.quant.kernels import int2_matmul, use_triton


def n_outlier_channels(in_features: int, fraction: float) -> int:
    """Number of fp16 input channels kept for ``fraction`` of ``in_features``."""
    return int(round(fraction * in_features))


def outlier_cols(n_out: int) -> int:
    """Stored width of the outlier rows: n_out rounded up to a multiple of 16 (32-byte fp16 rows) from 128
    outlier channels up. The kernels' outlier loads vectorize only when every row starts 16-byte aligned
    and the column bound is a multiple of 16; with an odd n_out (1003 for 3.5 % of 28672) they were 2-byte
    loads (H200, TMA GEMV kernel alone: 28672x8192 53.4 -> 48.7 us, 8192x28672 52.0 -> 51.1 us; without
    outliers 43.7 / 44.6). Below 128 the padding would be a large share of the outlier bytes (20 -> 32
    columns for the default model's 576-input layers, +0.33 bits per weight), so those rows stay as they
    are."""
    return -(-n_out // 16) * 16 if n_out >= 128 else n_out


def select_outliers(weight: torch.Tensor, act_scale: torch.Tensor | None, fraction: float) -> torch.Tensor:
    """Sorted int64 indices of the top ``fraction`` input channels by ||W[:, c]|| * mean|X_c|.

    Without calibration (``act_scale`` None) the ranking falls back to the column norm alone.
    """
    n = n_outlier_channels(weight.shape[1], fraction)
    score = weight.float().norm(dim=0)  # [in]
    if act_scale is not None:
        if act_scale.shape != score.shape:
            raise ValueError(f"act_scale has shape {tuple(act_scale.shape)}, expected ({weight.shape[1]},)")
        score = score * act_scale.float().to(score.device)
    return torch.topk(score, n).indices.sort().values


def centroids(codes: torch.Tensor) -> torch.Tensor:
    """fp32 centroid value of each 2-bit code."""
    table = torch.tensor(LLOYD_MAX_4, dtype=torch.float32, device=codes.device)
    return table[codes.long()]


def assign_codes(w: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Nearest Lloyd-Max code per weight after normalising each group (last dim) by its masked mean/std."""
    n = mask.sum(-1, keepdim=True).clamp_min(1)
    mean = (w * mask).sum(-1, keepdim=True) / n
    var = ((w * w) * mask).sum(-1, keepdim=True) / n - mean * mean
    std = var.clamp_min(0).sqrt().clamp_min(1e-12)
    # Compare against de-normalised thresholds instead of normalising every weight.
    thresholds = torch.tensor(THRESHOLDS, dtype=w.dtype, device=w.device)
    codes = torch.zeros(w.shape, dtype=torch.uint8, device=w.device)
    for t in thresholds:
        codes += w > mean + t * std
    return codes


def fit_scale_zero(w: torch.Tensor, codes: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Closed-form least squares w ~= scale * c + zero over each group's (masked) entries, in fp32."""
    c = centroids(codes)
    n = mask.sum(-1).clamp_min(1)
    mc = (c * mask).sum(-1) / n
    mw = (w * mask).sum(-1) / n
    dc = (c - mc[..., None]) * mask
    var = (dc * dc).sum(-1)
    cov = (dc * (w - mw[..., None])).sum(-1)
    # A group whose entries all drew one code has no slope to fit: it is represented by its mean.
    scale = torch.where(var > 0, cov / var.clamp_min(1e-30), torch.zeros_like(var))
    return scale, mw - scale * mc


def pack_codes(codes: torch.Tensor) -> torch.Tensor:
    """[out, in] codes 0..3 -> [out, in/4] uint8, channel k at bits 2*(k%4) of byte k//4."""
    c = codes.to(torch.int32).reshape(codes.shape[0], -1, 4)
    weights = torch.tensor([1, 4, 16, 64], dtype=torch.int32, device=codes.device)
    return (c * weights).sum(-1).to(torch.uint8)


def unpack_codes(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of ``pack_codes``: [out, in/4] uint8 -> [out, in] uint8."""
    shifts = torch.tensor([0, 2, 4, 6], dtype=torch.uint8, device=packed.device)
    return ((packed[..., None] >> shifts) & 3).reshape(packed.shape[0], -1)


def check_shape(in_features: int, group: int) -> None:
    if in_features % group:
        raise UnsupportedModelError(
            f"int2 needs in_features divisible by group: {in_features} % {group} != 0; "
            "pick a group that divides it or quantize this model with --quant nf4"
        )


def finish_tensors(
    weight: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, idx: torch.Tensor, group: int
) -> tuple[dict[str, torch.Tensor], dict]:
    """Round (scale, zero) to fp16, store fp16 residuals for the outlier channels, build module_meta."""
    scales, zeros = scale.to(torch.float16), zero.to(torch.float16)
    tensors = {"codes": pack_codes(codes), "scales": scales.contiguous(), "zeros": zeros.contiguous()}
    if idx.numel():
        grid = dequantize_int2(tensors["codes"], scales, zeros, group)  # [out, in] fp32
        residual = weight.float()[:, idx] - grid[:, idx]
        padded = torch.zeros(residual.shape[0], outlier_cols(idx.numel()), dtype=torch.float16, device=residual.device)
        padded[:, : idx.numel()] = residual
        tensors["outlier_weight"] = padded
        tensors["outlier_idx"] = idx.to(torch.int32).contiguous()
    meta = {"scheme": "int2", "group": group, "n_outliers": int(idx.numel()), "codebook": "lloyd_max_gauss4",
            "outlier_cols": outlier_cols(idx.numel())}
    return tensors, meta


def quantize_int2(
    weight: torch.Tensor, group: int, outliers: float, act_scale: torch.Tensor | None = None
) -> tuple[dict[str, torch.Tensor], dict]:
    """Round-to-nearest Lloyd-Max 2-bit quantization of an [out, in] weight (see module docstring)."""
    out_f, in_f = weight.shape
    check_shape(in_f, group)
    w = weight.float()
    idx = select_outliers(w, act_scale, outliers)
    keep = torch.ones(in_f, dtype=torch.float32, device=w.device)
    keep[idx] = 0.0
    wg = w.reshape(out_f, in_f // group, group)  # [out, G, group]
    mask = keep.reshape(1, in_f // group, group).expand_as(wg)
    codes = assign_codes(wg, mask)
    scale, zero = fit_scale_zero(wg, codes, mask)  # [out, G]
    return finish_tensors(weight, codes.reshape(out_f, in_f), scale, zero, idx, group)


def dequantize_int2(codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group: int) -> torch.Tensor:
    """fp32 [out, in] grid values scale * centroid + zero (outlier residuals not added)."""
    c = centroids(unpack_codes(codes))  # [out, in]
    out_f, in_f = c.shape
    c = c.reshape(out_f, in_f // group, group)
    return (c * scales.float()[..., None] + zeros.float()[..., None]).reshape(out_f, in_f)


class Int2Linear(QuantLinear):
    """y = x @ W.T + b with W as 2-bit Lloyd-Max codes plus fp16 outlier-channel residuals."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool,
        *,
        group: int,
        n_outliers: int,
        compute_dtype: torch.dtype,
        outlier_cols: int | None = None,
    ) -> None:
        super().__init__()
        check_shape(in_features, group)
        self.in_features, self.out_features = in_features, out_features
        self.group, self.n_outliers, self.compute_dtype = group, n_outliers, compute_dtype
        self.register_buffer("codes", torch.empty((out_features, in_features // 4), dtype=torch.uint8))
        self.register_buffer("scales", torch.empty((out_features, in_features // group), dtype=torch.float16))
        self.register_buffer("zeros", torch.empty((out_features, in_features // group), dtype=torch.float16))
        if n_outliers:
            cols = n_outliers if outlier_cols is None else outlier_cols  # None: a store from before the padding
            if cols < n_outliers:
                raise ValueError(f"outlier_cols={cols} is less than n_outliers={n_outliers}")
            self.register_buffer("outlier_weight", torch.empty((out_features, cols), dtype=torch.float16))
            self.register_buffer("outlier_idx", torch.empty(n_outliers, dtype=torch.int32))
        self.bias = nn.Parameter(torch.empty(out_features, dtype=compute_dtype), requires_grad=False) if bias else None

    def dequantize(self) -> torch.Tensor:
        """fp32 [out, in] weight the module multiplies by (torch reference path)."""
        w = dequantize_int2(self.codes, self.scales, self.zeros, self.group)
        if self.n_outliers:
            w[:, self.outlier_idx.long()] += self.outlier_weight[:, : self.n_outliers].float()
        return w

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = None if self.bias is None else self.bias.to(self.compute_dtype)
        xc = x.to(self.compute_dtype)
        if use_triton(x):
            outlier_w = self.outlier_weight if self.n_outliers else None  # int2_matmul reads len(idx) columns
            outlier_i = self.outlier_idx if self.n_outliers else None
            y = int2_matmul(xc, self.codes, self.scales, self.zeros, outlier_w, outlier_i, self.group)
            y = y if bias is None else y + bias
        else:
            y = F.linear(xc, self.dequantize().to(self.compute_dtype), bias)
        return y.to(x.dtype)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, int2 group={self.group}, "
            f"n_outliers={self.n_outliers}, bias={self.bias is not None}"
        )
