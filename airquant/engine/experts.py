"""Expert-aware streaming for Mixture-of-Experts layers: route first, then move only the routed experts.

A MoE layer's dense part (attention, norms, router, shared experts) goes through the streamer's slots as
before; its experts stay in host memory. When the block calls its experts module, the routing of the batch
is known (``top_k_index``): the union of routed experts is copied, one contiguous slice per expert tensor
(the manifest's byte ranges), into a device **expert pool** of fixed-size slots, and the experts run from
there. The pool is the arena of the experts a call needs plus a **cache**: slots keep their (store shard,
layer, expert) key until the policy (LRU, or LFU with decay) evicts them, and a hit skips the copy.

Ordering on CUDA (the copy stream is the streamer's): a copy into a slot waits for the last gather that
read the slot (``free``); the gather waits for the copy into each slot it reads (``ready``). The gather
packs the routed experts into [U, ...] tensors on the compute stream, so the slots are free again as
soon as it ran: layer i+1's speculated experts copy while layer i's experts compute.

Speculative prefetch (at most ``SPECULATE_TOKENS`` tokens in the call): layer i+1's router is applied to
layer i's expert input to guess i+1's experts, whose copies start at once; a wrong guess costs bandwidth.
"""

from __future__ import annotations

import logging
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch
from safetensors import safe_open

from airquant.engine import expert_compute
from airquant.errors import AirQuantError
from airquant.layout import swap_tensor
from airquant.store.manifest import Manifest, ShardEntry

log = logging.getLogger(__name__)
ExpertsMode = Literal["auto", "whole", "routed"]
Policy = Literal["lru", "lfu"]
EXPERTS_CHOICES = ("auto", "whole", "routed")
POLICY_CHOICES = ("lru", "lfu")
SPECULATE_TOKENS = 8  # speculation pays at decode batch sizes; larger batches route nearly every expert
ALIGN = 64  # every tensor of a slot starts on this boundary, so byte views reinterpret as any dtype
LFU_DECAY = 0.9  # per call of the pool: a count from 32 layers (one Mixtral step) ago weighs 0.03
CACHE_FRACTION = 0.9  # of the VRAM the plan leaves free, the rest is allocator slack


class ExpertsError(AirQuantError):
    """An expert-streaming option that cannot apply to this store or run."""


# -- sizing (pure) -------------------------------------------------------------------------------
@dataclass(frozen=True)
class ExpertPlan:
    """The expert pool of a routed run: ``work`` slots any one call may need, ``cache`` more kept warm."""

    slot_bytes: int  # one expert's tensors, each aligned
    work: int  # slots a call's routed experts (and a speculation) need at once
    cache: int  # further slots holding recently/frequently used experts
    gather_bytes: int  # the [U, ...] tensors a call packs its experts into (U <= experts per layer)
    decode_bytes: int = 0  # quantized experts decoded at once as stacked dense weights, and the decode's temporaries
    compute_bytes: int = 0  # intermediates of one grouped call (``call_tokens`` tokens; expert_compute)
    call_tokens: int = 0  # tokens a grouped call takes at most: a longer prefill runs in chunks of this many
    policy: Policy = "lfu"
    speculate: bool = True
    staging: int = 0  # host buffers (slot_bytes each) disk-tier experts are read into (``staging_buffers``)

    @property
    def slots(self) -> int:
        return self.work + self.cache

    @property
    def pool_bytes(self) -> int:
        return self.slots * self.slot_bytes

    @property
    def staging_bytes(self) -> int:
        """Host RAM of the staging buffers (a part of the host budget, ``StreamPlan.host_parts``)."""
        return self.staging * self.slot_bytes

    @property
    def arena_bytes(self) -> int:
        """Everything the routed path holds on the device beside the layers: pool, gather, stacked decode
        with its temporaries, and the grouped call's intermediates."""
        return self.pool_bytes + self.gather_bytes + self.decode_bytes + self.compute_bytes

    def describe(self) -> str:
        gb = 1e9
        return (f"experts   : routed; pool {self.slots} slots x {self.slot_bytes / 1e6:.1f} MB = "
                f"{self.pool_bytes / gb:.2f} GB ({self.work} working + {self.cache} cache, {self.policy.upper()}), "
                f"gather {self.gather_bytes / gb:.2f} GB, stacked decode {self.decode_bytes / gb:.2f} GB, "
                f"expert compute {self.compute_bytes / gb:.2f} GB ({self.call_tokens} tokens a call), "
                f"speculative prefetch "
                f"{'on' if self.speculate else 'off'} (batch <= {SPECULATE_TOKENS})"
                + (f", host staging {self.staging} x {self.slot_bytes / 1e6:.1f} MB" if self.staging else ""))


def aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def expert_slot_bytes(entry: ShardEntry) -> int:
    """Bytes of one expert of a MoE layer in a pool slot (its tensor slices, each aligned)."""
    if not entry.experts:
        return 0
    return max(sum(aligned(end - start) for start, end in ranges) for ranges in entry.experts["ranges"])


def dense_bytes(entry: ShardEntry) -> int:
    """A layer's bytes less its experts: what the streamer's slot carries in routed mode."""
    experts = sum(end - start for ranges in entry.experts.get("ranges", []) for start, end in ranges)
    return entry.bytes - experts


# Model types whose experts cannot be moved by routing, and why: ``auto`` streams their layers whole.
NOT_ROUTED = {
    "jetmoe": "its experts (the attention's query/output experts and the MLP's) are called through "
              "map/reduce and per-expert token splits, not as an experts module given a routing index",
}


# ``auto`` streams experts routed while one decode step is expected to route fewer than this share of a
# layer's experts, whole layers from it on. Why 0.6: on the H200 (results/moe_bench.json, Mixtral-8x7B NF4,
# GPU capped to 15 GB) a whole-layer step took 0.475 s at 0.99 of the link, a routed step at batch 1 0.31 s
# for 25 % of the experts (no cache). Those bytes (with the dense part, ~27 % of a layer) take ~0.13 s at the
# link, so routed pays ~0.13-0.18 s a step of its own (less what wrongly speculated experts moved): the host
# sync on each layer's routing, the gather, the copy launches. That cost hardly grows with the experts moved
# (a call's copies are issued as one batch), so routed breaks even near 60-70 % of a layer's experts (near
# 40 % were it to grow in proportion). 0.6 streams Mixtral routed up to batch 3 and Qwen3-30B-A3B up to
# batch 14; at batch 256 routed moves every expert anyway (at 512: 26.1 GB a step, 4.56 s) and is slower.
ROUTED_BELOW = 0.6


@dataclass(frozen=True)
class ExpertsChoice:
    """How a run streams its experts, and why (the plan's ``why:`` line; empty when there is nothing to say)."""

    routed: bool
    why: str = ""


def routed_share(top_k: int, num: int, batch: int) -> float:
    """The expected share of a layer's ``num`` experts that ``batch`` sequences (one token each, ``top_k``
    experts each) route to in a decode step, routing near-uniform: 1 - (1 - k/E)^B. Mixtral (2 of 8): batch
    1 0.25, 8 0.90; Qwen3-30B-A3B (8 of 128): batch 1 0.0625, 16 0.64. A skewed router routes fewer."""
    return 1.0 - (1.0 - min(top_k, num) / num) ** max(batch, 0)


def choose_experts(mode: ExpertsMode, manifest: Manifest, streamed: bool, batch: int | None = None) -> ExpertsChoice:
    """The one rule of how a streamed MoE store moves its experts (planner, ``Engine.open``, ``airquant plan``):
    ``whole`` moves whole layers; ``routed`` only the experts a call routes to (forced, whatever the batch);
    ``auto`` routed while ``batch`` sequences route fewer than ``ROUTED_BELOW`` of a layer's experts a decode
    step (``batch`` None, not known: routed), and never for types in ``NOT_ROUTED``. The batch is the one the
    run is opened for: a decode loop whose slots fill and drain keeps the mode chosen then."""
    moe = [e for e in manifest.shards.values() if e.is_layer and e.experts]
    if mode == "routed" and not moe:
        raise ExpertsError("--experts routed was asked for, but this store has no Mixture-of-Experts layer; "
                           "use --experts auto (or whole).")
    if mode == "routed" and not streamed:
        raise ExpertsError("--experts routed needs a streamed run; drop --resident (or use --experts auto).")
    if not moe or not streamed:
        return ExpertsChoice(False)
    if mode == "whole":
        return ExpertsChoice(False, "experts whole layers (--experts whole)")
    model_type = (manifest.source or {}).get("model_type")
    if (why := NOT_ROUTED.get(model_type)) is not None:
        if mode == "routed":
            raise ExpertsError(f"--experts routed cannot run {model_type}: {why}; use --experts auto (or whole).")
        log.info("experts   : whole layers for %s (%s)", model_type, why)
        return ExpertsChoice(False, f"experts whole layers for {model_type}: {why}")
    rule = f"auto streams routed below {ROUTED_BELOW * 100:.0f} %"
    if batch is None:
        return ExpertsChoice(True, f"experts routed: the batch is not known ({rule} of a layer's experts a step)")
    top = max(moe, key=lambda e: routed_share(e.experts["top_k"], e.experts["num"], batch)).experts
    share = routed_share(top["top_k"], top["num"], batch)
    routes = (f"batch {batch} routes ~{share * 100:.0f} % of {top['num']} experts per step "
              f"(top-{top['top_k']} per token)")
    if mode == "routed":
        return ExpertsChoice(True, f"experts routed (--experts routed): {routes}"
                             + ("" if share < ROUTED_BELOW else f"; {rule}, so auto would stream whole layers"))
    routed = share < ROUTED_BELOW
    return ExpertsChoice(routed, f"experts {'routed' if routed else 'whole layers'}: {routes}; {rule}")


