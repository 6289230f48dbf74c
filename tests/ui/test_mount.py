"""The UI's mount into the server app, without a browser."""

from __future__ import annotations

import pytest

pytest.importorskip("gradio", reason="the UI is optional: pip install -r requirements-ui.txt")

from fastapi import FastAPI  # noqa: E402
from fastapi.testclient import TestClient  # noqa: E402

from airquant.serve.config import ServeConfig  # noqa: E402
from airquant.ui import mount  # noqa: E402


def test_the_root_url_redirects_to_the_ui(monkeypatch, tmp_path):
    """`airquant ui` printed the server's address, whose / answered a JSON 404; the UI was only at /ui/."""
    monkeypatch.setattr(mount, "build_blocks", lambda ctx: None)
    monkeypatch.setattr(mount, "JobRunner", lambda provider, jobs: None)
    monkeypatch.setattr(mount.gr, "mount_gradio_app", lambda app, blocks, path, **kw: app)
    app = FastAPI()
    mount.UiMount(stores=("s",), results=tmp_path, jobs=tmp_path)(app, provider=None, config=ServeConfig())
    answer = TestClient(app).get("/", follow_redirects=False)
    assert answer.status_code in (307, 302) and answer.headers["location"] == "/ui/"
