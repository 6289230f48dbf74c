"""Where each decoder layer lives while the model runs: VRAM, pinned host RAM, or disk.

Pure arithmetic over the manifest's byte counts and the budgets, so it is tested with tables and
printed by ``airquant plan`` before anything is loaded.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal

from airquant.config import MLP_CHUNK_TOKENS
from airquant.errors import AirQuantError
from airquant.kv.layers import LayerStates
from airquant.quant.schemes import workspace_elems
from airquant.units import GB

Tier = Literal["vram", "ram", "disk"]
FLOAT_BYTES = {"float64": 8, "float32": 4, "bfloat16": 2, "float16": 2}  # manifest dtype names
# cuBLAS workspaces, allocator rounding and the sampling temporaries of generate().
WORKSPACE_BYTES = 256 << 20


class PlanError(AirQuantError):
    """The budgets cannot hold even the minimum the engine needs."""


@dataclass(frozen=True)
class Budgets:
    vram_bytes: int | None  # None: no GPU (CPU run), layers are used from host memory directly
    ram_bytes: int
    resident_layers: int | None = None  # override of the automatic VRAM-resident count
    slots: int = 2  # device buffers for streamed layers (double buffering)
    reserve_bytes: int = 0  # activations + KV cache + workspace kept free on the device
    kv_bytes: int = 0  # the KV-cache part of reserve_bytes (every layer, whole batch; 0: not known)
    kv_offload: bool | None = False  # streamed layers' cache in pinned host RAM; None: when it does not fit VRAM
    attention_layers: tuple[int, ...] | None = None  # the layers whose cache grows per token (None: every one)

    def kv_shares(self, n: int) -> list[int]:
        """Each of ``n`` layers' part of ``kv_bytes``: an equal share per attention layer, none for the others."""
        attention = range(n) if self.attention_layers is None else self.attention_layers
        share = self.kv_bytes // max(len(attention), 1)
        chosen = set(attention)
        return [share if i in chosen else 0 for i in range(n)]


