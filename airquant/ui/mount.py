"""Mounting the Gradio app into the server's FastAPI app, behind the server's key when it has one."""

from __future__ import annotations

import hmac
import logging
import os
from dataclasses import dataclass
from pathlib import Path

import gradio as gr
from fastapi import FastAPI
from fastapi.responses import RedirectResponse
from gradio.utils import get_upload_folder

from airquant.errors import AirQuantError
from airquant.serve.config import ServeConfig, is_loopback
from airquant.ui.app import UiContext, build_blocks
from airquant.ui.jobs import JobRunner

log = logging.getLogger(__name__)


def check_jobs_folder(jobs: Path, served: tuple[Path, ...]) -> None:
    """Refuse a --jobs-dir inside a folder Gradio serves (the results, its upload folder): anyone with the
    page could then download every job's prompts and outputs."""
    real = Path(os.path.realpath(jobs))
    for folder in served:
        if real.is_relative_to(os.path.realpath(folder)):
            raise AirQuantError(f"--jobs-dir {jobs} is inside {folder}, which the UI serves to every user; "
                                "give a --jobs-dir outside it.")


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
        uploads = Path(get_upload_folder())
        check_jobs_folder(Path(self.jobs), served=(Path(self.results), uploads))
        ctx = UiContext(provider=provider, stores=tuple(str(s) for s in self.stores), base_url=loopback_url(config),
                        api_key=config.api_key, results=Path(self.results),
                        runner=JobRunner(provider, self.jobs, uploads=uploads), prefix=self.prefix)
        blocks = build_blocks(ctx)
        # A browser cannot send a Bearer header with a page load: with a key, Gradio's login page asks for it
        # (any user name) and the server's middleware leaves this prefix to that check.
        auth = (lambda _user, password: hmac.compare_digest(password.encode(), config.api_key.encode())) \
            if config.api_key else None
        # Only the results are served as files: job folders hold every user's inputs and outputs (a finished
        # output reaches its page through Gradio's cache). CORS is the server's (--cors-origin): Gradio adds
        # none of its own under a parent app with a CORSMiddleware (serve.security installs one).
        gr.mount_gradio_app(app, blocks, path=self.prefix, auth=auth, auth_message="Password: the server's API key.",
                            allowed_paths=[str(Path(self.results).resolve())],
                            max_file_size=config.max_body_bytes, ssr_mode=False, footer_links=[])
        redirect_root(app, self.prefix)
        log.info("UI mounted at %s", self.prefix)


def redirect_root(app: FastAPI, prefix: str) -> None:
    """``/`` sends a browser to the UI: the address ``airquant ui`` prints answered a JSON 404 before."""
    app.add_api_route("/", lambda: RedirectResponse(f"{prefix}/"), methods=["GET"], include_in_schema=False)
