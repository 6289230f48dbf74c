"""Who may call the server and how much they may send: Bearer keys, a body-size limit, opt-in CORS.

Pure ASGI middleware rather than ``BaseHTTPMiddleware``: the latter runs the app in a separate task,
which delays a streamed response's disconnect notice, and a client that goes away must free its slot
at once. Rejections are the server's usual JSON errors.
"""

from __future__ import annotations

import hmac
import json

from fastapi import FastAPI
from fastapi.middleware.cors import CORSMiddleware

from airquant.serve.config import API_KEY_ENV, ServeConfig

OPEN_PATHS = ("/health",)  # load balancers and probes check liveness without a key


def install_security(app: FastAPI, config: ServeConfig, own_auth_prefixes: tuple[str, ...] = ()) -> None:
    """Add the key check, the body limit and (only when origins are given) CORS to ``app``.

    ``own_auth_prefixes``: mounts that check the key themselves (the UI's login page), since a browser
    cannot attach a Bearer header to a page load.
    """
    if config.api_key:
        app.add_middleware(BearerAuth, key=config.api_key, open_paths=OPEN_PATHS, own_auth=own_auth_prefixes)
    app.add_middleware(BodyLimit, max_bytes=config.max_body_bytes)
    if config.cors_origins:  # added last: it runs first, so preflight OPTIONS get their headers without a key
        app.add_middleware(CORSMiddleware, allow_origins=list(config.cors_origins), allow_methods=["GET", "POST"],
                           allow_headers=["authorization", "content-type"])


async def send_error(send, status: int, message: str, kind: str, headers: dict | None = None) -> None:
    body = json.dumps({"error": {"message": message, "type": kind, "param": None, "code": status}}).encode()
    raw = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    raw += [(k.lower().encode(), v.encode()) for k, v in (headers or {}).items()]
    await send({"type": "http.response.start", "status": status, "headers": raw})
    await send({"type": "http.response.body", "body": body})


def _header(scope, name: bytes) -> str | None:
    for key, value in scope.get("headers", ()):
        if key == name:
            return value.decode("latin-1")
    return None


class BearerAuth:
    """401 unless ``Authorization: Bearer KEY`` matches (constant-time compare)."""

    def __init__(self, app, key: str, open_paths: tuple[str, ...], own_auth: tuple[str, ...] = ()):
        self.app, self.key, self.open_paths, self.own_auth = app, key.encode(), open_paths, own_auth

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or self._exempt(scope["path"]):
            return await self.app(scope, receive, send)
        given = _header(scope, b"authorization") or ""
        scheme, _, token = given.partition(" ")
        if scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), self.key):
            return await self.app(scope, receive, send)
        why = "no Authorization header" if not given else "the key does not match"
        await send_error(send, 401, f"unauthorized ({why}): send 'Authorization: Bearer KEY' with the server's key "
                         f"(--api-key or ${API_KEY_ENV}); only /health is open.", "authentication_error",
                         {"WWW-Authenticate": "Bearer"})

    def _exempt(self, path: str) -> bool:
        return path in self.open_paths or any(path == p or path.startswith(p + "/") for p in self.own_auth)


class BodyLimit:
    """413 for a body over ``max_bytes``: by Content-Length up front, or counted for chunked uploads."""

    def __init__(self, app, max_bytes: int):
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        length = _header(scope, b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_bytes:
            return await self._reject(send, int(length))
        if length is not None:
            return await self.app(scope, receive, send)  # the HTTP layer holds the client to its Content-Length
        return await self._counted(scope, receive, send)

    async def _counted(self, scope, receive, send):
        """Chunked body: read it whole (it is small by construction) and replay it to the app."""
        chunks, total = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                return await self.app(scope, _replay([message]), send)
            total += len(message.get("body", b""))
            if total > self.max_bytes:
                return await self._reject(send, None)
            chunks.append(message)
            if not message.get("more_body", False):
                break
        return await self.app(scope, _replay(chunks, receive), send)

    async def _reject(self, send, size: int | None) -> None:
        got = f"{size} bytes" if size is not None else "more than that"
        await send_error(send, 413, f"request body too large ({got}; the limit is {self.max_bytes} bytes). Send a "
                         "shorter request, or start the server with a larger --max-body-mb.", "invalid_request_error")


def _replay(messages: list, then=None):
    """A ``receive`` that hands back ``messages`` first, then defers to ``then`` (disconnect notices)."""
    pending = list(messages)

    async def receive():
        if pending:
            return pending.pop(0)
        if then is None:
            return {"type": "http.disconnect"}
        return await then()

    return receive
