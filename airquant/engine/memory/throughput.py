"""A batch job's mix for throughput: KV format, where the cache lives, slots and resident layers (issue 38).

A streamed pass moves every streamed layer once whatever the batch, so a batch job's useful tokens per second
is the tokens each pass yields over the time a pass takes. ``choose_mix`` tries every KV format the router can
size (plain, TurboQuant K4/V2) on the device and offloaded to pinned host RAM, and for each a range of slot
counts up to the most that fit; each is placed by ``planner.plan`` (the placement ``Engine.open`` runs: its
resident layers, RAM and disk tiers) and costed:

* slots and passes: the job's requests admitted longest prompt first (as ``airquant batch`` feeds them) into
  the slots of continuous batching, one token per running slot and pass (``admit``);
* bytes per slot: a plain slot's buffers are preallocated at the job's context (its longest prompt + new
  tokens); a TurboQuant slot holds its exact window and the pages of its own length, so the arena is sized
  by the most tokens the admission ever holds at once, over the slots, plus a page per slot and an eighth
  more; the engine allocates that page pool at once (``StreamPlan.kv_tokens``, ``SlotKV``);
* pass time: ``step_bound`` (streamed layer bytes over the link, disk-tier bytes over the disk), the
  offloaded cache's bytes added to the link (plain: the used prefix in; TurboQuant: the arena in and out);
  prefill as ``plan.PASS_TOKENS`` prompt tokens costing one pass more;
* useful tok/s = the job's new tokens / ((passes + prompt tokens / PASS_TOKENS) x pass time).

Requests are taken to run to their ``max_new_tokens`` (an EOS ends them sooner: fewer passes for every option
alike). The model has no compute term beyond prefill: a TurboQuant pass does codec work and an offloaded one
waits on copies the link model may hide (kv_bench: TQ's step 1.17x plain's), so an option within ``TIE`` of
the best loses to the plainer one (plain before TurboQuant, on the device before offloaded). Without a link
(a CPU run) pass time is not modelled and options rank by useful tokens per pass.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, replace

from airquant.config import EngineConfig
from airquant.engine.decode.tqslots import PAGE_TOKENS
from airquant.engine.memory.placement import PASS_TOKENS, PlanError, StreamPlan
from airquant.engine.memory.planner import Hardware, KVScheme, compute_bytes, plan, workload_for
from airquant.engine.memory.router import Candidate
from airquant.engine.memory.step_bound import StepBound, step_bound
from airquant.errors import AirQuantError
from airquant.units import GB

TIE = 0.02  # within 2 % of the best estimate, the plainer option is chosen (costs the model does not see)
# Tried in this order; earlier ones win ties.
OPTIONS: tuple[tuple[KVScheme, bool], ...] = (("none", False), ("tq", False), ("none", True), ("tq", True))
KV_NAMES = {"none": "plain", "tq": "TQ K4/V2"}


class ThroughputError(AirQuantError):
    """No KV format, placement and slot count fits the budgets for this job; the message has the arithmetic."""


@dataclass(frozen=True)
class JobShape:
    """A batch job's length distribution: each request's prompt tokens and the new tokens it may generate."""

    prompt_tokens: tuple[int, ...]
    new_tokens: tuple[int, ...]
    source: str = "given figures"  # where the figures come from, for describe()

    @property
    def requests(self) -> int:
        return len(self.prompt_tokens)

    @property
    def context(self) -> int:
        """Tokens per sequence the loop is opened for: the longest prompt + its new tokens."""
        return max(p + n for p, n in zip(self.prompt_tokens, self.new_tokens))

    @property
    def useful(self) -> int:
        return sum(self.new_tokens)

    def describe(self) -> str:
        p, n = self.prompt_tokens, self.new_tokens
        return (f"job       : {self.requests} requests ({self.source}): prompts {min(p)}-{max(p)} tokens (mean "
                f"{sum(p) / len(p):.0f}), new tokens {min(n)}-{max(n)} (mean {sum(n) / len(n):.0f}); context "
                f"{self.context}; {self.useful} useful tokens, {sum(p)} prompt tokens")


@dataclass(frozen=True)
class Admission:
    passes: int  # passes until the last request ends
    peak_tokens: int  # most tokens cached at once, over every slot


def admit(job: JobShape, slots: int) -> Admission:
    """The job's requests longest prompt first through ``slots`` slots: a request takes a free slot at the next
    pass, is prefilled whole and yields its first token in that pass, then one token a pass until its new tokens
    are out (token budgets that spread a long prompt over passes are left out)."""
    order = sorted(zip(job.prompt_tokens, job.new_tokens), key=lambda r: -r[0])
    ends: list[int] = []  # heap of each running request's last pass
    held = 0  # sum over running requests of (prompt - first pass): their tokens after pass t are held + t * count
    members: dict[int, list[int]] = {}
    peak = start = 0
    for p, n in order:
        if len(ends) == slots:
            last = ends[0]
            peak = max(peak, held + len(ends) * last)
            while ends and ends[0] == last:
                heapq.heappop(ends)
                held -= members[last].pop()
            start = last + 1
        end = start + max(n, 1) - 1
        heapq.heappush(ends, end)
        members.setdefault(end, []).append(p - start)
        held += p - start
    passes = max(ends, default=-1) + 1
    while ends:
        last = ends[0]
        peak = max(peak, held + len(ends) * last)
        while ends and ends[0] == last:
            heapq.heappop(ends)
            held -= members[last].pop()
    return Admission(passes=passes, peak_tokens=peak)


@dataclass(frozen=True)
class Option:
    """One KV format and placement at its best slot count, or why it does not fit."""

    kv: KVScheme
    offload: bool
    slots: int = 0
    slot_tokens: int = 0  # tokens a slot's cache is sized for
    slot_bytes: int = 0  # its KV bytes
    passes: int = 0
    pass_s: float | None = None  # None: not modelled (no link, or nothing streamed)
    tok_s: float | None = None  # estimated useful tokens per second
    useful_per_pass: float = 0.0
    plan: StreamPlan | None = None
    bound: StepBound | None = None
    kv_link_bytes: int = 0  # an offloaded cache's bytes over the link per pass
    prefill_passes: float = 0.0  # prompt tokens / PASS_TOKENS
    rejected: str | None = None

    @property
    def label(self) -> str:
        return f"{KV_NAMES[self.kv]:<8} {'offloaded' if self.offload else 'on device':<9}"

    @property
    def resident_layers(self) -> int:
        return len(self.plan.vram_layers) if self.plan is not None else 0

    @property
    def disk_unknown(self) -> bool:
        """Layers come from disk each pass and no disk speed was given: the estimate leaves the disk out."""
        return bool(self.plan is not None and self.plan.disk_layers and self.bound and not self.bound.disk_gbps)

    def rank(self) -> tuple[int, float]:
        """Nothing streamed (compute-bound) first, then the estimate; unmodelled passes by tokens per pass; an
        estimate that leaves out a disk read every pass last."""
        if self.pass_s is None:
            return 1, self.useful_per_pass
        return (-1 if self.disk_unknown else 0), self.tok_s or 0.0

    def line(self) -> str:
        if self.rejected is not None:
            return f"{self.label}: does not fit: {self.rejected}"
        sizing = "preallocated at the job's context" if self.kv == "none" else "its own length: peak / slots"
        head = (f"{self.label}: {self.slots} slots x {_size(self.slot_bytes)} KV ({self.slot_tokens} tokens, "
                f"{sizing}), {self.resident_layers} layers resident")
        if self.pass_s is None:
            return (f"{head}; {self.passes} passes, {self.useful_per_pass:.1f} useful tokens/pass (pass time not "
                    "modelled: " + ("nothing streamed" if self.bound and self.bound.link_gbps else "no link") + ")")
        b = self.bound
        moved = f"link {b.link_bytes / GB:.2f} GB" + (f" (KV {self.kv_link_bytes / GB:.2f})" if self.kv_link_bytes
                                                     else "") + f" at {b.link_gbps:.1f} GB/s"
        if b.disk_s:
            moved += f", disk {b.disk_bytes / GB:.2f} GB at {b.disk_gbps:.2f} GB/s"
        elif self.disk_unknown:
            moved += (f"; {len(self.plan.disk_layers)} layers ({b.disk_bytes / GB:.2f} GB) read from disk every pass, "
                      "disk speed not given: ranked last")
        return (f"{head}; pass {self.pass_s:.3f} s ({moved}); {self.passes} passes + {self.prefill_passes:.1f} "
                f"prefill, {self.useful_per_pass:.1f} useful tokens/pass -> est. {self.tok_s:.2f} useful tok/s")


@dataclass(frozen=True)
class ThroughputPlan:
    options: tuple[Option, ...]  # each format and placement at its best slot count, in OPTIONS order
    choice: Option
    job: JobShape
    link_gbps: float | None
    link_note: str = ""

    def describe(self) -> str:
        link = (f"{self.link_gbps:.1f} GB/s{self.link_note}" if self.link_gbps else
                f"none{self.link_note}: pass time not modelled, options ranked by useful tokens per pass")
        c = self.choice
        estimate = f"est. {c.tok_s:.2f} useful tok/s" if c.tok_s else f"{c.useful_per_pass:.1f} useful tokens/pass"
        return "\n".join([
            self.job.describe(), f"link      : {link}",
            "model     : useful tok/s = new tokens / ((passes + prompt tokens / "
            f"{PASS_TOKENS}) x pass time); passes: requests admitted longest first into the slots; pass time = "
            "(streamed layer + offloaded KV bytes) / link, or disk-tier bytes / disk if slower; within "
            f"{TIE:.0%} the plainer option wins",
            "options (each at its best slot count):",
            *[f"  {'*' if o is c else ' '} {o.line()}" for o in self.options],
            f"choice    : {KV_NAMES[c.kv]} KV {'offloaded to host RAM' if c.offload else 'on the device'}, "
            f"{c.slots} slots, {c.resident_layers} layers resident ({estimate})"])

    def engine_config(self, base: EngineConfig) -> EngineConfig:
        """``base`` with the choice: slots, the job's context, KV format and offload (open the engine with
        ``placement=choice.plan``: the placement was sized for the TurboQuant arena's own lengths)."""
        return replace(base, batch_size=self.choice.slots, context=self.job.context, kv_cache=self.choice.kv,
                       kv_offload=self.choice.offload, prefill="chunked")


