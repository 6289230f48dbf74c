"""The FastAPI app: /v1/completions, /v1/chat/completions, /v1/models, /health, /metrics, /stats.

Requests are OpenAI-shaped; ``"stream": true`` answers with Server-Sent Events (``serve.stream``).
Settings the engine does not implement (n > 1, logprobs, penalties...) are refused with a 400 rather
than silently ignored; other unknown fields are ignored, as OpenAI clients send many. Errors are
``{"error": {"message", "type", "param", "code"}}``. A failing generation answers 500 to its own
request only: the worker keeps serving. A full queue answers 429 with ``Retry-After``.

What one request may hold is bounded, so that it cannot cost others much: at most ``MAX_STOPS`` stop
strings of ``MAX_STOP_CHARS`` characters (each is searched at every token), ``--max-prompts`` prompts and
``--max-request-tokens`` tokens (prompts + new tokens) in all. A request whose client disconnects is
cancelled, streamed or not.
"""

from __future__ import annotations

import asyncio
import logging
import math
import threading
import time
import uuid
from functools import lru_cache
from typing import Literal

import anyio
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, field_validator
from starlette.exceptions import HTTPException

from airquant import __version__
from airquant.engine.decode.loop import SEED_RANGE
from airquant.engine.decode.text import MAX_STOP_CHARS, MAX_STOPS
from airquant.engine.memory.router import StreamingNotAllowedError
from airquant.errors import AirQuantError
from airquant.jobs.batch import Prompt as JobPrompt
from airquant.jobs.batch import prompt_lengths
from airquant.jobs.provider import Provider, ProviderClosedError, QueueFullError
from airquant.serve.config import ServeConfig
from airquant.serve.metrics import ServerMetrics, StatusCounter
from airquant.serve.security import install_security
from airquant.serve.stream import ChunkFormat, aclose, sse_lines
from airquant.store.side_files import load_tokenizer

log = logging.getLogger(__name__)

# Fields OpenAI defines that this server does not implement, with the values that mean "off".
UNSUPPORTED = {
    "n": (1, None), "best_of": (1, None), "echo": (False, None),
    "logprobs": (None, False, 0), "top_logprobs": (None, 0), "presence_penalty": (None, 0, 0.0),
    "frequency_penalty": (None, 0, 0.0), "logit_bias": (None, {}), "suffix": (None, ""), "tools": (None, []),
}


def _utf8(value, field: str):
    """A string with a lone surrogate (JSON allows ``"\\ud800"``) cannot be encoded for the tokenizer."""
    for text in [value] if isinstance(value, str) else value if isinstance(value, list) else []:
        if isinstance(text, str):
            try:
                text.encode("utf-8")
            except UnicodeEncodeError as exc:
                raise ValueError(f"{field} holds a lone surrogate ({text[exc.start:exc.end]!r} at character "
                                 f"{exc.start}), which is not text; send valid UTF-8") from None
    return value


class StreamOptions(BaseModel):
    include_usage: bool = False


class _Sampling(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    seed: int | None = Field(None, ge=SEED_RANGE[0], le=SEED_RANGE[1])
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None

    @field_validator("stop")
    @classmethod
    def _stops(cls, value):
        if isinstance(value, list) and len(value) > MAX_STOPS:
            raise ValueError(f"at most {MAX_STOPS} stop strings (got {len(value)})")
        for s in [value] if isinstance(value, str) else value or []:
            if len(s) > MAX_STOP_CHARS:
                raise ValueError(f"a stop string may be at most {MAX_STOP_CHARS} characters (got {len(s)})")
        return _utf8(value, "stop")


class CompletionRequest(_Sampling):
    prompt: str | list[str] = Field(min_length=1)

    @field_validator("prompt")
    @classmethod
    def _text(cls, value):
        return _utf8(value, "prompt")


class Message(BaseModel):
    role: Literal["system", "user", "assistant"]
    content: str

    @field_validator("content")
    @classmethod
    def _text(cls, value):
        return _utf8(value, "content")


class ChatRequest(_Sampling):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)


