"""The UI mounted in the server, without a browser: what the batch tab takes as input, what Gradio serves,
and CORS under /ui (issue #35, items 2 and 9)."""

import json
from pathlib import Path

import pytest

pytest.importorskip("gradio")
httpx = pytest.importorskip("httpx")

from fastapi import FastAPI  # noqa: E402
from fastapi.testclient import TestClient  # noqa: E402
from gradio.utils import get_upload_folder  # noqa: E402

from airquant import Provider  # noqa: E402
from airquant.config import GenerateConfig  # noqa: E402
from airquant.errors import AirQuantError  # noqa: E402
from airquant.serve import BackgroundServer, create_app  # noqa: E402
from airquant.serve.config import ServeConfig  # noqa: E402
from airquant.ui import mount  # noqa: E402
from airquant.ui.jobs import JobRunner, UploadError  # noqa: E402
from airquant.ui.mount import UiMount  # noqa: E402

TIMEOUT = httpx.Timeout(60.0)
ROW = json.dumps({"id": 1, "prompt": "Hi", "max_new_tokens": 2}) + "\n"


@pytest.fixture(scope="module")
def provider(tiny_store):
    with Provider(tiny_store, device="cpu", max_batch=2, batch_window_ms=0) as p:
        yield p


@pytest.fixture(scope="module")
def jobs(tmp_path_factory):
    return tmp_path_factory.mktemp("ui-jobs")


def _serve(provider, jobs: Path, results: Path, config: ServeConfig):
    mount = UiMount(stores=(str(provider.route.store),), results=results, jobs=jobs)
    app = create_app(provider, config=config, own_auth_prefixes=(mount.prefix,))
    mount(app, provider, config)
    return BackgroundServer(app)  # the chat tab (which calls config.port) is not used here


@pytest.fixture(scope="module")
def ui(provider, jobs, tmp_path_factory):
    with _serve(provider, jobs, tmp_path_factory.mktemp("results"), ServeConfig()) as url:
        yield url


def test_batch_input_only_from_the_upload_folder(provider, jobs, tmp_path):
    """begin() took any path the browser named, staged it in a folder Gradio served and echoed that path:
    any .jsonl on the server could be read. Now only a file in Gradio's upload folder is taken."""
    runner = JobRunner(provider, jobs, uploads=Path(get_upload_folder()))
    secret = tmp_path / "secret.jsonl"
    secret.write_text(ROW)
    uploads = Path(get_upload_folder())
    uploads.mkdir(parents=True, exist_ok=True)
    link = uploads / f"link-{tmp_path.name}.jsonl"
    link.symlink_to(secret)  # a link inside the upload folder leads out of it
    try:
        for path in (secret, link, uploads / ".." / secret.name, uploads, "/etc/passwd"):
            with pytest.raises(UploadError) as err:
                runner.start(str(path), GenerateConfig(max_new_tokens=2))
            assert str(tmp_path) not in str(err.value) and "/" not in str(err.value)
    finally:
        link.unlink()
    assert not list(jobs.glob("*/input.jsonl")), "nothing was staged"


def test_input_errors_name_no_server_path(provider, jobs):
    runner = JobRunner(provider, jobs, uploads=Path(get_upload_folder()))
    bad = Path(get_upload_folder()) / "bad-input-test" / "prompts.jsonl"
    bad.parent.mkdir(parents=True, exist_ok=True)
    bad.write_text('{"id": 1, "prompt": "Hi"}\n{"id": 1, "prompt": "Ho"}\n')
    with pytest.raises(AirQuantError) as err:
        runner.start(bad, GenerateConfig(max_new_tokens=2))
    message = str(err.value)
    assert "the uploaded file has id 1 twice" in message and str(jobs) not in message and "/" not in message
    assert not list(jobs.glob("*/input.jsonl*"))
    assert runner.public(f"{jobs.resolve()}/ab/output.jsonl in {provider.route.store}") == \
        f"<jobs>/ab/output.jsonl in {provider.route.store.name}"


def test_job_folders_are_not_served(ui, provider, jobs):
    upload = Path(get_upload_folder()) / "served-test" / "prompts.jsonl"
    upload.parent.mkdir(parents=True, exist_ok=True)
    upload.write_text(ROW)
    runner = JobRunner(provider, jobs, uploads=Path(get_upload_folder()))
    job = runner.start(upload, GenerateConfig(max_new_tokens=2))
    staged = jobs / job / "input.jsonl"
    assert staged.is_file()
    r = httpx.get(f"{ui}/ui/gradio_api/file={staged.resolve()}", timeout=TIMEOUT)
    assert r.status_code == 403, r.text[:200]


def test_a_jobs_dir_inside_a_served_folder_is_refused(provider, tmp_path):
    mount = UiMount(stores=(str(provider.route.store),), results=tmp_path, jobs=tmp_path / "jobs")
    app = create_app(provider, config=ServeConfig(), own_auth_prefixes=(mount.prefix,))
    with pytest.raises(AirQuantError, match="--jobs-dir .* is inside"):
        mount(app, provider, ServeConfig())


def test_cors_under_ui_follows_cors_origin(ui, provider, jobs, tmp_path):
    """Gradio's own CORS echoed any localhost origin with credentials under /ui; the server's --cors-origin
    now decides there as for the API (none given: no origin is allowed)."""
    preflight = {"Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "content-type"}
    for origin in ("http://localhost:9999", "http://127.0.0.1:1234"):
        r = httpx.options(f"{ui}/ui/gradio_api/upload", headers={**preflight, "Origin": origin}, timeout=TIMEOUT)
        assert "access-control-allow-origin" not in r.headers, r.headers
        r = httpx.get(f"{ui}/ui/config", headers={"Origin": origin}, timeout=TIMEOUT)
        assert "access-control-allow-origin" not in r.headers and "access-control-allow-credentials" not in r.headers
    config = ServeConfig(cors_origins=("http://allowed.example",))
    with _serve(provider, tmp_path / "jobs", tmp_path / "results", config) as url:
        r = httpx.get(f"{url}/ui/config", headers={"Origin": "http://allowed.example"}, timeout=TIMEOUT)
        assert r.headers.get("access-control-allow-origin") == "http://allowed.example"
        r = httpx.get(f"{url}/ui/config", headers={"Origin": "http://localhost:9999"}, timeout=TIMEOUT)
        assert "access-control-allow-origin" not in r.headers


def test_the_root_url_redirects_to_the_ui(monkeypatch, tmp_path):
    """`airquant ui` printed the server's address, whose / answered a JSON 404; the UI was only at /ui/."""
    monkeypatch.setattr(mount, "build_blocks", lambda ctx: None)
    monkeypatch.setattr(mount, "JobRunner", lambda provider, jobs, **kw: None)
    monkeypatch.setattr(mount.gr, "mount_gradio_app", lambda app, blocks, path, **kw: app)
    app = FastAPI()
    # jobs staged apart from the results the UI serves (test_a_jobs_dir_inside_a_served_folder_is_refused)
    mount.UiMount(stores=("s",), results=tmp_path / "results", jobs=tmp_path / "jobs")(app, provider=None,
                                                                                     config=ServeConfig())
    answer = TestClient(app).get("/", follow_redirects=False)
    assert answer.status_code in (307, 302) and answer.headers["location"] == "/ui/"
