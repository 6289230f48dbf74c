"""The one planner: a store's manifest, the hardware budgets and the workload in, the placement out.

``airquant plan`` (``router.route``, which also picks the store, mode and KV scheme) and ``Engine.open``
(``runner.placement_for``) both place a streamed run through ``plan``: one budget rule (``Hardware.detect``,
``allocator_margin``), one ``ModelDims``, one reserve, one RAM-tier rule, one set of constants (``SLOTS``,
``READAHEAD``) and one expert-pool sizing. So on the same machine with the same flags they agree.

Everything is arithmetic over the manifest and ``config.json``: nothing is loaded, and no GPU is touched
when ``--max-vram`` is given.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from types import SimpleNamespace
from typing import Literal

import psutil
import torch

from airquant.config import DEFAULT_CONTEXT, EngineConfig
from airquant.engine.memory.placement import (
    WORKSPACE_BYTES,
    Budgets,
    PlanError,
    Reserve,
    StreamPlan,
    dequant_elems,
    expert_intermediate_of,
    fixed_bytes,
    kv_bytes_per_token,
    pass_tokens,
    plan_layers,
    reserve_for,
    top_k_of,
)
from airquant.engine.moe import sizing as expert_plan
from airquant.kv import KVConfig
from airquant.kv.layers import LayerStates
from airquant.layout import upper_bound_config
from airquant.store.manifest import Manifest
from airquant.units import GB, GIB

log = logging.getLogger(__name__)
Mode = Literal["auto", "resident", "streamed"]
KVScheme = Literal["none", "tq"]
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
SLOTS = EngineConfig.slots  # device buffers for streamed layers (declared in airquant/config.py)
READAHEAD = EngineConfig.readahead  # layers read ahead from disk. Staging buffers: READAHEAD + 1
RAM_FRACTION = 0.5  # of the available host RAM when --max-ram is not given: the tiers are pinned, and
# pinning most of the machine's memory starves the page cache the disk tier reads through.
# The CUDA caching allocator rounds blocks up (512 B, 2 MiB segments for large ones) and fragments between
# differently sized blocks, and cuBLAS takes its workspace on first use. With --max-vram the per-process
# fraction is exactly the budget, so a plan filling it to the byte OOMs on the first odd-sized request:
# the plan keeps this much of the budget unplanned (the CUDA context itself is outside the fraction).
MARGIN_FRACTION = 0.03
MARGIN_MIN_BYTES = 256 << 20
# The TurboQuant preset the router offers (airquant.kv.KVConfig): ~5x smaller than fp16 past the window.
TQ_SETTINGS = dict(backend="tq", bits_k=4, bits_v=2, window=128)


def allocator_margin(vram_bytes: int) -> int:
    """VRAM of a budget the plan leaves to the allocator: 3 % of it or 256 MiB, whichever is larger."""
    return max(int(vram_bytes * MARGIN_FRACTION), MARGIN_MIN_BYTES)


def tq_config():
    return KVConfig(**TQ_SETTINGS)


# -- budgets -----------------------------------------------------------------------------------
@dataclass(frozen=True)
class Hardware:
    vram_bytes: int | None  # the GPU budget (None: no GPU, everything lives in host RAM)
    ram_bytes: int  # host RAM the engine may use: the pinned tier, read-ahead buffers, an offloaded cache
    vram_note: str = ""  # where the figures come from, for describe()
    ram_note: str = ""

    @property
    def plan_vram(self) -> int | None:
        """The part of the VRAM budget the plan may fill: the budget less ``allocator_margin``."""
        if self.vram_bytes is None:
            return None
        return max(self.vram_bytes - allocator_margin(self.vram_bytes), 0)

    @classmethod
    def detect(cls, device: str = "auto", max_vram_gb: float | None = None,
               max_ram_gb: float | None = None) -> "Hardware":
        """The one budget rule. VRAM: ``max_vram_gb`` (GiB; plans for a GPU of that size even without one),
        else the free VRAM now (what other processes and the CUDA context hold is not ours). RAM:
        ``max_ram_gb`` (GiB), else ``RAM_FRACTION`` of the available RAM."""
        if max_ram_gb is not None:
            ram, ram_note = int(max_ram_gb * GIB), f"--max-ram {max_ram_gb:g} GiB"
        else:
            avail = psutil.virtual_memory().available
            ram, ram_note = int(avail * RAM_FRACTION), f"{RAM_FRACTION:.0%} of {avail / GB:.1f} GB available"
        if max_vram_gb is not None:
            return cls(int(max_vram_gb * GIB), ram, f"--max-vram {max_vram_gb:g} GiB", ram_note)
        if device == "cpu":
            return cls(None, ram, "--device cpu", ram_note)

        if not torch.cuda.is_available():
            return cls(None, ram, "torch sees no CUDA GPU", ram_note)
        free, total = torch.cuda.mem_get_info()
        return cls(free, ram, f"free VRAM of {torch.cuda.get_device_name()} ({total / GB:.1f} GB total)", ram_note)


# -- the model ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class ModelDims:
    """The shape numbers the memory arithmetic needs, from ``config.json`` or a transformers config."""

    num_layers: int
    heads: int
    hidden: int
    intermediate: int
    kv_heads: int
    head_dim: int
    vocab: int
    max_context: int
    states: LayerStates  # what each layer keeps between steps: KV (attention), a fixed state, nothing
    top_k: int = 0  # a Mixture-of-Experts stack: experts each token routes to (0: dense MLPs)
    expert_intermediate: int = 0  # and one expert's intermediate width

    @classmethod
    def from_config(cls, cfg: dict) -> "ModelDims":
        """From ``config.json``, read through the type's transformers config class where there is one: it
        derives fields from the names a family uses (Nemotron-H's layer pattern, GPT-2's ``n_embd``)."""
        return cls.of(_text_config(cfg))

    @classmethod
    def of(cls, config) -> "ModelDims":
        """From a transformers config (its text part) or a namespace with the same attributes."""
        text = upper_bound_config(config.get_text_config() if hasattr(config, "get_text_config") else config)
        states = LayerStates.of(text)
        hidden = text.hidden_size
        heads = getattr(text, "num_attention_heads", None) or 1  # a pure state-space stack has none
        top_k = top_k_of(text)
        return cls(num_layers=getattr(text, "num_hidden_layers", None) or len(states.kinds), heads=heads,
                   hidden=hidden, intermediate=getattr(text, "intermediate_size", None) or 4 * hidden,
                   kv_heads=getattr(text, "num_key_value_heads", None) or heads,
                   head_dim=getattr(text, "head_dim", None) or hidden // heads, vocab=text.vocab_size,
                   max_context=getattr(text, "max_position_embeddings", None) or DEFAULT_CONTEXT, states=states,
                   top_k=top_k, expert_intermediate=expert_intermediate_of(text) if top_k else 0)

    def as_config(self) -> SimpleNamespace:
        """The attributes ``plan.reserve_for`` reads from a transformers config."""
        return SimpleNamespace(num_hidden_layers=self.num_layers, hidden_size=self.hidden,
                               intermediate_size=self.intermediate, num_attention_heads=self.heads,
                               num_key_value_heads=self.kv_heads, head_dim=self.head_dim, vocab_size=self.vocab,
                               num_experts_per_tok=self.top_k, moe_intermediate_size=self.expert_intermediate)

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

    def context(self, requested: int | None) -> int:
        return requested or min(self.max_context, DEFAULT_CONTEXT)


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


# -- the workload ------------------------------------------------------------------------------
@dataclass(frozen=True)
class Workload:
    """What is placed: the run's settings as given (an ``EngineConfig``: batch, context, dtype, reserve,
    KV offload, expert settings, ...) and what only the router chooses among."""

    engine: EngineConfig = EngineConfig()
    mode: Mode = "auto"  # the router's choice of resident/streamed (the planner places streamed runs)
    allow_streaming: bool = True  # "auto" only: may the choice be a streamed engine?
    kv_schemes: tuple[KVScheme, ...] = ("none", "tq")
    # prefill "chunked": the most tokens one pass holds, when a job knows more than the batch and context say (a
    # TurboQuant prompt longer than a pass is prefilled whole); None: placement.pass_tokens(batch, context).
    pass_tokens: int | None = None

    @property
    def reserve_bytes(self) -> int | None:
        """--reserve as given (its KV part unknown: nothing offloaded by size); None: sized by the planner."""
        return None if self.engine.reserve_gb is None else int(self.engine.reserve_gb * GIB)

    @property
    def expert_cache_bytes(self) -> int | None:
        """--expert-cache as given; None: the cache takes what the layer plan leaves free."""
        return None if self.engine.expert_cache_gb is None else int(self.engine.expert_cache_gb * GIB)

    @property
    def staging(self) -> int:
        """Host staging buffers when layers come from disk (read-ahead, +1 being copied)."""
        return max(1, self.engine.readahead) + 1

    def pass_of(self, batch: int, context: int) -> int | None:
        """The most tokens a forward pass holds (None: prefill whole, every sequence's context at once)."""
        if self.engine.prefill != "chunked":
            return None
        return max(self.pass_tokens or 0, pass_tokens(batch, context))

    def updated(self, **changes) -> "Workload":
        """A copy with ``changes``, each a field of the Workload or of its EngineConfig."""
        return workload_for(self.engine, **{**{k: getattr(self, k) for k in _OWN}, **changes})


_OWN = ("mode", "allow_streaming", "kv_schemes", "pass_tokens")


def workload_for(engine: EngineConfig | None = None, **changes) -> Workload:
    """The Workload of an EngineConfig (its flags), ``changes`` overriding its fields (batch_size, context,
    kv_offload, ...) or setting the router's own (mode, allow_streaming, kv_schemes)."""
    engine = engine or EngineConfig()
    own = {k: v for k, v in changes.items() if k in _OWN}
    return Workload(engine=replace(engine, **{k: v for k, v in changes.items() if k not in own}), **own)


def compute_bytes(store_dtype: str, requested: str | None, gpu: bool) -> int:
    """The compute dtype's width: the store's (or ``requested``); fp16 stores compute in fp32 on CPU."""
    name = requested or store_dtype
    if not gpu and requested is None and name == "float16":
        return 4
    return DTYPE_BYTES.get(name, 2)


# -- the pieces of a plan ----------------------------------------------------------------------
def reserve_of(manifest: Manifest, dims: ModelDims | None, wl: Workload, kv: KVScheme, dtype_bytes: int,
               gpu: bool, batch: int | None = None) -> Reserve:
    """What ``batch`` sequences (default the workload's) need beside the weights, KV cache on the device;
    ``--reserve`` as given when set (or 1 GiB on a GPU when no config says what a sequence takes)."""
    if wl.reserve_bytes is not None or dims is None:
        given = wl.reserve_bytes if wl.reserve_bytes is not None else (GIB if gpu else 0)
        return Reserve(kv=0, activations=0, dequant=0, logits=0, workspace=given)
    batch = wl.engine.batch_size if batch is None else batch
    context = dims.context(wl.engine.context)
    config = dims.as_config()
    tokens = wl.pass_of(batch, context)
    sized = reserve_for(config, batch=batch, context=context, dtype_bytes=dtype_bytes,
                        dequant_elems=dequant_elems(manifest.shards, config), states=dims.states, tokens=tokens)
    kv_bytes = batch * dims.kv_bytes(kv, context, dtype_bytes)
    # The TurboQuant decode attention gathers each slot's history pages (and windows) of the running layer, and
    # reshapes them: two copies of one layer's compressed cache beside it (decode.tqslots.SlotArena.context).
    gather = 2 * kv_bytes // max(len(dims.states.attention_layers), 1) if kv == "tq" else 0
    return replace(sized, kv=kv_bytes, gather=gather, workspace=WORKSPACE_BYTES if gpu else 0)


def stream_bytes(manifest: Manifest, wl: Workload) -> list[int]:
    """What each layer carries through a device slot when streamed: routed MoE layers their dense part."""
    routed = expert_plan.use_routed(wl.engine.experts, manifest, True, wl.engine.batch_size)
    entries = [manifest.shards[f"layer.{i}"] for i in range(manifest.num_layers)]
    return [expert_plan.dense_bytes(e) if routed and e.experts else e.bytes for e in entries]


def ram_tier(hw: Hardware, wl: Workload, layer_bytes: list[int], fixed: int, host_fixed: int, reserve: int,
             host_kv: int = 0, expert_staging: int = 0) -> int:
    """Host RAM left for pinned layer copies: the budget less what lives in host RAM beside them (the
    embedding table kept there; on CPU the fixed parts and the reserve; an offloaded cache) and, when not
    every layer fits, the read-ahead staging buffers and a routed run's expert staging (``expert_staging``
    bytes). A budget below those buffers leaves no pinned tier (``--max-ram 0``: every streamed layer from
    disk); the buffers themselves are always allocated."""
    ram = hw.ram_bytes - host_fixed
    if hw.vram_bytes is None:
        ram -= fixed + reserve
    slot = max(layer_bytes, default=0)
    if sum(layer_bytes) + host_kv <= ram:
        return ram
    return max(ram - wl.staging * slot - expert_staging, 0)


# -- the plan ----------------------------------------------------------------------------------
def plan(manifest: Manifest, dims: ModelDims | None, hw: Hardware, wl: Workload, *, kv: KVScheme = "none",
         dtype_bytes: int = 2) -> StreamPlan:
    """The placement of a streamed run: layers in VRAM / pinned RAM / disk, device slots, reserve, KV
    offload and, for routed MoE layers, the expert arena and cache, all inside ``hw.plan_vram``.

    The expert arena (the working slots and gather of one call, plus a cache fixed by --expert-cache) is
    taken off the budget before resident layers are placed: resident layers give way to it. A cache left
    to the planner (--expert-cache unset) takes what the layers leave. Raises PlanError when the budgets
    cannot hold the minimum."""
    gpu = hw.vram_bytes is not None
    fixed, host_fixed = fixed_bytes(manifest.shards, manifest.tied_lm_head, wl.engine.host_embedding, dtype_bytes)
    reserve = reserve_of(manifest, dims, wl, kv, dtype_bytes, gpu)
    # On CPU an offload is only ever asked for (--kv-offload: the mechanism emulated, for tests); the cache
    # already lives in host RAM, counted in the reserve.
    offload = wl.engine.kv_offload if gpu else wl.engine.kv_offload is True
    tier = ram_tier(hw, wl, manifest.layer_bytes, fixed, host_fixed, reserve.total,
                    reserve.kv if gpu and offload else 0, _expert_staging(manifest, wl, gpu))
    budgets = Budgets(vram_bytes=hw.plan_vram, ram_bytes=tier, resident_layers=wl.engine.resident_layers,
                      slots=wl.engine.slots,
                      reserve_bytes=reserve.total, kv_bytes=reserve.kv, kv_offload=offload,
                      attention_layers=dims.states.attention_layers if dims is not None else None)
    streamed = stream_bytes(manifest, wl)
    placed = _place(manifest, budgets, fixed, streamed, wl)
    # The streamer allocates its staging buffers (each the largest layer) whenever a layer comes from disk.
    staging = wl.staging * max(manifest.layer_bytes, default=0) if placed.disk_layers else 0
    placed = replace(placed, host_fixed_bytes=host_fixed, ram_tier_bytes=tier, vram_budget_bytes=hw.vram_bytes,
                     margin_bytes=0 if hw.vram_bytes is None else hw.vram_bytes - hw.plan_vram,
                     staging_bytes=staging, ram_budget_bytes=hw.ram_bytes,
                     pass_tokens=wl.pass_of(wl.engine.batch_size, dims.context(wl.engine.context))
                     if dims is not None else None,
                     kv_tokens=wl.engine.batch_size * dims.context(wl.engine.context) if reserve.kv else None)
    if placed.experts is not None:  # the pool's host staging, now that the tiers say whether it reads from disk
        pool = replace(placed.experts, staging=expert_plan.staging_buffers(placed.experts, manifest, placed.tiers, gpu))
        placed = replace(placed, experts=pool)
    if gpu and wl.engine.resident_layers is not None and placed.experts_fit and placed.device_bytes > hw.plan_vram:
        raise PlanError(f"--resident-layers {wl.engine.resident_layers} does not fit: the plan takes "
                        f"{placed.device_bytes / GB:.2f} GB of the {hw.plan_vram / GB:.2f} GB it may fill; "
                        "lower --resident-layers or leave it to the planner.")
    return placed


def _place(manifest: Manifest, budgets: Budgets, fixed: int, streamed: list[int], wl: Workload) -> StreamPlan:
    """Layers placed around the expert arena of a routed MoE run (none for dense stores); the experts rule's
    choice (``expert_plan.choose_experts`` at the workload's batch) is a ``why:`` line when MoE layers stream."""
    layers = manifest.layer_bytes
    whole = plan_layers(layers, fixed, budgets, stream_bytes=streamed)
    choice = experts_choice(manifest, wl, budgets.vram_bytes is not None)
    routed = expert_plan.routed_layers(manifest, whole.tiers)  # the streamed MoE layers
    if routed and choice.host:
        choice = _host_tier_check(whole, routed, choice, wl)
        if choice.host:
            if budgets.vram_bytes is not None and wl.engine.dense_resident and not whole.kv_offload:
                whole = _dense_resident(manifest, whole, fixed, budgets, 0, streamed)
            whole.reasons.append(choice.why)
            return replace(whole, experts_host=True)
    if routed and choice.why:
        whole.reasons.append(choice.why)
    if not routed or not choice.routed:  # a dense store, whole layers, or every layer resident: no pool
        return whole
    if budgets.vram_bytes is None:  # CPU: the pool is host memory, nothing to plan on a device
        return replace(whole, experts=_size_pool(manifest, wl, None, expert_plan.fused_prefill(manifest, "cpu"),
                                                 device="cpu"))
    placed = _place_pool(manifest, budgets, fixed, streamed, wl, whole, choice, fused=False)
    if expert_plan.fused_prefill(manifest, "cuda"):
        why = _starved(manifest, wl, placed) if placed.experts_fit else "the expert arena would not fit"
        if why:
            fused = _place_pool(manifest, budgets, fixed, streamed, wl, whole, choice, fused=True)
            if fused.experts_fit:
                fused.reasons.append(f"routed prefills by the fused kernels from the expert slots: with the gather "
                                     f"and the stacked decode planned, {why} (a prefill then decodes each expert "
                                     "in its own tiles, slower than stacked)")
                return fused
    return placed


def _starved(manifest: Manifest, wl: Workload, placed: StreamPlan) -> str | None:
    """What the decode loses to a routed plan's prefill arena (the gather and the stacked decode), or None: a
    dense part of a streamed routed layer not kept in VRAM, or an expert hot set (planner-sized) smaller than the
    experts one step routes. Only then does the plan give the arena's bytes to the decode and run prefills by
    the fused kernels from the slots (``expert_plan.fused_prefill``).

    Why not always: those kernels decode each expert's tiles inside the product, at ~100-160 G NF4 elements a
    second, where the stacked path decodes an expert once at bitsandbytes' speed and multiplies with cuBLAS.
    H100, moe_bench batch 1, hot set (wave3_moe26): Qwen3-30B-A3B under 4 GB prefilled 1024 tokens in 0.72 s
    against 0.26, but decoded at 0.0178 s a step against 0.0263 (its dense parts and a 707-expert hot set in
    VRAM, against the dense parts streamed and 238 experts); Mixtral-8x7B under 15 GB, whose stacked plan kept
    its dense parts and 85 cached experts, decoded alike (0.0336 / 0.0337 s) and prefilled 128 tokens in 0.92 s
    against 0.40."""
    routed = expert_plan.routed_layers(manifest, placed.tiers)
    in_ram = [i for i in routed if placed.tiers[i] == "ram"]
    if wl.engine.dense_resident and not placed.kv_offload and len(placed.dense_layers) < len(in_ram):
        return f"{len(in_ram) - len(placed.dense_layers)} dense parts of streamed MoE layers would not stay in VRAM"
    need = routed_per_step(manifest, routed, wl.engine.batch_size)
    if wl.expert_cache_bytes is None and placed.experts.cache < need:
        return f"the expert hot set would hold {placed.experts.cache} experts, fewer than the {need} a step routes"
    return None


def _place_pool(manifest: Manifest, budgets: Budgets, fixed: int, streamed: list[int], wl: Workload,
                whole: StreamPlan, choice, fused: bool) -> StreamPlan:
    """The layers placed around a routed run's expert arena on a GPU (``fused``: prefills by the fused kernels
    from the slots, no gather and no stacked decode planned)."""
    layers = manifest.layer_bytes
    sizing = _size_pool(manifest, wl, 0, fused)
    arena = sizing.arena_bytes
    try:
        placed = plan_layers(layers, fixed, replace(budgets, vram_bytes=budgets.vram_bytes - arena),
                             stream_bytes=streamed)
    except PlanError:  # not even the arena fits beside the floor: say so (the engine refuses to open)
        return replace(whole, experts=sizing, experts_fit=False, expert_bytes=arena)
    if wl.engine.dense_resident and not placed.kv_offload:
        streaming = placed
        placed = _dense_resident(manifest, placed, fixed, budgets, arena, streamed)
        if wl.expert_cache_bytes is None and placed.dense_layers:
            placed = _dense_or_hot_set(manifest, wl, budgets, streaming, placed, fused)
    if wl.expert_cache_bytes is None:  # the cache takes what the resident layers leave
        left = budgets.vram_bytes - placed.device_bytes
        sizing = _size_pool(manifest, wl, left, fused)
        arena = sizing.arena_bytes
    placed = replace(placed, reasons=list(placed.reasons))  # its own list: the unfused plan's stays as it was
    placed.reasons.append(choice.why)
    placed.reasons.append(f"expert arena {sizing.work} working + {sizing.cache} cache slots and gather "
                          f"({arena / GB:.2f} GB) planned inside the VRAM budget, before resident layers")
    return replace(placed, experts=sizing, expert_bytes=arena)


def _dense_resident(manifest: Manifest, placed: StreamPlan, fixed: int, budgets: Budgets, arena: int,
                    streamed: list[int]) -> StreamPlan:
    """``placed`` with the dense parts of its streamed routed layers kept in VRAM (``--dense-resident``), as many
    as fit in layer order, placed before resident whole layers and before the expert cache.

    Why first: a decode step reads every layer's dense part (attention, norms, router), but only the routed few
    of its experts, and a cached expert pays only when it is routed again. Qwen3-30B-A3B NF4 at batch 1 under a
    4 GB cap moved 0.54 GB of dense parts a step over the link and 0.10 GB of experts with a 369-slot hot set
    (H200, wave3_moe14): the dense parts were most of the step's bytes, and their copies most of its host calls.
    Only RAM-tier layers: their experts are read from the tier, and a disk-tier layer is read whole anyway. Experts
    computed on the host (``arena`` 0) keep the attention on the GPU the same way, as llama.cpp's --n-cpu-moe does."""
    def candidates(plan: StreamPlan) -> list[int]:
        return [i for i in expert_plan.routed_layers(manifest, plan.tiers) if plan.tiers[i] == "ram"]

    want = sum(streamed[i] for i in candidates(placed))
    if not want:
        return placed
    try:  # room for every dense part first; resident whole layers take what is left of the budget
        first = plan_layers(manifest.layer_bytes, fixed, replace(budgets, vram_bytes=budgets.vram_bytes - arena - want),
                            stream_bytes=streamed)
        if not first.kv_offload:  # an offloaded cache moves with each layer's copy: it keeps its layers streamed
            placed = first
    except PlanError:  # not beside the floor: as many as the plan without them leaves room for
        pass
    room = budgets.vram_bytes - arena - placed.device_bytes
    layers = candidates(placed)
    chosen, total = [], 0
    for i in layers:
        if total + streamed[i] <= room:
            chosen.append(i)
            total += streamed[i]
    if not chosen:
        return placed
    why = (f"MoE dense parts of {len(chosen)} of {len(layers)} streamed routed layers kept in VRAM "
           f"({total / GB:.2f} GB): every decode step reads them, and only the routed few of their experts"
           + ("" if len(chosen) == len(layers) else "; the rest do not fit"))
    return replace(placed, dense_layers=chosen, dense_bytes=total, reasons=[*placed.reasons, why])


def routed_per_step(manifest: Manifest, routed: dict, batch: int) -> int:
    """The (layer, expert) pairs one decode step routes at most: each streamed routed layer's top-k per sequence,
    at most its experts."""
    experts = (manifest.shards[f"layer.{i}"].experts for i in routed)
    return sum(min(e["num"], e["top_k"] * batch) for e in experts)


def _dense_or_hot_set(manifest: Manifest, wl: Workload, budgets: Budgets, streaming: StreamPlan,
                      kept: StreamPlan, fused: bool = False) -> StreamPlan:
    """``kept`` (dense parts in VRAM) where the expert hot set the planner then sizes still holds every expert one
    step routes; else ``streaming`` (dense parts streamed) with the hot set the larger by their bytes.

    Why: below that size each hot-set slot is hit often and saves reads of experts in place from host RAM, which
    run well under the link for small experts, while a dense part streams at the link overlapped with them.
    Qwen3-30B-A3B NF4, batch 1, 4 GB cap (H100, moe_bench, one run): dense parts kept, 187 cache slots, hit 0.35,
    0.0295 s a step; streamed, 369 slots, hit 0.68, 0.0203 s (a step routes 384). Without a cache, 0.0353 s against
    0.0356: kept dense parts only pay where they take nothing from the hot set."""
    need = routed_per_step(manifest, expert_plan.routed_layers(manifest, kept.tiers), wl.engine.batch_size)
    slots = _size_pool(manifest, wl, budgets.vram_bytes - kept.device_bytes, fused).cache
    if slots >= need:
        return kept
    grown = _size_pool(manifest, wl, budgets.vram_bytes - streaming.device_bytes, fused).cache
    why = (f"MoE dense parts streamed: kept in VRAM ({kept.dense_bytes / GB:.2f} GB) they would leave the expert hot "
           f"set {slots} slots, fewer than the {need} experts a step routes; streamed, it holds {grown}")
    return replace(streaming, reasons=[*streaming.reasons, why])


def experts_choice(manifest: Manifest, wl: Workload, gpu: bool) -> expert_plan.ExpertsChoice:
    """``expert_plan.choose_experts`` at the workload's batch, with its figures (given, or airquant doctor's) where
    there is a link to weigh the host against (a GPU)."""
    figures = expert_plan.figures_for(wl.engine.host_gemv_gbps, wl.engine.link_gbps) if gpu else None
    return expert_plan.choose_experts(wl.engine.experts, manifest, True, wl.engine.batch_size, figures)


def _host_tier_check(whole: StreamPlan, routed: dict[int, set[str]], choice: expert_plan.ExpertsChoice,
                     wl: Workload) -> expert_plan.ExpertsChoice:
    """Experts computed on the host are read from the RAM tier, so every streamed MoE layer must be in it:
    ``--experts cpu`` is refused otherwise, ``auto`` copies them to the GPU instead."""
    on_disk = [i for i in routed if whole.tiers[i] == "disk"]
    if not on_disk:
        return choice
    if wl.engine.experts == "cpu":
        raise PlanError(f"--experts cpu computes experts from the host RAM tier, but {len(on_disk)} streamed MoE "
                        f"layers (first: layer {on_disk[0]}) do not fit the RAM budget and would be read from "
                        "disk at every step; raise --max-ram, or use --experts routed (copied to the GPU).")
    return replace(choice, host=False, why=f"{choice.why}; but {len(on_disk)} MoE layers are on disk, not in "
                                           "the RAM tier, so their experts are copied to the GPU")


def _expert_staging(manifest: Manifest, wl: Workload, gpu: bool) -> int:
    """Host bytes a routed run's expert staging takes when a routed layer comes from disk (one buffer per
    working slot, on a GPU): the RAM tier leaves room for it as for the read-ahead buffers."""
    if not gpu or not expert_plan.use_routed(wl.engine.experts, manifest, True, wl.engine.batch_size) or \
            experts_choice(manifest, wl, gpu).host:
        return 0
    sizing = _size_pool(manifest, wl, None)
    return sizing.work * sizing.slot_bytes


def _size_pool(manifest: Manifest, wl: Workload, spare: int | None, fused: bool = False,
               device: str = "cuda") -> expert_plan.ExpertPlan:
    """The expert pool's sizes on ``device``; ``fused``: routed prefills by the fused kernels from the slots,
    without the gather and the stacked decode (``_starved``)."""
    run = wl.engine
    return expert_plan.plan_experts(manifest, spare, cache_bytes=wl.expert_cache_bytes, policy=run.expert_policy,
                                    speculate=run.expert_prefetch, fused=fused, device=device,
                                    tokens=run.batch_size * (run.context or DEFAULT_CONTEXT))
