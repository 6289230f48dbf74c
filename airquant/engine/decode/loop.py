"""The decode loop: a scheduler of slots over one weight pass per step (continuous batching).

Each ``step()`` is one forward of the model on a packed row: one decode token per running sequence,
then chunks of the prompts being prefilled, within ``token_budget`` tokens. A sequence that ends
(EOS, a stop string, its own ``max_new_tokens``) or is cancelled frees its slot at once, and the next
waiting prompt takes it in the next pass. Per-request sampling settings, per-request timing (TTFT,
latency) and per-pass timing come from here; nothing is attached to transformers' ``generate``.

Sampling is total: a temperature below ``GREEDY_BELOW`` is greedy, NaN logits are never picked and
infinities never reach ``multinomial``; a sequence whose own step still raises (its sampling, its
detokenizing) ends with ``finish_reason="error"`` and its ``error`` set, and its pass-mates go on.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections import deque
from dataclasses import dataclass, field

import torch

from airquant.engine.decode.slots import (
    ATTN_NAME,
    CacheOutputChanged,
    Segment,
    SlotKV,
    attention_backends,
    caches_latents,
    register_ragged_attention,
)
from airquant.engine.decode.text import Detokenizer
from airquant.errors import AirQuantError, PromptTooLongError
from airquant.kv import model_dims
from airquant.kv.rotation import to_device

log = logging.getLogger(__name__)

# Below this a temperature is greedy: logits / 1e-300 overflow to inf, and no sampling differs from argmax
# there anyway (a gap of 1e-3 between the two best logits is already a 1 : e^-100 odds at 1e-5).
GREEDY_BELOW = 1e-5
# Each pass of ``step`` is marked under torch's profiler (a no-op without it): a trace then shows the passes,
# and ``benchmarks/stream_bench.pass_breakdown`` reads the last one's wall against the device's busy time.
PASS_MARK = "airquant.pass"
SEED_RANGE = (-(1 << 63), (1 << 64) - 1)  # what torch.Generator.manual_seed accepts
# Queue ahead: where every sequence of a pass is decoding greedily and nothing waits, the next pass is queued
# (its tokens the device's own argmax, never read back first) before this pass's tokens are read, so the device
# goes on from one pass into the next while the host reads, detokenizes and checks for ends. A sequence that
# ended meanwhile (EOS, a stop string) gets one wasted row in the pass after, which is dropped. Nothing in queueing
# a pass may wait for the device (a pageable copy, a host read), or the host waits for the pass before. Measured
# (H100, Qwen3-30B-A3B NF4 batch 1, wave3_moe39): no cache 0.0242-0.0245 s a step against 0.0263-0.0267 reading
# first (the device idle 0.24-0.41 ms a pass, ~3 ms before under the profiler); the hot set 0.0085 against 0.0100.
QUEUE_AHEAD: bool | None = None  # None: on a GPU (on the CPU a pass runs as it is queued: nothing to overlap)


class RequestSettingsError(AirQuantError):
    """A request's own setting is out of range (e.g. a seed torch cannot take); the message names it."""


class SamplingError(AirQuantError):
    """A sequence's logits hold no token to pick (every one NaN or -inf)."""


@dataclass(frozen=True)
class Request:
    """One prompt (token ids) and its own settings."""

    prompt_ids: tuple[int, ...]
    max_new_tokens: int = 64
    temperature: float = 0.0  # below GREEDY_BELOW: greedy
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False


@dataclass(frozen=True)
class Completion:
    """What a request produced, as the engine returns it."""

    text: str
    prompt_tokens: int
    new_tokens: int  # generated tokens, an EOS that ended the sequence included
    token_ids: tuple[int, ...]
    finish_reason: str = "length"  # "stop" (EOS or a stop string) or "length" (max_new_tokens)
    ttft_s: float | None = None  # submit to first token
    latency_s: float | None = None  # submit to last token