class _GenerationFailed(Exception):
    """Handled (not re-raised) by the app, so uvicorn does not log it a second time."""


class _ClientGone(Exception):
    """The client disconnected before its answer was ready; nobody reads the response."""


class _BadRequest(Exception):
    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


def error_response(status: int, message: str, kind: str, param: str | None = None) -> JSONResponse:
    return JSONResponse(status_code=status,
                        content={"error": {"message": message, "type": kind, "param": param, "code": status}})


def create_app(provider: Provider, model_name: str | None = None, config: ServeConfig | None = None,
               own_auth_prefixes: tuple[str, ...] = ()) -> FastAPI:
    """The app serving ``provider``; ``model_name`` is what /v1/models lists (default: the store's model).

    ``config`` sets the key, body limit and CORS (``ServeConfig``); ``own_auth_prefixes`` are mounts that
    check the key themselves (the UI's login page).
    """
    name = model_name or provider.describe()["model"] or provider.route.store.name
    app = FastAPI(title="AirQuant", version=__version__)
    app.state.metrics = metrics = ServerMetrics(provider)
    config = config or ServeConfig()
    install_security(app, config, own_auth_prefixes)
    app.add_middleware(StatusCounter, counter=metrics.rejected)  # outermost: sees the 401/413 of security too
    _install_error_handlers(app, provider)
    count = prompt_counter(provider)
    budget = RequestBudget(config.max_prompts, config.max_request_tokens, count, provider.defaults.max_new_tokens)

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, http: Request):
        prompts = [req.prompt] if isinstance(req.prompt, str) else req.prompt
        if req.stream and len(prompts) > 1:
            raise _BadRequest("stream=true takes one prompt per request; send the prompts as separate "
                              "requests (they share weight passes all the same).", "prompt")
        await budget.check(prompts, req.max_tokens, chat=False)
        if req.stream:
            fmt = ChunkFormat("completion", name, _include_usage(req))
            return await _stream(provider, prompts[0], req, req.max_tokens, fmt, count)
        outs = await _generate(provider, prompts, req, req.max_tokens, chat=False, http=http)
        choices = [{"index": i, "text": text, "logprobs": None, "finish_reason": why}
                   for i, (text, why, _) in enumerate(outs)]
        return _body("text_completion", "cmpl", name, choices, outs)

    @app.post("/v1/chat/completions")
    async def chat(req: ChatRequest, http: Request):
        messages = [m.model_dump() for m in req.messages]
        limit = req.max_completion_tokens or req.max_tokens
        await budget.check([messages], limit, chat=True)
        if req.stream:
            return await _stream(provider, messages, req, limit, ChunkFormat("chat", name, _include_usage(req)),
                                 count)
        outs = await _generate(provider, [messages], req, limit, chat=True, http=http)
        choices = [{"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": why}
                   for text, why, _ in outs]
        return _body("chat.completion", "chatcmpl", name, choices, outs)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": name, "object": "model", "owned_by": "airquant"}]}

    @app.get("/health")
    async def health():  # open without a key: the status only (the route, with the store's path, is /stats)
        return JSONResponse(status_code=200 if provider.alive else 503,
                            content={"status": "ok" if provider.alive else "down"})

    @app.get("/metrics")
    async def prometheus():
        return Response(metrics.render(), media_type=metrics.content_type)

    @app.get("/stats")
    async def stats():
        return {**provider.metrics(), **provider.describe()}

    return app


def prompt_counter(provider: Provider):
    """``count(prompt, chat) -> tokens`` as the engine encodes them, with a tokenizer of the app's own
    (the engine's belongs to the provider's worker thread)."""

    @lru_cache(maxsize=1)
    def tokenizer():
        return load_tokenizer(provider.route.store / "tokenizer")

    lock = threading.Lock()  # a fast tokenizer refuses to be used from two threads at once ("Already borrowed")

    def count(prompt, chat: bool) -> int:
        with lock:
            return prompt_lengths(tokenizer(), [JobPrompt(id=0, prompt=prompt, key="0")], chat)[0]

    return count


