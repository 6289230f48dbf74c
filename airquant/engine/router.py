"""Which store, mode, KV scheme and placement to run a workload with, and the arithmetic behind it.

The router sits above the layer planner (``plan.py``): given one or more stores of the same model
(one weight scheme each), the hardware budgets and the workload (batch size, context), it picks

* the weight scheme: the best quality that fits. Quality is ranked by bytes per weight (dense stores
  first, then the larger quantized store): for one model, more bits per weight mean less error;
* the mode: resident when every layer fits with room for the KV cache and activations, streamed
  otherwise (only where streaming is allowed: batch work, or ``allow_streaming``);
* the KV scheme: the plain cache when it fits, else the TurboQuant cache (K4/V2); streamed, when
  neither fits in VRAM, the cache offloaded to pinned host RAM (moved with each layer's weights);
* the layers kept resident in VRAM and the pinned-RAM tier, through ``plan_layers``;
* the largest batch that still fits at this context.

Everything is arithmetic over the manifests and ``config.json``, so a manifest-only store (no shard
files) can be planned. Hybrid stacks count KV for their attention layers only, plus the fixed state of
their linear-attention / state-space layers per sequence (``airquant.kv.layers``). ``Route.describe()``
is what ``airquant plan`` prints.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, replace
from pathlib import Path
from types import SimpleNamespace
from typing import Literal, Sequence

from airquant.engine.plan import (
    GB,
    MLP_CHUNK_TOKENS,
    WORKSPACE_BYTES,
    Budgets,
    PlanError,
    Reserve,
    StreamPlan,
    dequant_elems,
    fixed_bytes,
    kv_bytes_per_token,
    mlp_chunk_bytes,
    plan_layers,
    reserve_for,
)
from airquant.errors import AirQuantError, StoreError
from airquant.kv.layers import LayerStates
from airquant.store.manifest import Manifest, load_manifest

log = logging.getLogger(__name__)
GIB = 1 << 30
Mode = Literal["auto", "resident", "streamed"]
KVScheme = Literal["none", "tq"]
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
SLOTS = 2  # device buffers for streamed layers (LayerStreamer double-buffers)
STAGING = 3  # host staging buffers when layers come from disk (read-ahead 2, +1 being copied)
DEFAULT_CONTEXT = 2048
RAM_FRACTION = 0.7  # of the available host RAM, when --max-ram is not given
# The TurboQuant preset the router offers (airquant.kv.KVConfig): ~5x smaller than fp16 past the window.
TQ_SETTINGS = dict(backend="tq", bits_k=4, bits_v=2, window=128)


class RouteError(AirQuantError):
    """No store, mode and KV scheme fits the budgets; the message shows the arithmetic and the fixes."""


class StreamingNotAllowedError(RouteError):
    """The model fits only streamed, and streaming is kept off the interactive path."""


# -- inputs ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ModelDims:
    """The shape numbers the memory arithmetic needs, read from the store's ``config.json``."""

    num_layers: int
    heads: int
    hidden: int
    intermediate: int
    kv_heads: int
    head_dim: int
    vocab: int
    max_context: int
    states: LayerStates  # what each layer keeps between steps: KV (attention), a fixed state, nothing

    @classmethod
    def from_config(cls, cfg: dict) -> "ModelDims":
        """From ``config.json``, read through the type's transformers config class where there is one: it
        derives fields from the names a family uses (Nemotron-H's layer pattern, GPT-2's ``n_embd``)."""
        text = _text_config(cfg)
        states = LayerStates.of(text)
        hidden = text.hidden_size
        heads = getattr(text, "num_attention_heads", None) or 1  # a pure state-space stack has none
        return cls(num_layers=getattr(text, "num_hidden_layers", None) or len(states.kinds), heads=heads,
                   hidden=hidden, intermediate=getattr(text, "intermediate_size", None) or 4 * hidden,
                   kv_heads=getattr(text, "num_key_value_heads", None) or heads,
                   head_dim=getattr(text, "head_dim", None) or hidden // heads, vocab=text.vocab_size,
                   max_context=getattr(text, "max_position_embeddings", None) or DEFAULT_CONTEXT, states=states)

    def as_config(self) -> SimpleNamespace:
        """The attributes ``plan.reserve_for`` reads from a transformers config."""
        return SimpleNamespace(num_hidden_layers=self.num_layers, hidden_size=self.hidden,
                               intermediate_size=self.intermediate, num_attention_heads=self.heads,
                               num_key_value_heads=self.kv_heads, head_dim=self.head_dim, vocab_size=self.vocab)

    def kv_bytes(self, scheme: KVScheme, tokens: int, dtype_bytes: int) -> int:
        """KV cache bytes for one sequence of ``tokens`` (plain, or TurboQuant past its window), attention
        layers only (a hybrid stack's fixed state is ``states.state_bytes``)."""
        per_token = kv_bytes_per_token(self.as_config(), dtype_bytes, self.states)
        if scheme == "none":
            return tokens * per_token
        kv = tq_config()
        exact = min(tokens, kv.window + kv.block - 1)  # the recent window stays in the compute dtype
        packed = per_token / (8 * dtype_bytes) * kv.bits_per_element(self.head_dim)
        return int(exact * per_token + (tokens - exact) * packed)


