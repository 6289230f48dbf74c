"""A provider other software can call: ``await Provider(store).generate(prompt)``, ``Provider.stream``.

The engine is not thread-safe, so one worker thread owns it and its decode loop
(``airquant.engine.decode``). Every prompt becomes a sequence of that loop, with its own settings
(max_new_tokens, temperature, top_p, seed, stop): concurrent requests share weight passes, a sequence
that ends frees its slot at once, and a new request joins at the next pass. ``stream`` yields the
text as it is generated; closing the stream early (a client that went away) frees its slot at the
next pass. Callers await a ``concurrent.futures.Future`` (wrapped for asyncio), so the provider works
from any event loop, from several at once, and from plain threads (``provider.sync``).

The router (``airquant.engine.memory.router``) picks the store, mode and KV scheme. Layer-by-layer
streaming is kept off the interactive path: a single ``generate`` call runs streamed only when the
provider was built with ``allow_streaming=True`` (or ``mode="streamed"``); ``generate_batch`` is a
batch job and may always stream.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import AsyncIterator, Callable, Literal, Sequence

import torch

from airquant.config import EngineConfig, GenerateConfig
from airquant.engine import runner  # runner.resolve_device at call time: tests give it a fake GPU
from airquant.engine.decode.text import MAX_STOP_CHARS, MAX_STOPS
from airquant.engine.memory.router import Hardware, Mode, Route, StreamingNotAllowedError, plan_route, workload_for
from airquant.engine.runner import Engine
from airquant.errors import AirQuantError

log = logging.getLogger(__name__)

Prompt = str | list  # a string, or a conversation: a list of {"role", "content"} (chat)
_STOP = object()


class ProviderClosedError(AirQuantError):
    """The provider was closed (or its engine failed to open); create a new one."""


class QueueFullError(AirQuantError):
    """More prompts are waiting than ``max_queue``; retry later or raise --max-queue."""


class RequestCancelledError(AirQuantError):
    """The request was cancelled (``Provider.cancel``, or its stream closed) before it finished."""


class SequenceFailedError(RuntimeError):
    """One sequence of a request failed on its own (its sampling, its text); its pass-mates went on. Not an
    ``AirQuantError``: the request was valid, the server answers 500."""


@dataclass(frozen=True)
class ProviderConfig:
    """``airquant serve`` flags: --mode --allow-streaming --kv --max-batch --batch-window-ms --context --max-queue."""

    mode: Mode = "auto"
    allow_streaming: bool = False  # may a single (interactive) call run streamed?
    kv: Literal["auto", "none", "tq"] = "auto"  # auto: plain cache if it fits, else TurboQuant
    max_batch: int = 8  # sequences per weight pass (decode-loop slots); the router plans memory for this many
    batch_window_ms: float = 20.0  # how long an idle loop waits for more requests before its first pass
    context: int | None = None  # tokens per sequence the memory plan allows; None: min(model's, 2048)
    max_queue: int = 1024  # prompts waiting for a slot (beyond max_batch running) before new ones are refused


@dataclass(frozen=True)
class StreamEvent:
    """One step of a streamed generation: the text and token ids new since the previous event.

    ``text`` never ends inside a UTF-8 character and never holds (part of) a stop string;
    ``finish_reason`` ("stop" or "length") and ``usage`` (prompt_tokens, completion_tokens,
    total_tokens) are set on the last event only."""

    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    usage: dict | None = None


@dataclass
class _Request:
    prompts: list[Prompt]
    gen: GenerateConfig
    future: Future = field(default_factory=Future)
    results: list = field(default_factory=list)
    on_event: Callable | None = None  # streaming: called (on the worker thread) with each StreamEvent
    cancelled: bool = False  # the client went away (``Provider.cancel``, a closed stream)
    seqs: list = field(default_factory=list)

    def __post_init__(self) -> None:
        self.results = [None] * len(self.prompts)


@dataclass
class _Metrics:
    started_at: float = field(default_factory=time.time)
    requests: int = 0
    requests_failed: int = 0
    prompts: int = 0
    passes: int = 0
    new_tokens: int = 0
    prompt_tokens: int = 0
    busy_s: float = 0.0
    waiting: int = 0  # prompts queued for the worker
    loop_waiting: int = 0  # prompts in the loop, waiting for a slot
    running: int = 0  # sequences in the loop's slots


class Provider:
    """``Provider(store_or_stores, mode="auto", allow_streaming=False, device="cpu", ...)``.

    ``store`` is one store directory or several stores of the same model (one weight scheme each);
    the router runs the best-quality one that fits. Keyword arguments are fields of
    ``ProviderConfig`` or ``EngineConfig``; ``gen`` holds the default generation settings.
    Opening blocks until the model is loaded.
    """

    def __init__(self, store: str | Path | Sequence[str | Path], mode: Mode = "auto", *,
                 config: ProviderConfig | None = None, engine: EngineConfig | None = None,
                 gen: GenerateConfig | None = None, **overrides):
        self.config, engine_cfg = _split_overrides(replace(config or ProviderConfig(), mode=mode),
                                                   engine or EngineConfig(), overrides)
        self.defaults = gen or GenerateConfig()
        self.stores = [store] if isinstance(store, (str, Path)) else list(store)
        # Every request runs through the decode loop: the reserve holds one pass's activations (as airquant batch).
        engine_cfg = replace(engine_cfg, prefill="chunked")
        self.route, self.interactive = route_for(self.stores, self.config, engine_cfg)
        self.engine_config = self.route.engine_config(engine_cfg)
        self._kv = self.route.kv_config()
        self._queue: queue.Queue = queue.Queue()
        self._lock = threading.Lock()
        self._metrics = _Metrics()
        self._requests: dict[int, _Request] = {}  # requests whose future is not done, by id of the future
        self._closed = False
        self.engine = None
        self._ready = Future()
        self._thread = threading.Thread(target=self._serve, name="airquant-provider", daemon=True)
        self._thread.start()
        self._ready.result()  # re-raises the engine's opening error here
        self.sync = SyncProvider(self)

    # -- public async API ----------------------------------------------------------------------
    async def generate(self, prompt: Prompt, **kw) -> str:
        """One prompt (interactive). A list of messages is a chat conversation."""
        return (await self.complete(prompt, **kw)).text

    async def generate_batch(self, prompts: Sequence[Prompt], **kw) -> list[str]:
        """A batch job: the prompts go through the model together (``max_batch`` at a time)."""
        return [c.text for c in await self.complete_batch(prompts, **kw)]

    async def complete(self, prompt: Prompt, **kw):
        """Like ``generate`` but returns the ``Completion`` (text, token counts, token ids)."""
        return (await asyncio.wrap_future(self.submit([prompt], batch_job=False, **kw)))[0]

    async def complete_batch(self, prompts: Sequence[Prompt], **kw):
        return await asyncio.wrap_future(self.submit(list(prompts), batch_job=True, **kw))

    async def stream(self, prompt: Prompt, **kw) -> AsyncIterator[StreamEvent]:
        """One prompt (interactive), its text as it is generated: ``async for event in provider.stream(p)``.
        Settings are ``generate``'s keywords. Leaving early (``aclose()``, a cancelled task) frees the
        sequence's slot at the next pass."""
        loop = asyncio.get_running_loop()
        events: asyncio.Queue = asyncio.Queue()

        def deliver(event) -> None:  # on the worker thread
            loop.call_soon_threadsafe(events.put_nowait, event)

        request = self._enqueue([prompt], batch_job=False, on_event=deliver, **kw)
        future = request.future
        finished = asyncio.wrap_future(future)
        try:
            while True:
                if finished.done() and events.empty():
                    finished.result()  # the request failed before its last event: raise its error
                    return
                getter = asyncio.ensure_future(events.get())
                await asyncio.wait([getter, finished], return_when=asyncio.FIRST_COMPLETED)
                if not getter.done():
                    getter.cancel()
                    continue
                event = getter.result()
                yield event
                if event.finish_reason is not None:
                    return
        finally:
            if not future.done():  # the caller left early: free the slot, and let nothing wait on the result
                request.cancelled = True
                finished.cancel()

    def submit(self, prompts: list[Prompt], *, batch_job: bool, on_event: Callable | None = None, **kw) -> Future:
        """Queue prompts; the Future resolves to their Completions in order (``on_event``: streamed events)."""
        return self._enqueue(prompts, batch_job=batch_job, on_event=on_event, **kw).future

    def _enqueue(self, prompts: list[Prompt], *, batch_job: bool, on_event: Callable | None = None,
                 **kw) -> _Request:
        """``submit``'s request itself (``stream`` keeps it to mark it cancelled)."""
        if self._closed or not self._thread.is_alive():
            raise ProviderClosedError("this provider is closed; create a new Provider.")
        if not batch_job and not self.interactive:
            raise StreamingNotAllowedError(
                f"{self.route.scheme} from {self.route.store} runs only streamed, which is kept off interactive "
                "calls: use generate_batch, or build the Provider with allow_streaming=True.")
        if not prompts:
            request = _Request([], GenerateConfig())
            request.future.set_result([])
            return request
        gen = self._settings(kw, prompts)
        with self._lock:  # waiting: queued for the worker, or in the loop without a slot yet; a free slot takes one
            m, held = self._metrics, self.config.max_queue + self.config.max_batch
            waiting = m.waiting + m.loop_waiting
            if waiting + m.running + len(prompts) > held:
                raise QueueFullError(f"{waiting} prompts are already waiting (max_queue "
                                     f"{self.config.max_queue}); retry later.")
            self._metrics.waiting += len(prompts)
            self._metrics.requests += 1
        request = _Request(list(prompts), gen, on_event=on_event)
        self._requests[id(request.future)] = request
        request.future.add_done_callback(lambda f: self._requests.pop(id(f), None))
        self._queue.put(request)
        return request

    def cancel(self, future: Future) -> None:
        """Stop the request behind ``future`` (``submit``'s): its client went away. Its sequences free their
        slots at the next pass and the future ends cancelled or failed; nothing waits on it any more."""
        request = self._requests.get(id(future))
        if request is not None and not future.cancel():  # already taken by the worker: it drops the sequences
            request.cancelled = True

    def _settings(self, kw: dict, prompts: list[Prompt]) -> GenerateConfig:
        names = {f.name for f in fields(GenerateConfig)}
        unknown = sorted(set(kw) - names)
        if unknown:
            raise TypeError(f"unknown generation setting(s) {unknown}; use {sorted(names)}")
        gen = replace(self.defaults, **kw)
        if any(isinstance(p, list) for p in prompts) and not gen.chat:
            gen = replace(gen, chat=True)  # a conversation only makes sense through the chat template
        if gen.max_new_tokens < 1 or gen.temperature < 0 or not 0 < gen.top_p <= 1:
            raise AirQuantError(f"max_new_tokens={gen.max_new_tokens}, temperature={gen.temperature}, "
                                f"top_p={gen.top_p}: need max_new_tokens >= 1, temperature >= 0, 0 < top_p <= 1.")
        if len(gen.stop) > MAX_STOPS or any(len(s) > MAX_STOP_CHARS for s in gen.stop):
            raise AirQuantError(f"{len(gen.stop)} stop strings of up to {max(map(len, gen.stop))} characters: "
                                f"the provider takes at most {MAX_STOPS} of {MAX_STOP_CHARS} characters each "
                                "(each is searched at every token of the pass its sequence shares).")
        return gen

    # -- lifecycle and reporting ---------------------------------------------------------------
    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._queue.put(_STOP)
        self._thread.join()

    async def aclose(self) -> None:
        await asyncio.get_running_loop().run_in_executor(None, self.close)

    def __enter__(self) -> "Provider":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    async def __aenter__(self) -> "Provider":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.aclose()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and not self._closed

    def describe(self) -> dict:
        return {"model": self.route.candidate.manifest.source.get("name"), "store": str(self.route.store),
                "scheme": self.route.scheme, "mode": self.route.mode, "kv": self.route.kv,
                "resident_layers": self.route.resident_layers, "max_batch": self.config.max_batch,
                "interactive": self.interactive, "device": self.engine.device.type if self.engine else None}

    def metrics(self) -> dict:
        """Queue depth, running sequences, tokens/s and passes/s (of engine time), counters since start."""
        with self._lock:
            m = replace(self._metrics)
        out = {"uptime_s": time.time() - m.started_at, "requests": m.requests, "requests_failed": m.requests_failed,
               "prompts": m.prompts, "passes": m.passes, "batches": m.passes, "new_tokens": m.new_tokens,
               "prompt_tokens": m.prompt_tokens, "busy_s": m.busy_s,
               "tokens_per_s": m.new_tokens / m.busy_s if m.busy_s else 0.0,
               "passes_per_s": m.passes / m.busy_s if m.busy_s else 0.0,
               "mean_batch_size": m.new_tokens / m.passes if m.passes else 0.0,
               "queue_depth": m.waiting + m.loop_waiting, "running": m.running, "in_flight": m.running}
        out.update(_vram(self.engine))
        return out

    # -- the worker thread ---------------------------------------------------------------------
    def _serve(self) -> None:
        try:
            # The route's placement is the engine's (engine/memory/planner.py): no second planning pass.
            self.engine = Engine.open(self.route.store, self.engine_config,
                                      placement=self.route.plan if self.route.mode == "streamed" else None)
            self._loop = self.engine.decode_loop(self.config.max_batch, context=self.route.context, kv=self._kv)
        except BaseException as exc:  # handed to the constructor, which re-raises it
            self._closed = True
            self._ready.set_exception(exc)
            return
        self._ready.set_result(None)
        log.info("provider: %s", self.describe())
        live: list[_Request] = []
        stop = False
        try:
            while not (stop and self._loop.idle):
                if self._loop.idle:
                    stop = self._take(live, block=True) is _STOP
                    if not stop:  # an idle loop waits a moment so concurrent callers share the first pass
                        time.sleep(self.config.batch_window_ms / 1000)
                while not stop:  # the stop sentinel can arrive here too (close() during the window or a pass)
                    taken = self._take(live, block=False)
                    if taken is None:
                        break
                    stop = taken is _STOP
                if not self._loop.idle:
                    self._step(live)
        finally:
            self._closed = True
            self._fail_all(live, ProviderClosedError("the provider was closed before this request ran."))
            self.engine.close()

    def _take(self, live: list, block: bool):
        """Move one queued request into the loop and return it; ``_STOP`` when that came, None when nothing is
        queued. The two must stay apart: a stop taken for "nothing queued" is lost and close() never returns."""
        try:
            request = self._queue.get(block=block)
        except queue.Empty:
            return None
        if request is _STOP:
            return _STOP
        if not request.future.set_running_or_notify_cancel():
            self._count_loop(taken=len(request.prompts))
            return request
        try:
            for p in request.prompts:  # one at a time: those submitted before a bad one are cancelled below
                seq = self._loop.submit(self.engine.request(self.engine.prompt_ids(p, request.gen.chat), request.gen))
                seq.owner = request
                request.seqs.append(seq)
        except Exception as exc:  # a prompt over the context: this request fails, the others run
            self._drop(request, exc, taken=len(request.prompts))
            return request
        self._count_loop(taken=len(request.prompts))
        live.append(request)
        return request

    def _step(self, live: list[_Request]) -> None:
        for request in live:
            if request.cancelled or request.future.cancelled():
                for seq in request.seqs:
                    self._loop.cancel(seq)
        stats = self._loop.stats
        before = stats.passes, stats.useful_tokens, stats.prompt_tokens, stats.busy_s
        try:
            events = self._loop.step()
        except Exception as exc:  # the pass failed: its sequences fail, the provider keeps serving
            self._abort(live, exc)
            return
        with self._lock:  # before the results go out: a caller that got one reads metrics that include it
            m = self._metrics
            m.busy_s += stats.busy_s - before[3]
            m.passes += stats.passes - before[0]
            m.new_tokens += stats.useful_tokens - before[1]
            m.prompt_tokens += stats.prompt_tokens - before[2]
            m.running, m.loop_waiting = len(self._loop.running), len(self._loop.waiting)
        for event in events:
            try:
                self._deliver(event)
            except Exception as exc:  # e.g. a streaming client's event loop is gone: that request fails alone
                log.warning("delivering a result failed (%s): its request fails, the provider keeps serving", exc)
                self._drop(event.seq.owner, exc)
        for request in [r for r in live if r.cancelled and all(s.done for s in r.seqs)]:
            self._fail(request, RequestCancelledError("the client went away; the request was cancelled."),
                       count=False)
        live[:] = [r for r in live if not r.future.done()]

    def _deliver(self, event) -> None:
        request = event.seq.owner
        if request.future.done():  # failed already (another of its sequences), or cancelled
            return
        if event.finish_reason == "error":  # this sequence failed alone: its request fails, the pass went on
            self._drop(request, SequenceFailedError(f"sequence failed: {event.seq.error}"))
            return
        if request.on_event is not None and not request.cancelled:
            usage = None
            if event.finish_reason is not None:
                done = len(event.seq.out) + event.seq.eos_hit
                usage = {"prompt_tokens": event.seq.prompt_len, "completion_tokens": done,
                         "total_tokens": event.seq.prompt_len + done}
            request.on_event(StreamEvent(event.text, list(event.token_ids), event.finish_reason, usage))
        if event.finish_reason is None:
            return
        k = request.seqs.index(event.seq)
        request.results[k] = self.engine.completion(event.seq)
        if all(r is not None for r in request.results) and not request.future.done():
            with self._lock:
                self._metrics.prompts += len(request.results)
            request.future.set_result(request.results)

    def _abort(self, live: list[_Request], exc: Exception) -> None:
        log.warning("a pass failed (%s): its requests fail, the provider keeps serving", exc)
        for request in live:
            self._drop(request, exc)
        live.clear()

    def _drop(self, request: _Request, exc: BaseException, taken: int = 0) -> None:
        """Fail one request and free its slots (its other sequences stop at once)."""
        for seq in request.seqs:
            self._loop.cancel(seq)
        self._count_loop(taken)
        self._fail(request, exc)

    def _count_loop(self, taken: int = 0) -> None:
        """Bring the loop's counts into the metrics; ``taken`` prompts moved from the queue into the loop. One
        update under the lock, so ``max_queue`` (which counts both places) never misses them in between."""
        with self._lock:
            m = self._metrics
            m.waiting -= taken
            m.running, m.loop_waiting = len(self._loop.running), len(self._loop.waiting)

    def _fail(self, request: _Request, exc: BaseException, count: bool = True) -> None:
        if count:
            with self._lock:
                self._metrics.requests_failed += 1
        if not request.future.done():
            request.future.set_exception(exc)

    def _fail_all(self, live: list, exc: BaseException) -> None:
        while True:
            try:
                item = self._queue.get(block=False)
            except queue.Empty:
                break
            if item is not _STOP:
                live.append(item)
        for request in live:
            self._fail(request, exc)