@dataclass
class StreamPlan:
    tiers: list[Tier]
    slot_bytes: int
    slots: int
    fixed_bytes: int  # embeddings, final norm, lm_head on the device
    reasons: list[str] = field(default_factory=list)
    reserve_bytes: int = 0  # KV cache + activations + workspace kept free on the device
    host_fixed_bytes: int = 0  # embedding table kept in host memory (--host-embedding)
    kv_offload: bool = False  # streamed layers' KV cache lives in pinned host RAM, moves with the layer
    kv_host_bytes: int = 0  # pinned host RAM the offloaded cache takes at the planned batch and context
    resident_bytes: int = 0  # the VRAM-resident layers, with their KV share when the cache is offloaded
    ram_tier_bytes: int = 0  # host RAM the pinned tier may fill (planner.ram_tier)
    experts: object | None = None  # expert_plan.ExpertPlan of a routed MoE run: arena and cache (planner.plan)
    expert_bytes: int = 0  # that pool and its gather on the device
    experts_fit: bool = True  # False: the arena does not fit beside the floor (the engine refuses to open)
    experts_host: bool = False  # routed experts computed on the host CPU (engine/expert_host): no device pool
    vram_budget_bytes: int | None = None  # the GPU budget the plan was made for (None: CPU, or not known)
    margin_bytes: int = 0  # of that budget, left unplanned for the allocator (planner.allocator_margin)
    staging_bytes: int = 0  # the read-ahead staging buffers in host RAM (allocated when layers come from disk)
    ram_budget_bytes: int | None = None  # the host RAM budget the plan was made for (--max-ram or its default)
    pass_tokens: int | None = None  # the most tokens a forward pass may hold (None: a whole batch's prefill at once)
    # Tokens the reserve's KV cache holds, over every sequence (batch x context of the planned workload; None: not
    # sized, --reserve or no config). A TurboQuant arena allocates its page pool for them at once (``SlotKV``).
    kv_tokens: int | None = None
    # Streamed routed MoE layers whose dense part (attention, norms, router: what each decode step reads) is kept
    # in VRAM, copied once (--dense-resident); their routed experts stay in the RAM tier. planner._dense_resident.
    dense_layers: list[int] = field(default_factory=list)
    dense_bytes: int = 0

    @property
    def expert_staging_bytes(self) -> int:
        """A routed run's host buffers for experts read from disk (``ExpertPlan.staging``)."""
        return self.experts.staging_bytes if self.experts is not None else 0

    @property
    def device_bytes(self) -> int:
        """Everything the plan puts on the device: fixed parts, slots, reserve, resident layers, expert pool."""
        return (self.fixed_bytes + self.slots * self.slot_bytes + self.reserve_bytes + self.resident_bytes
                + self.expert_bytes + self.dense_bytes)

    def host_parts(self, layer_bytes: list[int]) -> dict[str, int]:
        """Host RAM the engine's buffers take under this plan, by part (``LayerStreamer.host_held`` and the
        host embedding table are what it then holds): the host embedding table, the staging buffers, the
        pinned layer tier, an offloaded KV cache and a routed MoE run's expert staging buffers."""
        return {"embedding": self.host_fixed_bytes, "staging": self.staging_bytes,
                "ram_tier": sum(layer_bytes[i] for i in self.ram_layers), "kv_offload": self.kv_host_bytes,
                "expert_staging": self.expert_staging_bytes}

    @property
    def arena_room_bytes(self) -> int:
        """VRAM of the budget the layer plan leaves to a routed run's expert arena (less the allocator margin)."""
        return max((self.vram_budget_bytes or 0) - self.margin_bytes - self.device_bytes + self.expert_bytes, 0)

    @property
    def vram_layers(self) -> list[int]:
        return [i for i, t in enumerate(self.tiers) if t == "vram"]

    @property
    def ram_layers(self) -> list[int]:
        return [i for i, t in enumerate(self.tiers) if t == "ram"]

    @property
    def disk_layers(self) -> list[int]:
        return [i for i, t in enumerate(self.tiers) if t == "disk"]

    def describe(self, layer_bytes: list[int]) -> str:
        def total(idx: list[int]) -> str:
            return f"{sum(layer_bytes[i] for i in idx) / GB:.2f} GB"

        lines = [
            f"layers resident in VRAM : {_ranges(self.vram_layers)} ({total(self.vram_layers)})",
            f"layers pinned in RAM    : {_ranges(self.ram_layers)} ({total(self.ram_layers)})",
            f"layers read from disk   : {_ranges(self.disk_layers)} ({total(self.disk_layers)})",
            f"device slots            : {self.slots} x {self.slot_bytes / GB:.3f} GB",
            *([f"MoE dense parts in VRAM : layers {_ranges(self.dense_layers)} ({self.dense_bytes / GB:.3f} GB: "
               "attention, norms, router; their experts are streamed)"] if self.dense_layers else []),
            f"embeddings/norm/lm_head : {self.fixed_bytes / GB:.3f} GB on the device"
            + (f", embedding table {self.host_fixed_bytes / GB:.3f} GB in host RAM" if self.host_fixed_bytes else ""),
            f"reserve (KV + activ.)   : {self.reserve_bytes / GB:.3f} GB"
            + (f", activations of one {self.pass_tokens}-token pass" if self.pass_tokens else ""),
        ]
        host = self.host_parts(layer_bytes)
        if any(host.values()):
            budget = f" of the {self.ram_budget_bytes / GB:.3f} GB budget" if self.ram_budget_bytes is not None else ""
            lines.append(f"host RAM buffers        : {sum(host.values()) / GB:.3f} GB{budget} = "
                         + " + ".join(f"{k} {v / GB:.3f}" for k, v in host.items() if v))
        if self.kv_offload:
            lines.append(f"KV cache                : offloaded, {self.kv_host_bytes / GB:.3f} GB in pinned host RAM; "
                         "each streamed layer's cache moves with its weights")
        if self.experts_host:
            lines.append("experts   : routed, computed on the host CPU from the RAM tier (no device expert pool)")
        if self.experts is not None:
            lines.append(self.experts.describe())
            if not self.experts_fit:
                lines.append(f"            does NOT fit the {self.arena_room_bytes / GB:.3f} GB the layer plan leaves: "
                             "lower --expert-cache, raise --max-vram or use --experts whole")
        if self.vram_budget_bytes is not None:
            lines.append(f"device total            : {self.device_bytes / GB:.3f} GB of the "
                         f"{self.vram_budget_bytes / GB:.3f} GB budget, {self.margin_bytes / GB:.3f} GB of it "
                         "left to the allocator (rounding, fragmentation, cuBLAS workspace)")
        return "\n".join(lines + [f"why: {r}" for r in self.reasons])


def _ranges(idx: list[int]) -> str:
    if not idx:
        return "none"
    out, start, prev = [], idx[0], idx[0]
    for i in idx[1:] + [None]:
        if i is not None and i == prev + 1:
            prev = i
            continue
        out.append(f"{start}" if start == prev else f"{start}-{prev}")
        if i is not None:
            start = prev = i
    return ",".join(out)