def _text_config(cfg: dict):
    """The text part of ``cfg`` as its transformers config class reads it; as given (attributes of a
    namespace) when transformers does not know the type."""
    from transformers import AutoConfig

    fields = {k: v for k, v in cfg.items() if k != "model_type"}
    try:
        config = AutoConfig.for_model(cfg["model_type"], **fields)
    except (KeyError, ValueError) as exc:
        log.debug("config.json read as is (%s)", exc)
        return SimpleNamespace(**cfg.get("text_config", cfg))
    return config.get_text_config()


@dataclass(frozen=True)
class Candidate:
    """One store of the model: its weight scheme and byte counts."""

    store: Path
    manifest: Manifest
    dims: ModelDims

    @classmethod
    def open(cls, store: str | Path) -> "Candidate":
        store = Path(store)
        manifest = load_manifest(store)
        cfg_path = store / "config.json"
        if not cfg_path.is_file():
            raise StoreError(f"{cfg_path} is missing; re-run `airquant shard` into {store}.")
        return cls(store=store, manifest=manifest, dims=ModelDims.from_config(json.loads(cfg_path.read_text())))

    @property
    def scheme(self) -> str:
        return self.manifest.scheme

    def fixed_bytes(self, host_embedding: bool = False) -> tuple[int, int]:
        """(device, host) bytes of embeddings, final norm and lm_head."""
        return fixed_bytes(self.manifest.shards, self.manifest.tied_lm_head, host_embedding)

    @property
    def layer_bytes(self) -> list[int]:
        return self.manifest.layer_bytes

    @property
    def dense(self) -> bool:
        return self.manifest.quant.get("method", "none") == "none"


def load_candidates(stores: Sequence[str | Path]) -> list[Candidate]:
    """Open every store, check they hold the same model, best quality first."""
    if not stores:
        raise RouteError("no store given: pass at least one store directory.")
    found = [Candidate.open(s) for s in stores]
    first = found[0]
    for c in found[1:]:
        same = (c.manifest.num_layers == first.manifest.num_layers and c.dims == first.dims
                and c.manifest.source.get("model_type") == first.manifest.source.get("model_type"))
        if not same:
            raise RouteError(f"stores {first.store} ({first.manifest.source.get('name')}) and {c.store} "
                             f"({c.manifest.source.get('name')}) hold different models; pass stores of one model "
                             "(one per weight scheme).")
    return sorted(found, key=lambda c: (not c.dense, -sum(c.layer_bytes)))


@dataclass(frozen=True)
class Hardware:
    vram_bytes: int | None  # None: no GPU, everything lives in host RAM
    ram_bytes: int  # host RAM the engine may use
    vram_note: str = ""  # where the figures come from, for describe()
    ram_note: str = ""

    @classmethod
    def detect(cls, device: str = "auto", max_vram_gb: float | None = None,
               max_ram_gb: float | None = None) -> "Hardware":
        """Budgets of this machine; ``max_vram_gb`` (GiB) plans for a GPU of that size even without one."""
        import psutil

        if max_ram_gb is not None:
            ram, ram_note = int(max_ram_gb * GIB), f"--max-ram {max_ram_gb:g} GiB"
        else:
            avail = psutil.virtual_memory().available
            ram, ram_note = int(avail * RAM_FRACTION), f"{RAM_FRACTION:.0%} of {avail / GB:.1f} GB available"
        if max_vram_gb is not None:
            return cls(int(max_vram_gb * GIB), ram, f"--max-vram {max_vram_gb:g} GiB", ram_note)
        if device == "cpu":
            return cls(None, ram, "--device cpu", ram_note)
        import torch

        if not torch.cuda.is_available():
            return cls(None, ram, "torch sees no CUDA GPU", ram_note)
        free, total = torch.cuda.mem_get_info()
        return cls(free, ram, f"free VRAM of {torch.cuda.get_device_name()} ({total / GB:.1f} GB total)", ram_note)


