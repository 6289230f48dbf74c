"""Which store, mode, KV scheme and placement to run a workload with, and the arithmetic behind it.

The router sits above the layer planner (``plan.py``): given one or more stores of the same model
(one weight scheme each), the hardware budgets and the workload (batch size, context), it picks

* the weight scheme: the best quality that fits. Quality is ranked by bytes per weight (dense stores
  first, then the larger quantized store): for one model, more bits per weight mean less error;
* the mode: resident when every layer fits with room for the KV cache and activations, streamed
  otherwise (only where streaming is allowed: batch work, or ``allow_streaming``);
* the KV scheme: the plain cache when it fits, else the TurboQuant cache (K4/V2); streamed, when
  neither fits in VRAM, the cache offloaded to pinned host RAM (moved with each layer's weights);
* the layers kept resident in VRAM, the pinned-RAM tier and a routed MoE run's expert pool, through
  ``planner.plan`` (the function ``Engine.open`` places its layers with: the two agree);
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
from typing import Literal, Sequence

from airquant.config import MLP_CHUNK_TOKENS, EngineConfig
from airquant.engine.memory.placement import (
    PASS_TOKENS,
    PlanError,
    Reserve,
    StreamPlan,
    fixed_bytes,
    mlp_chunk_bytes,
)
from airquant.engine.memory.planner import (
    DTYPE_BYTES,
    TQ_SETTINGS,
    Hardware,
    KVScheme,
    Mode,
    ModelDims,
    Workload,
    compute_bytes,
    plan,
    reserve_of,
    stream_bytes,
    tq_config,
    workload_for,
)
from airquant.engine.moe.sizing import first_whole_batch
from airquant.errors import AirQuantError, StoreError
from airquant.store.manifest import Manifest, load_manifest
from airquant.units import GB

log = logging.getLogger(__name__)
# Re-exported: the budgets, the model's dimensions and the workload are the planner's (engine/memory/planner.py).
__all__ = ["DTYPE_BYTES", "TQ_SETTINGS", "Candidate", "Hardware", "KVScheme",
           "Mode", "ModelDims", "Route", "RouteError", "StreamingNotAllowedError", "Workload", "load_candidates",
           "plan_route", "route", "tq_config", "workload_for"]


class RouteError(AirQuantError):
    """No store, mode and KV scheme fits the budgets; the message shows the arithmetic and the fixes."""


class StreamingNotAllowedError(RouteError):
    """The model fits only streamed, and streaming is kept off the interactive path."""


# -- inputs ------------------------------------------------------------------------------------
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

    def fixed_bytes(self, host_embedding: bool = False, dtype_bytes: int | None = None) -> tuple[int, int]:
        """(device, host) bytes of embeddings, final norm and lm_head; a host embedding table held in a
        ``dtype_bytes``-wide compute dtype (None: as stored), as ``planner.plan`` counts it."""
        return fixed_bytes(self.manifest.shards, self.manifest.tied_lm_head, host_embedding, dtype_bytes)

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


# -- arithmetic --------------------------------------------------------------------------------
@dataclass(frozen=True)
class _Costs:
    """Bytes one (store, KV scheme) needs on the budgeted memory: VRAM on a GPU, host RAM on CPU."""

    gpu: bool
    fixed: int  # embeddings, final norm, lm_head on the budgeted memory
    host_fixed: int  # an embedding table kept in host RAM beside a GPU (--host-embedding)
    weights: int  # every decoder layer
    slot: int  # what the largest streamed layer carries through a device slot (or host staging buffer)
    one: Reserve  # what one sequence needs beside the weights (planner.reserve_of); offloaded: its device KV
    buffers: int  # device slots (GPU) or staging buffers (CPU) a streamed run holds
    fixed_reserve: bool  # --reserve as given: it does not grow with the batch
    kv_host: int = 0  # an offloaded cache: one sequence's KV in host RAM (every layer)
    mlp_cap: int = 0  # MLP intermediates of a full chunk (plan.MLP_CHUNK_TOKENS tokens)
    act_cap: int = 0  # --prefill chunked: the activations of the decode loop's largest pass (0: no cap)

    def reserve(self, batch: int) -> Reserve:
        # reserve_for is linear in the batch for KV, activations and logits; the MLP chunk grows with the
        # batch's tokens up to a full chunk, the activations (chunked prefill) up to a pass's; dequant and
        # workspace do not grow.
        one = self.one
        activations = batch * one.activations
        return replace(one, kv=batch * one.kv, activations=min(activations, self.act_cap or activations),
                       logits=batch * one.logits, mlp=min(batch * one.mlp, self.mlp_cap), state=batch * one.state,
                       gather=batch * one.gather)

    @property
    def per_seq(self) -> int:
        return self.one.kv + self.one.state + self.one.gather + self.one.activations + self.one.logits

    def weights_part(self, mode: str) -> int:
        if mode == "resident":
            return self.fixed + self.weights
        # GPU: the device slots; CPU: layers from the RAM tier are used in place, disk ones need staging.
        # A routed MoE run's expert arena is not counted here: planner.plan places it, and the plan says
        # when it does not fit (the engine then refuses to open with the fix).
        return self.fixed + self.buffers * self.slot

    def need(self, mode: str, batch: int) -> int:
        return self.weights_part(mode) + self.reserve(batch).total

    def max_batch(self, mode: str, budget: int, batch: int = 1) -> int:
        free = budget - self.weights_part(mode) - self.one.dequant - self.one.workspace
        if free <= 0:
            return 0
        if self.fixed_reserve:  # --reserve as given says nothing of what one sequence takes
            return batch
        per = max(self.per_seq, 1)
        growing = free // (per + self.one.mlp)  # batches whose MLP chunk (and activations) are below their caps
        below = growing * self.one.mlp <= self.mlp_cap and (
            not self.act_cap or growing * self.one.activations <= self.act_cap)
        # Past the caps: a full MLP chunk, and with chunked prefill one pass's activations whatever the batch.
        capped = self.act_cap or 0
        full = max(0, (free - self.mlp_cap - capped) // max(per - (self.one.activations if capped else 0), 1))
        return max(growing if below else 0, full)

    def formula(self, mode: str, batch: int) -> str:
        if mode == "resident":
            weights = f"layers {self.weights / GB:.2f}"
        else:
            weights = f"{self.buffers} x {self.slot / GB:.3f} {'slots' if self.gpu else 'staging'}"
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
    return compute_bytes(c.manifest.dtype, dtype, hw.vram_bytes is not None)


def _activation_cap(one: Reserve, wl: Workload, context: int) -> int:
    """Chunked prefill: the activations of the loop's largest pass, the pass of any batch past ``PASS_TOKENS``
    sequences' worth (``Workload.pass_of``); 0 (no cap) when a batch is prefilled whole or --reserve is given."""
    tokens = wl.pass_of(PASS_TOKENS, context) if wl.reserve_bytes is None else None
    return one.activations * tokens // context if tokens else 0