def choose_mix(candidate: Candidate, hw: Hardware, engine: EngineConfig, job: JobShape, *,
               link_gbps: float | None, disk_gbps: float | None = None, max_slots: int = 256,
               kv_schemes: tuple[KVScheme, ...] = ("none", "tq"), link_note: str = "") -> ThroughputPlan:
    """The mix with the most estimated useful tok/s for ``job`` (see the module docstring). ``engine``'s
    ``kv_offload`` True/False keeps only that placement; ``max_slots`` caps the slots (so do the requests)."""
    if engine.reserve_gb is not None:
        raise ThroughputError("--reserve fixes the reserve, and the planner sizes it from the slots it tries: drop "
                              "--reserve, or pass --batch-size N.")
    gpu = hw.vram_bytes is not None
    places = {None: (False, True), True: (True,), False: (False,)}[engine.kv_offload] if gpu else (False,)
    limit = max(1, min(max_slots, job.requests))
    options = tuple(_best(candidate, hw, engine, job, kv, offload, limit, link_gbps, disk_gbps)
                    for kv, offload in OPTIONS if kv in kv_schemes and offload in places)
    fitting = [o for o in options if o.rejected is None]
    if not fitting:
        raise ThroughputError("no KV format and placement fits one sequence of this job:\n"
                              + "\n".join(f"  {o.line()}" for o in options)
                              + "\nfixes: raise --max-vram/--max-ram, shorten the prompts or --max-new-tokens, use "
                                "--host-embedding or a more compressed store.")
    best = max(fitting, key=Option.rank)
    top = best.rank()
    choice = next(o for o in fitting if o.rank()[0] == top[0] and o.rank()[1] >= top[1] * (1 - TIE))
    return ThroughputPlan(options=options, choice=choice, job=job, link_gbps=link_gbps, link_note=link_note)


