"""Tiny random models of many transformers causal-LM types, saved as real checkpoints.

``MODEL_TYPES`` is the list of types the test matrix streams; the supported-types list in docs/MODELS.md is
generated from it (``python -m tests.zoo``). A type is added by adding its name here (and, when its
config needs other small sizes, an entry in ``OVERRIDES``).
"""

from __future__ import annotations

from pathlib import Path

import torch
from huggingface_hub.errors import StrictDataclassError

# Dense families.
DENSE_TYPES = ("llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3_text", "phi3", "olmo2", "granite",
               "cohere2", "starcoder2", "smollm3", "glm4", "glm", "olmo3", "stablelm", "exaone4", "seed_oss",
               "ministral", "helium", "arcee", "apertus", "hunyuan_v1_dense", "ernie4_5", "phi", "vaultgemma",
               "nemotron", "internlm3", "cohere", "gpt2", "gpt_bigcode", "gpt_neo", "gpt_neox", "gptj", "codegen",
               "opt", "bloom", "falcon", "mpt", "olmo", "nanochat", "gemma4_text", "apertus1p5_text", "biogpt",
               "bitnet", "ctrl", "cwm", "exaone", "gpt-sw3", "gpt_neox_japanese", "granite_swa", "hyperclovax",
               "iquestcoder", "jais2", "minicpm3", "ministral3", "modernbert-decoder", "openai-gpt", "persimmon",
               "youtu", "xglm", "cohere_compass_text", "gemma3n_text",
               "gemma4_unified_text", "diffllama",
               "doge")  # its default, dense form; with is_moe (CDMoE) streamed logits are 7% off: open
# Mixture-of-Experts families; the second line's types are also run with NF4 and int2 experts.
MOE_TYPES = ("mixtral", "qwen2_moe", "qwen3_moe", "qwen3_5_moe_text", "gpt_oss", "deepseek_v3", "deepseek_v2",
             "glm4_moe", "olmoe", "granitemoe", "phimoe", "dots1", "ernie4_5_moe", "minimax", "hunyuan_v1_moe",
             "flex_olmo", "llama4_text", "granitemoeshared", "jetmoe", "minimax_m2", "exaone_moe", "cohere2_moe",
             "afmoe", "glm4_moe_lite")
NEW_MOE_TYPES = ("aria_text", "beam", "deepseek_v4", "flint", "glm_moe_dsa", "granitemoe_swa", "hy_v3",
                 "hy_v4", "kolibri1", "laguna", "mellum", "mimo_v2_flash", "sarvam_mla", "sarvam_moe", "solar_open",
                 "minimax_m3_vl_text", "axk1", "axk2", "deepseek_v32", "longcat_flash", "zaya",
                 "dots3_note_text")
# Hybrid stacks: attention beside linear-attention / state-space blocks with a recurrent state.
HYBRID_TYPES = ("qwen3_5_text", "qwen3_5_moe_text", "qwen3_next", "lfm2", "nemotron_h")
# State-space (Mamba) stacks and further hybrids, streamed like the rest.
SSM_TYPES = ("mamba", "falcon_mamba", "mamba2", "bamba", "falcon_h1", "jamba", "lfm2_moe", "olmo_hybrid", "lfm3",
             "bailing_hybrid", "qwen4_exp_text", "kimi_linear", "granitemoehybrid", "inkling_text",
             "inkling2_text", "inkling2_loop_text", "lara_mini", "zamba", "zamba2")
MODEL_TYPES = DENSE_TYPES + MOE_TYPES + NEW_MOE_TYPES + SSM_TYPES
TESTED = frozenset(MODEL_TYPES + HYBRID_TYPES)

# The rest of transformers' causal-LM mapping (MODEL_FOR_CAUSAL_LM_MAPPING_NAMES), each with the reason it is
# not tested (docs/MODELS.md lists them); tests/store/test_model_types.py fails on a type listed nowhere.
_MULTIMODAL = ("an image/audio model: its causal-LM class builds the vision/audio parts too; streaming it needs the "
               "engine to take pixel/audio inputs; ")