def _costs(c: Candidate, kv: KVScheme, hw: Hardware, wl: Workload, context: int, offload: bool = False) -> _Costs:
    width = _compute_bytes(c, hw, wl.engine.dtype)
    gpu = hw.vram_bytes is not None
    wl = wl.updated(context=context)
    one = reserve_of(c.manifest, c.dims, wl, kv, width, gpu, batch=1)
    kv_bytes = c.dims.kv_bytes(kv, context, width)
    # Offloaded, the device keeps the cache of the layers in flight: one per slot, and the running one's
    # grown copy (plan.plan_layers adds each VRAM-resident layer's share). Only attention layers have one.
    attention = max(len(c.dims.states.attention_layers), 1)
    if offload and wl.reserve_bytes is None:
        one = replace(one, kv=(wl.engine.slots + 1) * kv_bytes // attention)
    device, host = c.fixed_bytes(wl.engine.host_embedding, width)
    return _Costs(gpu=gpu, fixed=device if gpu else device + host, host_fixed=host if gpu else 0,
                  weights=sum(c.layer_bytes), slot=max(stream_bytes(c.manifest, wl) if gpu else c.layer_bytes,
                                                       default=0),
                  one=one, kv_host=kv_bytes if offload else 0,
                  mlp_cap=mlp_chunk_bytes(c.dims.as_config(), MLP_CHUNK_TOKENS, width),
                  act_cap=_activation_cap(one, wl, context),
                  buffers=wl.engine.slots if gpu else wl.staging,
                  fixed_reserve=wl.reserve_bytes is not None)


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
    # What the route was tried with; a streamed route's is what planner.plan placed it with (describe re-plans).
    workload: Workload = Workload()

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
        """The ``kv=`` argument for ``Engine.generate`` (None: the plain cache)."""
        return tq_config() if self.kv == "tq" else None

    def engine_config(self, base: EngineConfig | None = None) -> EngineConfig:
        """``base`` (default: the settings the route was planned with) with what the route chose: mode,
        batch, context, KV cache and offload, resident layers. Budgets stay as the user gave them (GiB):
        open the engine with ``placement=route.plan`` to run this placement, or plan with
        ``hardware=route.hardware`` to place it again with the budgets the route detected."""
        base = replace(base or self.workload.engine, batch_size=self.batch_size, context=self.context,
                       kv_offload=self.kv_offload, kv_cache=self.kv)
        if self.mode == "resident":
            return replace(base, resident=True)
        gpu = self.hardware.vram_bytes is not None
        return replace(base, resident=False, resident_layers=self.resident_layers if gpu else None)

    def describe(self, engine=None) -> str:
        """What ``airquant plan`` prints; ``engine`` (an EngineConfig) gives other expert settings to size a
        streamed MoE route's expert pool with (--experts, --expert-cache, ...) than the route was planned with."""
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
            self._replanned(engine).describe(c.layer_bytes),
            f"max batch : {self.max_batch} sequences of {self.context} tokens with this choice"
            + (" (larger batches keep fewer layers in VRAM)" if self.mode == "streamed" and self.resident_layers
               else ""),
        ]
        return "\n".join(head + [f"  {line}" for line in self.lines] + tail)


    def _replanned(self, engine: EngineConfig | None) -> StreamPlan:
        """The plan, re-placed by the planner when ``engine``'s expert settings differ from the route's."""
        if engine is None or self.mode != "streamed":
            return self.plan
        wl = self.workload.updated(experts=engine.experts, expert_cache_gb=engine.expert_cache_gb,
                                   expert_policy=engine.expert_policy, expert_prefetch=engine.expert_prefetch,
                                   dense_resident=engine.dense_resident, host_gemv_gbps=engine.host_gemv_gbps,
                                   link_gbps=engine.link_gbps)
        if wl == self.workload:
            return self.plan
        try:
            return plan(self.candidate.manifest, self.candidate.dims, self.hardware, wl, kv=self.kv,
                        dtype_bytes=self.dtype_bytes)
        except PlanError as exc:
            log.info("with %s the plan does not fit: %s", engine, exc)
            return self.plan