@dataclass
class Sequence:
    """A request in the loop: where it is, what it produced, when."""

    id: int
    request: Request
    slot: int | None = None
    cached: int = 0  # prompt + generated tokens written to the cache
    out: list[int] = field(default_factory=list)
    finish_reason: str | None = None  # "stop" | "length" | "cancelled" | "error"
    error: str | None = None  # why the sequence failed (finish_reason "error"); its pass-mates went on
    submitted: float = field(default_factory=time.perf_counter)
    first_token_at: float | None = None
    finished_at: float | None = None
    eos_hit: bool = False
    detok: Detokenizer | None = None
    generator: torch.Generator | None = None
    owner: object = None  # whoever submitted it (the Provider's request)

    @property
    def greedy(self) -> bool:
        return self.request.temperature < GREEDY_BELOW

    @property
    def prompt_len(self) -> int:
        return len(self.request.prompt_ids)

    def tokens(self, n: int) -> list[int] | tuple[int, ...]:
        """The ``n`` tokens after those cached: a prompt chunk, or the last token generated (a decode step), read
        where they are (joining prompt and output was a copy of the whole sequence a pass)."""
        start, prompt = self.cached, self.request.prompt_ids
        if start + n <= len(prompt):
            return prompt[start: start + n]
        if start >= len(prompt):
            return self.out[start - len(prompt): start - len(prompt) + n]
        return (*prompt[start:], *self.out[: start + n - len(prompt)])

    @property
    def prefilling(self) -> bool:
        return self.cached < self.prompt_len

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_token_at is None else self.first_token_at - self.submitted

    @property
    def latency_s(self) -> float | None:
        return None if self.finished_at is None else self.finished_at - self.submitted


@dataclass(frozen=True)
class Event:
    """What one pass produced for one sequence: new token ids, new text, and the finish reason at the end."""

    seq: Sequence
    token_ids: list[int]
    text: str
    finish_reason: str | None


@dataclass
class _Queued:
    """A pass queued on the device whose tokens are not read yet (``DecodeLoop._queue``)."""

    plan: list  # (sequence, tokens this pass)
    emit: list  # (sequence, row) of the rows that give a token
    logits: torch.Tensor  # [len(emit), V] fp32
    greedy: list[int]  # indices into emit of the greedy rows
    picked: torch.Tensor | None  # their argmax, on the device
    host: torch.Tensor | None  # the same on its way to the host
    done: object  # a CUDA event after the copy (None on the CPU: copied already)
    start: float  # when the host began queueing it
    queued: float  # seconds the host took to queue it


@dataclass
class LoopStats:
    passes: int = 0
    useful_tokens: int = 0  # tokens generated (each pass gives at most one per slot)
    prompt_tokens: int = 0
    pass_s: list[float] = field(default_factory=list)
    decode_pass_s: list[float] = field(default_factory=list)  # passes without prefill
    # Of each decode pass, the seconds until the host had queued all of it (the forward returned; the token read
    # waits for the device after). Near the pass's time: the host bounds the step, not the device.
    decode_host_s: list[float] = field(default_factory=list)
    busy_s: float = 0.0
    ahead: int = 0  # passes queued before the pass before's tokens were read (QUEUE_AHEAD)

    def utilization(self, slots: int) -> float:
        return self.useful_tokens / (slots * self.passes) if self.passes else 0.0


