"""Quantized Mixture-of-Experts weights: one compressed matrix per expert, stacked along a leading dim.

transformers 5 keeps a layer's experts as fused 3-D parameters (``gate_up_proj[E, 2I, H]``,
``down_proj[E, H, I]``) and every family's experts forward reads them one expert at a time
(``self.gate_up_proj[expert_idx]``). ``ExpertWeights`` takes that parameter's place: indexing it
dequantizes that one expert into the compute dtype, so transformers' own expert code (activation,
gating, biases, routing weights) runs unchanged for every family and only routed experts are decoded.

Stored tensors are the per-expert outputs of ``quantize_linear`` stacked on dim 0
(``<param>.<suffix>`` of shape ``[E, ...]``), so each expert's bytes are one contiguous slice.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
from torch import nn

from airquant.quant import make_linear, quantize_linear
from airquant.quant.spec import QuantSpec


def quantize_experts(spec: QuantSpec, weight: torch.Tensor, *, transposed: bool,
                     act_scales: torch.Tensor | None = None) -> tuple[dict[str, torch.Tensor], dict]:
    """Quantize a fused [E, a, b] expert parameter one expert at a time.

    ``transposed`` (transformers' ``is_transposed``, gpt-oss) means each expert is stored [in, out]; it is
    quantized as [out, in] so int2's groups and outlier channels run along the input dimension.
    ``act_scales`` [E, in] (calibration, mean |x| of the tokens routed to each expert) rank each expert's
    int2 outlier channels; a row of NaN (no calibration token reached that expert) falls back to the
    column norm.
    """
    rows = [None if act_scales is None or not torch.isfinite(act_scales[e]).all() else act_scales[e]
            for e in range(weight.shape[0])]
    per = [quantize_linear(spec, w.t() if transposed else w, act_scale=a) for w, a in zip(weight, rows)]
    metas = {repr(sorted(m.items())) for _, m in per}
    if len(metas) != 1:
        raise ValueError(f"experts of one tensor quantized with different settings: {metas}")
    out_f, in_f = (weight.shape[2], weight.shape[1]) if transposed else (weight.shape[1], weight.shape[2])
    tensors = {s: torch.stack([t[s] for t, _ in per]).contiguous() for s in per[0][0]}
    meta = {**per[0][1], "experts": int(weight.shape[0]), "shape": [int(out_f), int(in_f)],
            "transposed": transposed}
    return tensors, meta


class ExpertWeights(nn.Module):
    """Stands in for a fused expert parameter; ``self[e]`` is expert e's dense matrix in the compute dtype."""

    def __init__(self, meta: dict, *, compute_dtype: torch.dtype):
        super().__init__()
        self.num_experts, (self.out_features, self.in_features) = meta["experts"], meta["shape"]
        self.transposed, self.compute_dtype = meta["transposed"], compute_dtype
        one = make_linear(meta, self.in_features, self.out_features, False, compute_dtype=compute_dtype)
        # A plain attribute, not a submodule: the stacked buffers below are the state, the template has none.
        self.one, self.suffixes = [one], [name for name, _ in one.named_buffers()]
        for name, buf in one.named_buffers():
            self.register_buffer(name, torch.empty((self.num_experts, *buf.shape), dtype=buf.dtype,
                                                   device=buf.device))
        for name in self.suffixes:  # the template's own (one expert's) buffers: never read, not kept
            one._buffers[name] = None

    @contextmanager
    def _expert(self, e: int):
        """The one-expert template with expert e's slices as its buffers, for the time of the block. Plain
        assignment, not functional_call: this runs once per routed expert and tensor in every step, and the
        reparametrization machinery cost ~0.1 ms of CPU each (Qwen3-30B: 16 calls per layer at batch 1).
        The slices are dropped after the block: a template left pointing at them kept alive the tensors they
        view (in a routed run, each layer's packed gather of the call: 32 x 198 MB on a Mixtral-8x7B NF4)."""
        linear = self.one[0]
        for name in self.suffixes:
            linear._buffers[name] = getattr(self, name)[e]
        try:
            yield linear
        finally:
            for name in self.suffixes:
                linear._buffers[name] = None

    def __getitem__(self, index) -> torch.Tensor:
        with self._expert(int(index)) as linear:
            w = linear.dequantize().to(self.compute_dtype)  # [out, in]
        return w.t() if self.transposed else w

    def matmul(self, e: int, x: torch.Tensor) -> torch.Tensor:
        """``x`` [n, in] times expert e's matrix: [n, out], by the scheme's own ``forward`` on expert e's slices
        (NF4: bitsandbytes' ``matmul_4bit``, whose CUDA kernel reads the 4-bit bytes and writes no dense weight
        for a few rows). A transposed expert is stored [in, out] but quantized as [out, in]: same product."""
        with self._expert(e) as linear:
            return linear(x)

    def multiplies_packed(self) -> bool:
        """Whether ``matmul`` multiplies from the packed bytes without decoding first (``multiplies_packed`` of
        the scheme's linear; schemes without one: no)."""
        check = getattr(self.one[0], "multiplies_packed", None)
        return bool(check is not None and check())

    def stacked(self, start: int = 0, stop: int | None = None) -> torch.Tensor:
        """Every expert's dense matrix at once, ``[E, *inner]`` in the compute dtype: one decode of the stacked
        buffers where the scheme has one (``dequantize_stacked``: NF4), else expert by expert. Grouped expert
        matmuls run on it (engine/moe/pool.py) instead of decoding and multiplying one expert at a time."""
        stop = self.num_experts if stop is None else stop
        decode = getattr(self.one[0], "dequantize_stacked", None)
        if decode is None:
            return torch.stack([self[e] for e in range(start, stop)])
        w = decode({name: getattr(self, name)[start:stop] for name in self.suffixes}, self.compute_dtype)
        return w.transpose(1, 2) if self.transposed else w

    def __len__(self) -> int:
        return self.num_experts

    @property
    def shape(self) -> torch.Size:
        inner = (self.in_features, self.out_features) if self.transposed else (self.out_features, self.in_features)
        return torch.Size((self.num_experts, *inner))

    @property
    def dtype(self) -> torch.dtype:
        return self.compute_dtype

    def extra_repr(self) -> str:
        return f"experts={self.num_experts}, shape={tuple(self.shape)}, scheme={type(self.one[0]).__name__}"