def _size(nbytes: float) -> str:
    """GB from 1 GB up, else MB (three significant digits below 10 MB)."""
    if nbytes >= GB:
        return f"{nbytes / GB:.2f} GB"
    mb = nbytes / 1e6
    return f"{mb:.0f} MB" if mb >= 10 else f"{mb:.3g} MB"


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
    return [(kv, offload) for offload in offloads[wl.engine.kv_offload] for kv in wl.kv_schemes]


def _context(dims: ModelDims, wl: Workload) -> int:
    context = dims.context(wl.engine.context)
    if context > dims.max_context:
        raise RouteError(f"context {context} exceeds the model's {dims.max_context} tokens; lower --context.")
    if wl.engine.batch_size < 1 or context < 1:
        raise RouteError(f"batch {wl.engine.batch_size} and context {context} must both be >= 1.")
    return context


def _fixes(candidates: Sequence[Candidate], hw: Hardware, wl: Workload, context: int) -> str:
    fixes = []
    budget = hw.vram_bytes if hw.vram_bytes is not None else hw.ram_bytes
    fixed = min(c.fixed_bytes(wl.engine.host_embedding)[0] for c in candidates)
    if fixed > budget / 2:
        fixes.append(f"embeddings/norm/lm_head alone take {fixed / GB:.2f} of the {budget / GB:.2f} GB"
                     + ("" if wl.engine.host_embedding or hw.vram_bytes is None else
                        ": keep the embedding table in host RAM (--host-embedding) or use a larger GPU"))
    fixes.append("a more compressed store of this model (nf4, int2) passed alongside the others")
    if "tq" not in wl.kv_schemes:
        fixes.append("the TurboQuant KV cache (--kv tq)")
    if wl.engine.kv_offload is False and hw.vram_bytes is not None:
        fixes.append("the KV cache in host RAM (--kv-offload)")
    fixes.append(f"a smaller batch ({wl.engine.batch_size}) or context ({context})" if wl.engine.batch_size > 1
                 else f"a shorter context ({context} tokens)")
    fixes.append("raise --max-vram/--max-ram" if hw.vram_bytes is not None else "raise --max-ram or use a GPU")
    return "fixes: " + "; ".join(fixes) + "."


