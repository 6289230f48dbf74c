"""Attacks on the server, the UI and batch sampling for ``benchmarks/faults.py`` (issue #35): each one is
tried as a client would, and its outcome says whether the server held (the refusal it owes) and whether the
attack crossed its scope (read a file it should not, reached past a limit, cost another request its answer,
kept running after its client left).

Every attack returns ``Outcome``s; nothing here starts or ends a process (``faults.py`` runs the server).
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import time
from dataclasses import dataclass
from pathlib import Path

KEY = "fault-key"  # the key the attacked server is started with
MAX_BODY_MB = 0.5
BODY_TIMEOUT_S = 2.0
SERVER_FLAGS = ("--api-key", KEY, "--max-body-mb", str(MAX_BODY_MB), "--body-timeout-s", str(BODY_TIMEOUT_S))


@dataclass(frozen=True)
class Outcome:
    name: str
    held: bool  # the server answered as it owes (the refusal, or the other request's answer)
    crossed: bool  # the attack got past its own scope
    note: str = ""


def _raw(url: str, head: str, body: bytes = b"", wait_s: float = 10.0) -> tuple[int | None, bytes, float]:
    """A hand-written request (framing no client library writes): status, reply, seconds to the reply."""
    host, port = url.removeprefix("http://").split(":")
    start = time.monotonic()
    with socket.create_connection((host, int(port)), timeout=wait_s) as sock:
        try:
            sock.sendall(head.replace("\n", "\r\n").encode() + b"\r\n" + body)
        except (BrokenPipeError, ConnectionResetError):
            pass  # the server answered and closed before the whole body went out
        data = b""
        try:
            while not data.rstrip().endswith(b"}"):
                chunk = sock.recv(65536)
                if not chunk:
                    break
                data += chunk
        except (socket.timeout, ConnectionResetError):
            pass
    status = int(data.split(b" ", 2)[1]) if data.startswith(b"HTTP/") else None
    return status, data, time.monotonic() - start


def _chunked(data: bytes, size: int = 65536) -> bytes:
    parts = [data[i:i + size] for i in range(0, len(data), size)]
    return b"".join(b"%x\r\n%s\r\n" % (len(p), p) for p in parts) + b"0\r\n\r\n"


def _post(url: str, path: str, body: dict, key: str | None = KEY, timeout: float = 120.0, **headers):
    import httpx

    auth = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.post(f"{url}{path}", content=json.dumps(body).encode(), timeout=timeout,
                      headers={"content-type": "application/json", **auth, **headers})


# -- the server ---------------------------------------------------------------------------------
def body_attacks(url: str) -> list[Outcome]:
    """Limits on the bytes received, auth before the body, a body read timeout (items 4 and 8)."""
    big = json.dumps({"prompt": "x" * int(2 * MAX_BODY_MB * 2**20), "max_tokens": 1}).encode()
    auth = f"Authorization: Bearer {KEY}\n"
    out = []
    for name, framing in (("Content-Length 5 + chunked body of 1 MiB", "Content-Length: 5\nTransfer-Encoding: chunked\n"),
                          ("chunked body of 1 MiB", "Transfer-Encoding: chunked\n")):
        status, _, _ = _raw(url, f"POST /v1/completions HTTP/1.1\nHost: 127.0.0.1\n{auth}"
                                 f"Content-Type: application/json\n{framing}", _chunked(big))
        out.append(Outcome(name, status == 413, status not in (413, None), f"status {status}"))
    for framing in ("Transfer-Encoding: chunked", "Content-Length: 400000"):
        status, _, took = _raw(url, f"POST /v1/completions HTTP/1.1\nHost: 127.0.0.1\n{framing}\n", wait_s=5)
        read = took >= BODY_TIMEOUT_S * 0.9  # it waited for the body before checking the key
        out.append(Outcome(f"no key, body never sent ({framing.split(':')[0]})", status == 401 and not read, read,
                           f"status {status} after {took:.2f}s"))
    status, _, took = _raw(url, f"POST /v1/completions HTTP/1.1\nHost: 127.0.0.1\n{auth}"
                                "Content-Type: application/json\nContent-Length: 100\n", b'{"prompt": ', wait_s=30)
    out.append(Outcome("body that never finishes", status == 408, status is None or took > 4 * BODY_TIMEOUT_S,
                       f"status {status} after {took:.1f}s"))
    return out


def host_attacks(url: str) -> list[Outcome]:
    """DNS rebinding: names that are not the server's (item 10)."""
    import httpx

    out = []
    for host in ("attacker.example", "attacker.example:8000", "localhost.attacker.example", "127.0.0.1.nip.io"):
        r = httpx.get(f"{url}/v1/models", headers={"Host": host, "Authorization": f"Bearer {KEY}"}, timeout=30)
        out.append(Outcome(f"Host: {host}", r.status_code == 400, r.status_code < 400, f"status {r.status_code}"))
    return out