NOT_TESTED = {
    "recurrent_gemma": "keeps its recurrent state in module attributes and ignores left padding; needs a Cache-API "
                       "adapter for that state",
    "rwkv": "keeps its recurrent state outside the Cache API and ignores left padding; needs a Cache-API adapter",
    "xlstm": "takes no attention mask: transformers' own model gives a left-padded prompt other logits than the "
             "prompt alone (1.3 relative error on the tiny model), and its xLSTMCache sizes the query heads from "
             "qk_dim rounded up to 64 while its layers use hidden_size * qk_dim_factor (transformers' own forward "
             "fails, 'matC_old has wrong shape', whenever that is not a multiple of 64); needs mask handling in "
             "the model and a Cache-API adapter for its state",
    "gemma3": _MULTIMODAL + "its text part is tested as gemma3_text",
    "gemma3n": _MULTIMODAL + "its text part is gemma3n_text",
    "gemma4": _MULTIMODAL + "its text part is tested as gemma4_text",
    "gemma4_unified": _MULTIMODAL + "its text part is gemma4_unified_text",
    "qwen3_5": _MULTIMODAL + "its text part is tested as qwen3_5_text",
    "qwen3_5_moe": _MULTIMODAL + "its text part is tested as qwen3_5_moe_text",
    "qwen4_exp": _MULTIMODAL + "its text part is qwen4_exp_text",
    "dots3_note": _MULTIMODAL + "its text part is dots3_note_text",
    "llama4": _MULTIMODAL + "its text part is tested as llama4_text",
    "mllama": _MULTIMODAL + "its stack interleaves cross-attention layers that read image states",
    "phi4_multimodal": _MULTIMODAL + "vision and speech adapters (LoRA) inside the text stack",
    "emu3": _MULTIMODAL + "its config builds the VQ image tokenizer beside the text stack",
    "got_ocr2": _MULTIMODAL + "OCR of an image, no text-only use",
    "fuyu": _MULTIMODAL + "image patches are fed into the decoder's input embeddings",
    "git": _MULTIMODAL + "image captioning: the decoder attends to image tokens",
    "moshi": "a speech model: its decoder reads audio codebooks beside text (a depth decoder per step); needs "
             "audio inputs and a second stack",
    "moss_transcribe_diarize": _MULTIMODAL + "speech transcription",
    "gemma4_assistant": "a speculative-decoding drafter: it reads the target Gemma 4's hidden states "
                        "(backbone_hidden_size), so it runs only beside a target; needs assisted decoding",
    "gemma4_unified_assistant": "a speculative-decoding drafter for gemma4_unified (reads the target's hidden "
                                "states); needs assisted decoding",
    "hrm_text": "runs its blocks in nested reasoning cycles (H and L modules, several passes per token), not one "
                "ModuleList once per token; streaming needs a per-cycle schedule",
    "blt": "Byte Latent Transformer: a byte patcher, a local encoder, a global stack and a local decoder, not one "
           "decoder stack; streaming needs one schedule per stack",
    "reformer": "LSH/chunked attention keeps buckets in its own cache, not the Cache API; needs a cache adapter",
    **{t: "ignores left padding: transformers' own model gives a left-padded prompt other logits than the "
          "prompt alone (" + why + "); needs position handling from the attention mask in the model" for t, why in (
        ("cpmant", "0.7 relative error on the tiny model"), ("trocr", "1.1 relative error"))},
    "dory": "transformers' own model fails on a left-padded batch (its mask and keys differ in length); needs "
            "padding support in the model",
    "dbrx": "a tiny checkpoint that loads back: transformers 5.24 reloads a saved DBRX config with the default "
            "ffn_config hidden size (2048), so the tiny model's tensors do not fit (AirQuant refuses the mismatch)",
    "xlnet": "a permutation LM with two-stream attention and its own memory (mems), not a KV cache; needs a mems "
             "adapter in the decode loop",
}
# Types of the mapping outside the decoder-only catalogue: encoder-decoder models (their config says so) and
# bidirectional encoders with a causal-LM head (BERT family, used as decoders only with is_decoder=True).
ENCODER_DECODER = ("bart", "bigbird_pegasus", "blenderbot", "blenderbot-small", "marian", "mbart", "musicgen",
                   "musicgen_melody", "mvp", "pegasus", "plbart", "prophetnet", "whisper")
ENCODER_ONLY = ("bert", "bert-generation", "big_bird", "camembert", "data2vec-text", "electra", "ernie",
                "megatron-bert", "rembert", "roberta", "roberta-prelayernorm", "roc_bert", "roformer", "xlm",
                "xlm-roberta", "xlm-roberta-xl", "xmod")