def _attempt(c: Candidate, mode: str, kv: KVScheme, hw: Hardware, wl: Workload, context: int,
             lines: list[str], offload: bool = False) -> Route | None:
    """The route for this store/mode/KV if it fits; appends the arithmetic either way. On a GPU the budget
    is ``hw.plan_vram``: the VRAM budget less the allocator's margin (planner.allocator_margin)."""
    costs = _costs(c, kv, hw, wl, context, offload)
    budget, where = (hw.plan_vram, "VRAM") if costs.gpu else (hw.ram_bytes, "host RAM")
    need = costs.need(mode, wl.engine.batch_size)
    label = f"{c.scheme:<9} {mode:<8} KV {kv:<4}{' offloaded' if offload else ''}: " \
            f"{costs.formula(mode, wl.engine.batch_size)}"
    if need > budget:
        lines.append(f"{label} > {where} {budget / GB:.2f} GB")
        return None
    try:
        placed, planned = _placement(c, costs, mode, kv, hw, wl.updated(context=context), offload)
    except PlanError as exc:
        lines.append(f"{label} fits {where}, but {exc}")
        return None
    if placed is None:
        return None  # the offloaded option whose cache fits on the device after all: the plain option covers it
    lines.append(f"{label} <= {where} {budget / GB:.2f} GB: fits")
    reserve = placed.reserve_bytes if placed.kv_offload else costs.reserve(wl.engine.batch_size).total
    max_batch = _max_batch(c, costs, mode, kv, hw, wl, context, offload, budget)
    if costs.kv_host:  # the host holds every sequence's cache beside the read-ahead and expert staging buffers
        host = hw.ram_bytes - costs.host_fixed - wl.staging * max(c.layer_bytes) - placed.expert_staging_bytes
        max_batch = min(max_batch, max(0, host) // costs.kv_host)
    return Route(candidate=c, mode=mode, kv=kv, plan=placed, hardware=hw, batch_size=wl.engine.batch_size,
                 context=context, reserve_bytes=reserve,
                 ram_tier_bytes=placed.ram_tier_bytes - placed.kv_host_bytes if mode == "streamed" else 0,
                 max_batch=max_batch, lines=tuple(lines), kv_offload=placed.kv_offload,
                 dtype_bytes=_compute_bytes(c, hw, wl.engine.dtype), workload=planned or wl.updated(context=context))


def _max_batch(c: Candidate, costs: _Costs, mode: str, kv: KVScheme, hw: Hardware, wl: Workload, context: int,
               offload: bool, budget: int) -> int:
    """The largest batch, counted with the slots of the experts mode the rule picks at that batch: a MoE store
    streamed routed at the planned batch streams whole layers (larger slots) from ``first_whole_batch`` on."""
    largest = costs.max_batch(mode, budget, wl.engine.batch_size)
    flip = first_whole_batch(wl.engine.experts, c.manifest) if mode == "streamed" and costs.gpu else None
    if flip is None or wl.engine.batch_size >= flip or largest < flip:
        return largest
    whole = _costs(c, kv, hw, wl.updated(batch_size=flip), context, offload).max_batch(mode, budget, flip)
    return whole if whole >= flip else flip - 1


def _placement(c: Candidate, costs: _Costs, mode: str, kv: KVScheme, hw: Hardware, wl: Workload,
               offload: bool) -> tuple[StreamPlan | None, Workload | None]:
    """The placement of this option (and the workload planner.plan placed it with): resident, every layer
    loaded once; streamed, ``planner.plan``, the engine's own planner. None: an offloaded option whose
    cache turned out to fit on the device. Raises PlanError when the option does not fit."""
    n = len(c.layer_bytes)
    if mode == "resident":
        tier, why = ("vram", "every layer fits in VRAM: loaded once") if costs.gpu else \
            ("ram", "every layer fits in host RAM: loaded once")
        return StreamPlan(tiers=[tier] * n, slot_bytes=costs.slot, slots=0, fixed_bytes=costs.fixed,
                          reasons=[f"resident: {why}, no streaming"],
                          reserve_bytes=costs.reserve(wl.engine.batch_size).total,
                          host_fixed_bytes=costs.host_fixed), None
    # The offloaded option: asked for (--kv-offload), or (None) when the cache does not fit in VRAM.
    planned = wl.updated(kv_offload=(True if wl.engine.kv_offload else None) if offload else False)
    placed = plan(c.manifest, c.dims, hw, planned, kv=kv, dtype_bytes=_compute_bytes(c, hw, wl.engine.dtype))
    if offload and not placed.kv_offload:
        return None, None
    return placed, planned


def plan_route(stores: Sequence[str | Path], hw: Hardware, wl: Workload) -> Route:
    """``route`` over the stores given by path (what ``airquant plan`` and the Provider call)."""
    return route(load_candidates(stores), hw, wl)