def request_attacks(url: str, store: Path) -> list[Outcome]:
    """Requests that cost everyone or answered 500 (items 5, 6, 11, 14), CORS off for the API (item 9)."""
    import httpx

    cases = [("200 000 stop strings", {"prompt": "Hi", "stop": ["ab"] * 200_000}),
             ("5 stop strings", {"prompt": "Hi", "stop": list("abcde")}),
             ("a stop string of 10 000 characters", {"prompt": "Hi", "stop": "x" * 10_000}),
             ("1 032 prompts", {"prompt": ["Hi"] * 1032, "max_tokens": 1}),
             ("2 prompts x 40 000 new tokens", {"prompt": ["Hi", "Ho"], "max_tokens": 40_000}),
             ("seed 2^64", {"prompt": "Hi", "seed": 2**64, "temperature": 0.5}),
             ("a lone surrogate", {"prompt": "Hi \ud800"})]
    out = []
    for name, body in cases:
        r = _post(url, "/v1/completions", body)
        out.append(Outcome(name, 400 <= r.status_code < 500, r.status_code >= 500 or r.status_code == 200,
                           f"status {r.status_code}"))
    health = httpx.get(f"{url}/health", timeout=30)
    leaked = str(store) in health.text or store.name in health.text
    out.append(Outcome("/health without the key", health.json() == {"status": "ok"}, leaked, health.text[:80]))
    r = httpx.get(f"{url}/v1/models", headers={"Origin": "http://localhost:1234", "Authorization": f"Bearer {KEY}"},
                  timeout=30)
    echoed = "access-control-allow-origin" in r.headers
    out.append(Outcome("CORS from a localhost origin", not echoed, echoed, f"status {r.status_code}"))
    return out


def pass_mate_attacks(url: str) -> list[Outcome]:
    """temperature 1e-300 beside ordinary requests in one pass: they must all be answered (item 3)."""
    import httpx

    bodies = [{"prompt": "Water is", "max_tokens": 6, "temperature": 1e-300},
              *({"prompt": f"Client {k} says", "max_tokens": 6, "temperature": 0.7, "seed": k} for k in range(3))]

    async def together():
        async with httpx.AsyncClient(base_url=url, timeout=120, headers={"Authorization": f"Bearer {KEY}"}) as c:
            return await asyncio.gather(*[c.post("/v1/completions", json=b) for b in bodies])

    statuses = [r.status_code for r in asyncio.run(together())]
    others_failed = any(s != 200 for s in statuses[1:])
    return [Outcome("temperature 1e-300 beside 3 requests", all(s == 200 for s in statuses), others_failed,
                    f"statuses {statuses}")]


