"""Expert planning for Mixture-of-Experts stores: every decision and size made before a tensor exists.

Whether a streamed MoE run moves whole layers or only the experts a call routes to (``choose_experts``:
one rule for the planner, ``Engine.open``, the router and ``airquant plan``; ``auto`` streams routed while a
decode step at the run's batch routes fewer than ``ROUTED_BELOW`` of a layer's experts), whether routed
experts are then copied to the GPU or computed on the host CPU from the RAM tier (``host_cost``: measured
host GEMV and link bandwidths, ``Figures``; ``engine.expert_host`` runs it), and how big the
routed run's device arena is (``plan_experts``: pool slots of one call plus a cache, the gather, the stacked
decode and the grouped call's intermediates) with its host staging (``staging_buffers``). Everything here
reads the manifest alone; the pool that runs such a plan is ``engine.experts``.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch

from airquant.config import MLP_CHUNK_TOKENS
from airquant.engine.moe import compute as expert_compute
from airquant.errors import AirQuantError
from airquant.quant import kernels, make_linear
from airquant.quant.nf4 import NF4Linear
from airquant.store.manifest import Manifest, ShardEntry
from airquant.units import GB

log = logging.getLogger(__name__)
ExpertsMode = Literal["auto", "whole", "routed", "cpu"]
Policy = Literal["lru", "lfu"]
EXPERTS_CHOICES = ("auto", "whole", "routed", "cpu")
POLICY_CHOICES = ("lru", "lfu")
SPECULATE_TOKENS = 8  # speculation pays at decode batch sizes; larger batches route nearly every expert
ALIGN = 64  # every tensor of a slot starts on this boundary, so byte views reinterpret as any dtype
# Every expert image of the RAM tier starts on a 128-byte line, so a kernel's 128-byte reads of a row are whole
# lines of the link: the tiered kernel read host RAM at 38-41 GB/s from images 64 bytes past a line, 45-48
# from aligned ones (benchmarks/uva_bench.py, H200). Qwen3-30B-A3B's and Mixtral's NF4 tensors are multiples
# of 128 bytes but for the last two (the nested offset, the code book): their rows stay on lines.
LINE = 128
CACHE_FRACTION = 0.9  # of the VRAM the plan leaves free, the rest is allocator slack
# Same-layer speculative reads (direct.py ``DirectReads.speculate``): each one-token call's most likely experts
# guessed from the layer's input before its attention (the router over the post-attention norm of it) and copied
# into slots of their own beside the attention, while the link would idle; the call's kernels read them from VRAM.
# None (auto): only in a pool with no hot set (a cache of fewer experts than a token routes) on a GPU, as many
# guesses as ``SPECULATE_BYTES`` holds (with a hot set most guesses are hits already; a guess larger than the
# attention's idle link only delays the call). True: always, every one of the top-k guessed (``SPECULATE_GUESSES``
# limits it); False: never.
# Measured (H100, batch 1, Qwen3-30B-A3B, no cache, each case in its own process): 2 guesses are 95 % right. Copied
# by byte loads after ~14 small kernels (0.2 ms against a 0.09 ms attention) the step took 0.0341 s against 0.0291
# without (wave3_moe35); by spec_plan and gather_images' 16-byte loads (51 GB/s) 0.0279 against 0.0285, the
# kernels reading 4.5 ms less but the attention kernel starting ~55 us late a layer beside a copy that sat on every
# SM (wave3_moe36); in at most 48 programs (uva_copy.IMAGE_PROGRAMS) **0.0265 / 0.0267 s against 0.0287 / 0.0290**
# (wave3_moe37). The hot set's step: 0.0118 s with 2 guesses against 0.0112 (wave3_moe36).
SPECULATE: bool | None = None
SPECULATE_BYTES = 6 * 2**20  # auto: the guesses' bytes a layer's attention hides (~0.1 ms of a 55 GB/s link)
# How many of a call's top-k guesses are copied where ``SPECULATE`` is True (None: all k).
SPECULATE_GUESSES: int | None = None
# Copied reads (pool.py ``ExpertPool._run_copied``): a few-row call whose routed experts bring at least this many
# bytes over the link, in a pool with no hot set, reads its routing to the host (one sync, an eager island of the
# layer graph) and has the copy engine bring its experts into working slots, the (gate/)up parts first; the same
# tiered kernels then read them from VRAM, the up projection while the down parts still arrive and each top-k
# column's down projection as soon as its experts are in. Why: the tiered kernel reads the pinned RAM tier at
# 0.84-0.89 of the link (Mixtral-8x7B's experts, results/uva_hostmem.json, H100), the copy engine at the link
# (55.0 GB/s in the traced copied step); a copied call pays instead the host's reply to its routing (~0.15 ms) and
# its last down projection after the link (~0.12 ms), which ~12 % of a call's link time buys back from ~100 MB up.
# Measured (H100, batch 1, no cache, wave3_moe32/33): Mixtral-8x7B (2 x 99 MB a call) 0.128 s a step copied against
# 0.138-0.142 read by the kernel; gpt-oss-120b (4 x 12.6 MB) 0.0233 against 0.0216; Qwen3-30B-A3B (8 x 2.7 MB)
# 0.0755 against 0.0286. None: never (every call reads directly); 0: every eligible call.
COPY_READS_MIN_BYTES: int | None = 96 * 2**20


def copy_reads(call_bytes: int, hot_set: bool) -> bool:
    """Whether a direct-read call whose routed experts are ``call_bytes`` (top-k times rows, at most every expert,
    times an image) is copied by the copy engine instead (``COPY_READS_MIN_BYTES``): never beside a hot set."""
    return COPY_READS_MIN_BYTES is not None and not hot_set and call_bytes >= COPY_READS_MIN_BYTES


def spec_guesses(top_k: int, slot_bytes: int, hot_set: bool, device: str = "cuda") -> int:
    """How many of a top-k call's experts speculation copies (``SPECULATE``, ``SPECULATE_GUESSES``,
    ``SPECULATE_BYTES`` for experts of ``slot_bytes``), and so the slots it needs: 0 is off."""
    if SPECULATE is False:
        return 0
    if SPECULATE is None:
        if hot_set or device != "cuda" or slot_bytes <= 0:
            return 0
        return min(top_k, SPECULATE_BYTES // slot_bytes)
    return min(top_k, SPECULATE_GUESSES or top_k)


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
    fused: bool = False  # many-row calls run by the fused grouped kernels over the slots: no gather, no decode
    spec_slots: int = 0  # further slots same-layer speculative reads copy into (``spec_guesses``; 0: off)
    top_k: int = 0  # experts a token routes to (the largest of the store's layers)

    @property
    def copied(self) -> bool:
        """Whether a one-token decode call takes copied reads (``copy_reads``: its top-k experts' bytes, no cache)
        where direct reads run."""
        return copy_reads(self.top_k * self.slot_bytes, hot_set=self.cache > 0)

    @property
    def slots(self) -> int:
        return self.work + self.cache

    @property
    def pool_bytes(self) -> int:
        return (self.slots + self.spec_slots) * self.slot_bytes

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
        return (f"experts   : routed; pool {self.slots} slots x {self.slot_bytes / 1e6:.1f} MB = "
                f"{self.pool_bytes / GB:.2f} GB ({self.work} working + {self.cache} cache, {self.policy.upper()}), "
                + ("prefill by the fused kernels from the slots (no gather, no stacked decode), " if self.fused else
                   f"gather {self.gather_bytes / GB:.2f} GB, stacked decode {self.decode_bytes / GB:.2f} GB, ")
                + f"expert compute {self.compute_bytes / GB:.2f} GB ({self.call_tokens} tokens a call), "
                f"speculative prefetch "
                f"{'on' if self.speculate else 'off'} (batch <= {SPECULATE_TOKENS})"
                + (f", same-layer speculative reads {self.spec_slots} slots (a one-token call's likeliest "
                   f"{self.spec_slots} experts copied while the layer's attention runs)" if self.spec_slots else "")
                + (f", one-token decode calls ({self.top_k * self.slot_bytes / 1e6:.0f} MB) copied by the copy engine"
                   if self.copied else "")
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


# Model types whose routed experts the host path cannot compute, and why: ``auto`` copies them to the GPU.
NOT_HOST = {t: "its experts module takes every token spread over all experts (no routing index)"
            for t in ("llama4", "llama4_text")}


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
    """How a run streams its experts, and why (the plan's ``why:`` line; empty when there is nothing to say).
    ``routed``: the streamer leaves the experts out of the layer copies; ``host``: they are then computed on
    the host CPU (``engine.expert_host``), not copied into a device pool."""

    routed: bool
    why: str = ""
    host: bool = False


# -- host CPU or link: the measured figures and the cost model -----------------------------------------
# Host seconds a layer's call costs beyond reading its experts: the routed rows' hidden states to the host and
# the sum back (a few KB at batch 1, one device sync), the per-expert Python. ~0.3 ms measured on CPU runs of
# tiny stores (engine/expert_host); the GPU's copies are asynchronous, so it is counted whole.
HOST_CALL_S = 3e-4
# Each further row of one expert's call adds this share of a one-row call's time (the C kernel re-reads x from
# cache per row of W): 1536 x 2048 NF4 matrices on a 2-core EPYC VM took 0.53 ms at 1 row, 1.09 at 4, 2.30 at 8,
# 3.21 at 16 (quant/kernels/nf4_cpu.c), ~0.4 of a row's time per extra row.
HOST_ROW_COST = 0.4
FIGURES_FILE = "figures.json"


@dataclass(frozen=True)
class Figures:
    """The bandwidths the host-or-link rule weighs: packed NF4 bytes a second the host kernel reads
    (``airquant doctor``), and pinned host-to-GPU bytes a second."""

    host_gemv_gbps: float
    link_gbps: float
    source: str = "given"


FIGURES_ENV = "AIRQUANT_FIGURES"  # another file for the figures (tests keep theirs apart from the user's)


def figures_path() -> Path:
    if os.environ.get(FIGURES_ENV):
        return Path(os.environ[FIGURES_ENV])
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "airquant" / FIGURES_FILE


def save_figures(**values: float) -> None:
    """Record measured bandwidths (``airquant doctor``) for later plans on this machine."""
    path = figures_path()
    old = _saved_figures(path)  # a damaged file (a write cut short, a hand edit) is replaced
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps({**old, **values}, indent=1))
    os.replace(tmp, path)


def _saved_figures(path: Path) -> dict:
    """What ``save_figures`` wrote at ``path``; {} where it is missing, unreadable or not a JSON object."""
    try:
        saved = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return saved if isinstance(saved, dict) else {}


def figures_for(host_gemv_gbps: float | None = None, link_gbps: float | None = None) -> Figures | None:
    """The figures of a run: those given (``--host-gemv-gbps`` / ``--link-gbps``), the rest from what
    ``airquant doctor`` last measured here; None where one is still unknown (``auto`` then never picks cpu)."""
    saved = _saved_figures(figures_path()) if host_gemv_gbps is None or link_gbps is None else {}
    host = host_gemv_gbps if host_gemv_gbps is not None else saved.get("host_gemv_gbps")
    link = link_gbps if link_gbps is not None else saved.get("link_gbps")
    if not host or not link:
        return None
    given = host_gemv_gbps is not None and link_gbps is not None
    return Figures(float(host), float(link), "given" if given else f"measured by airquant doctor ({figures_path()})")


@dataclass(frozen=True)
class HostCost:
    """One decode step's routed experts of one MoE layer, on the host or over the link (seconds)."""

    experts: float  # distinct experts the batch routes to (expected)
    expert_bytes: float
    rows: float  # rows each of them multiplies
    host_s: float
    link_s: float

    @property
    def host_wins(self) -> bool:
        return self.host_s < self.link_s

    def describe(self, figures: Figures) -> str:
        moved = self.experts * self.expert_bytes / 1e6
        return (f"host {moved:.3g} MB / {figures.host_gemv_gbps:.3g} GB/s x (1 + {HOST_ROW_COST} x "
                f"({self.rows:.3g} - 1) rows) + {HOST_CALL_S * 1e3:.3g} ms = {self.host_s * 1e3:.3g} ms vs link "
                f"{moved:.3g} MB / {figures.link_gbps:.3g} GB/s = {self.link_s * 1e3:.3g} ms a layer")


def host_cost(entry: ShardEntry, batch: int, figures: Figures) -> HostCost:
    """The cost model of ``auto``'s host-or-link choice for one MoE layer at ``batch`` one-token sequences: the
    host reads each routed expert once for all its rows (bytes / host GEMV bandwidth, growing by ``HOST_ROW_COST``
    per extra row) plus ``HOST_CALL_S``; the link moves the same bytes (no VRAM cache hit assumed: a cache
    lowers the link's side). The dense part and the attention run on the GPU either way."""
    num, top_k = entry.experts["num"], entry.experts["top_k"]
    experts = routed_share(top_k, num, batch) * num
    per = sum(end - start for ranges in entry.experts["ranges"] for start, end in ranges) / num
    rows = max(1.0, batch * min(top_k, num) / max(experts, 1e-9))
    host = experts * per / (figures.host_gemv_gbps * GB) * (1 + HOST_ROW_COST * (rows - 1)) + HOST_CALL_S
    return HostCost(experts, per, rows, host, experts * per / (figures.link_gbps * GB))


def routed_share(top_k: int, num: int, batch: int) -> float:
    """The expected share of a layer's ``num`` experts that ``batch`` sequences (one token each, ``top_k``
    experts each) route to in a decode step, routing near-uniform: 1 - (1 - k/E)^B. Mixtral (2 of 8): batch
    1 0.25, 8 0.90; Qwen3-30B-A3B (8 of 128): batch 1 0.0625, 16 0.64. A skewed router routes fewer."""
    return 1.0 - (1.0 - min(top_k, num) / num) ** max(batch, 0)


def choose_experts(mode: ExpertsMode, manifest: Manifest, streamed: bool, batch: int | None = None,
                   figures: Figures | None = None) -> ExpertsChoice:
    """The one rule of how a streamed MoE store moves its experts (planner, ``Engine.open``, ``airquant plan``):
    ``whole`` moves whole layers; ``routed`` only the experts a call routes to (forced, whatever the batch);
    ``cpu`` computes the routed experts on the host (forced); ``auto`` routed while ``batch`` sequences route
    fewer than ``ROUTED_BELOW`` of a layer's experts a decode step (``batch`` None, not known: routed), and
    never for types in ``NOT_ROUTED``; routed ones on the host where ``figures`` say the host reads them faster
    than the link moves them (``host_cost``). The batch is the one the run is opened for: a decode loop whose
    slots fill and drain keeps the mode chosen then."""
    moe = [e for e in manifest.shards.values() if e.is_layer and e.experts]
    forced = mode in ("routed", "cpu")
    if forced and not moe:
        raise ExpertsError(f"--experts {mode} was asked for, but this store has no Mixture-of-Experts layer; "
                           "use --experts auto (or whole).")
    if forced and not streamed:
        raise ExpertsError(f"--experts {mode} needs a streamed run; drop --resident (or use --experts auto).")
    if not moe or not streamed:
        return ExpertsChoice(False)
    if mode == "whole":
        return ExpertsChoice(False, "experts whole layers (--experts whole)")
    model_type = (manifest.source or {}).get("model_type")
    if (why := NOT_ROUTED.get(model_type)) is not None:
        if forced:
            raise ExpertsError(f"--experts {mode} cannot run {model_type}: {why}; use --experts auto (or whole).")
        log.info("experts   : whole layers for %s (%s)", model_type, why)
        return ExpertsChoice(False, f"experts whole layers for {model_type}: {why}")
    not_host = NOT_HOST.get(model_type)
    if mode == "cpu" and not_host is not None:
        raise ExpertsError(f"--experts cpu cannot run {model_type}: {not_host}; use --experts routed (or auto).")
    if mode == "cpu":
        return ExpertsChoice(True, "experts routed, computed on the host CPU (--experts cpu)"
                             + _host_note(moe, batch or 1, figures), host=True)
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
    if not routed:
        return ExpertsChoice(False, f"experts whole layers: {routes}; {rule}")
    if not_host is not None:
        return ExpertsChoice(True, f"experts routed: {routes}; {rule}; not on the host CPU: {not_host}")
    if figures is None:
        return ExpertsChoice(True, f"experts routed: {routes}; {rule}; host CPU not weighed (no measured host "
                                   "GEMV / link figures: run airquant doctor, or give --host-gemv-gbps and --link-gbps)")
    cost = host_cost(max(moe, key=lambda e: e.bytes), batch, figures)
    where = "on the host CPU" if cost.host_wins else "copied to the GPU"
    return ExpertsChoice(True, f"experts routed, {where}: {routes}; {rule}; {cost.describe(figures)} "
                               f"({figures.source})", host=cost.host_wins)


def _host_note(moe: list[ShardEntry], batch: int, figures: Figures | None) -> str:
    if figures is None:
        return ""
    cost = host_cost(max(moe, key=lambda e: e.bytes), batch, figures)
    return f"; {cost.describe(figures)}" + ("" if cost.host_wins else ", so auto would copy them to the GPU")


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


def fused_chunk_tokens(num: int, top_k: int) -> int:
    """Tokens of one chunk of a many-row routed call run by the fused grouped kernels over the pool
    (``pool._run_fused_chunks``): at most the widest grouped block's rows an expert on average
    (``expert_compute.POOL_CHUNK_ROWS``), so that each block decodes its expert's tile about once (Qwen3-30B-A3B:
    2048 tokens, Mixtral-8x7B: 512); the plan bounds a chunk's intermediates further (``plan_experts``)."""
    return max(1, expert_compute.POOL_CHUNK_ROWS * num // max(top_k, 1))


def fused_prefill(manifest: Manifest, device: str) -> bool:
    """Whether a routed run's many-row calls (prefills) take the fused grouped kernels straight from the pool's
    slots (``pool._run_fused_chunks``), so that the plan holds no gather and no stacked decode for them: NF4
    experts of exactly a (gate/)up and a down matrix with blocks inside rows and no dense expert tensor, in
    every MoE layer, on a GPU where Triton runs (``expert_compute.FUSED``), or under Triton's interpreter (the
    tests' CPU runs). Whether a GPU plan takes it is the planner's (``planner._starved``); the pool follows the
    plan (``ExpertPlan.fused``). A layer whose module turns out not to qualify at run time (a post-expert norm)
    takes the gather path anyway, beyond the plan."""
    runs = device == "cuda" and kernels.triton_available() or kernels.interpreting()
    if not (runs and expert_compute.FUSED and expert_compute.FUSED_PREFILL):
        return False
    moe = [e for e in manifest.shards.values() if e.is_layer and e.experts]
    for entry in moe:
        ones = expert_linears(entry)
        if len(ones) != 2 or not all(isinstance(o, NF4Linear) and o.in_features % o.blocksize == 0 for o in ones):
            return False
        if len({(o.blocksize, o.double_quant) for o in ones}) != 1 or not expert_matrices(entry).all_quantized:
            return False
    return bool(moe)


def plan_experts(manifest: Manifest, spare_bytes: int | None, *, cache_bytes: int | None = None,
                 policy: Policy = "lfu", speculate: bool = True, width: int = 2, device: str = "cuda",
                 tokens: int | None = None, fused: bool = False) -> ExpertPlan:
    """Size the pool: ``work`` slots for the experts of one call (every expert of a layer, as a prefill
    routes them, plus one speculated batch), and ``cache`` slots from ``cache_bytes`` or, when None, from
    the VRAM the layer plan leaves free (``spare_bytes``; None on CPU: no cache). The decode and compute
    terms are for a ``width``-byte compute dtype on a ``device`` (``expert_compute.DECODE_TEMP_PER_ELEM``), and
    calls of at most ``tokens`` tokens (the batch's prompt and new tokens; None: as many as a call may get).
    ``fused`` (``fused_prefill``): many-row calls run by the fused kernels from the slots in chunks
    (``fused_chunk_tokens``), so no gather and no stacked decode; compute is a chunk's intermediates.
    Same-layer speculative reads get ``spec_guesses`` slots beside the pool's (auto: none beside a cache)."""
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
    caps = [min(c, tokens) if c and tokens else c or tokens for c in map(call_cap, moe)]
    if fused:
        gather = decode = 0
        chunks = [min(fused_chunk_tokens(e.experts["num"], e.experts["top_k"]), m.fused_call_tokens(width),
                      cap or MLP_CHUNK_TOKENS) for m, e, cap in zip(shapes, moe, caps)]
        compute = max(m.fused_bytes(width, chunk) for m, chunk in zip(shapes, chunks))
        tokens = min(chunks)
    else:
        decode = max(m.decode_bytes(e.experts["num"], width, device) for m, e in zip(shapes, moe))
        compute = max(m.compute_bytes(width, cap) for m, cap in zip(shapes, caps))
        tokens = min(m.call_tokens(width, cap) for m, cap in zip(shapes, caps))
    total = sum(e.experts["num"] for e in moe)
    # the spare VRAM the cache and the guesses' slots share (None: a cache given, or no VRAM to plan)
    free = None if cache_bytes is not None or spare_bytes is None else \
        spare_bytes - (work * slot + gather + decode + compute)
    if cache_bytes is not None:
        cache = cache_bytes // slot
    else:
        cache = 0 if free is None else max(int(free * CACHE_FRACTION), 0) // slot
    cache = min(cache, max(total - num, 0))  # more than every other expert of the store is never used
    # the pool's rows beyond its slots; a cache of fewer experts than a token routes is no hot set worth them
    spec = spec_guesses(top_k, slot, hot_set=cache >= top_k, device=device)
    if free is not None:  # the cache leaves the guesses' slots room
        cache = min(cache, max(int((free - spec * slot) * CACHE_FRACTION), 0) // slot)
        if spec and cache == 0 and free < spec * slot:
            spec = 0  # no room for them either
    return ExpertPlan(slot_bytes=slot, work=work, cache=cache, gather_bytes=gather, decode_bytes=decode,
                      compute_bytes=compute, call_tokens=tokens, policy=policy, speculate=speculate, fused=fused,
                      spec_slots=spec, top_k=top_k)


def call_cap(entry: ShardEntry) -> int | None:
    """The most tokens one call of the layer's experts module gets: a module inside the block's ``mlp`` runs
    ``MLP_CHUNK_TOKENS`` at a time (skeleton.chunk_mlp); elsewhere a call may get the whole prefill."""
    return MLP_CHUNK_TOKENS if experts_module(tuple(entry.experts["tensors"])).startswith("mlp.") else None


def expert_linears(entry: ShardEntry) -> list:
    """One expert's quantized modules of a MoE layer, built on meta from its manifest entry (in_features and
    out_features, the scheme's class and settings)."""
    module = experts_module(tuple(entry.experts["tensors"]))
    ones = []
    for name, meta in entry.modules.items():
        if "experts" in meta and name.startswith(f"{module}."):
            out_f, in_f = meta["shape"]
            with torch.device("meta"):
                ones.append(make_linear(meta, in_f, out_f, False, compute_dtype=torch.bfloat16))
    return ones


def expert_matrices(entry: ShardEntry) -> expert_compute.ExpertMatrices:
    """One expert's matrices of a MoE layer, from its manifest entry: quantized modules (their dense
    ``shape``, and whether their scheme decodes stacked) and dense [E, a, b] expert tensors."""
    shapes, quantized, stacks = [], [], []
    for one in expert_linears(entry):
        shapes.append((one.out_features, one.in_features))
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


def experts_module(names: tuple[str, ...]) -> str:
    """The experts module the stacked tensors belong to (``mlp.experts.gate_up_proj`` -> ``mlp.experts``)."""
    parents = {n.split(".experts.")[0] + ".experts" if ".experts." in n else n.rpartition(".")[0] for n in names}
    if len(parents) != 1 or any(n.split(".")[len(next(iter(parents)).split(".")):][0].isdigit() for n in names):
        raise ExpertsError(f"experts stored as {sorted(names)[:3]}... are not one fused experts module; "
                           "expert-aware streaming needs transformers 5's fused layout (use --experts whole).")
    return parents.pop()


# -- the streamed layers' experts -------------------------------------------------------------
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
