"""Mounting the Gradio app into the server's FastAPI app, behind the server's key when it has one."""

from __future__ import annotations

import hmac
import logging
from dataclasses import dataclass
from pathlib import Path

import gradio as gr
from fastapi import FastAPI
from fastapi.responses import RedirectResponse

from airquant.serve.config import ServeConfig, is_loopback
from airquant.ui.app import UiContext, build_blocks
from airquant.ui.jobs import JobRunner

log = logging.getLogger(__name__)


def loopback_url(config: ServeConfig) -> str:
    """Where the UI reaches its own server: the bound address, or 127.0.0.1 for a wildcard bind."""
    host = config.host if is_loopback(config.host) or config.host not in ("0.0.0.0", "::", "") else "127.0.0.1"
    host = f"[{host}]" if ":" in host else host
    return f"http://{host}:{config.port}"


@dataclass(frozen=True)
class UiMount:
    """``airquant ui`` flags: the stores (for Plan), --results and --jobs-dir; mounted at ``prefix``."""

    stores: tuple[str, ...]
    results: Path = Path("results")
    jobs: Path = Path("airquant-jobs")
    prefix: str = "/ui"

    def __call__(self, app: FastAPI, provider, config: ServeConfig) -> None:
        ctx = UiContext(provider=provider, stores=tuple(str(s) for s in self.stores), base_url=loopback_url(config),
                        api_key=config.api_key, results=Path(self.results), runner=JobRunner(provider, self.jobs),
                        prefix=self.prefix)
        blocks = build_blocks(ctx)
        # A browser cannot send a Bearer header with a page load: with a key, Gradio's login page asks for it
        # (any user name) and the server's middleware leaves this prefix to that check.
        auth = (lambda _user, password: hmac.compare_digest(password.encode(), config.api_key.encode())) \
            if config.api_key else None
        gr.mount_gradio_app(app, blocks, path=self.prefix, auth=auth, auth_message="Password: the server's API key.",
                            allowed_paths=[str(Path(self.results).resolve()), str(Path(self.jobs).resolve())],
                            max_file_size=config.max_body_bytes, ssr_mode=False, footer_links=[])
        redirect_root(app, self.prefix)
        log.info("UI mounted at %s", self.prefix)


def redirect_root(app: FastAPI, prefix: str) -> None:
    """``/`` sends a browser to the UI: the address ``airquant ui`` prints answered a JSON 404 before."""
    app.add_api_route("/", lambda: RedirectResponse(f"{prefix}/"), methods=["GET"], include_in_schema=False)
