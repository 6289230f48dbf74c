"""Running the app: ``airquant serve`` in the foreground, ``BackgroundServer`` in a thread."""

from __future__ import annotations

import logging
import socket
import threading
import time
from pathlib import Path
from typing import Protocol, Sequence

import uvicorn
from fastapi import FastAPI

from airquant.config import EngineConfig
from airquant.engine.memory.router import StreamingNotAllowedError
from airquant.jobs.provider import Provider, ProviderConfig, route_for
from airquant.serve.app import create_app
from airquant.serve.config import ServeConfig, check_bind

log = logging.getLogger(__name__)


class Mount(Protocol):
    """Something served beside the API (the UI, ``airquant.ui.UiMount``), passed in by the CLI so that
    serve does not import the UI. It answers under ``prefix`` and checks the key itself there (a browser
    cannot send a Bearer header with a page load)."""

    prefix: str

    def __call__(self, app: FastAPI, provider: Provider, config: ServeConfig) -> None: ...


def serve(stores: Sequence[str | Path], config: ProviderConfig, engine: EngineConfig,
          serve_config: ServeConfig | None = None, *, log_level: str = "info",
          mount: Mount | None = None) -> int:
    """Load the model, then serve it until interrupted (``airquant serve``); ``mount`` adds the UI."""
    sc = serve_config or ServeConfig()
    check_bind(sc)
    route, interactive = route_for(stores, config, engine)
    if not interactive:  # refuse before loading: every request would be refused anyway
        raise StreamingNotAllowedError(
            f"{route.scheme} from {route.store} fits only streamed layer by layer, which the server keeps off "
            "by default: pass --allow-streaming to serve it streamed, or a more compressed store.\n"
            + route.describe())
    provider = Provider(stores, config=config, engine=engine, mode=config.mode)
    try:
        own = (mount.prefix,) if mount is not None else ()
        app = create_app(provider, config=sc, own_auth_prefixes=own)
        if mount is not None:
            mount(app, provider, sc)
        log.info("serving %s (%s, %s, KV %s) on http://%s:%d%s", route.store, route.scheme, route.mode, route.kv,
                 sc.host, sc.port, f" (UI at {own[0]}/)" if own else "")
        uvicorn.run(app, host=sc.host, port=sc.port, log_level=log_level)
    finally:
        provider.close()
    return 0


class BackgroundServer:
    """``with BackgroundServer(app) as url:`` runs ``app`` with uvicorn on a free loopback port."""

    def __init__(self, app, host: str = "127.0.0.1", port: int = 0, start_timeout_s: float = 20.0):
        self.app, self.host, self.port, self.start_timeout_s = app, host, port, start_timeout_s
        self._server: uvicorn.Server | None = None
        self._thread: threading.Thread | None = None

    def __enter__(self) -> str:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((self.host, self.port))
        self.port = sock.getsockname()[1]
        config = uvicorn.Config(self.app, log_level="warning", lifespan="auto")  # Gradio starts its queue there
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [sock]},
                                        name="airquant-http", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + self.start_timeout_s
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"the HTTP server did not start on {self.host}:{self.port}")
            time.sleep(0.02)
        return f"http://{self.host}:{self.port}"

    def __exit__(self, *exc) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=10)