def catalogue() -> list[str]:
    """The decoder-only causal-LM types of the installed transformers."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return [t for t in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES if t not in ENCODER_DECODER + ENCODER_ONLY]


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
    "falcon_h1": dict(mamba_n_heads=8, mamba_d_ssm=128),
    "jamba": dict(num_hidden_layers=4, attn_layer_period=2, attn_layer_offset=1, expert_layer_period=2,
                  expert_layer_offset=1, use_mamba_kernels=False, mamba_dt_rank=16),
    "nemotron_h": dict(mamba_num_heads=8, mamba_head_dim=16, n_groups=1, moe_shared_expert_intermediate_size=64),
    "lfm2_moe": dict(num_dense_layers=1, layer_types=["conv", "full_attention", "conv"]),
    "lfm2": dict(full_attn_idxs=[1]),  # otherwise every block of a small LFM2 is attention
    "zaya": dict(num_experts_per_tok=1),
    "longcat_flash": dict(zero_expert_num=2),
    "bailing_hybrid": dict(layer_group_size=3), "beam": dict(mlp_layer_types=["dense", "sparse", "sparse"]),
    "zamba2": dict(layers_block_type=["linear_attention", "hybrid", "linear_attention"]),
    "kimi_linear": dict(layer_types=["linear_attention", "full_attention", "linear_attention"],
                        mlp_layer_types=["dense", "sparse", "sparse"]),
    "granitemoehybrid": dict(mamba_n_heads=8, layer_types=["linear_attention", "full_attention", "linear_attention"]),
    "qwen4_exp_text": dict(layer_types=["linear_attention", "linear_attention", "indexed_attention"],
                           indexer_n_heads=4, indexer_kv_heads=1, indexer_head_dim=16, indexer_budget=16,
                           indexer_compress_ratio=4),
    "cohere_compass_text": dict(rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1e4}}),
    "gemma3n_text": dict(num_kv_shared_layers=0, vocab_size_per_layer_input=512),  # masks the ids past its table
    "dbrx": dict(attn_config=dict(kv_n_heads=2, rope_theta=1e4, clip_qkv=8.0),
                 ffn_config=dict(hidden_size=64, ffn_hidden_size=128, moe_num_experts=4, moe_top_k=2)),
}


def tiny_config(model_type: str, tokenizer, *, layers: int = 3, **over):
    """The type's config class with small sizes, token ids from ``tokenizer``."""
    from transformers import AutoConfig

    base = AutoConfig.for_model(model_type)
    sizes = {**SMALL, **(MLA if _settable(base, "kv_lora_rank") else {})}
    kw = {k: v for k, v in sizes.items() if _settable(base, k)}
    if _settable(base, "unpadded_vocab_size"):  # a head narrower than the padded embedding (Inkling 2)
        kw["unpadded_vocab_size"] = len(tokenizer)
    kw.update(num_hidden_layers=layers, vocab_size=len(tokenizer), tie_word_embeddings=False,
              bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
              pad_token_id=tokenizer.pad_token_id)
    if _settable(base, "vocab_size_per_layer_input"):  # Gemma 3n/4 per-layer inputs: by default 262 144 rows x 256
        # per layer (Gemma 4: 208M parameters, 1.6 GB of model and store); Gemma 4's must cover the token ids
        kw.update(vocab_size_per_layer_input=len(tokenizer), hidden_size_per_layer_input=16)
    kw.update(OVERRIDES.get(model_type, {}))
    kw.update(over)
    try:
        return AutoConfig.for_model(model_type, **kw)
    except (ValueError, StrictDataclassError):  # per-layer lists of the default size refused
        return AutoConfig.for_model(model_type, **{**_per_layer_lists(base, layers), **kw})


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
    """The default config's lists of one entry per layer (``layer_types``, ``mlp_layer_types`` ...) cut to
    ``layers`` entries, the same ones of every list: configs validate them against ``num_hidden_layers``.
    The first blocks and the last are kept: stacks open with their dense-MLP blocks, and patterns of full
    attention every k-th block end on one."""
    n = getattr(base, "num_hidden_layers", None)
    if not n or n <= layers:
        return {}
    keep = list(range(layers - 1)) + [n - 1]
    return {k: [v[i] for i in keep] for k, v in base.to_dict().items() if isinstance(v, list) and len(v) == n}


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


if __name__ == "__main__":  # the list in docs/MODELS.md
    print("Dense:", ", ".join(DENSE_TYPES))
    print("Mixture-of-Experts:", ", ".join(MOE_TYPES + NEW_MOE_TYPES))
    print("Hybrid:", ", ".join(HYBRID_TYPES))
    print("State-space and other hybrids:", ", ".join(SSM_TYPES))
    print("Not tested:")
    for model_type, reason in sorted(NOT_TESTED.items()):
        print(f"  {model_type}: {reason}")