# Tokens one pass of the decode loop takes (decodes + prefill chunks): a pass of this many tokens costs
# about one weight pass more than a decode step on a GPU, and its activations fit the reserve below.
PASS_TOKENS = 2048


def token_budget(slots: int, context: int) -> int:
    """Tokens per pass of the decode loop: every slot's decode token, and prefill up to ``PASS_TOKENS``."""
    return max(slots, min(slots * context, PASS_TOKENS))


def pass_tokens(slots: int, context: int) -> int:
    """The most tokens one pass of the decode loop holds at its planned budget: each slot's decode token and
    prefill up to ``PASS_TOKENS``, or one whole prompt (a TurboQuant prompt is prefilled whole), never more
    than every sequence's whole context."""
    return min(slots * context, max(token_budget(slots, context), context))


@dataclass(frozen=True)
class Reserve:
    """VRAM kept free next to the weights for a batch of ``batch`` sequences of ``context`` tokens."""

    kv: int  # the KV cache at full context
    activations: int  # prefill hidden states (and q/k/v, attention output) of the whole batch
    dequant: int  # the largest quantized linear dequantized for a multi-token matmul
    logits: int  # last-position logits in fp32, and one processed copy
    workspace: int = WORKSPACE_BYTES
    mlp: int = 0  # MLP intermediates of one chunk (<= MLP_CHUNK_TOKENS tokens): bounded, whatever the batch
    state: int = 0  # hybrid stacks: the fixed recurrent/conv state of every sequence (not per token)
    gather: int = 0  # TurboQuant: one layer's histories gathered for the decode attention (planner.reserve_of)

    @property
    def total(self) -> int:
        return (self.kv + self.state + self.gather + self.activations + self.mlp + self.dequant + self.logits
                + self.workspace)

    def describe(self) -> str:
        extra = f" + fixed state {self.state / GB:.2f}" if self.state else ""
        extra += f" + TQ gather {self.gather / GB:.2f}" if self.gather else ""
        return (f"KV {self.kv / GB:.2f}{extra} + activations {self.activations / GB:.2f} + MLP chunk "
                f"{self.mlp / GB:.2f} + dequant {self.dequant / GB:.2f} + logits {self.logits / GB:.2f} + "
                f"workspace {self.workspace / GB:.2f} = {self.total / GB:.2f} GB")


def kv_bytes_per_token(config, dtype_bytes: int, states: LayerStates | None = None) -> int:
    """Keys and values of every attention layer for one token of one sequence.

    A hybrid stack's linear-attention / state-space / conv layers keep no keys and values; their fixed
    state is ``LayerStates.state_bytes``. ``states``: what each layer keeps (None: read from ``config``).
    """
    states = states or LayerStates.of(config)
    if not states.attention_layers:  # a pure state-space stack
        return 0
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    return 2 * len(states.attention_layers) * kv_heads * head_dim * dtype_bytes


def reserve_for(config, *, batch: int, context: int, dtype_bytes: int, dequant_elems: int = 0,
                states: LayerStates | None = None, tokens: int | None = None) -> Reserve:
    """What a batch needs beside the weights; ``dequant_elems`` is the largest quantized out*in;
    ``states``: what each layer keeps between steps (None: read from ``config``); ``tokens``: the most one
    forward pass holds (None: every sequence's whole context at once, generate's prefill; ``pass_tokens``:
    the decode loop's)."""
    states = states or LayerStates.of(config)
    h = config.hidden_size
    # Prefill holds the residual, the normed input and q/k/v/attention output (<= 4 x H) for every token
    # at once, and an RMSNorm computes in fp32: its upcast and square of the whole pass (2 x 4 bytes a value)
    # beside its input, 5 x H in a 16-bit dtype (measured on the CPU in bf16: tests/engine/test_prefill_memory.py).
    # The MLP runs MLP_CHUNK_TOKENS tokens at a time (skeleton.chunk_mlp), so its intermediates exist for one
    # chunk only: at most MLP_CHUNK_TOKENS tokens, whatever the batch.
    tokens = batch * context if tokens is None else min(tokens, batch * context)
    activations = tokens * h * max(4 * dtype_bytes, dtype_bytes + 2 * 4)
    return Reserve(kv=kv_bytes_per_token(config, dtype_bytes, states) * batch * context, activations=activations,
                   dequant=dequant_elems * dtype_bytes, logits=batch * config.vocab_size * 4 * 2,
                   mlp=mlp_chunk_bytes(config, tokens, dtype_bytes),
                   state=states.state_bytes(dtype_bytes) * batch)


