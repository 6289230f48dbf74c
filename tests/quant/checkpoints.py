"""Tiny pre-quantized Llama checkpoints for tests: a folder that looks like a hub GPTQ/AWQ model
(``config.json`` with ``quantization_config`` and one ``model.safetensors``)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch

from airquant.quant.rtn import awq_tensors, gptq_tensors, quantization_config, rtn_quantize

_LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class SyntheticCheckpoint:
    path: Path
    config: dict  # the config.json written
    reference_state_dict: dict[str, torch.Tensor]  # plain-Llama fp32 weights equal to the dequantized checkpoint


def tiny_llama_config(**overrides) -> dict:
    """Config of a random 2-layer Llama whose shapes exercise partial groups (in=160 with group 64)."""
    cfg = {"hidden_size": 160, "intermediate_size": 256, "num_hidden_layers": 2, "num_attention_heads": 5,
           "num_key_value_heads": 1, "head_dim": 32, "vocab_size": 320, "max_position_embeddings": 256,
           "tie_word_embeddings": False, "rms_norm_eps": 1e-5}
    cfg.update(overrides)
    return cfg


def write_synthetic_gptq_checkpoint(
    directory: str | Path,
    *,
    method: Literal["gptq", "awq"] = "gptq",
    bits: int = 4,
    group_size: int = 64,
    desc_act: bool = False,
    sym: bool = True,
    seed: int = 0,
    llama_config: dict | None = None,
) -> SyntheticCheckpoint:
    """Write a tiny random LlamaForCausalLM as a GPTQ/AWQ checkpoint folder (config.json + model.safetensors)."""
    from safetensors.torch import save_file
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(**(llama_config or tiny_llama_config()))
    model = LlamaForCausalLM(cfg).eval()
    tensors, reference = {}, {}
    for name, param in model.state_dict().items():
        module = name.rsplit(".", 1)[0]
        if not (name.endswith(".weight") and module.rsplit(".", 1)[-1] in _LINEARS):
            tensors[name] = reference[name] = param.detach().clone().contiguous()
            continue
        perm = torch.randperm(param.shape[1]) if desc_act else None
        rtn = rtn_quantize(param.detach(), bits, group_size, sym=sym if method == "gptq" else False, perm=perm)
        packed = gptq_tensors(rtn, bits) if method == "gptq" else awq_tensors(rtn)
        tensors.update({f"{module}.{k}": v for k, v in packed.items()})
        reference[name] = rtn.dequantize()
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    config = cfg.to_dict()
    config["quantization_config"] = quantization_config(method, bits, group_size, desc_act, sym)
    config["architectures"] = ["LlamaForCausalLM"]
    (directory / "config.json").write_text(json.dumps(config, indent=2, default=str))
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
    return SyntheticCheckpoint(path=directory, config=config, reference_state_dict=reference)


# Hub names of a MoE family's per-expert linears (transformers 5 merges them into experts.gate_up_proj and
# experts.down_proj on loading): the experts module's path in a hub checkpoint, and the gate, up, down names.
MOE_EXPERT_NAMES = {"qwen3_moe": ("mlp.experts", ("gate_proj", "up_proj", "down_proj")),
                    "mixtral": ("block_sparse_moe.experts", ("w1", "w3", "w2"))}


def write_synthetic_gptq_moe_checkpoint(
    directory: str | Path,
    tokenizer,
    model_type: str,
    *,
    method: Literal["gptq", "awq"] = "gptq",
    bits: int = 4,
    group_size: int = 32,
    desc_act: bool = False,
    shared_perm: bool = True,
    seed: int = 0,
    **over,
) -> SyntheticCheckpoint:
    """A tiny random MoE (``MOE_EXPERT_NAMES``) as a hub GPTQ/AWQ checkpoint: every expert's gate, up and down
    linears and the attention's linears packed under their hub names (``experts.N.gate_proj.qweight`` ...), the
    router, norms and embeddings dense. ``desc_act``: act-order groups, one permutation for an expert's gate and
    up (they read the same input, as GPTQ's Hessian order gives) unless ``shared_perm`` is False.
    ``reference_state_dict``: the model's own (fused) tensors equal to the dequantized checkpoint."""
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    from tests.zoo import tiny_config

    torch.manual_seed(seed)
    cfg = tiny_config(model_type, tokenizer, **over)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    experts_path, (gate, up, down) = MOE_EXPERT_NAMES[model_type]

    def pack(weight: torch.Tensor, perm: torch.Tensor | None) -> tuple[dict, torch.Tensor]:
        rtn = rtn_quantize(weight, bits, group_size, sym=method == "gptq", perm=perm)
        return (gptq_tensors(rtn, bits) if method == "gptq" else awq_tensors(rtn)), rtn.dequantize()

    tensors, reference = {}, {}
    for name, param in model.state_dict().items():
        param = param.detach().clone().contiguous()
        layer, _, rest = name.partition(".mlp.experts.")
        if rest in ("gate_up_proj", "down_proj"):  # [E, out, in]
            fused = []
            for e in range(param.shape[0]):
                w = param[e]
                perm = torch.randperm(w.shape[1]) if desc_act else None
                if rest == "down_proj":
                    linears = [(down, w)]
                else:
                    half = w.shape[0] // 2
                    linears = [(gate, w[:half]), (up, w[half:])]
                parts = []
                for hub, part in linears:
                    packed, dense = pack(part, perm if shared_perm or perm is None else torch.randperm(w.shape[1]))
                    tensors.update({f"{layer}.{experts_path}.{e}.{hub}.{k}": v for k, v in packed.items()})
                    parts.append(dense)
                fused.append(torch.cat(parts))
            reference[name] = torch.stack(fused)
        elif name.endswith(("q_proj.weight", "k_proj.weight", "v_proj.weight", "o_proj.weight")) and ".layers." in name:
            packed, reference[name] = pack(param, torch.randperm(param.shape[1]) if desc_act else None)
            tensors.update({f"{name.removesuffix('.weight')}.{k}": v for k, v in packed.items()})
        else:
            tensors[name] = reference[name] = param
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    config = cfg.to_dict()
    config["quantization_config"] = quantization_config(method, bits, group_size, desc_act, method == "gptq")
    (directory / "config.json").write_text(json.dumps(config, indent=2, default=str))
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
    tokenizer.save_pretrained(directory)
    return SyntheticCheckpoint(path=directory, config=config, reference_state_dict=reference)
