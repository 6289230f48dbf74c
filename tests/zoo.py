"""Tiny random models of many transformers causal-LM types, saved as real checkpoints.

``MODEL_TYPES`` is the list of types the test matrix streams; the README's supported-types list is
generated from it (``python -m tests.zoo``). A type is added by adding its name here (and, when its
config needs other small sizes, an entry in ``OVERRIDES``).
"""

from __future__ import annotations

from pathlib import Path

import torch

# Dense families.
DENSE_TYPES = ("llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3_text", "phi3", "olmo2", "granite",
               "cohere2", "starcoder2", "smollm3", "glm4", "glm", "olmo3", "stablelm", "exaone4", "seed_oss",
               "ministral", "helium", "arcee", "apertus", "hunyuan_v1_dense", "ernie4_5", "phi", "vaultgemma",
               "nemotron", "internlm3", "cohere", "gpt2", "gpt_bigcode", "gpt_neo", "gpt_neox", "gptj", "codegen",
               "opt", "bloom", "falcon", "mpt")
# Mixture-of-Experts families.
MOE_TYPES = ("mixtral", "qwen2_moe", "qwen3_moe", "qwen3_5_moe_text", "gpt_oss", "deepseek_v3", "deepseek_v2",
             "glm4_moe", "olmoe", "granitemoe", "phimoe", "dots1", "ernie4_5_moe", "minimax", "hunyuan_v1_moe",
             "flex_olmo", "llama4_text", "granitemoeshared", "jetmoe", "minimax_m2", "exaone_moe", "cohere2_moe",
             "afmoe", "glm4_moe_lite")
# Hybrid stacks: attention beside linear-attention / state-space blocks with a recurrent state.
HYBRID_TYPES = ("qwen3_5_text", "qwen3_5_moe_text", "qwen3_next", "lfm2", "nemotron_h")
# State-space (Mamba) stacks and further hybrids, streamed like the rest.
SSM_TYPES = ("mamba", "falcon_mamba", "mamba2", "bamba", "falcon_h1", "jamba", "lfm2_moe", "olmo_hybrid")
MODEL_TYPES = DENSE_TYPES + MOE_TYPES + SSM_TYPES
# Known causal-LM types left out of the tested list, and why (the README lists them).
NOT_TESTED = {
    "recurrent_gemma": "keeps its recurrent state in module attributes and ignores left padding",
    "rwkv": "keeps its recurrent state outside the Cache API and ignores left padding",
}

SMALL = dict(
    hidden_size=64, intermediate_size=128, moe_intermediate_size=32, shared_expert_intermediate_size=64,
    num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
    num_local_experts=4, num_experts=4, n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1,
    kv_lora_rank=16, q_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16, n_group=1, topk_group=1,
    first_k_dense_replace=1, sliding_window=8, linear_num_value_heads=4, linear_num_key_heads=2,
    linear_key_head_dim=16, linear_value_head_dim=16, linear_conv_kernel_dim=4, mamba_n_heads=4, mamba_d_head=16,
    mamba_d_state=8, mamba_n_groups=1, ssm_state_size=8, mamba_d_conv=4, decoder_sparse_step=1,
    index_n_heads=4, index_head_dim=16,
)
# MLA attention (a config with kv_lora_rank) keeps one key/value head per query head and ropes
# qk_rope_head_dim channels.
MLA = dict(head_dim=8, num_key_value_heads=4)
# The layer pattern of Qwen3.5 / Qwen3-Next puts full attention at every fourth block.
OVERRIDES: dict[str, dict] = {
    "qwen3_5_text": dict(num_hidden_layers=4), "qwen3_5_moe_text": dict(num_hidden_layers=4),
    "qwen3_next": dict(num_hidden_layers=4),
    "gptj": dict(rotary_dim=8), "codegen": dict(rotary_dim=8),
    "gpt_neo": dict(attention_types=[[["global", "local"], 1], [["global"], 1]]),
    "mamba2": dict(num_heads=8), "bamba": dict(mamba_n_heads=8, attn_layer_indices=[1]),
    "falcon_h1": dict(mamba_n_heads=8, mamba_d_ssm=128), "granitemoehybrid": dict(mamba_n_heads=8),
    "jamba": dict(num_hidden_layers=4, attn_layer_period=2, attn_layer_offset=1, expert_layer_period=2,
                  expert_layer_offset=1, use_mamba_kernels=False, mamba_dt_rank=16),
    "nemotron_h": dict(mamba_num_heads=8, mamba_head_dim=16, n_groups=1, moe_shared_expert_intermediate_size=64),
    "lfm2_moe": dict(num_dense_layers=1, layer_types=["conv", "full_attention", "conv"]),
    "lfm2": dict(full_attn_idxs=[1]),  # otherwise every block of a small LFM2 is attention
}


def tiny_config(model_type: str, tokenizer, *, layers: int = 3, **over):
    """The type's config class with small sizes, token ids from ``tokenizer``."""
    from transformers import AutoConfig

    base = AutoConfig.for_model(model_type)
    sizes = {**SMALL, **(MLA if _settable(base, "kv_lora_rank") else {})}
    kw = {k: v for k, v in sizes.items() if _settable(base, k)}
    kw.update(_per_layer_lists(base, layers))
    kw.update(num_hidden_layers=layers, vocab_size=len(tokenizer), tie_word_embeddings=False,
              bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
              pad_token_id=tokenizer.pad_token_id)
    kw.update(OVERRIDES.get(model_type, {}))
    kw.update(over)
    return AutoConfig.for_model(model_type, **kw)


def _settable(config, key: str) -> bool:
    """The config class has ``key`` and lets it be set: some expose head_dim as a derived property; a
    heterogeneous config refuses to read a per-layer attribute globally (a RuntimeError) but sets it."""
    if isinstance(getattr(type(config), key, None), property):
        return False
    try:
        return hasattr(config, key)
    except RuntimeError:
        return True


def _per_layer_lists(base, layers: int) -> dict[str, list]:
    """The default config's lists of one entry per layer (``layer_types``, ``mlp_layer_types`` ...), cut to
    ``layers`` entries: configs that validate them against ``num_hidden_layers`` refuse the full ones."""
    n = getattr(base, "num_hidden_layers", None)
    if not n or n == layers:
        return {}
    return {k: v[:layers] for k, v in base.to_dict().items() if isinstance(v, list) and len(v) == n}


def make_model(folder: Path, tokenizer, model_type: str, *, seed: int = 0, **over) -> Path:
    """Build the tiny model with random weights, save it with ``save_pretrained``; returns the folder."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(model_type, tokenizer, **over), dtype=torch.float32)
    # Random init gives near-uniform logits; a larger spread makes greedy decoding less tie-prone.
    with torch.no_grad():
        for p in model.parameters():
            if p.ndim >= 2:
                p.normal_(0, 0.08)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


if __name__ == "__main__":  # the README's list
    print("Dense:", ", ".join(DENSE_TYPES))
    print("Mixture-of-Experts:", ", ".join(MOE_TYPES))
    print("Hybrid:", ", ".join(HYBRID_TYPES))
    print("State-space and other hybrids:", ", ".join(SSM_TYPES))