def use_routed(mode: ExpertsMode, manifest: Manifest, streamed: bool, batch: int | None = None) -> bool:
    """Whether a run streams experts routed (``choose_experts``)."""
    return choose_experts(mode, manifest, streamed, batch).routed


def first_whole_batch(mode: ExpertsMode, manifest: Manifest) -> int | None:
    """The smallest batch from which ``mode`` streams this store's layers whole where a batch of one streams
    them routed (``auto``), None where the batch changes nothing. The router sizes its largest batch with it."""
    if mode != "auto" or not use_routed(mode, manifest, True, 1):
        return None
    batch = 2
    while use_routed(mode, manifest, True, batch):  # the share grows with the batch: double, then bisect
        if batch >= 1 << 16:  # a share that never reaches the threshold (one expert of a huge pool)
            return None
        batch *= 2
    low = batch // 2  # routed at low, whole at batch
    while batch - low > 1:
        mid = (low + batch) // 2
        low, batch = (mid, batch) if use_routed(mode, manifest, True, mid) else (low, mid)
    return batch


def plan_experts(manifest: Manifest, spare_bytes: int | None, *, cache_gb: float | None = None,
                 policy: Policy = "lfu", speculate: bool = True, width: int = 2, device: str = "cuda",
                 tokens: int | None = None) -> ExpertPlan:
    """Size the pool: ``work`` slots for the experts of one call (every expert of a layer, as a prefill
    routes them, plus one speculated batch), and ``cache`` slots from ``cache_gb`` or, when None, from
    the VRAM the layer plan leaves free (``spare_bytes``; None on CPU: no cache). The decode and compute
    terms are for a ``width``-byte compute dtype on a ``device`` (``expert_compute.DECODE_TEMP_PER_ELEM``), and
    calls of at most ``tokens`` tokens (the batch's prompt and new tokens; None: as many as a call may get)."""
    moe = [e for e in manifest.shards.values() if e.is_layer and e.experts]
    if not moe:
        raise ExpertsError("the store has no Mixture-of-Experts layer to stream by expert.")
    slot = max(expert_slot_bytes(e) for e in moe)
    num = max(e.experts["num"] for e in moe)
    top_k = max(e.experts["top_k"] for e in moe)
    guess = min(num, SPECULATE_TOKENS * top_k) if speculate else 0
    work = num + guess
    gather = num * slot
    shapes = [expert_matrices(e) for e in moe]
    # Bounded whatever the batch (expert_compute): stacked weights of one decode chunk and its temporaries,
    # and the intermediates of one grouped call of at most call_tokens tokens.
    decode = max(m.decode_bytes(e.experts["num"], width, device) for m, e in zip(shapes, moe))
    caps = [min(c, tokens) if c and tokens else c or tokens for c in map(call_cap, moe)]
    compute = max(m.compute_bytes(width, cap) for m, cap in zip(shapes, caps))
    tokens = min(m.call_tokens(width, cap) for m, cap in zip(shapes, caps))
    total = sum(e.experts["num"] for e in moe)
    if cache_gb is not None:
        cache = int(cache_gb * 1e9) // slot
    elif spare_bytes is None:
        cache = 0
    else:
        cache = max(int((spare_bytes - (work * slot + gather + decode + compute)) * CACHE_FRACTION), 0) // slot
    cache = min(cache, max(total - num, 0))  # more than every other expert of the store is never used
    return ExpertPlan(slot_bytes=slot, work=work, cache=cache, gather_bytes=gather, decode_bytes=decode,
                      compute_bytes=compute, call_tokens=tokens, policy=policy, speculate=speculate)


def call_cap(entry: ShardEntry) -> int | None:
    """The most tokens one call of the layer's experts module gets: a module inside the block's ``mlp`` runs
    ``MLP_CHUNK_TOKENS`` at a time (skeleton.chunk_mlp); elsewhere a call may get the whole prefill."""
    from airquant.engine.plan import MLP_CHUNK_TOKENS

    return MLP_CHUNK_TOKENS if _common_module(tuple(entry.experts["tensors"])).startswith("mlp.") else None


