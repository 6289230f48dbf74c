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
    handles += [model.get_submodule(n).register_forward_pre_hook(lambda m, a, n=n: _expert_hook(stats, n, m, a))
                for n in _fused_experts(model)]
    try:
        ids = _token_ids(tokenizer, text, n_tokens).to(next(model.parameters()).device)
        for start in range(0, ids.numel(), _CHUNK):
            model(ids[None, start : start + _CHUNK], use_cache=False)
    finally:
        for h in handles:
            h.remove()
    log.info("calibrated %d linears on %d tokens", len(stats), ids.numel())
    return stats


def _fused_experts(model: nn.Module) -> list[str]:
    """transformers' fused experts modules (``use_experts_implementation``: gate_up/up and down 3-D weights)."""
    return [n for n, m in model.named_modules() if n.rpartition(".")[2] == "experts" and hasattr(m, "is_transposed")
            and isinstance(getattr(m, "down_proj", None), torch.Tensor)
            and isinstance(getattr(m, "gate_up_proj" if getattr(m, "has_gate", True) else "up_proj", None), torch.Tensor)]


def _expert_hook(stats: dict, name: str, module: nn.Module, args: tuple) -> None:
    """Per expert, mean |x| of the tokens routed to it: for its gate/up weight (the layer input) and its
    down weight (the gated intermediate, recomputed here with the module's own gate). Statistics are
    ``[E, in]`` sums with a count per expert; an expert no token reached has count 0."""
    up_name = "gate_up_proj" if getattr(module, "has_gate", True) else "up_proj"
    w_up = getattr(module, up_name)
    x = args[0].detach().reshape(-1, args[0].shape[-1]).float()  # [tokens, H]
    routed = args[1].reshape(x.shape[0], -1)  # [tokens, k]
    n_experts = w_up.shape[0]
    for e in routed.unique().tolist():
        if not 0 <= e < n_experts:
            continue
        xe = x[(routed == e).any(-1)]
        up = xe @ w_up[e].float() if module.is_transposed else nn.functional.linear(xe, w_up[e].float())
        if getattr(module, "has_bias", False):
            up = up + getattr(module, f"{up_name}_bias")[e].float()
        mid = module._apply_gate(up) if getattr(module, "has_gate", True) else module.act_fn(up)
        for param, inputs in ((up_name, xe), ("down_proj", mid)):
            s = stats.setdefault(f"{name}.{param}", {"n": torch.zeros(n_experts, device=x.device),
                                                     "abs": torch.zeros(n_experts, inputs.shape[-1], device=x.device)})
            s["n"][e] += inputs.shape[0]
            s["abs"][e] += inputs.abs().sum(0)


def _mean_abs(s: dict) -> torch.Tensor:
    """mean |x| per input channel; for experts [E, in], NaN rows where no token was routed."""
    n = s["n"]
    return (s["abs"] / (n[:, None] if isinstance(n, torch.Tensor) else n)).cpu()


def calibrate_act_scales(model: nn.Module, tokenizer, text: str, n_tokens: int = 2048) -> dict[str, torch.Tensor]:
    """{decoder linear name: mean |x| per input channel} over the first ``n_tokens`` of ``text``; fused
    expert weights (``...experts.gate_up_proj``) get one row per expert."""
    stats = _collect(model, tokenizer, text, n_tokens, hessian=False)
    return {n: _mean_abs(s) for n, s in stats.items()}


def calibrate_hessians(
    model: nn.Module, tokenizer, text: str, n_tokens: int = 2048
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """(act_scales, hessians): also X^T X / n per linear, for int2 error feedback."""
    stats = _collect(model, tokenizer, text, n_tokens, hessian=True)
    scales = {n: _mean_abs(s) for n, s in stats.items()}
    return scales, {n: (s["xtx"] / s["n"]).cpu() for n, s in stats.items() if "xtx" in s}