class DecodeLoop:
    """``submit`` requests, ``step`` until ``idle``; ``run`` does both for a list of requests."""

    def __init__(self, model, tokenizer, *, slots: int, context: int, token_budget: int, device: torch.device,
                 dtype: torch.dtype, eos_ids: list[int], cache_arg: str, kv=None, offload: set[int] = frozenset(),
                 sync=lambda: None, on_error=lambda: None, scope=attention_backends, pool_tokens: int | None = None,
                 copy_ops=None):
        register_ragged_attention()
        self.model, self.tokenizer, self.device = model, tokenizer, device
        self.slots, self.context, self.token_budget = slots, context, max(token_budget, slots)
        self.eos = set(eos_ids)
        self.cache_arg, self.sync, self.on_error = cache_arg, sync, on_error
        self.scope = scope  # the context of every forward (the engine's: SDPA backends, its VRAM cap)
        layers, _, _ = model_dims(model.config, turboquant=kv is not None)
        self.kv = SlotKV(layers, slots, context, device, dtype, kv=kv, offload=offload, pin=device.type == "cuda",
                         latent=caches_latents(model.config), pool_tokens=pool_tokens, copy_ops=copy_ops)
        # A stack that changes what the cache returns (MLA's expansion) hands its attention untagged keys: the
        # cache comes along.
        self._prefix = {"slot_kv": self.kv} if self.kv.prefix else {}
        self.waiting: deque[Sequence] = deque()
        self.running: dict[int, Sequence] = {}  # slot -> sequence
        self.stats = LoopStats()
        self._ids = itertools.count()
        self._mask = torch.ones(1, 1, 1, 1, dtype=torch.bool, device=device)  # 4D: transformers builds none
        self._ahead: _Queued | None = None  # a pass queued ahead (QUEUE_AHEAD), its tokens not yet read
        self._ahead_error: BaseException | None = None  # raised queueing it: raised by the next step
        self._collected = 0.0  # when the last pass's tokens were read

    # -- requests ------------------------------------------------------------------------------
    def check(self, request: Request) -> None:
        """PromptTooLongError when the prompt and its new tokens do not fit a slot; RequestSettingsError for
        a seed torch cannot take."""
        if request.seed is not None and not SEED_RANGE[0] <= request.seed <= SEED_RANGE[1]:
            raise RequestSettingsError(f"seed={request.seed} is out of range; use an integer from {SEED_RANGE[0]} "
                                       f"to {SEED_RANGE[1]}.")
        need = len(request.prompt_ids) + request.max_new_tokens
        if not request.prompt_ids or need > self.context:
            raise PromptTooLongError(
                f"prompt of {len(request.prompt_ids)} tokens + {request.max_new_tokens} new tokens exceeds the "
                f"context of {self.context} tokens per sequence; shorten the prompt or lower max_new_tokens "
                "(or raise --context within the model's limit).")

    def submit(self, request: Request) -> Sequence:
        self.check(request)
        seq = Sequence(next(self._ids), request, detok=Detokenizer(self.tokenizer, request.stop))
        if not seq.greedy:
            seq.generator = torch.Generator()
            seq.generator.manual_seed(request.seed if request.seed is not None else torch.seed())
        self.waiting.append(seq)
        return seq

    def cancel(self, seq: Sequence) -> None:
        """Drop a sequence (its client went away): its slot is free for the next pass."""
        if seq.done:
            return
        if seq in self.waiting:
            self.waiting.remove(seq)
        self._finish(seq, "cancelled")

    @property
    def idle(self) -> bool:
        return not self.waiting and not self.running and self._ahead is None

    def run(self, requests: list[Request], on_event=None) -> list[Sequence]:
        seqs = [self.submit(r) for r in requests]
        while not self.idle:
            for event in self.step():
                if on_event is not None:
                    on_event(event)
        return seqs

    # -- one pass ------------------------------------------------------------------------------
    def _schedule(self) -> list[tuple[Sequence, int]]:
        """(sequence, tokens this pass): decodes first, then prefill chunks of admitted and new prompts."""
        plan, budget = [], self.token_budget
        for seq in self.running.values():
            if not seq.prefilling:
                plan.append((seq, 1))
                budget -= 1
        for seq in [s for s in self.running.values() if s.prefilling]:
            budget -= self._chunk(plan, seq, budget)
        free = [i for i in range(self.slots) if i not in self.running]
        while free and self.waiting and budget > 0:
            seq = self.waiting[0]
            if self.kv.tq and seq.prompt_len > budget and plan:
                # A TurboQuant prompt is prefilled whole (its flush points then match one-at-a-time): the first
                # waiting prompt that fits what is left of the pass goes now (a job fed longest first filled
                # ~half of each pass's budget otherwise), where the one it passes fits the next pass even with
                # every slot decoding; a prompt that does not waits, and none passes it.
                seq = None if seq.prompt_len > self.token_budget - self.slots else \
                    next((s for s in self.waiting if s.prompt_len <= budget), None)
                if seq is None:
                    break
                self.waiting.remove(seq)
            else:
                self.waiting.popleft()
            seq.slot = free.pop(0)
            self.running[seq.slot] = seq
            budget -= self._chunk(plan, seq, budget)
        return plan

    def _chunk(self, plan: list, seq: Sequence, budget: int) -> int:
        left = seq.prompt_len - seq.cached
        n = left if self.kv.tq else min(left, budget)
        if n > 0:
            plan.append((seq, n))
        return n

    def step(self) -> list[Event]:
        """One weight pass; the events of the sequences that produced tokens or finished."""
        if self._ahead_error is not None:  # queueing the pass ahead failed: raised after the pass before's events
            error, self._ahead_error = self._ahead_error, None
            raise error
        with torch.profiler.record_function(PASS_MARK):
            queued, self._ahead = self._ahead, None
            if queued is None:
                plan = self._schedule()
                if not plan:
                    return []
                queued = self._queue(plan)
            kept = self._go_ahead(queued)
            if kept:
                tokens = queued.picked if len(kept) == len(queued.plan) else queued.picked[kept]
                try:
                    self._ahead = self._queue([(queued.plan[k][0], 1) for k in kept], tokens=tokens)
                    self.stats.ahead += 1
                except Exception as exc:  # raised at the next step, this pass's tokens delivered first
                    self._ahead_error = exc
            events = self._collect(queued)
        return events

    def _queue(self, plan: list[tuple[Sequence, int]], tokens: torch.Tensor | None = None) -> _Queued:
        """The pass of ``plan`` queued on the device: its greedy rows' argmax under way to the host (not waited
        for). ``tokens``: the row's ids on the device (a pass queued ahead), else each sequence's own."""
        ids, pos, segments, emit = [], [], [], []
        for seq, n in plan:
            segments.append(Segment(seq.slot, seq.cached, n, len(pos)))
            if tokens is None:
                ids.extend(seq.tokens(n))
            pos.extend(range(seq.cached, seq.cached + n))
            if seq.cached + n >= seq.prompt_len:
                emit.append((seq, len(pos) - 1))
        start = time.perf_counter()
        logits = self._forward(ids if tokens is None else tokens, pos, segments, [i for _, i in emit])
        for seq, n in plan:
            self.stats.prompt_tokens += max(0, min(seq.cached + n, seq.prompt_len) - seq.cached)
            seq.cached += n
        # Greedy rows in one argmax and one host read for the pass (was one sync per sequence).
        greedy = [k for k, (seq, _) in enumerate(emit) if seq.greedy]
        # indexed on the device (a list index is a pageable host-to-device copy: a stream sync)
        picked = None
        if greedy:
            picked = pick_greedy(logits if len(greedy) == len(emit) else
                                 logits[to_device(torch.tensor(greedy, dtype=torch.long), logits.device)])
        host, done = None, None
        if picked is not None:
            host = torch.empty(picked.shape, dtype=picked.dtype, pin_memory=picked.is_cuda)
            host.copy_(picked, non_blocking=picked.is_cuda)
            if picked.is_cuda:
                done = torch.cuda.Event()
                done.record()
        return _Queued(plan, emit, logits, greedy, picked, host, done, start, time.perf_counter() - start)

    def _go_ahead(self, q: _Queued) -> list[int]:
        """The rows of ``q`` whose sequences the pass after it takes, queued before ``q``'s tokens are read (none:
        it is not queued ahead): with ``QUEUE_AHEAD`` on, where every sequence of ``q`` decodes one token
        greedily with a token to go after ``q``'s and room in its slot, no prompt could take a free slot and the
        cache is a plain one on the device; a sequence cancelled since ``q`` was queued is left out. (A prompt
        waiting on a full loop may wait one pass longer for a slot a sequence frees by EOS or a stop string.)"""
        if not queues_ahead(self.device) or q.picked is None or len(q.greedy) != len(q.plan) or self.kv.tq or \
                self.kv.offload or (self.waiting and len(self.running) < self.slots):
            return []
        if not all(n == 1 and len(seq.out) + 2 <= seq.request.max_new_tokens and seq.cached < self.context
                   for seq, n in q.plan):
            return []
        return [k for k, (seq, _) in enumerate(q.plan) if not seq.done]

    def _collect(self, q: _Queued) -> list[Event]:
        """``q``'s tokens read (waiting for its pass alone where one is queued after it) and its events."""
        if q.done is not None:
            q.done.synchronize()
        picked = dict(zip(q.greedy, q.host.tolist())) if q.host is not None else {}
        events = [self._advance_alone(seq, q.logits[k], picked.get(k)) for k, (seq, _) in enumerate(q.emit)]
        if self._ahead is None:
            self.sync()
        now = time.perf_counter()
        took = now - max(q.start, self._collected)  # a pass queued ahead: from the pass before's read
        self._collected = now
        self.stats.passes += 1
        self.stats.pass_s.append(took)
        self.stats.busy_s += took
        if all(n == 1 for _, n in q.plan):
            self.stats.decode_pass_s.append(took)
            self.stats.decode_host_s.append(q.queued)
        return [e for e in events if e is not None]

    def _forward(self, ids: list[int] | torch.Tensor, pos: list[int], segments: list[Segment],
                 keep: list[int]) -> torch.Tensor:
        """Logits ``[len(keep), V]`` (fp32) at the row positions ``keep``; a stack found changing what the cache
        returns (at its first pass) runs the pass again with the cache in prefix mode, which rewrites the
        same positions."""
        try:
            return self._model_pass(ids, pos, segments, keep)
        except CacheOutputChanged:
            self.kv.use_prefix()
            self._prefix = {"slot_kv": self.kv}
            return self._model_pass(ids, pos, segments, keep)

    @torch.inference_mode()
    def _model_pass(self, ids: list[int] | torch.Tensor, pos: list[int], segments: list[Segment],
                    keep: list[int]) -> torch.Tensor:
        config = self.model.config
        previous = config._attn_implementation
        config._attn_implementation = ATTN_NAME
        self.kv.begin(segments)
        # through pinned memory, without a stream sync (a pageable copy waits for the device: a pass queued ahead
        # would wait for the pass before)
        row = ids.view(1, -1) if isinstance(ids, torch.Tensor) else to_device(torch.tensor([ids]), self.device)
        positions = to_device(torch.tensor([pos]), self.device)
        keep_rows = to_device(torch.tensor(keep, dtype=torch.long), self.device)
        try:
            with self.scope():
                out = self.model(input_ids=row, position_ids=positions, attention_mask=self._mask, use_cache=True,
                                 logits_to_keep=keep_rows,
                                 **{self.cache_arg: self.kv}, **self._prefix)
            self.kv.end_pass()
        except BaseException:
            self.on_error()  # an OOM or an interrupt cut the pass short: the streamer's state is reset
            raise
        finally:
            config._attn_implementation = previous
        return out.logits[0].float()

    def _advance_alone(self, seq: Sequence, logits: torch.Tensor, token: int | None) -> Event | None:
        """``_advance``, where a failure ends this sequence with ``finish_reason="error"``, not the pass."""
        try:
            return self._advance(seq, logits, token)
        except Exception as exc:  # one sequence's sampling or text: its pass-mates' tokens are still good
            log.warning("sequence %d failed (%s: %s); the others in its pass go on", seq.id, type(exc).__name__, exc)
            seq.error = f"{type(exc).__name__}: {exc}"
            self._finish(seq, "error")
            return Event(seq, [], "", "error")

    def _advance(self, seq: Sequence, logits: torch.Tensor, token: int | None = None) -> Event | None:
        if seq.done:  # cancelled while its pass ran
            return None
        token = self._sample(seq, logits) if token is None else token
        now = time.perf_counter()
        seq.first_token_at = seq.first_token_at or now
        self.stats.useful_tokens += 1
        r = seq.request
        if token in self.eos and not r.ignore_eos:
            seq.eos_hit = True
            return Event(seq, [], self._finish(seq, "stop"), "stop")
        seq.out.append(token)
        text = seq.detok.push([token])
        if seq.detok.finish_reason is not None:  # a stop string (the detokenizer owns them)
            return Event(seq, [token], text + self._finish(seq, seq.detok.finish_reason), seq.detok.finish_reason)
        if len(seq.out) >= r.max_new_tokens:
            return Event(seq, [token], text + self._finish(seq, "length"), "length")
        return Event(seq, [token], text, None)

    def _sample(self, seq: Sequence, logits: torch.Tensor) -> int:
        r = seq.request
        return sample(logits, r.temperature, r.top_p, seq.generator)

    def _finish(self, seq: Sequence, reason: str) -> str:
        seq.finish_reason = reason
        seq.finished_at = time.perf_counter()
        if seq.slot is not None and self.running.get(seq.slot) is seq:
            del self.running[seq.slot]
            self.kv.free(seq.slot)
        return seq.detok.flush() if reason not in ("cancelled", "error") else ""


