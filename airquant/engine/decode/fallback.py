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
Here the attention layers keep their keys and values in the loop's own store (``slot_cache.SlotCache`` over
``slots.SlotKV``: its KV offload, its TurboQuant arenas and attention); the other layers keep transformers' own
cache layers. Backend "turboquant" (the PyPI package, a peer to compare with) brings its own cache (``make_cache``);
MiniMax (a cache class of its own) and OpenAI GPT (no cache) take no transformers Cache (``takes_cache``) and
generate with their own.
A batch is one ``generate`` call per group of requests with equal settings (left-padded).
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import sys
import time
from typing import Callable

import torch
from transformers import DynamicCache, GenerationConfig, LogitsProcessorList
from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer

from airquant.engine.decode.loop import Completion, Request
from airquant.engine.decode.slot_cache import KVOffloadError, SlotCache
from airquant.engine.decode.slots import ATTN_NAME, attention_backends, register_ragged_attention
from airquant.engine.decode.text import Detokenizer
from airquant.kv import make_cache, model_dims
from airquant.kv.config import KVConfig, KVConfigError
from airquant.kv.layers import LayerStates

log = logging.getLogger(__name__)


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


def takes_cache(model) -> bool:
    """Whether ``generate`` can hand the stack a transformers ``Cache``: its forward takes one, and it brings no
    cache class of its own (MiniMax's lightning attention; transformers' own check)."""
    try:
        params = inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return False
    own = getattr(model, "_supports_default_dynamic_cache", lambda: True)
    return ("cache" in params or "past_key_values" in params) and own()


def generate_with_transformers(model, tokenizer, requests: list[Request], *, device: torch.device,
                               dtype: torch.dtype, eos_ids: list[int], kv: KVConfig | None = None,
                               offload: set[int] | frozenset = frozenset(), cache_arg: str,
                               check_context: Callable[[int, int], None], on_error: Callable[[], None],
                               scope: Callable = attention_backends,
                               timings: list[tuple[float, list[float]]] | None = None,
                               sync: Callable[[], None] = lambda: None) -> list[Completion]:
    """``requests`` through ``model.generate``, each call's cache a ``SlotCache`` (``kv``: TurboQuant's settings,
    None or backend "none": plain keys/values; ``offload``: layers whose keys/values live in host memory); each
    call runs inside ``scope()``; ``on_error`` runs when a call is cut short. ``timings``: each call's start and
    the times its tokens' logits were ready (after ``sync()``), appended."""
    kv = kv if kv is not None and kv.backend != "none" else None
    groups: dict[Request, list[int]] = {}
    for k, r in enumerate(requests):
        groups.setdefault(Request((), *[getattr(r, f) for f in ("max_new_tokens", "temperature", "top_p",
                                                               "seed", "stop", "ignore_eos")]), []).append(k)
    out: list[Completion | None] = [None] * len(requests)
    pad = tokenizer.pad_token_id
    for key, members in groups.items():
        width = max(len(requests[k].prompt_ids) for k in members)
        pads = [width - len(requests[k].prompt_ids) for k in members]
        ids = torch.tensor([[pad] * p + list(requests[k].prompt_ids) for p, k in zip(pads, members)], device=device)
        mask = torch.tensor([[0] * p + [1] * (width - p) for p in pads], device=device)
        check_context(width, key.max_new_tokens)
        if key.seed is not None:
            torch.manual_seed(key.seed)
        sample = key.temperature > 0
        config = GenerationConfig(
            max_new_tokens=key.max_new_tokens, do_sample=sample, temperature=key.temperature if sample else None,
            top_p=key.top_p if sample else None, top_k=None, pad_token_id=pad, eos_token_id=eos_ids,
            min_new_tokens=key.max_new_tokens if key.ignore_eos else None, stop_strings=list(key.stop) or None,
            use_cache=True)  # MPT's config says False: it would run every step over the whole sequence
        cache = _cache(model, kv, offload, rows=len(members), cap=width + key.max_new_tokens, pads=pads,
                       device=device, dtype=dtype)
        clock = StepClock(sync)
        if timings is not None:
            timings.append((time.perf_counter(), clock.times))
        try:
            with scope(), _attention_for(model, cache):
                rows = model.generate(input_ids=ids, attention_mask=mask, generation_config=config,
                                      tokenizer=tokenizer if key.stop else None,
                                      logits_processor=LogitsProcessorList([clock]),
                                      **({cache_arg: cache} if cache is not None else {}))
        except BaseException:
            on_error()  # an OOM or an interrupt cut a forward short
            raise
        for k, row in zip(members, rows):
            out[k] = _completion(tokenizer, row[width:], len(requests[k].prompt_ids), key.stop, set(eos_ids))
    return out


class StepClock:
    """A logits processor noting when each generated token's logits are ready (the host's clock after ``sync``):
    the fallback's step times, and the benchmarks' for a transformers-style ``generate`` (stream_bench)."""

    def __init__(self, sync: Callable[[], None]):
        self.sync, self.times = sync, []

    def __call__(self, input_ids, scores):
        self.sync()
        self.times.append(time.perf_counter())
        return scores


def _cache(model, kv: KVConfig | None, offload: set[int] | frozenset, *, rows: int, cap: int, pads: list[int],
           device: torch.device, dtype: torch.dtype):
    """One ``generate`` call's cache: the loop's store (``SlotCache``), the turboquant package's, or None for a
    stack that takes no transformers ``Cache`` (generate then runs it with its own, or none)."""
    if not takes_cache(model):
        if kv is not None:
            raise KVConfigError(f"{type(model).__name__} takes no transformers Cache (it keeps a cache of its own, or "
                                "none), so no compressed one: use kv backend 'none'")
        if offload:
            log.warning("%s keeps a cache of its own (or none): its KV cache is not offloaded", type(model).__name__)
        return None
    if kv is not None and kv.backend == "turboquant":
        if offload:
            raise KVOffloadError("KV offload holds AirQuant's caches, not the turboquant package's: use --kv tq "
                                 "or --no-kv-offload")

        return make_cache(model.config, kv)
    if kv is not None and not attention_by_name(model):
        raise KVConfigError(f"{type(model).__name__} computes its attention in its own module code, which does not "
                            "read the TurboQuant cache: use kv backend 'none'")
    if kv is not None:
        model_dims(model.config)  # the layouts the TurboQuant cache refuses (sliding windows), named
    return SlotCache(model.config, rows=rows, cap=cap, device=device, dtype=dtype, kv=kv, offload=offload,
                     pads=pads)


@contextlib.contextmanager
def _attention_for(model, cache):
    """The loop's attention (it reads the TurboQuant arenas) while ``cache``'s store compresses, as in the loop."""
    if not (isinstance(cache, SlotCache) and cache.store.tq):
        yield
        return
    register_ragged_attention()
    config = model.config
    previous = config._attn_implementation
    config._attn_implementation = ATTN_NAME
    try:
        yield
    finally:
        config._attn_implementation = previous


def _completion(tokenizer, new_ids: torch.Tensor, prompt_tokens: int, stop: tuple[str, ...],
                eos: set[int]) -> Completion:
    ids = new_ids.tolist()
    cut = next((k for k, t in enumerate(ids) if t in eos), len(ids))
    kept = ids[:cut]
    detok = Detokenizer(tokenizer, stop)  # cuts the text at a stop string, as the decode loop's does
    detok.push(kept)
    return Completion(text=detok.text, prompt_tokens=prompt_tokens, new_tokens=len(kept) + (cut < len(ids)),
                      token_ids=tuple(kept), finish_reason="stop" if cut < len(ids) else detok.finish_reason or "length")