def expert_matrices(entry: ShardEntry) -> expert_compute.ExpertMatrices:
    """One expert's matrices of a MoE layer, from its manifest entry: quantized modules (their dense
    ``shape``, and whether their scheme decodes stacked) and dense [E, a, b] expert tensors."""
    from airquant.quant import make_linear

    module = _common_module(tuple(entry.experts["tensors"]))
    shapes, quantized, stacks = [], [], []
    for name, meta in entry.modules.items():
        if "experts" in meta and name.startswith(f"{module}."):
            out_f, in_f = meta["shape"]
            with torch.device("meta"):
                one = make_linear(meta, in_f, out_f, False, compute_dtype=torch.bfloat16)
            shapes.append((out_f, in_f))
            quantized.append(True)
            stacks.append(hasattr(one, "dequantize_stacked"))
    for name in entry.experts["tensors"]:
        meta = entry.tensors[name]
        if meta.get("scheme", "dense") == "dense" and "float" in meta.get("dtype", "") and len(meta["shape"]) == 3:
            shapes.append(tuple(meta["shape"][1:]))
            quantized.append(False)
            stacks.append(False)
    return expert_compute.ExpertMatrices(tuple(shapes), int(entry.experts["top_k"]), tuple(quantized),
                                         tuple(stacks))


# -- the pool's bookkeeping ------------------------------------------------------------------------
class SlotTable:
    """Which key each slot holds, and which slot to evict: least recently used, or least frequently used
    with the counts decayed by ``LFU_DECAY`` per call (so experts hot long ago fade out)."""

    def __init__(self, slots: int, policy: Policy):
        if policy not in POLICY_CHOICES:
            raise ExpertsError(f"expert cache policy {policy!r} is not one of {POLICY_CHOICES}.")
        self.policy, self.tick = policy, 0
        self.key_of: list[tuple | None] = [None] * slots
        self.slot_of: dict[tuple, int] = {}
        self.score = [0.0] * slots
        self.stamp = [0] * slots

    def lookup(self, key: tuple) -> int | None:
        return self.slot_of.get(key)

    def touch(self, slot: int) -> None:
        if self.policy == "lru":
            self.score[slot] = float(self.tick)
        else:
            self.score[slot] = self._decayed(slot) + 1.0
        self.stamp[slot] = self.tick

    def _decayed(self, slot: int) -> float:
        return self.score[slot] * LFU_DECAY ** (self.tick - self.stamp[slot])

    def victim(self, keep: set[int]) -> int:
        """An empty slot, else the policy's choice among those not in ``keep``."""
        free = [s for s, k in enumerate(self.key_of) if k is None and s not in keep]
        if free:
            return free[0]
        rank = (lambda s: self.score[s]) if self.policy == "lru" else self._decayed
        candidates = [s for s in range(len(self.key_of)) if s not in keep]
        if not candidates:
            raise AssertionError("every expert slot is held by the current call; the pool is undersized")
        return min(candidates, key=rank)

    def assign(self, slot: int, key: tuple) -> None:
        self.forget(slot)
        self.key_of[slot], self.slot_of[key] = key, slot
        self.score[slot], self.stamp[slot] = 0.0, self.tick

    def forget(self, slot: int) -> None:
        old = self.key_of[slot]
        if old is not None:
            del self.slot_of[old]
        self.key_of[slot] = None


@dataclass(frozen=True)
class LayerExperts:
    """One MoE layer's experts: their tensors (names inside the block), where each expert's slices sit in
    the shard's data section, and where they sit inside a pool slot."""

    index: int
    top_k: int
    module: str  # the experts module, e.g. "mlp.experts"
    names: tuple[str, ...]  # its tensors, relative to the module ("gate_up_proj", "down_proj.absmax", ...)
    dtypes: tuple[torch.dtype, ...]
    shapes: tuple[tuple[int, ...], ...]  # per expert (the stored shape less its leading expert dim)
    dense: tuple[bool, ...]  # a dense floating tensor (cast to the compute dtype), not a quantized payload
    offsets: tuple[int, ...]  # inside a slot
    ranges: tuple[tuple[tuple[int, int], ...], ...]  # [expert][tensor] (start, end) in the data section
    key: str  # the shard's identity: a cache key never matches another store's or a rewritten shard's
    path: Path
    data_offset: int

    @classmethod
    def of(cls, index: int, entry: ShardEntry, layout, store: Path) -> "LayerExperts":
        full = tuple(entry.experts["tensors"])
        module = _common_module(full)
        specs = {name: (dtype, shape) for name, dtype, shape, _, _ in layout.tensors}
        offsets, at = [], 0
        for start, end in entry.experts["ranges"][0]:
            offsets.append(at)
            at += aligned(end - start)
        return cls(index=index, top_k=int(entry.experts["top_k"]), module=module, names=tuple(n[len(module) + 1:] for n in full),
                   dtypes=tuple(specs[n][0] for n in full), shapes=tuple(tuple(specs[n][1][1:]) for n in full),
                   dense=tuple(entry.tensors[n].get("scheme", "dense") == "dense" and specs[n][0].is_floating_point
                               for n in full),
                   offsets=tuple(offsets), ranges=tuple(tuple(map(tuple, r)) for r in entry.experts["ranges"]),
                   key=f"{(store / entry.file).resolve()}:{entry.sha256}", path=layout.path,
                   data_offset=layout.data_offset)

    @property
    def full_names(self) -> tuple[str, ...]:
        return tuple(f"{self.module}.{n}" for n in self.names)

    def expert_bytes(self, e: int) -> int:
        return sum(end - start for start, end in self.ranges[e])