def mlp_chunk_bytes(config, tokens: int, dtype_bytes: int) -> int:
    """The intermediates of the MLP chunk that ``tokens`` tokens of prefill run in: gate, up and their product
    (3 x I); a Mixture-of-Experts block's are per routed row (top-k rows a token): the fused gate/up output,
    the activation and product (4 x the expert width), and the weighted rows summed in fp32."""
    n = min(tokens, MLP_CHUNK_TOKENS)
    dense = n * 3 * config.intermediate_size * dtype_bytes
    k, width = top_k_of(config), expert_intermediate_of(config)
    if not k or not width:
        return dense
    rows = n * k
    moe = rows * 4 * width * dtype_bytes + rows * config.hidden_size * 2 * 4 \
        + n * config.hidden_size * 4
    return max(dense, moe)


def top_k_of(config) -> int:
    """Experts a token routes to (0: a dense stack). Not a plain ``top_k``: older configs carry sampling's."""
    for name in ("num_experts_per_tok", "moe_topk", "moe_k", "experts_per_token"):
        value = getattr(config, name, None)
        if isinstance(value, int) and value > 0:
            return value
    return 0


def expert_intermediate_of(config) -> int:
    """One expert's intermediate width (Qwen/DeepSeek name it; Mixtral's experts are the MLP width)."""
    return getattr(config, "moe_intermediate_size", None) or getattr(config, "intermediate_size", None) or 0


def fixed_bytes(shards: dict, tied: bool, host_embedding: bool = False,
                dtype_bytes: int | None = None) -> tuple[int, int]:
    """(device, host) bytes of the embedding, final norm and lm_head shards.

    ``host_embedding`` moves an untied embedding table to host RAM; a tied one is the lm_head too. The table
    is held cast to the compute dtype (``dtype_bytes`` wide; None: as stored), as the engine loads it."""
    sizes = {g: shards[g].bytes for g in ("embed", "norm", "lm_head") if g in shards}
    host = sizes.pop("embed", 0) if host_embedding and not tied else 0
    if host and dtype_bytes:
        host = cast_bytes(shards["embed"], dtype_bytes)
    return sum(sizes.values()), host


def cast_bytes(entry, dtype_bytes: int) -> int:
    """A shard's bytes once its dense floating tensors are cast to a ``dtype_bytes``-wide compute dtype
    (``skeleton.load_fixed_parts``): a bf16 table held in fp32 on CPU takes twice its file."""
    extra = 0
    for meta in entry.tensors.values():
        width = FLOAT_BYTES.get(meta.get("dtype"))
        if width and meta.get("scheme", "dense") == "dense":
            extra += math.prod(meta["shape"]) * (dtype_bytes - width)
    return entry.bytes + extra


def dequant_elems(shards: dict, config) -> int:
    """out*in of the largest quantized weight a multi-token matmul dequantizes whole (0: none)."""
    metas = [m for e in shards.values() if e.is_layer for m in e.modules.values()]
    elems = 0
    if metas:
        heads = getattr(config, "num_attention_heads", None) or 1  # a pure state-space stack has none
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        dense = config.hidden_size * max(getattr(config, "intermediate_size", 0) or 0, heads * head_dim)
        elems = max(workspace_elems(m, dense) for m in metas)
    # A quantized expert is decoded whole into the compute dtype (gate_up: 2 x its width x hidden).
    experts = [m["shape"] for e in shards.values() if e.is_layer for m in e.modules.values() if "experts" in m]
    elems = max([elems] + [out * inp for out, inp in experts])
    head = shards.get("lm_head")
    if head is not None and head.modules:
        rows = max(m["rows"][1] - m["rows"][0] for m in head.modules.values())
        elems = max(elems, rows * config.hidden_size)
    return elems