class RequestBudget:
    """What one request may queue: ``max_prompts`` prompts and ``max_tokens`` tokens (each prompt's tokens
    plus its new tokens); a 400 names the cap and the flag. Counting runs off the event loop."""

    def __init__(self, max_prompts: int, max_tokens: int, count, default_new_tokens: int):
        self.max_prompts, self.max_tokens, self.count = max_prompts, max_tokens, count
        self.default_new_tokens = default_new_tokens

    async def check(self, prompts: list, max_new_tokens: int | None, chat: bool) -> None:
        if len(prompts) > self.max_prompts:
            raise _BadRequest(f"{len(prompts)} prompts in one request; the server takes at most {self.max_prompts} "
                              "(--max-prompts): send the rest in further requests.", "prompt")
        new = max_new_tokens or self.default_new_tokens
        total = new * len(prompts)
        if total > self.max_tokens:  # refused before any tokenizing
            raise self._over(total, new, len(prompts))
        total += sum(await anyio.to_thread.run_sync(lambda: [self.count(p, chat) for p in prompts]))
        if total > self.max_tokens:
            raise self._over(total, new, len(prompts))

    def _over(self, total: int, new: int, prompts: int) -> _BadRequest:
        return _BadRequest(f"this request would queue {total} tokens ({prompts} prompt(s) plus {new} new tokens "
                           f"each); the server takes at most {self.max_tokens} per request (--max-request-tokens): "
                           "send fewer or shorter prompts, or a lower max_tokens.", "max_tokens")


def _include_usage(req: _Sampling) -> bool:
    return bool(req.stream_options and req.stream_options.include_usage)


def _settings(req: _Sampling, max_tokens: int | None, chat: bool) -> dict:
    """Provider keywords (as ``Provider.generate`` takes them), the request's stop strings among them."""
    _check_supported(req)
    kw = {"chat": chat}
    for key, value in (("max_new_tokens", max_tokens), ("temperature", req.temperature),
                       ("top_p", req.top_p), ("seed", req.seed)):
        if value is not None:
            kw[key] = value
    stops = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    if stops:  # the engine's detokenizer ends the sequence there and cuts the text (no tokens spent past it)
        kw["stop"] = tuple(stops)
    return kw