def hang_up_attack(url: str) -> list[Outcome]:
    """A non-streaming request whose client leaves must stop (item 6): nothing runs a few passes later."""
    import httpx

    try:
        _post(url, "/v1/completions", {"prompt": "Tell me a long story", "max_tokens": 200}, timeout=0.3)
    except httpx.TimeoutException:
        pass
    deadline, running = time.monotonic() + 5, None
    while time.monotonic() < deadline:
        running = httpx.get(f"{url}/stats", headers={"Authorization": f"Bearer {KEY}"}, timeout=30).json()["running"]
        if running == 0:
            break
        time.sleep(0.1)
    return [Outcome("client hangs up a non-streaming request", running == 0, running != 0, f"running {running}")]


# -- the UI -------------------------------------------------------------------------------------
def ui_attacks(provider, work: Path) -> list[Outcome]:
    """The batch tab's input path, the served job folders, CORS under /ui (items 2 and 9)."""
    import httpx
    from gradio.utils import get_upload_folder

    from airquant.config import GenerateConfig
    from airquant.errors import AirQuantError
    from airquant.serve import BackgroundServer, create_app
    from airquant.serve.config import ServeConfig
    from airquant.ui.jobs import JobRunner
    from airquant.ui.mount import UiMount

    jobs, uploads = work / "jobs", Path(get_upload_folder())
    secret = work / "secret.jsonl"
    secret.write_text(json.dumps({"id": 1, "prompt": "the server's own file"}) + "\n")
    uploads.mkdir(parents=True, exist_ok=True)
    link = uploads / f"fault-link-{os.getpid()}.jsonl"
    link.unlink(missing_ok=True)
    link.symlink_to(secret)
    runner = JobRunner(provider, jobs, uploads=uploads)
    out = []
    try:
        for name, path in (("a server file by path", secret), ("a link out of the upload folder", link),
                           ("../ out of the upload folder", uploads / ".." / secret.name),
                           ("/etc/passwd", Path("/etc/passwd"))):
            try:
                runner.start(path, GenerateConfig(max_new_tokens=1))
                message, started = "", True
            except AirQuantError as exc:
                message, started = str(exc), False
            staged = list(jobs.glob("*/input.jsonl*"))
            leaked = str(work) in message or "/" in message
            out.append(Outcome(f"batch input: {name}", not started and not staged and not leaked,
                               started or bool(staged) or leaked, message[:80]))
    finally:
        link.unlink(missing_ok=True)
    upload = uploads / f"fault-upload-{os.getpid()}" / "prompts.jsonl"
    upload.parent.mkdir(parents=True, exist_ok=True)
    upload.write_text(json.dumps({"id": 1, "prompt": "Hi", "max_new_tokens": 1}) + "\n")
    job = runner.start(upload, GenerateConfig(max_new_tokens=1))
    mount = UiMount(stores=(str(provider.route.store),), results=work / "results", jobs=jobs)
    app = create_app(provider, config=ServeConfig(), own_auth_prefixes=(mount.prefix,))
    mount(app, provider, ServeConfig())
    with BackgroundServer(app) as url:
        r = httpx.get(f"{url}/ui/gradio_api/file={(jobs / job / 'input.jsonl').resolve()}", timeout=30)
        out.append(Outcome("download a job's input through Gradio", r.status_code == 403, r.status_code == 200,
                           f"status {r.status_code}"))
        for origin in ("http://localhost:9999", "null"):
            r = httpx.get(f"{url}/ui/config", headers={"Origin": origin}, timeout=30)
            echoed = "access-control-allow-origin" in r.headers
            out.append(Outcome(f"CORS under /ui from {origin}", not echoed, echoed, f"status {r.status_code}"))
    return out


# -- batch sampling -----------------------------------------------------------------------------
def sampling_records(path: Path, n: int = 6) -> list[object]:
    """A batch input whose first records would have failed the job (item 3); the ids every output must hold."""
    rows = [{"id": "tiny-temperature", "prompt": "Water is", "temperature": 1e-300},
            {"id": "seed-2^64", "prompt": "Water is", "temperature": 0.5, "seed": 2**64},
            *({"id": k, "prompt": f"Prompt {k}", "temperature": 0.7, "seed": k} for k in range(n))]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return [r["id"] for r in rows]