def _vram(engine) -> dict:
    if engine is None or engine.device.type != "cuda":
        return {"vram_allocated_gb": None, "vram_reserved_gb": None, "vram_peak_gb": None}

    return {"vram_allocated_gb": torch.cuda.memory_allocated(engine.device) / 1e9,
            "vram_reserved_gb": torch.cuda.memory_reserved(engine.device) / 1e9,
            "vram_peak_gb": torch.cuda.max_memory_allocated(engine.device) / 1e9}


def _split_overrides(config: ProviderConfig, engine: EngineConfig,
                     overrides: dict) -> tuple[ProviderConfig, EngineConfig]:
    mine = {f.name for f in fields(ProviderConfig)}
    theirs = {f.name for f in fields(EngineConfig)}
    unknown = sorted(set(overrides) - mine - theirs)
    if unknown:
        raise TypeError(f"unknown Provider setting(s) {unknown}; use fields of ProviderConfig {sorted(mine)} "
                        f"or EngineConfig {sorted(theirs)}")
    config = replace(config, **{k: v for k, v in overrides.items() if k in mine})
    if config.max_batch < 1:
        raise AirQuantError(f"max_batch={config.max_batch}: use max_batch >= 1.")
    return config, replace(engine, **{k: v for k, v in overrides.items() if k in theirs})