def _common_module(names: tuple[str, ...]) -> str:
    """The experts module the stacked tensors belong to (``mlp.experts.gate_up_proj`` -> ``mlp.experts``)."""
    parents = {n.split(".experts.")[0] + ".experts" if ".experts." in n else n.rpartition(".")[0] for n in names}
    if len(parents) != 1 or any(n.split(".")[len(next(iter(parents)).split(".")):][0].isdigit() for n in names):
        raise ExpertsError(f"experts stored as {sorted(names)[:3]}... are not one fused experts module; "
                           "expert-aware streaming needs transformers 5's fused layout (use --experts whole).")
    return parents.pop()


def router_weights(block, entry: ShardEntry, module: str) -> str | None:
    """The name of the router's [E, H] weight beside the experts module (None: not found, no speculation)."""
    parent = module.rpartition(".")[0]
    num = entry.experts["num"]
    for name, meta in entry.tensors.items():
        if name.startswith(f"{parent}.") and name.endswith("weight") and name.count(".") == parent.count(".") + 2 \
                and len(meta["shape"]) == 2 and meta["shape"][0] == num and meta.get("scheme", "dense") == "dense":
            return name
    return None


def load_router(entry: ShardEntry, store: Path, name: str, device: torch.device, dtype: torch.dtype):
    with safe_open(store / entry.file, "pt", device="cpu") as f:
        return f.get_tensor(name).to(device=device, dtype=dtype)


# -- wiring ---------------------------------------------------------------------------------------
def routed_layers(manifest: Manifest, tiers: list[str]) -> dict[int, set[str]]:
    """The streamed MoE layers and their expert tensors: what the streamer leaves for the pool to move."""
    out = {}
    for i in range(manifest.num_layers):
        entry = manifest.shards[f"layer.{i}"]
        if entry.experts and tiers[i] != "vram":
            out[i] = set(entry.experts["tensors"])
    return out


def staging_buffers(plan: ExpertPlan, manifest: Manifest, tiers: list[str], gpu: bool) -> int:
    """Host staging buffers the pool needs under ``tiers``: one per working slot on a GPU when a routed layer
    is read from disk (its experts are read into one, then copied into the slot). A RAM-tier layer's experts
    are copied from the tier itself, and on CPU the pool reads straight into its slots: none."""
    on_disk = any(tiers[i] == "disk" for i in routed_layers(manifest, tiers))
    return plan.work if gpu and on_disk else 0


def open_pool(store: Path, manifest: Manifest, streamer, routed: dict[int, set[str]], plan: ExpertPlan,
              model_layers, device: torch.device, dtype: torch.dtype) -> "ExpertPool":
    """The pool of a routed run over ``streamer``'s host tiers and copy stream, routers loaded to speculate."""
    layers, routers = {}, {}
    for i in routed:
        entry = manifest.shards[f"layer.{i}"]
        layers[i] = LayerExperts.of(i, entry, streamer.layouts[i], store)
        name = router_weights(model_layers[i], entry, layers[i].module) if plan.speculate else None
        if name is not None:
            routers[i] = load_router(entry, store, name, device, dtype)
    return ExpertPool(layers, plan, device, dtype, streamer.ops, streamer.memory, streamer.host_bytes, routers)


def open_for(engine, routed: dict[int, set[str]]) -> "ExpertPool":
    """The pool of an ``Engine`` whose streamer leaves ``routed`` layers' experts behind, exactly as its plan
    sized it (``planner.plan``: the arena inside the VRAM budget, the staging inside the host budget).
    Nothing is re-decided here: a plan without a pool, or whose arena does not fit, is refused."""
    plan, manifest = engine.plan, engine.manifest
    sizing = plan.experts
    if sizing is None:
        raise ExpertsError("this run streams experts routed, but its plan has no expert pool (it was made with "
                           "--experts whole, or for another store); plan it with the run's own --experts flags "
                           "(or leave the plan to Engine.open).")
    if not plan.experts_fit:
        raise ExpertsError(f"the expert pool ({sizing.pool_bytes / 1e9:.2f} GB), gather "
                           f"({sizing.gather_bytes / 1e9:.2f} GB), stacked decode ({sizing.decode_bytes / 1e9:.2f} GB) "
                           f"and expert compute ({sizing.compute_bytes / 1e9:.2f} GB) do not fit the "
                           f"{plan.arena_room_bytes / 1e9:.2f} GB "
                           "the layer plan leaves; lower --expert-cache, raise --max-vram or use --experts whole.")
    log.info("%s", sizing.describe())
    layers = skeleton_layers(engine.model)
    return open_pool(engine.store, manifest, engine.streamer, routed, sizing, layers, engine.device, engine.dtype)


