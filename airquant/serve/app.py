"""The FastAPI app: /v1/completions, /v1/chat/completions, /v1/models, /health, /metrics, /stats.

Requests are OpenAI-shaped; ``"stream": true`` answers with Server-Sent Events (``serve.stream``).
Settings the engine does not implement (n > 1, logprobs, penalties...) are refused with a 400 rather
than silently ignored; other unknown fields are ignored, as OpenAI clients send many. Errors are
``{"error": {"message", "type", "param", "code"}}``. A failing generation answers 500 to its own
request only: the worker keeps serving. A full queue answers 429 with ``Retry-After``.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
import uuid
from functools import lru_cache
from typing import Literal

import anyio
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field
from starlette.exceptions import HTTPException

from airquant import __version__
from airquant.engine.router import StreamingNotAllowedError
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


class StreamOptions(BaseModel):
    include_usage: bool = False


class _Sampling(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None


class CompletionRequest(_Sampling):
    prompt: str | list[str] = Field(min_length=1)


class Message(BaseModel):
    role: Literal["system", "user", "assistant"]
    content: str


class ChatRequest(_Sampling):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)


class _GenerationFailed(Exception):
    """Handled (not re-raised) by the app, so uvicorn does not log it a second time."""


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
    install_security(app, config or ServeConfig(), own_auth_prefixes)
    app.add_middleware(StatusCounter, counter=metrics.rejected)  # outermost: sees the 401/413 of security too
    _install_error_handlers(app, provider)
    count = prompt_counter(provider)

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest):
        prompts = [req.prompt] if isinstance(req.prompt, str) else req.prompt
        if req.stream:
            if len(prompts) > 1:
                raise _BadRequest("stream=true takes one prompt per request; send the prompts as separate "
                                  "requests (they share weight passes all the same).", "prompt")
            fmt = ChunkFormat("completion", name, _include_usage(req))
            return await _stream(provider, prompts[0], req, req.max_tokens, fmt, count)
        outs = await _generate(provider, prompts, req, req.max_tokens, chat=False)
        choices = [{"index": i, "text": text, "logprobs": None, "finish_reason": why}
                   for i, (text, why, _) in enumerate(outs)]
        return _body("text_completion", "cmpl", name, choices, outs)

    @app.post("/v1/chat/completions")
    async def chat(req: ChatRequest):
        messages = [m.model_dump() for m in req.messages]
        limit = req.max_completion_tokens or req.max_tokens
        if req.stream:
            return await _stream(provider, messages, req, limit, ChunkFormat("chat", name, _include_usage(req)),
                                 count)
        outs = await _generate(provider, [messages], req, limit, chat=True)
        choices = [{"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": why}
                   for text, why, _ in outs]
        return _body("chat.completion", "chatcmpl", name, choices, outs)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": name, "object": "model", "owned_by": "airquant"}]}

    @app.get("/health")
    async def health():
        body = {"status": "ok" if provider.alive else "down", **provider.describe()}
        return JSONResponse(status_code=200 if provider.alive else 503, content=body)

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

    def count(prompt, chat: bool) -> int:
        return prompt_lengths(tokenizer(), [JobPrompt(id=0, prompt=prompt, key="0")], chat)[0]

    return count


def _include_usage(req: _Sampling) -> bool:
    return bool(req.stream_options and req.stream_options.include_usage)


def _settings(req: _Sampling, max_tokens: int | None, chat: bool) -> tuple[dict, list[str]]:
    """Provider keywords (as ``Provider.generate`` takes them) and the stop strings of a request."""
    _check_supported(req)
    kw = {"chat": chat}
    for key, value in (("max_new_tokens", max_tokens), ("temperature", req.temperature),
                       ("top_p", req.top_p), ("seed", req.seed)):
        if value is not None:
            kw[key] = value
    stops = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    if stops:  # the engine ends the sequence there (no tokens spent past it); the app cuts again as a guard
        kw["stop"] = tuple(stops)
    return kw, stops


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
    kw, stops = _settings(req, max_tokens, chat)
    events = provider.stream(prompt, **kw)
    try:
        first = await anext(events, None)
    except BaseException:
        await aclose(events)
        raise
    return EventStream(sse_lines(first, events, fmt, stops, lambda: count(prompt, chat)))


async def _generate(provider: Provider, prompts: list, req: _Sampling, max_tokens: int | None,
                    chat: bool) -> list[tuple[str, str, object]]:
    """(text, finish_reason, Completion) per prompt, in order."""
    kw, stops = _settings(req, max_tokens, chat)
    limit = kw.get("max_new_tokens", provider.defaults.max_new_tokens)
    try:
        completions = await asyncio.wrap_future(provider.submit(prompts, batch_job=False, **kw))
    except AirQuantError:
        raise
    except Exception as exc:  # only this request failed; the worker is still serving
        log.exception("generation failed")
        raise _GenerationFailed(f"generation failed: {type(exc).__name__}: {exc}") from exc
    return [(*_finish(c, stops, limit), c) for c in completions]


def _finish(completion, stops: list[str], limit: int) -> tuple[str, str]:
    text = completion.text
    cuts = [text.find(s) for s in stops if s and s in text]
    if cuts:
        return text[: min(cuts)], "stop"
    hit_eos = completion.new_tokens > len(completion.token_ids)
    return text, "stop" if hit_eos or completion.new_tokens < limit else "length"


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

    @app.exception_handler(_GenerationFailed)
    async def failed(_: Request, exc: _GenerationFailed):
        return error_response(500, str(exc), "server_error")

    @app.exception_handler(Exception)
    async def unexpected(_: Request, exc: Exception):
        return error_response(500, f"internal error: {type(exc).__name__}: {exc}", "server_error")