def plan_layers(layer_bytes: list[int], fixed_bytes: int, budgets: Budgets,
                stream_bytes: list[int] | None = None) -> StreamPlan:
    """Place layers: as many leading layers in VRAM as the budget spares, then pinned RAM, then disk.
    ``stream_bytes``: what each layer carries through a device slot (routed MoE layers: their dense part)."""
    n = len(layer_bytes)
    slot = max(stream_bytes or layer_bytes) if layer_bytes else 0
    reasons: list[str] = []
    tiers: list[Tier] = ["disk"] * n
    offload = _choose_kv_offload(slot, n, fixed_bytes, budgets, reasons)
    # An offloaded cache keeps each VRAM-resident layer's share on the device, and the shares of the
    # layers in flight: one per slot, plus the running layer's grown copy (DynamicLayer concatenates).
    kv_of = budgets.kv_shares(n) if offload and n else [0] * n
    kv_layer = max(kv_of, default=0)
    reserve = budgets.reserve_bytes - budgets.kv_bytes + (budgets.slots + 1) * kv_layer if offload \
        else budgets.reserve_bytes
    if budgets.vram_bytes is None:
        resident = 0
        reasons.append("no GPU: layers are used in host memory, nothing to keep in VRAM")
    else:
        floor = fixed_bytes + budgets.slots * slot + reserve
        if floor > budgets.vram_bytes:
            hint = "" if offload or not budgets.kv_bytes else ", --kv-offload"
            raise PlanError(
                f"the GPU budget {budgets.vram_bytes / GB:.2f} GB cannot hold embeddings/lm_head "
                f"({fixed_bytes / GB:.2f} GB) + {budgets.slots} layer buffers ({budgets.slots * slot / GB:.2f} GB) "
                f"+ reserve ({reserve / GB:.2f} GB) = {floor / GB:.2f} GB; raise --max-vram, "
                f"use a compressed store (--quant nf4){hint} or a smaller batch/context.")
        spare = budgets.vram_bytes - floor
        resident = _fit([b + kv for b, kv in zip(layer_bytes, kv_of)], spare)
        reasons.append(f"VRAM {budgets.vram_bytes / GB:.2f} GB - fixed {fixed_bytes / GB:.2f} - slots "
                       f"{budgets.slots * slot / GB:.2f} - reserve {reserve / GB:.2f} leaves "
                       f"{spare / GB:.2f} GB: {resident} layer(s) fit"
                       + (" with their KV cache" if kv_layer else ""))
        if budgets.resident_layers is not None:
            resident = min(budgets.resident_layers, n)
            reasons.append(f"resident layers set to {resident} by request")
        if resident == n:
            reasons.append("every layer fits: no streaming needed")
    for i in range(resident):
        tiers[i] = "vram"
    kv_host = sum(kv_of[resident:])
    ram_left = max(budgets.ram_bytes - kv_host, 0)
    for i in range(resident, n):
        if layer_bytes[i] <= ram_left:
            tiers[i] = "ram"
            ram_left -= layer_bytes[i]
    streamed = [i for i in range(resident, n)]
    in_ram = sum(1 for i in streamed if tiers[i] == "ram")
    reasons.append(f"RAM budget {budgets.ram_bytes / GB:.2f} GB"
                   + (f" less the offloaded KV cache {kv_host / GB:.2f} GB" if kv_host else "")
                   + f" holds {in_ram} of {len(streamed)} streamed layer(s)"
                   + ("" if in_ram == len(streamed) else "; the rest are read from disk with read-ahead"))
    slots = 0 if resident == n else budgets.slots
    return StreamPlan(tiers=tiers, slot_bytes=slot, slots=slots, fixed_bytes=fixed_bytes, reasons=reasons,
                      reserve_bytes=reserve, kv_offload=offload, kv_host_bytes=kv_host,
                      resident_bytes=sum(layer_bytes[i] + kv_of[i] for i in range(resident)))


def _choose_kv_offload(slot: int, n: int, fixed_bytes: int, budgets: Budgets, reasons: list[str]) -> bool:
    """Whether the streamed layers' KV cache lives in host RAM: as asked, or (None) when only that fits."""
    if budgets.kv_offload is not None:
        if budgets.kv_offload:
            reasons.append("KV cache offloaded by request (--kv-offload)")
        return budgets.kv_offload
    if budgets.vram_bytes is None or not budgets.kv_bytes or not n:
        return False
    on_device = fixed_bytes + budgets.slots * slot + budgets.reserve_bytes
    offloaded = on_device - budgets.kv_bytes + (budgets.slots + 1) * max(budgets.kv_shares(n))
    if on_device <= budgets.vram_bytes or offloaded > budgets.vram_bytes or budgets.kv_bytes > budgets.ram_bytes:
        return False
    reasons.append(f"the KV cache ({budgets.kv_bytes / GB:.2f} GB at this batch and context) does not fit in VRAM "
                   f"beside the weights ({on_device / GB:.2f} > {budgets.vram_bytes / GB:.2f} GB): it is offloaded "
                   "to pinned host RAM, each streamed layer's cache copied in with its weights and back after")
    return True


def _fit(layer_bytes: list[int], budget: int) -> int:
    used = 0
    for i, b in enumerate(layer_bytes):
        if used + b > budget:
            return i
        used += b
    return len(layer_bytes)
