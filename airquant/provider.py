"""A provider other software can call: ``await Provider(store).generate(prompt)``.

The engine is not thread-safe, so one worker thread owns it and drains a request queue. Requests
that arrive within ``batch_window_ms`` of each other and share their settings (max_new_tokens,
temperature, top_p, seed, chat) go through the model as one batch: one weight pass serves them all.
Callers await a ``concurrent.futures.Future`` (wrapped for asyncio), so the provider works from any
event loop, from several at once, and from plain threads (``provider.sync``).

The router (``airquant.engine.router``) picks the store, mode and KV scheme. Layer-by-layer
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
from typing import Literal, Sequence

from airquant.config import EngineConfig, GenerateConfig
from airquant.engine.router import Hardware, Mode, Route, StreamingNotAllowedError, plan_route, workload_for
from airquant.errors import AirQuantError

log = logging.getLogger(__name__)

Prompt = str | list  # a string, or a conversation: a list of {"role", "content"} (chat)
_STOP = object()


class ProviderClosedError(AirQuantError):
    """The provider was closed (or its engine failed to open); create a new one."""


class QueueFullError(AirQuantError):
    """More prompts are waiting than ``max_queue``; retry later or raise --max-queue."""


@dataclass(frozen=True)
class ProviderConfig:
    """``airquant serve`` flags: --mode --allow-streaming --kv --max-batch --batch-window-ms --context --max-queue."""

    mode: Mode = "auto"
    allow_streaming: bool = False  # may a single (interactive) call run streamed?
    kv: Literal["auto", "none", "tq"] = "auto"  # auto: plain cache if it fits, else TurboQuant
    max_batch: int = 8  # prompts per weight pass; the router plans memory for this many
    batch_window_ms: float = 20.0  # how long the first request waits for others to share its pass
    context: int | None = None  # tokens per sequence the memory plan allows; None: min(model's, 2048)
    max_queue: int = 1024  # prompts waiting before new ones are refused


@dataclass
class _Request:
    prompts: list[Prompt]
    gen: GenerateConfig
    future: Future = field(default_factory=Future)
    results: list = field(default_factory=list)
    started: bool = False

    def __post_init__(self) -> None:
        self.results = [None] * len(self.prompts)


@dataclass
class _Metrics:
    started_at: float = field(default_factory=time.time)
    requests: int = 0
    requests_failed: int = 0
    prompts: int = 0
    batches: int = 0
    new_tokens: int = 0
    prompt_tokens: int = 0
    busy_s: float = 0.0
    last_batch_size: int = 0
    waiting: int = 0  # prompts queued, not yet in a batch
    running: int = 0  # prompts in the batch being generated


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
        self.route, self.interactive = route_for(self.stores, self.config, engine_cfg)
        self.engine_config = self.route.engine_config(engine_cfg)
        self._kv = self.route.kv_config()
        self._queue: queue.Queue = queue.Queue()
        self._lock = threading.Lock()
        self._metrics = _Metrics()
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

    def submit(self, prompts: list[Prompt], *, batch_job: bool, **kw) -> Future:
        """Queue prompts; the Future resolves to their Completions in order."""
        if self._closed or not self._thread.is_alive():
            raise ProviderClosedError("this provider is closed; create a new Provider.")
        if not batch_job and not self.interactive:
            raise StreamingNotAllowedError(
                f"{self.route.scheme} from {self.route.store} runs only streamed, which is kept off interactive "
                "calls: use generate_batch, or build the Provider with allow_streaming=True.")
        if not prompts:
            done = Future()
            done.set_result([])
            return done
        gen = self._settings(kw, prompts)
        with self._lock:
            if self._metrics.waiting + len(prompts) > self.config.max_queue:
                raise QueueFullError(f"{self._metrics.waiting} prompts are already waiting (max_queue "
                                     f"{self.config.max_queue}); retry later.")
            self._metrics.waiting += len(prompts)
            self._metrics.requests += 1
        request = _Request(list(prompts), gen)
        self._queue.put(request)
        return request.future

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
        with self._lock:
            m = replace(self._metrics)
        out = {"uptime_s": time.time() - m.started_at, "requests": m.requests, "requests_failed": m.requests_failed,
               "prompts": m.prompts, "batches": m.batches, "new_tokens": m.new_tokens,
               "prompt_tokens": m.prompt_tokens, "busy_s": m.busy_s,
               "tokens_per_s": m.new_tokens / m.busy_s if m.busy_s else 0.0,
               "mean_batch_size": m.prompts / m.batches if m.batches else 0.0,
               "last_batch_size": m.last_batch_size, "queue_depth": m.waiting, "in_flight": m.running}
        out.update(_vram(self.engine))
        return out

    # -- the worker thread ---------------------------------------------------------------------
    def _serve(self) -> None:
        from airquant.engine.runner import Engine

        try:
            self.engine = Engine.open(self.route.store, self.engine_config)
        except BaseException as exc:  # handed to the constructor, which re-raises it
            self._closed = True
            self._ready.set_exception(exc)
            return
        self._ready.set_result(None)
        log.info("provider: %s", self.describe())
        pending: list[tuple[_Request, int]] = []
        try:
            while not (self._closed and not pending and self._queue.empty()):
                if not pending and not self._take(pending, block=True):
                    break
                self._gather(pending)
                batch = self._next_batch(pending)
                if batch:
                    self._run(batch)
        finally:
            self._closed = True
            self._fail_all(pending, ProviderClosedError("the provider was closed before this request ran."))
            self.engine.close()

    def _take(self, pending: list, block: bool, timeout: float | None = None) -> bool:
        """Move one queued request into ``pending``; False on stop or timeout."""
        try:
            item = self._queue.get(block=block, timeout=timeout)
        except queue.Empty:
            return False
        if item is _STOP:
            return False
        pending.extend((item, i) for i in range(len(item.prompts)))
        return True

    def _gather(self, pending: list) -> None:
        """Wait up to the batch window for more prompts with the first one's settings."""
        deadline = time.monotonic() + self.config.batch_window_ms / 1000
        key = pending[0][0].gen
        while sum(r.gen == key for r, _ in pending) < self.config.max_batch:
            left = deadline - time.monotonic()
            if left <= 0 or not self._take(pending, block=True, timeout=left):
                return

    def _run(self, batch: list[tuple[_Request, int]]) -> None:
        with self._lock:
            self._metrics.waiting -= len(batch)
            self._metrics.running = len(batch)
        start = time.perf_counter()
        try:
            completions = self.engine.generate_detailed([r.prompts[i] for r, i in batch], batch[0][0].gen,
                                                        kv=self._kv)
        except Exception as exc:  # forwarded to the callers; the worker keeps serving the others
            self._count(batch, None, time.perf_counter() - start)
            if len(batch) > 1:
                self._run_alone(batch, exc)
            else:
                self._fail(batch[0][0], exc)
            return
        self._count(batch, completions, time.perf_counter() - start)
        for (request, i), completion in zip(batch, completions):
            request.results[i] = completion
            if all(r is not None for r in request.results) and not request.future.done():
                request.future.set_result(request.results)

    def _run_alone(self, batch: list[tuple[_Request, int]], error: Exception) -> None:
        """One bad prompt (too long, say) must not fail the requests it was batched with."""
        log.info("batch of %d failed (%s); running its prompts one by one", len(batch), error)
        for one in batch:
            if one[0].future.done():  # an earlier prompt of the same request failed
                continue
            with self._lock:
                self._metrics.waiting += 1  # _run takes it off again
            self._run([one])

    def _count(self, batch: list, completions: list | None, took: float) -> None:
        with self._lock:
            m = self._metrics
            m.running = 0
            m.busy_s += took
            if completions is not None:
                m.batches += 1
                m.last_batch_size = len(batch)
                m.prompts += len(batch)
                m.new_tokens += sum(c.new_tokens for c in completions)
                m.prompt_tokens += sum(c.prompt_tokens for c in completions)

    def _next_batch(self, pending: list[tuple[_Request, int]]) -> list[tuple[_Request, int]]:
        """Take up to ``max_batch`` prompts sharing the first one's settings, in arrival order."""
        wanted = [(r, i) for r, i in pending if _still_wanted(r)]
        with self._lock:
            self._metrics.waiting -= len(pending) - len(wanted)  # cancelled by their callers
        if not wanted:
            pending.clear()
            return []
        key = wanted[0][0].gen
        batch = [p for p in wanted if p[0].gen == key][: self.config.max_batch]
        taken = {(id(r), i) for r, i in batch}
        pending[:] = [(r, i) for r, i in wanted if (id(r), i) not in taken]
        return batch

    def _fail(self, request: _Request, exc: BaseException) -> None:
        with self._lock:
            self._metrics.requests_failed += 1
        if not request.future.done():
            request.future.set_exception(exc)

    def _fail_all(self, pending: list, exc: BaseException) -> None:
        while self._take(pending, block=False):
            pass
        for request in {id(r): r for r, _ in pending}.values():
            self._fail(request, exc)


def _still_wanted(request: _Request) -> bool:
    """False for a request its caller cancelled (or one already failed); marks it running otherwise."""
    if request.started:
        return not request.future.done()
    request.started = True
    return request.future.set_running_or_notify_cancel()


def _vram(engine) -> dict:
    if engine is None or engine.device.type != "cuda":
        return {"vram_allocated_gb": None, "vram_reserved_gb": None, "vram_peak_gb": None}
    import torch

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
    from airquant.engine.runner import resolve_device

    device = resolve_device(engine.device)
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
