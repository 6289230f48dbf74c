"""Who may call the server and how much they may send: the Host check, opt-in CORS, Bearer keys, a body
limit counted on the bytes received, a body read timeout.

Pure ASGI middleware rather than ``BaseHTTPMiddleware``: the latter runs the app in a separate task,
which delays a streamed response's disconnect notice, and a client that goes away must free its slot
at once. Rejections are the server's usual JSON errors. Outermost first: the Host check, CORS (a preflight
needs no key), the key, the body limit; so a request for a foreign Host or without the key is refused
before a byte of its body is read, and the body is read only as the app asks for it.
"""

from __future__ import annotations

import hmac
import ipaddress
import json

import anyio
from fastapi import FastAPI
from fastapi.middleware.cors import CORSMiddleware
from starlette.exceptions import HTTPException

from airquant.serve.config import API_KEY_ENV, ServeConfig

OPEN_PATHS = ("/health",)  # load balancers and probes check liveness without a key
LOOPBACK_NAMES = ("localhost",)


def install_security(app: FastAPI, config: ServeConfig, own_auth_prefixes: tuple[str, ...] = ()) -> None:
    """Add the body limit, the key check, CORS and the Host check to ``app`` (each added one runs first).

    ``own_auth_prefixes``: mounts that check the key themselves (the UI's login page), since a browser
    cannot attach a Bearer header to a page load.
    """
    app.add_middleware(BodyLimit, max_bytes=config.max_body_bytes, timeout_s=config.body_timeout_s)
    if config.api_key:
        app.add_middleware(BearerAuth, key=config.api_key, open_paths=OPEN_PATHS, own_auth=own_auth_prefixes)
    # Installed even without origins (it then allows none): a mounted Gradio app leaves CORS to a parent that
    # has a CORSMiddleware, and its own echoes any localhost origin with credentials.
    app.add_middleware(CORSMiddleware, allow_origins=list(config.cors_origins), allow_methods=["GET", "POST"],
                       allow_headers=["authorization", "content-type"])
    app.add_middleware(TrustedHosts, hosts=trusted_hosts(config))


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


# -- the Host header ------------------------------------------------------------------------------
def trusted_hosts(config: ServeConfig) -> tuple[str, ...]:
    """Host names the server answers to: loopback names, its own --host, each --allowed-host ("*": any,
    "*.example.com": its subdomains). IP addresses are always answered (see ``TrustedHosts``)."""
    return tuple(dict.fromkeys(h.strip().lower().rstrip(".") for h in (*LOOPBACK_NAMES, config.host,
                                                                         *config.allowed_hosts) if h.strip()))


def host_name(header: str) -> str:
    """The name of a Host header, without its port: ``[::1]:8000`` -> ``::1``, ``Example.com.:80`` -> ``example.com``."""
    header = header.strip().lower()
    if header.startswith("["):
        return header[1:header.find("]")] if "]" in header else header
    return header.rsplit(":", 1)[0].rstrip(".") if header.count(":") == 1 else header.rstrip(".")


class TrustedHosts:
    """400 for a Host header the server does not answer to: a page of ``attacker.example`` whose DNS name
    is rebound to 127.0.0.1 reaches a key-less loopback server with its own name as the Host. An IP
    address as the Host is answered whatever it is: rebinding needs a name (a page served from an IP is
    the server's own origin)."""

    def __init__(self, app, hosts: tuple[str, ...]):
        self.app, self.hosts, self.any = app, hosts, "*" in hosts

    def allows(self, name: str) -> bool:
        if self.any or name in self.hosts:
            return True
        if any(h.startswith("*.") and name.endswith(h[1:]) for h in self.hosts):
            return True
        try:
            ipaddress.ip_address(name)
            return True
        except ValueError:
            return False

    async def __call__(self, scope, receive, send):
        if scope["type"] not in ("http", "websocket") or self.any:
            return await self.app(scope, receive, send)
        given = _header(scope, b"host") or ""
        if self.allows(host_name(given)):
            return await self.app(scope, receive, send)
        if scope["type"] == "websocket":
            return await send({"type": "websocket.close", "code": 1008})
        await send_error(send, 400, f"Host {given[:100]!r} is not a name this server answers to (loopback names, "
                         "IP addresses and its --host); start it with --allowed-host NAME to answer that name.",
                         "invalid_request_error")


# -- the key --------------------------------------------------------------------------------------
class BearerAuth:
    """401 unless ``Authorization: Bearer KEY`` matches (constant-time compare); the body is not read."""

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


# -- the body -------------------------------------------------------------------------------------
class BodyRejected(HTTPException):
    """Raised from ``receive`` while the app reads the body; FastAPI passes an HTTPException through its body
    parsing unchanged, so the app's own handler answers it (``BodyLimit`` answers when nothing else did)."""


class BodyLimit:
    """413 for a body over ``max_bytes``, 408 for one not received whole within ``timeout_s``.

    The bytes are counted as they arrive, chunked or not: a Content-Length is only a claim (with
    ``Transfer-Encoding: chunked`` the HTTP layer ignores it). A declared length over the limit is refused
    before anything is read. Nothing is buffered here: the app reads the body as it always does.
    """

    def __init__(self, app, max_bytes: int, timeout_s: float):
        self.app, self.max_bytes, self.timeout_s = app, max_bytes, timeout_s

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        length = _header(scope, b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_bytes:
            return await send_error(send, 413, self._too_large(f"{int(length)} bytes"), "invalid_request_error")
        started = False

        async def watched_send(message):
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, self._counted(receive), watched_send)
        except BodyRejected as exc:
            if started:
                raise
            await send_error(send, exc.status_code, exc.detail, "invalid_request_error")

    def _counted(self, receive):
        deadline = anyio.current_time() + self.timeout_s
        total, done = 0, False

        async def counted():
            nonlocal total, done
            if done:  # the body is in: later calls wait for a disconnect, as long as the response takes
                return await receive()
            with anyio.move_on_after(max(0.0, deadline - anyio.current_time())) as waited:
                message = await receive()
            if waited.cancelled_caught:
                raise BodyRejected(408, f"request body not received within {self.timeout_s:g} s; send it whole "
                                        "at once (the server's --body-timeout-s).")
            if message["type"] != "http.request":
                done = True
                return message
            total += len(message.get("body", b""))
            if total > self.max_bytes:
                raise BodyRejected(413, self._too_large("more than that"))
            done = not message.get("more_body", False)
            return message

        return counted

    def _too_large(self, got: str) -> str:
        return (f"request body too large ({got}; the limit is {self.max_bytes} bytes). Send a shorter request, "
                "or start the server with a larger --max-body-mb.")