def _best(c: Candidate, hw: Hardware, engine: EngineConfig, job: JobShape, kv: KVScheme, offload: bool,
          limit: int, link: float | None, disk: float | None) -> Option:
    """The option at the slot count with the best estimate: up to the most that fit (fewer slots can leave room
    for resident layers, which shortens every pass)."""
    def at(slots: int) -> Option:
        return _evaluate(c, hw, engine, job, kv, offload, slots, link, disk)

    first = at(1)
    if first.rejected is not None:
        return first
    lo, hi = 1, limit  # the most slots that fit: lo fits, hi + 1 does not
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if at(mid).rejected is None else (lo, mid - 1)
    counts = {lo} | {1 << k for k in range(lo.bit_length()) if 1 << k < lo} | {lo * k // 8 for k in range(1, 8)}
    tried = [at(s) for s in sorted(n for n in counts if n >= 1)]
    return max((o for o in tried if o.rejected is None), key=lambda o: (o.rank(), -o.slots))


def _evaluate(c: Candidate, hw: Hardware, engine: EngineConfig, job: JobShape, kv: KVScheme, offload: bool,
              slots: int, link: float | None, disk: float | None) -> Option:
    width = compute_bytes(c.manifest.dtype, engine.dtype, hw.vram_bytes is not None)
    admission = admit(job, slots)
    tokens = job.context if kv == "none" else \
        min(job.context, -(-admission.peak_tokens * 9 // (8 * slots)) + PAGE_TOKENS)
    option = Option(kv=kv, offload=offload, slots=slots, slot_tokens=tokens,
                    slot_bytes=c.dims.kv_bytes(kv, tokens, width))
    # The decode loop runs the job: passes of its token budget, a TurboQuant prompt whole (engine_config: chunked).
    wl = workload_for(engine, batch_size=slots, context=tokens, kv_cache=kv, prefill="chunked",
                      kv_offload=offload if hw.vram_bytes is not None else False,
                      pass_tokens=max(job.prompt_tokens) if kv == "tq" else None)
    try:
        placed = plan(c.manifest, c.dims, hw, wl, kv=kv, dtype_bytes=width)
    except PlanError as exc:
        return replace(option, rejected=f"at {slots} slots: {exc}")
    why = _host_shortfall(placed, hw)
    if why is None and not placed.experts_fit:
        why = f"the expert arena does not fit beside {slots} slots' reserve"
    if why is not None:
        return replace(option, rejected=why)
    bound = step_bound(placed, c.layer_bytes, link_gbps=link, disk_gbps=disk)
    # The offloaded cache crosses the link every pass, host to device: plain copies the used prefix in (its new
    # tokens back are small), a TurboQuant arena moves whole. Its copy back to the host runs the link's other
    # direction beside the next layers' copies in (an H100, wave3_kv27: 0.40 s of device-to-host copies under a
    # 0.99 s pass whose host-to-device copies took 0.86 s), so it is not counted again.
    kv_link = placed.kv_host_bytes if placed.kv_offload else 0
    bound = replace(bound, link_bytes=bound.link_bytes + kv_link)
    prefill = sum(job.prompt_tokens) / PASS_TOKENS
    pass_s = bound.seconds
    tok_s = job.useful / ((admission.passes + prefill) * pass_s) if pass_s else None
    return replace(option, passes=admission.passes, pass_s=pass_s, tok_s=tok_s, plan=placed, bound=bound,
                   useful_per_pass=job.useful / admission.passes, kv_link_bytes=kv_link, prefill_passes=prefill)


def _size(nbytes: float) -> str:
    return f"{nbytes / GB:.3f} GB" if nbytes >= GB / 10 else f"{nbytes / 1e6:.3g} MB"


def _host_shortfall(placed: StreamPlan, hw: Hardware) -> str | None:
    """Why host RAM cannot hold what the plan keeps there besides the pinned tier (None: it can). On CPU the
    planner counts the fixed parts and the reserve in host RAM; offloaded, the cache lives there."""
    if hw.vram_bytes is None:
        need, what = placed.fixed_bytes + placed.reserve_bytes, "embeddings/lm_head + KV and activations"
    else:
        need, what = placed.kv_host_bytes, "the offloaded KV cache"
    need += placed.host_fixed_bytes + placed.staging_bytes + placed.expert_staging_bytes
    if need <= hw.ram_bytes:
        return None
    return (f"host RAM {hw.ram_bytes / GB:.2f} GB cannot hold {what} ({need / GB:.2f} GB with the staging "
            "buffers and host embedding)")