def queues_ahead(device: torch.device) -> bool:
    """Whether a decode loop on ``device`` queues its greedy passes ahead (``QUEUE_AHEAD``)."""
    return QUEUE_AHEAD if QUEUE_AHEAD is not None else device.type == "cuda"


def pick_greedy(logits: torch.Tensor) -> torch.Tensor:
    """Argmax per row ``[N, V] -> [N]``, a NaN never chosen (torch's argmax takes NaN as the largest)."""
    return logits.masked_fill(logits.isnan(), float("-inf")).argmax(-1)


def sample(logits: torch.Tensor, temperature: float, top_p: float, generator: torch.Generator | None) -> int:
    """One token from ``logits [V]``: greedy below ``GREEDY_BELOW``, else softmax(logits / T) cut to top_p.

    Total: NaN logits are never picked, a +inf one is picked outright, and the probabilities handed to
    ``multinomial`` are finite and sum to 1 (the largest logit is subtracted before dividing by T, in
    float64); a row without any finite or +inf logit raises ``SamplingError`` (that sequence fails alone).
    """
    logits = logits.detach().cpu().double()
    # NaN -> -inf, nothing else (nan_to_num also turned -inf into the lowest finite double: a row of -inf then
    # sampled uniformly instead of failing)
    logits = logits.masked_fill(logits.isnan(), float("-inf"))
    best = float(logits.max())
    if best == float("-inf"):
        raise SamplingError("every logit is NaN or -inf: the model produced no token to pick for this sequence.")
    if best == float("inf") or temperature < GREEDY_BELOW:
        return int(logits.argmax())
    probs = torch.softmax((logits - best) / temperature, dim=-1)  # finite: exp(x <= 0), the best one is 1
    if top_p < 1:
        sorted_p, order = probs.sort(descending=True)
        drop = sorted_p.cumsum(-1) - sorted_p > top_p  # keep the smallest set reaching top_p
        probs = probs.scatter(0, order[drop], 0.0)
    return int(torch.multinomial(probs, 1, generator=generator))