def route_for(stores: Sequence[str | Path], config: ProviderConfig, engine: EngineConfig) -> tuple[Route, bool]:
    """The route the provider runs, and whether single (interactive) calls may use it."""
    device = runner.resolve_device(engine.device)
    hardware = Hardware.detect(device.type, engine.max_vram_gb if device.type == "cuda" else None,
                               engine.max_ram_gb)
    kv = ("none", "tq") if config.kv == "auto" else (config.kv,)
    workload = workload_for(engine, batch_size=config.max_batch, context=config.context or engine.context,
                            mode=config.mode, allow_streaming=config.allow_streaming, kv_schemes=kv)
    try:
        return plan_route(stores, hardware, workload), True
    except StreamingNotAllowedError:
        return plan_route(stores, hardware, replace(workload, allow_streaming=True)), False


class SyncProvider:
    """The blocking facade: ``provider.sync.generate(prompt)``, for scripts and notebooks."""

    def __init__(self, provider: Provider):
        self._provider = provider

    def generate(self, prompt: Prompt, **kw) -> str:
        return self._provider.submit([prompt], batch_job=False, **kw).result()[0].text

    def generate_batch(self, prompts: Sequence[Prompt], **kw) -> list[str]:
        return [c.text for c in self._provider.submit(list(prompts), batch_job=True, **kw).result()]

    def complete(self, prompt: Prompt, **kw):
        return self._provider.submit([prompt], batch_job=False, **kw).result()[0]

    def complete_batch(self, prompts: Sequence[Prompt], **kw):
        return self._provider.submit(list(prompts), batch_job=True, **kw).result()