@dataclass(frozen=True)
class Workload:
    batch_size: int = 1
    context: int | None = None  # prompt + new tokens per sequence; None: min(model context, 2048)
    mode: Mode = "auto"
    allow_streaming: bool = True  # "auto" only: may the choice be a streamed engine?
    kv_schemes: tuple[KVScheme, ...] = ("none", "tq")
    resident_layers: int | None = None  # override of the planned VRAM-resident count (streamed)
    dtype: str | None = None  # compute dtype; None: the store's (fp16 computes in fp32 on CPU)
    host_embedding: bool = False  # the untied embedding table stays in host RAM (--host-embedding)
    kv_offload: bool | None = False  # streamed KV cache in host RAM; None: when no cache fits in VRAM


def workload_for(engine, **fields) -> Workload:
    """A Workload taking resident layers, dtype, host embedding and KV offload from an EngineConfig."""
    return Workload(resident_layers=engine.resident_layers, dtype=engine.dtype,
                    host_embedding=engine.host_embedding, kv_offload=engine.kv_offload, **fields)


def tq_config():
    from airquant.kv import KVConfig

    return KVConfig(**TQ_SETTINGS)


# -- arithmetic --------------------------------------------------------------------------------
@dataclass(frozen=True)
class _Costs:
    """Bytes one (store, KV scheme) needs on the budgeted memory: VRAM on a GPU, host RAM on CPU."""

    gpu: bool
    fixed: int  # embeddings, final norm, lm_head on the budgeted memory
    host_fixed: int  # an embedding table kept in host RAM beside a GPU (--host-embedding)
    weights: int  # every decoder layer
    slot: int  # the largest layer: one device slot or host staging buffer
    one: Reserve  # what one sequence needs beside the weights (plan.reserve_for); offloaded: its device KV
    kv_host: int = 0  # an offloaded cache: one sequence's KV in host RAM (every layer)
    mlp_cap: int = 0  # MLP intermediates of a full chunk (plan.MLP_CHUNK_TOKENS tokens)

    def reserve(self, batch: int) -> Reserve:
        # reserve_for is linear in the batch for KV, activations and logits; the MLP chunk grows with the
        # batch's tokens up to a full chunk; dequant and workspace do not grow.
        one = self.one
        return replace(one, kv=batch * one.kv, activations=batch * one.activations, logits=batch * one.logits,
                       mlp=min(batch * one.mlp, self.mlp_cap), state=batch * one.state)

    @property
    def per_seq(self) -> int:
        return self.one.kv + self.one.state + self.one.activations + self.one.logits

    def weights_part(self, mode: str) -> int:
        if mode == "resident":
            return self.fixed + self.weights
        # GPU: two device slots; CPU: layers from the RAM tier are used in place, disk ones need staging.
        return self.fixed + (SLOTS if self.gpu else STAGING) * self.slot

    def need(self, mode: str, batch: int) -> int:
        return self.weights_part(mode) + self.reserve(batch).total

    def max_batch(self, mode: str, budget: int) -> int:
        free = budget - self.weights_part(mode) - self.one.dequant - self.one.workspace
        if free <= 0:
            return 0
        per = max(self.per_seq, 1)
        growing = free // (per + self.one.mlp)  # batches whose MLP chunk is still below a full one
        full = max(0, (free - self.mlp_cap) // per)  # once it is a full chunk
        return max(growing if growing * self.one.mlp <= self.mlp_cap else 0, full)

    def formula(self, mode: str, batch: int) -> str:
        if mode == "resident":
            weights = f"layers {self.weights / GB:.2f}"
        else:
            weights = f"{SLOTS if self.gpu else STAGING} x {self.slot / GB:.3f} {'slots' if self.gpu else 'staging'}"
        r = self.reserve(batch)
        extra = "".join(f" + {name} {value / GB:.2f}" for name, value in
                        (("MLP chunk", r.mlp), ("dequant", r.dequant), ("workspace", r.workspace)) if value)
        kv = f"KV {self.one.kv / GB:.3f}"
        if self.kv_host:
            kv += f" on the device, {self.kv_host / GB:.3f} in host RAM"
        if self.one.state:
            kv += f" + state {self.one.state / GB:.3f}"
        return (f"fixed {self.fixed / GB:.2f} + {weights} + batch {batch} x ({kv} + act "
                f"{(self.one.activations + self.one.logits) / GB:.3f}){extra} = {self.need(mode, batch) / GB:.2f} GB")


def _compute_bytes(c: Candidate, hw: Hardware, dtype: str | None) -> int:
    name = dtype or c.manifest.dtype
    if hw.vram_bytes is None and dtype is None and name == "float16":
        return 4  # the engine computes fp16 stores in fp32 on CPU
    return DTYPE_BYTES.get(name, 2)


def _costs(c: Candidate, kv: KVScheme, hw: Hardware, wl: Workload, context: int, offload: bool = False) -> _Costs:
    width = _compute_bytes(c, hw, wl.dtype)
    gpu = hw.vram_bytes is not None
    config = c.dims.as_config()
    one = reserve_for(config, batch=1, context=context, dtype_bytes=width,
                      dequant_elems=dequant_elems(c.manifest.shards, config), states=c.dims.states)
    kv_bytes = c.dims.kv_bytes(kv, context, width)
    # Offloaded, the device keeps the cache of the layers in flight: one per slot, and the running one's
    # grown copy (plan.plan_layers adds each VRAM-resident layer's share). Only attention layers have one.
    attention = max(len(c.dims.states.attention_layers), 1)
    device_kv = (SLOTS + 1) * kv_bytes // attention if offload else kv_bytes
    one = replace(one, kv=device_kv, workspace=WORKSPACE_BYTES if gpu else 0)
    device, host = c.fixed_bytes(wl.host_embedding)
    return _Costs(gpu=gpu, fixed=device if gpu else device + host, host_fixed=host if gpu else 0,
                  weights=sum(c.layer_bytes), slot=max(c.layer_bytes, default=0), one=one,
                  kv_host=kv_bytes if offload else 0, mlp_cap=mlp_chunk_bytes(config, MLP_CHUNK_TOKENS, width))


# -- the decision ------------------------------------------------------------------------------
@dataclass(frozen=True)
class Route:
    candidate: Candidate
    mode: Literal["resident", "streamed"]
    kv: KVScheme
    plan: StreamPlan
    hardware: Hardware
    batch_size: int
    context: int
    reserve_bytes: int  # KV + activations + dequant + logits + workspace kept free beside the weights
    ram_tier_bytes: int  # pinned host RAM given to streamed layers
    max_batch: int  # largest batch at this context with this store/mode/KV (fewer resident layers)
    lines: tuple[str, ...]  # the arithmetic, in the order it was tried
    kv_offload: bool = False  # the streamed layers' cache lives in pinned host RAM
    dtype_bytes: int = 2  # the compute dtype's width the arithmetic used

    @property
    def store(self) -> Path:
        return self.candidate.store

    @property
    def scheme(self) -> str:
        return self.candidate.scheme

    @property
    def resident_layers(self) -> int:
        return len(self.plan.vram_layers)

    def kv_config(self):
        """The ``kv=`` argument for ``Engine.generate_detailed`` (None: the plain cache)."""
        return tq_config() if self.kv == "tq" else None

    def engine_config(self, base=None):
        """``base`` (an EngineConfig) with the mode, resident layers and RAM tier of this route."""
        from airquant.config import EngineConfig

        base = replace(base or EngineConfig(), batch_size=self.batch_size, context=self.context,
                       reserve_gb=self.reserve_bytes / GIB, kv_offload=self.kv_offload)
        if self.mode == "resident":
            return replace(base, resident=True)
        gpu = self.hardware.vram_bytes is not None
        return replace(base, resident=False, resident_layers=self.resident_layers if gpu else None,
                       max_ram_gb=self.ram_tier_bytes / GIB)

    def describe(self, engine=None) -> str:
        """What ``airquant plan`` prints; ``engine`` (an EngineConfig, None: its defaults) gives the expert
        settings a streamed MoE route sizes its expert pool with (--experts, --expert-cache, ...)."""
        c, d = self.candidate, self.candidate.dims
        head = [
            f"model     : {c.manifest.source.get('name')}, {d.num_layers} layers, hidden {d.hidden}, "
            f"{d.kv_heads} KV heads x {d.head_dim}, context {d.max_context}",
            *([f"cache     : {d.states.describe(self.dtype_bytes)}"] if d.states.hybrid else []),
            *([f"experts   : {text}"] if (text := _experts_text(c.manifest)) else []),
            f"hardware  : {_budget_text(self.hardware)}",
            f"workload  : batch {self.batch_size} x {self.context} tokens (prompt + new)",
            "tried, best quality first:",
        ]
        tail = [
            f"choice    : {self.scheme} from {self.store}: {self.mode}, KV cache "
            f"{'TurboQuant K4/V2' if self.kv == 'tq' else 'plain'}"
            + (", offloaded to pinned host RAM (moved with each layer)" if self.kv_offload else ""),
            self.plan.describe(c.layer_bytes),
            *_expert_pool_lines(self, engine),
            f"max batch : {self.max_batch} sequences of {self.context} tokens with this choice"
            + (" (larger batches keep fewer layers in VRAM)" if self.mode == "streamed" and self.resident_layers
               else ""),
        ]
        return "\n".join(head + [f"  {line}" for line in self.lines] + tail)


def _size(nbytes: float) -> str:
    """GB from 1 GB up, else MB (three significant digits below 10 MB)."""
    if nbytes >= GB:
        return f"{nbytes / GB:.2f} GB"
    mb = nbytes / 1e6
    return f"{mb:.0f} MB" if mb >= 10 else f"{mb:.3g} MB"


def _expert_pool_lines(route: Route, engine) -> list[str]:
    """The expert pool a streamed MoE route opens, sized as the engine sizes it (``experts.open_for``) from the
    VRAM this plan leaves; nothing when the route is resident, the store dense or the experts move whole."""
    from airquant.config import EngineConfig
    from airquant.engine import experts

    cfg, manifest, plan = engine or EngineConfig(), route.candidate.manifest, route.plan
    moe = any(e.experts for e in manifest.shards.values() if e.is_layer)
    routed = experts.routed_layers(manifest, plan.tiers) if moe and route.mode == "streamed" else {}
    if not routed or cfg.experts == "whole":
        return []
    spare = experts.spare_vram(manifest, plan.tiers, plan.fixed_bytes, plan.slots, plan.reserve_bytes, routed,
                               route.hardware.vram_bytes)
    sizing = experts.plan_experts(manifest, spare, cache_gb=cfg.expert_cache_gb, policy=cfg.expert_policy,
                                  speculate=cfg.expert_prefetch)
    lines = [sizing.describe()]
    if spare is not None and sizing.pool_bytes + sizing.gather_bytes > spare:  # open_for refuses this run
        lines.append(f"            does NOT fit the {_size(max(spare, 0))} the layer plan leaves: lower "
                     "--expert-cache, raise --max-vram or use --experts whole")
    return lines


def _experts_text(manifest: Manifest) -> str | None:
    """The largest Mixture-of-Experts layer: its bytes, of which its experts' (the manifest's byte ranges)."""
    moe = [e for e in manifest.shards.values() if e.is_layer and e.experts]
    if not moe:
        return None
    entry = max(moe, key=lambda e: e.bytes)
    per_expert = [sum(end - start for start, end in ranges) for ranges in entry.experts["ranges"]]
    text = (f"layer {_size(entry.bytes)}, of which experts {_size(sum(per_expert))} "
            f"({entry.experts['num']} x {_size(max(per_expert))}, {entry.experts['top_k']} routed per token)")
    if len(moe) < manifest.num_layers:
        text += f"; {len(moe)} of {manifest.num_layers} layers have experts"
    return text


def _budget_text(hw: Hardware) -> str:
    def note(text: str) -> str:
        return f" ({text})" if text else ""

    vram = f"no GPU{note(hw.vram_note)}" if hw.vram_bytes is None else \
        f"VRAM {hw.vram_bytes / GB:.2f} GB{note(hw.vram_note)}"
    return f"{vram}; host RAM {hw.ram_bytes / GB:.2f} GB{note(hw.ram_note)}"


def route(candidates: Sequence[Candidate], hw: Hardware, wl: Workload) -> Route:
    """The best-quality store that fits, resident before streamed, plain KV before TurboQuant."""
    context = _context(candidates[0].dims, wl)
    modes = {"auto": ("resident", "streamed"), "resident": ("resident",), "streamed": ("streamed",)}[wl.mode]
    lines: list[str] = []
    blocked: Route | None = None  # fits only streamed while streaming is not allowed
    for c in candidates:
        for mode in modes:
            for kv, offload in _kv_options(mode, hw, wl):
                found = _attempt(c, mode, kv, hw, wl, context, lines, offload)
                if found is None:
                    continue
                if mode == "streamed" and wl.mode == "auto" and not wl.allow_streaming:
                    blocked = blocked or found
                    continue
                return found
    if blocked is not None:
        raise StreamingNotAllowedError(
            f"{blocked.scheme} from {blocked.store} fits only streamed layer by layer, which is kept off the "
            "interactive path: pass allow_streaming=True (airquant serve --allow-streaming) or submit the prompts "
            "as a batch job (generate_batch); or give a more compressed store.\n" + "\n".join(lines))
    raise RouteError("the model does not fit these budgets with any store, mode or KV scheme:\n"
                     + "\n".join(f"  {line}" for line in lines) + "\n" + _fixes(candidates, hw, wl, context))


def _kv_options(mode: str, hw: Hardware, wl: Workload) -> list[tuple[KVScheme, bool]]:
    """(KV scheme, offloaded) in the order tried: every scheme in VRAM first, then offloaded (streamed, GPU)."""
    can = mode == "streamed" and hw.vram_bytes is not None
    offloads = {False: (False,), True: (True,) if can else (False,), None: (False, True) if can else (False,)}
    return [(kv, offload) for offload in offloads[wl.kv_offload] for kv in wl.kv_schemes]


def _context(dims: ModelDims, wl: Workload) -> int:
    context = wl.context or min(dims.max_context, DEFAULT_CONTEXT)
    if context > dims.max_context:
        raise RouteError(f"context {context} exceeds the model's {dims.max_context} tokens; lower --context.")
    if wl.batch_size < 1 or context < 1:
        raise RouteError(f"batch {wl.batch_size} and context {context} must both be >= 1.")
    return context


def _fixes(candidates: Sequence[Candidate], hw: Hardware, wl: Workload, context: int) -> str:
    fixes = []
    budget = hw.vram_bytes if hw.vram_bytes is not None else hw.ram_bytes
    fixed = min(c.fixed_bytes(wl.host_embedding)[0] for c in candidates)
    if fixed > budget / 2:
        fixes.append(f"embeddings/norm/lm_head alone take {fixed / GB:.2f} of the {budget / GB:.2f} GB"
                     + ("" if wl.host_embedding or hw.vram_bytes is None else
                        ": keep the embedding table in host RAM (--host-embedding) or use a larger GPU"))
    fixes.append("a more compressed store of this model (nf4, int2) passed alongside the others")
    if "tq" not in wl.kv_schemes:
        fixes.append("the TurboQuant KV cache (--kv tq)")
    if wl.kv_offload is False and hw.vram_bytes is not None:
        fixes.append("the KV cache in host RAM (--kv-offload)")
    fixes.append(f"a smaller batch ({wl.batch_size}) or context ({context})" if wl.batch_size > 1
                 else f"a shorter context ({context} tokens)")
    fixes.append("raise --max-vram/--max-ram" if hw.vram_bytes is not None else "raise --max-ram or use a GPU")
    return "fixes: " + "; ".join(fixes) + "."


def _attempt(c: Candidate, mode: str, kv: KVScheme, hw: Hardware, wl: Workload, context: int,
             lines: list[str], offload: bool = False) -> Route | None:
    """The route for this store/mode/KV if it fits; appends the arithmetic either way."""
    costs = _costs(c, kv, hw, wl, context, offload)
    budget, where = (hw.vram_bytes, "VRAM") if costs.gpu else (hw.ram_bytes, "host RAM")
    need = costs.need(mode, wl.batch_size)
    label = f"{c.scheme:<9} {mode:<8} KV {kv:<4}{' offloaded' if offload else ''}: " \
            f"{costs.formula(mode, wl.batch_size)}"
    if need > budget:
        lines.append(f"{label} > {where} {budget / GB:.2f} GB")
        return None
    ram_tier = _ram_tier(costs, mode, hw, wl.batch_size)
    if ram_tier is None:
        lines.append(f"{label} fits {where}, but host RAM {hw.ram_bytes / GB:.2f} GB cannot hold "
                     f"{STAGING} read-ahead buffers of {costs.slot / GB:.3f} GB")
        return None
    plan = _placement(c, costs, mode, hw, wl, ram_tier)
    if plan is None:
        lines.append(f"{label} fits {where}, but --resident-layers {wl.resident_layers} does not")
        return None
    lines.append(f"{label} <= {where} {budget / GB:.2f} GB: fits")
    reserve = plan.reserve_bytes if plan.kv_offload else costs.reserve(wl.batch_size).total
    max_batch = costs.max_batch(mode, budget)
    if costs.kv_host:  # the host holds every sequence's cache beside the read-ahead buffers
        max_batch = min(max_batch, max(0, hw.ram_bytes - costs.host_fixed - STAGING * costs.slot) // costs.kv_host)
    return Route(candidate=c, mode=mode, kv=kv, plan=plan, hardware=hw, batch_size=wl.batch_size,
                 context=context, reserve_bytes=reserve,
                 ram_tier_bytes=ram_tier - plan.kv_host_bytes if mode == "streamed" else 0,
                 max_batch=max_batch, lines=tuple(lines), kv_offload=plan.kv_offload,
                 dtype_bytes=_compute_bytes(c, hw, wl.dtype))


def _ram_tier(costs: _Costs, mode: str, hw: Hardware, batch: int) -> int | None:
    """Host RAM left for pinned layer copies (None: not even the read-ahead buffers fit)."""
    if mode == "resident":
        return 0
    ram = hw.ram_bytes - costs.host_fixed
    if not costs.gpu:  # the fixed parts, KV cache and activations live in host RAM too
        ram -= costs.fixed + costs.reserve(batch).total
    # An offloaded cache is taken off this tier by plan_layers, for the layers it streams.
    host_kv = batch * costs.kv_host
    if costs.weights + host_kv <= ram:
        return ram
    if ram - host_kv < STAGING * costs.slot:
        return None
    return ram - STAGING * costs.slot


def _placement(c: Candidate, costs: _Costs, mode: str, hw: Hardware, wl: Workload,
               ram_tier: int) -> StreamPlan | None:
    n = len(c.layer_bytes)
    reserve = costs.reserve(wl.batch_size).total
    if mode == "resident":
        tier, why = ("vram", "every layer fits in VRAM: loaded once") if costs.gpu else \
            ("ram", "every layer fits in host RAM: loaded once")
        return StreamPlan(tiers=[tier] * n, slot_bytes=costs.slot, slots=0, fixed_bytes=costs.fixed,
                          reasons=[f"resident: {why}, no streaming"], reserve_bytes=reserve,
                          host_fixed_bytes=costs.host_fixed)
    kv = wl.batch_size * costs.kv_host  # offloaded: plan_layers keeps the share of resident layers in VRAM
    if kv:
        reserve += kv - wl.batch_size * costs.one.kv  # the reserve with the whole cache on the device
    budgets = Budgets(vram_bytes=hw.vram_bytes, ram_bytes=ram_tier, resident_layers=wl.resident_layers,
                      slots=SLOTS, reserve_bytes=reserve if costs.gpu else 0, kv_bytes=kv,
                      kv_offload=(True if wl.kv_offload else None) if kv else False,
                      attention_layers=c.dims.states.attention_layers)
    try:
        plan = plan_layers(c.layer_bytes, costs.fixed, budgets)
    except PlanError:
        return None
    if kv and not plan.kv_offload:  # the cache fits in VRAM after all: the option without offload covers it
        return None
    if costs.gpu and wl.resident_layers is not None:
        free = hw.vram_bytes - costs.need("streamed", wl.batch_size)
        if sum(c.layer_bytes[i] for i in plan.vram_layers) > free:
            return None
    # On CPU the reserve is host RAM, already taken off the tier.
    return replace(plan, reserve_bytes=plan.reserve_bytes if kv else reserve, host_fixed_bytes=costs.host_fixed)


def plan_route(stores: Sequence[str | Path], hw: Hardware, wl: Workload) -> Route:
    """``route`` over the stores given by path (what ``airquant plan`` and the Provider call)."""
    return route(load_candidates(stores), hw, wl)