def skeleton_layers(model) -> list:
    from airquant.layout import find_layout

    return list(model.get_submodule(find_layout(model).stack))


class RoutedForward:
    """Stands in for an experts module's ``forward``: the pool brings the routed experts, then runs it."""

    def __init__(self, pool: "ExpertPool", index: int, module, forward):
        self.pool, self.index, self.module, self.forward = pool, index, module, forward

    def __call__(self, *args, **kwargs):
        return self.pool.run(self.index, self.module, self.forward, args, kwargs)


# -- the pool at run time ----------------------------------------------------------------------------
class ExpertPool:
    """Owns the device expert slots, their events, the host staging for disk reads and the counters.

    ``host_bytes(i)`` gives layer i's data section in host memory, or None when it is on disk only
    (the routed experts' ranges are then read from the shard file)."""

    def __init__(self, layers: dict[int, LayerExperts], plan: ExpertPlan, device: torch.device,
                 compute_dtype: torch.dtype, ops, memory, host_bytes, routers: dict[int, torch.Tensor]):
        self.layers, self.plan, self.device, self.compute_dtype = layers, plan, device, compute_dtype
        self.ops, self.host_bytes, self.routers = ops, host_bytes, routers
        self.table = SlotTable(plan.slots, plan.policy)
        self.mem = (ops.alloc(plan.pool_bytes) if ops is not None else torch.empty(plan.pool_bytes, dtype=torch.uint8)
                    ).view(plan.slots, plan.slot_bytes)
        self.ready: list[object] = [None] * plan.slots  # copy into the slot done (event)
        self.free: list[object] = [None] * plan.slots  # last gather out of the slot done (event)
        # Exactly the staging the plan counted in the host budget (ExpertPlan.staging: none unless a routed
        # layer is read from disk on a GPU; on CPU disk reads go straight into the slots).
        self._staging = [memory.empty(plan.slot_bytes) for _ in range(plan.staging)] if ops is not None else []
        self._staging_free: list[object] = [None] * len(self._staging)
        self._next_staging = 0
        self.guessed: dict[int, set[int]] = {}  # layer -> experts speculated for it, not yet routed
        self.current: int | None = None
        self.grouped = True  # grouped matmul over the packed experts (False: the module's own forward)
        self.stats = {"bytes_copied": 0, "copied": 0, "hits": 0, "routed": 0, "guessed": 0, "guess_used": 0,
                      "guess_bytes": 0}

    @property
    def bytes_copied(self) -> int:
        return self.stats["bytes_copied"]

    def staging_held(self) -> int:
        """Host bytes of the staging buffers (``Engine.host_memory``'s expert_staging)."""
        return sum(b.numel() for b in self._staging)

    def reset_stats(self) -> None:
        self.stats = dict.fromkeys(self.stats, 0)

    def report(self) -> dict:
        s = self.stats
        return {**s, "hit_rate": s["hits"] / s["routed"] if s["routed"] else None,
                "speculation_recall": s["guess_used"] / s["routed"] if s["guessed"] else None,
                "speculation_precision": s["guess_used"] / s["guessed"] if s["guessed"] else None}

    # -- one call of a layer's experts -------------------------------------------------------------
    def run(self, i: int, module, forward, args: tuple, kwargs: dict) -> torch.Tensor:
        """The experts module's ``forward`` on the batch, its routed experts brought into the pool first."""
        hidden = args[0] if args else next(iter(kwargs.values()))
        index = _routing(args, kwargs)
        if index is None:
            if not expert_compute.dispatched(module):
                raise ExpertsError("an experts module was called without a routing index; "
                                   "use --experts whole for this model.")
            return self._run_dispatched(i, module, forward, hidden)
        layer = self.layers[i]
        union = torch.unique(index).tolist()  # the one host sync: which experts to move
        slots = self._acquire(i, layer, union)
        packed = self._gather(layer, slots)
        if self.plan.speculate and hidden.reshape(-1, hidden.shape[-1]).shape[0] <= SPECULATE_TOKENS:
            self._speculate(i + 1, hidden, keep=set(slots))
        lookup = torch.zeros(max(union) + 1, dtype=index.dtype, device=index.device)
        lookup[torch.tensor(union, device=index.device)] = torch.arange(len(union), dtype=index.dtype,
                                                                        device=index.device)
        args, kwargs = _with_index(args, kwargs, lookup[index])  # expert ids -> rows of the packed tensors
        grouped = expert_compute.grouped_forward(module) if self.grouped and len(args) == 3 and not kwargs \
            else None
        with _packed_into(module, packed, len(union)):
            if grouped is None:
                return forward(*args, **kwargs)
            return expert_compute.run_grouped(module, grouped, *args, num=len(union),
                                               tokens=self.plan.call_tokens or None)

    def _run_dispatched(self, i: int, module, forward, hidden: torch.Tensor) -> torch.Tensor:
        """Llama 4: tokens spread over every expert ([E * T, H]); only experts with a non-zero row run."""
        layer = self.layers[i]
        num = len(layer.ranges)
        rows, union = expert_compute.dispatched_union(hidden, num)
        out = torch.zeros_like(rows)
        if not union:
            return out.reshape(hidden.shape)
        slots = self._acquire(i, layer, union)
        packed = self._gather(layer, slots)
        if self.plan.speculate and rows.shape[1] <= SPECULATE_TOKENS:
            # Each token's rows are positive multiples of its hidden state: their sum routes like it.
            self._speculate(i + 1, rows.sum(dim=0), keep=set(slots))
        chosen = torch.tensor(union, device=hidden.device)
        with _packed_into(module, packed, len(union)):
            part = forward(rows.index_select(0, chosen).reshape(-1, hidden.shape[-1]))
        out.index_copy_(0, chosen, part.reshape(len(union), -1, part.shape[-1]).to(out.dtype))
        return out.reshape(hidden.shape)

    def _acquire(self, i: int, layer: LayerExperts, union: list[int]) -> list[int]:
        table = self.table
        table.tick += 1
        if i != self.current and self.plan.cache == 0:  # no cache: only this layer's (and speculated) stay
            for slot, key in enumerate(table.key_of):
                if key is not None and key[1] != i:
                    table.forget(slot)
        self.current = i
        guessed = self.guessed.pop(i, set())
        self.stats["guess_used"] += len(guessed & set(union))
        self.stats["routed"] += len(union)
        slots, keep, missing = {}, set(), []
        for e in union:
            slot = table.lookup((layer.key, i, e))
            if slot is None:
                missing.append(e)
            else:
                slots[e] = slot
                keep.add(slot)
        self.stats["hits"] += len(union) - len(missing)
        self._copy_in(i, layer, missing, keep, slots)
        for slot in slots.values():
            table.touch(slot)
        return [slots[e] for e in union]

    def _copy_in(self, i: int, layer: LayerExperts, experts: list[int], keep: set[int], slots: dict) -> None:
        """Slots for ``experts`` (evicting by policy, never a slot in ``keep``) and their copies queued."""
        for e in experts:
            slot = self.table.victim(keep)
            self.table.assign(slot, (layer.key, i, e))
            keep.add(slot)
            slots[e] = slot
        if not experts:
            return
        src = self.host_bytes(i)
        targets = [(slots[e], e) for e in experts]
        if self.ops is None:
            for slot, e in targets:
                for (start, end), off in zip(layer.ranges[e], layer.offsets):
                    self.mem[slot, off:off + end - start].copy_(src[start:end] if src is not None else
                                                                _read(layer, start, end))
        else:
            self._copy_cuda(layer, targets, src)
        moved = sum(layer.expert_bytes(e) for e in experts)
        self.stats["bytes_copied"] += moved
        self.stats["copied"] += len(experts)

    def _copy_cuda(self, layer: LayerExperts, targets: list[tuple[int, int]], src) -> None:
        """The copies of a call in one batch on the copy stream: one per expert tensor slice from the RAM
        tier, one per expert from a staging buffer (disk), after the gathers that last read the slots."""
        stream = self.ops.stream
        with torch.cuda.stream(stream):
            for event in {id(self.free[s]): self.free[s] for s, _ in targets if self.free[s] is not None}.values():
                stream.wait_event(event)
            staged = []
            for slot, e in targets:
                if src is not None:
                    for (start, end), off in zip(layer.ranges[e], layer.offsets):
                        self.mem[slot, off:off + end - start].copy_(src[start:end], non_blocking=True)
                else:
                    k = self._fill_staging(layer, e)
                    self.mem[slot].copy_(self._staging[k], non_blocking=True)
                    staged.append(k)
            done = torch.cuda.Event()
            done.record(stream)
        for slot, _ in targets:
            self.ready[slot] = done
        for k in staged:
            self._staging_free[k] = done

    def _fill_staging(self, layer: LayerExperts, e: int) -> int:
        if not self._staging:
            raise ExpertsError(f"layer {layer.index}'s experts are read from disk, but the plan gave the expert pool "
                               "no host staging buffer; open the engine with a plan of this run's tiers "
                               "(planner.plan, or leave the plan to Engine.open).")
        k = self._next_staging
        self._next_staging = (k + 1) % len(self._staging)
        if self._staging_free[k] is not None:
            self._staging_free[k].synchronize()  # its previous copy out has run
        buf = self._staging[k]
        for (start, end), off in zip(layer.ranges[e], layer.offsets):
            buf[off:off + end - start].copy_(_read(layer, start, end))
        return k

    def _gather(self, layer: LayerExperts, slots: list[int]) -> dict[str, torch.Tensor]:
        """The routed experts packed into [U, ...] tensors (one device gather); the slots are free after it."""
        if self.ops is not None:
            for event in {id(self.ready[s]): self.ready[s] for s in slots if self.ready[s] is not None}.values():
                self.ops.wait(event)
        rows = self.mem.index_select(0, torch.tensor(slots, device=self.mem.device))  # [U, slot_bytes]
        if self.ops is not None:
            mark = self.ops.mark()
            for s in slots:
                self.free[s] = mark
        out = {}
        for name, dtype, shape, off, (start, end), dense in zip(layer.names, layer.dtypes, layer.shapes,
                                                                layer.offsets, layer.ranges[0], layer.dense):
            t = rows[:, off:off + end - start].view(dtype).view(len(slots), *shape)
            out[name] = t.to(self.compute_dtype) if dense and dtype != self.compute_dtype else t
        return out

    def _speculate(self, j: int, hidden: torch.Tensor, keep: set[int]) -> None:
        """Guess layer j's experts with its router on this layer's expert input; start their copies."""
        router, layer = self.routers.get(j), self.layers.get(j)
        if router is None or layer is None or self.host_bytes(j) is None:
            return  # not a routed MoE layer, or its bytes are not in host memory yet (no blocking read)
        flat = hidden.reshape(-1, hidden.shape[-1]).to(router.dtype)
        top_k = min(len(layer.ranges), layer.top_k)
        guess = torch.unique((flat @ router.t()).topk(top_k, dim=-1).indices).tolist()  # [T, k] -> ids
        missing = [e for e in guess if self.table.lookup((layer.key, j, e)) is None]
        self.guessed[j] = set(guess)
        self.stats["guessed"] += len(guess)
        before = self.stats["bytes_copied"]
        slots: dict = {}
        self._copy_in(j, layer, missing, set(keep), slots)
        self.stats["guess_bytes"] += self.stats["bytes_copied"] - before
        for slot in slots.values():
            self.table.touch(slot)


