"""The stacks the decode loop does not take, and the one call that generates for them (transformers' ``generate``).

Who takes this path (``reason`` says which rule, ``None``: the loop takes the stack):

- **recurrent or convolution state layers**, beside attention or instead of it (``kv.layers.LayerStates.hybrid``):
  Qwen3.5 / Qwen3-Next, LFM2, Nemotron-H, MiniMax, Jamba, Bamba, Falcon-H1, OLMo-hybrid, LFM2-MoE, Mamba,
  Mamba-2, Falcon-Mamba, ZAYA, and the other hybrid types of ``tests/zoo.py``. The loop's per-slot cache holds keys and values only; these layers keep a fixed
  state per sequence that transformers' own cache layers update.
- **cache layers beyond keys and values** (``plain_kv_layers`` false): DeepSeek-V3.2 / GLM-MoE-DSA / HY-V4's
  indexer keys (``update_indexer``), DeepSeek-V4's compressed attention. The loop's cache keeps keys and values.
- **attention outside transformers' AttentionInterface** (``attention_by_name`` false): GPT-Neo, BLOOM, Falcon,
  MPT, GPT-NeoX-Japanese, OpenAI GPT and XGLM compute it in their own module code. The loop's ragged attention is reached through that interface only.

MLA (DeepSeek-V2/V3, GLM-4-MoE-lite) and attention sinks (gpt-oss) run in the loop (``slots``); the tested
types each rule takes are checked in ``tests/engine/test_decode_attention_kinds.py``.
Here the cache is transformers' ``DynamicCache`` or TurboQuant's ``kv.cache.TQCache`` (``make_cache``),
moved to host memory between a layer's runs by the streamer's ``engine/memory/kv_offload.KVOffload`` (``offload``).
A batch is one ``generate`` call per group of requests with equal settings (left-padded).
"""

from __future__ import annotations

import sys
from typing import Callable

import torch

from airquant.engine.decode.loop import Completion, Request
from airquant.engine.decode.slots import attention_backends
from airquant.engine.decode.text import Detokenizer
from airquant.kv.layers import LayerStates


def reason(model, config) -> str | None:
    """Why transformers' ``generate`` runs this stack instead of the decode loop (None: the loop runs it)."""
    if LayerStates.of(config).hybrid:
        return "recurrent/conv state layers"
    if not plain_kv_layers(config):
        return "cache layers beyond keys and values (an indexer, compressed attention)"
    if not attention_by_name(model):
        return "attention outside transformers' AttentionInterface"
    return None


def plain_kv_layers(config) -> bool:
    """Whether transformers' own cache for the stack (``DynamicCache(config=...)``) holds keys and values only,
    what the loop's cache replaces; a layer type it does not know (a KeyError) is a cache the model brings."""
    from transformers import DynamicCache
    from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer

    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    try:
        layers = DynamicCache(config=text).layers
    except KeyError:
        return False
    return all(type(layer) in (DynamicLayer, DynamicSlidingWindowLayer) for layer in layers)


def attention_by_name(model) -> bool:
    """Whether the stack looks its attention function up by ``config._attn_implementation`` in transformers'
    registry, where the loop registers its own: the flag transformers sets on such models, or their modeling
    module importing the registry (StableLM does so without the flag)."""
    if getattr(model, "_supports_attention_backend", False):
        return True
    return hasattr(sys.modules.get(type(model).__module__), "ALL_ATTENTION_FUNCTIONS")


def generate_with_transformers(model, tokenizer, requests: list[Request], *, device: torch.device, eos_ids: list[int],
             make_cache: Callable,
             cache_arg: str, offload=None, check_context: Callable[[int, int], None],
             on_error: Callable[[], None], scope: Callable = attention_backends) -> list[Completion]:
    """``requests`` through ``model.generate``: ``make_cache()`` gives each call's cache (None: generate's own);
    ``offload`` (``KVOffload`` or None) is bound to it for the call; each call runs inside ``scope()``;
    ``on_error`` runs when a call is cut short."""
    from transformers import GenerationConfig

    groups: dict[Request, list[int]] = {}
    for k, r in enumerate(requests):
        groups.setdefault(Request((), *[getattr(r, f) for f in ("max_new_tokens", "temperature", "top_p",
                                                               "seed", "stop", "ignore_eos")]), []).append(k)
    out: list[Completion | None] = [None] * len(requests)
    pad = tokenizer.pad_token_id
    for key, members in groups.items():
        width = max(len(requests[k].prompt_ids) for k in members)
        ids = torch.tensor([[pad] * (width - len(requests[k].prompt_ids)) + list(requests[k].prompt_ids)
                            for k in members], device=device)
        mask = torch.tensor([[0] * (width - len(requests[k].prompt_ids)) + [1] * len(requests[k].prompt_ids)
                             for k in members], device=device)
        check_context(width, key.max_new_tokens)
        if key.seed is not None:
            torch.manual_seed(key.seed)
        sample = key.temperature > 0
        config = GenerationConfig(
            max_new_tokens=key.max_new_tokens, do_sample=sample, temperature=key.temperature if sample else None,
            top_p=key.top_p if sample else None, top_k=None, pad_token_id=pad, eos_token_id=eos_ids,
            min_new_tokens=key.max_new_tokens if key.ignore_eos else None, stop_strings=list(key.stop) or None)
        cache = make_cache()
        if offload is not None:
            offload.bind(cache, tokens=width + key.max_new_tokens)
        try:
            with scope():
                rows = model.generate(input_ids=ids, attention_mask=mask, generation_config=config,
                                      tokenizer=tokenizer if key.stop else None,
                                      **({cache_arg: cache} if cache is not None else {}))
        except BaseException:
            on_error()  # an OOM or an interrupt cut a forward short
            raise
        finally:
            if offload is not None:
                offload.unbind()
        for k, row in zip(members, rows):
            out[k] = _completion(tokenizer, row[width:], len(requests[k].prompt_ids), key.stop, set(eos_ids))
    return out


def _completion(tokenizer, new_ids: torch.Tensor, prompt_tokens: int, stop: tuple[str, ...],
                eos: set[int]) -> Completion:
    ids = new_ids.tolist()
    cut = next((k for k, t in enumerate(ids) if t in eos), len(ids))
    kept = ids[:cut]
    detok = Detokenizer(tokenizer, stop)  # cuts the text at a stop string, as the decode loop's does
    detok.push(kept)
    return Completion(text=detok.text, prompt_tokens=prompt_tokens, new_tokens=len(kept) + (cut < len(ids)),
                      token_ids=tuple(kept), finish_reason="stop" if cut < len(ids) else detok.finish_reason or "length")