class EventStream(StreamingResponse):
    """An SSE response that closes its event iterator however it ends: a client that disconnects frees
    its sequence's slot at once, not when the generator is garbage-collected."""

    def __init__(self, lines):
        super().__init__(lines, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    async def stream_response(self, send) -> None:
        try:
            await super().stream_response(send)
        finally:
            with anyio.CancelScope(shield=True):  # a disconnect cancels this task; the close must still run
                await self.body_iterator.aclose()


async def _stream(provider: Provider, prompt, req: _Sampling, max_tokens: int | None, fmt: ChunkFormat, count):
    """Start the stream and wait for its first event before answering, so that a bad request or a full
    queue still gets its 4xx status instead of an error inside a 200 stream."""
    chat = fmt.kind == "chat"
    events = provider.stream(prompt, **_settings(req, max_tokens, chat))
    try:
        first = await anext(events, None)
    except BaseException:
        await aclose(events)
        raise
    return EventStream(sse_lines(first, events, fmt, lambda: count(prompt, chat)))


async def _generate(provider: Provider, prompts: list, req: _Sampling, max_tokens: int | None,
                    chat: bool, http: Request) -> list[tuple[str, str, object]]:
    """(text, finish_reason, Completion) per prompt, in order; the request is cancelled if its client leaves."""
    future = provider.submit(prompts, batch_job=False, **_settings(req, max_tokens, chat))
    try:
        completions = await _unless_disconnected(provider, future, http)
    except AirQuantError:
        raise
    except Exception as exc:  # only this request failed; the worker is still serving
        log.exception("generation failed")
        raise _GenerationFailed(f"generation failed: {type(exc).__name__}: {exc}") from exc
    return [(c.text, c.finish_reason, c) for c in completions]  # cut and ended by the engine's detokenizer


async def _unless_disconnected(provider: Provider, future, http: Request):
    """The future's result, or ``_ClientGone`` (and the request cancelled, its slots freed) when the client
    disconnects first. The body is read by now, so ``receive`` next reports the disconnect."""
    result = asyncio.wrap_future(future)

    async def gone() -> None:
        while (await http.receive())["type"] != "http.disconnect":
            pass

    watcher = asyncio.ensure_future(gone())
    try:
        await asyncio.wait([result, watcher], return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
    if not result.done():
        result.cancel()
        provider.cancel(future)
        raise _ClientGone()
    return result.result()


def _check_supported(req: _Sampling) -> None:
    extra = req.model_extra or {}
    for field, off in UNSUPPORTED.items():
        if field in extra and extra[field] not in off:
            raise _BadRequest(f"{field}={extra[field]!r} is not supported by the AirQuant server; "
                              f"leave it out (or send {off[0]!r}).", field)


def _body(kind: str, prefix: str, model: str, choices: list, outs: list) -> dict:
    prompt_tokens = sum(c.prompt_tokens for _, _, c in outs)
    new_tokens = sum(c.new_tokens for _, _, c in outs)
    return {"id": f"{prefix}-{uuid.uuid4().hex[:24]}", "object": kind, "created": int(time.time()),
            "model": model, "choices": choices,
            "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": new_tokens,
                      "total_tokens": prompt_tokens + new_tokens}}


def retry_after_s(metrics: dict) -> int:
    """Seconds until the waiting prompts have likely been served at the rate prompts have finished so far,
    at least 1 (RFC 9110 wants whole seconds), at most 10 minutes."""
    rate = metrics["prompts"] / metrics["busy_s"] if metrics.get("prompts") and metrics.get("busy_s") else 1.0
    return max(1, min(600, math.ceil(max(metrics.get("queue_depth", 0), 1) / rate)))


def _install_error_handlers(app: FastAPI, provider: Provider) -> None:
    @app.exception_handler(RequestValidationError)
    async def invalid(_: Request, exc: RequestValidationError):
        parts = ["body: not valid JSON" if e["type"] == "json_invalid" else
                 f"{'.'.join(str(x) for x in e['loc'][1:]) or 'body'}: {e['msg']}" for e in exc.errors()]
        return error_response(400, "invalid request: " + "; ".join(parts), "invalid_request_error")

    @app.exception_handler(HTTPException)
    async def http_error(_: Request, exc: HTTPException):
        return error_response(exc.status_code, str(exc.detail), "invalid_request_error")

    @app.exception_handler(_BadRequest)
    async def bad(_: Request, exc: _BadRequest):
        return error_response(400, str(exc), "invalid_request_error", exc.param)

    @app.exception_handler(QueueFullError)
    async def busy(_: Request, exc: QueueFullError):
        response = error_response(429, str(exc), "rate_limit_error")
        response.headers["Retry-After"] = str(retry_after_s(provider.metrics()))
        return response

    @app.exception_handler(ProviderClosedError)
    async def closed(_: Request, exc: ProviderClosedError):
        return error_response(503, str(exc), "server_error")

    @app.exception_handler(StreamingNotAllowedError)
    async def no_streaming(_: Request, exc: StreamingNotAllowedError):
        return error_response(503, str(exc), "server_error")

    @app.exception_handler(AirQuantError)
    async def airquant_error(_: Request, exc: AirQuantError):
        return error_response(400, str(exc), "invalid_request_error")

    @app.exception_handler(_ClientGone)
    async def gone(_: Request, exc: _ClientGone):
        return Response(status_code=499)  # nginx's "client closed request": counted, never read

    @app.exception_handler(_GenerationFailed)
    async def failed(_: Request, exc: _GenerationFailed):
        return error_response(500, str(exc), "server_error")

    @app.exception_handler(Exception)
    async def unexpected(_: Request, exc: Exception):
        return error_response(500, f"internal error: {type(exc).__name__}: {exc}", "server_error")
