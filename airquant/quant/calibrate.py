"""Activation statistics of a resident HF model for int2: mean |x| per input channel, and X^T X.

One forward pass over the first ``n_tokens`` tokens of a calibration text, with forward pre-hooks on
every decoder-layer linear. The store computes these once per model before quantizing.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from airquant.quant.swap import decoder_linears

log = logging.getLogger(__name__)

# Longest window fed at once; long enough for the default 2048 calibration tokens in one pass.
_CHUNK = 2048


def _token_ids(tokenizer, text: str, n_tokens: int) -> torch.Tensor:
    # Tokenizing a generous prefix is enough for the first n_tokens and avoids tokenizing a whole corpus.
    for chars in (n_tokens * 16, len(text)):
        ids = tokenizer(text[:chars], return_tensors="pt").input_ids[0]
        if ids.numel() >= n_tokens or chars >= len(text):
            break
    if ids.numel() < n_tokens:
        log.warning("calibration text has %d tokens, fewer than the %d asked for", ids.numel(), n_tokens)
    return ids[:n_tokens]


@torch.no_grad()
def _collect(model: nn.Module, tokenizer, text: str, n_tokens: int, hessian: bool) -> dict[str, dict]:
    stats: dict[str, dict] = {}

    def hook(name: str, module: nn.Linear, args: tuple) -> None:
        x = args[0].detach().reshape(-1, module.in_features).float()  # [tokens, in]
        s = stats.setdefault(name, {"n": 0, "abs": torch.zeros(module.in_features, device=x.device)})
        s["n"] += x.shape[0]
        s["abs"] += x.abs().sum(0)
        if hessian:
            s["xtx"] = s.get("xtx", 0) + x.t() @ x

    handles = [model.get_submodule(n).register_forward_pre_hook(lambda m, a, n=n: hook(n, m, a))
               for n in decoder_linears(model)]
    try:
        ids = _token_ids(tokenizer, text, n_tokens).to(next(model.parameters()).device)
        for start in range(0, ids.numel(), _CHUNK):
            model(ids[None, start : start + _CHUNK], use_cache=False)
    finally:
        for h in handles:
            h.remove()
    log.info("calibrated %d linears on %d tokens", len(stats), ids.numel())
    return stats


def calibrate_act_scales(model: nn.Module, tokenizer, text: str, n_tokens: int = 2048) -> dict[str, torch.Tensor]:
    """{decoder linear name: mean |x| per input channel} over the first ``n_tokens`` of ``text``."""
    stats = _collect(model, tokenizer, text, n_tokens, hessian=False)
    return {n: (s["abs"] / s["n"]).cpu() for n, s in stats.items()}


def calibrate_hessians(
    model: nn.Module, tokenizer, text: str, n_tokens: int = 2048
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """(act_scales, hessians): also X^T X / n per linear, for int2 error feedback."""
    stats = _collect(model, tokenizer, text, n_tokens, hessian=True)
    scales = {n: (s["abs"] / s["n"]).cpu() for n, s in stats.items()}
    return scales, {n: (s["xtx"] / s["n"]).cpu() for n, s in stats.items()}