def _read(layer: LayerExperts, start: int, end: int) -> torch.Tensor:
    """Bytes [start, end) of a layer's data section, read from its shard file (a disk-tier layer)."""
    buf = torch.empty(end - start, dtype=torch.uint8)
    view = memoryview(buf.numpy()).cast("B")
    with open(layer.path, "rb", buffering=0) as f:
        f.seek(layer.data_offset + start)
        got = 0
        while got < len(view):
            n = f.readinto(view[got:])
            if not n:
                raise ExpertsError(f"shard {layer.path} is truncated; re-run `airquant shard` on this store.")
            got += n
    return buf


def _routing(args: tuple, kwargs: dict) -> torch.Tensor | None:
    """The experts call's routing index: its second positional argument (every transformers 5 family),
    or the integer tensor among its keywords; None when it has none (Llama 4's dispatched tokens)."""
    if len(args) > 1:
        return args[1]
    for value in kwargs.values():
        if isinstance(value, torch.Tensor) and not value.is_floating_point():
            return value
    return None


@contextmanager
def _packed_into(module, packed: dict[str, torch.Tensor], num: int):
    """The module computes from the call's packed [U, ...] tensors, and sees U experts (grouped_mm sizes
    its per-expert offsets by it, the eager loop its one_hot classes, Llama 4 its bmm batch)."""
    old = {name: swap_tensor(module, name, t) for name, t in packed.items()}
    count = getattr(module, "num_experts", None)
    if count is not None:
        module.num_experts = num
    try:
        yield
    finally:
        for name, t in old.items():
            swap_tensor(module, name, t)
        if count is not None:
            module.num_experts = count


def _with_index(args: tuple, kwargs: dict, index: torch.Tensor) -> tuple[tuple, dict]:
    if len(args) > 1:
        return (args[0], index, *args[2:]), kwargs
    key = next(k for k, v in kwargs.items() if isinstance(v, torch.Tensor) and not v.is_floating_point())
    return args, {**kwargs, key: index}
