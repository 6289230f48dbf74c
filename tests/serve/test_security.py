"""Safe serving: Bearer keys, the bind check, the body limit, CORS off by default; back-pressure and /metrics."""

import asyncio
import json
import socket
import time

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("prometheus_client")
httpx = pytest.importorskip("httpx")

from airquant import Provider  # noqa: E402
from airquant.cli import main  # noqa: E402
from airquant.config import GenerateConfig  # noqa: E402
from airquant.serve import BackgroundServer, create_app  # noqa: E402
from airquant.serve.config import InsecureBindError, ServeConfig, api_key_from, check_bind, is_loopback  # noqa: E402

KEY = "s3cret-key"
TIMEOUT = httpx.Timeout(60.0)
CHAT = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3}


@pytest.fixture(scope="module")
def provider(tiny_store):
    with Provider(tiny_store, device="cpu", max_batch=1, batch_window_ms=0, max_queue=1) as p:
        yield p


@pytest.fixture(scope="module")
def keyed(provider):
    config = ServeConfig(api_key=KEY, max_body_mb=0.01, body_timeout_s=1.0, cors_origins=("http://allowed.example",))
    with BackgroundServer(create_app(provider, config=config)) as url:
        yield url


@pytest.fixture(scope="module")
def hosted(provider):
    config = ServeConfig(allowed_hosts=("api.example", "*.lan.example"))
    with BackgroundServer(create_app(provider, config=config)) as url:
        yield url


@pytest.fixture(scope="module")
def open_server(provider):
    with BackgroundServer(create_app(provider)) as url:
        yield url


@pytest.mark.parametrize("headers, status", [
    ({}, 401),
    ({"Authorization": "Bearer wrong"}, 401),
    ({"Authorization": f"Basic {KEY}"}, 401),
    ({"Authorization": f"Bearer {KEY}"}, 200),
])
def test_every_route_needs_the_key(keyed, headers, status):
    for method, path, body in (("POST", "/v1/chat/completions", CHAT), ("GET", "/v1/models", None),
                               ("GET", "/metrics", None), ("GET", "/stats", None)):
        r = httpx.request(method, f"{keyed}{path}", json=body, headers=headers, timeout=TIMEOUT)
        assert r.status_code == status, (path, r.text)
        if status == 401:
            assert r.headers["www-authenticate"] == "Bearer"
            assert "Authorization: Bearer KEY" in r.json()["error"]["message"]


def test_health_is_open_without_the_key_and_says_only_the_status(keyed, tiny_store):
    r = httpx.get(f"{keyed}/health", timeout=TIMEOUT)
    assert r.status_code == 200 and r.json() == {"status": "ok"}
    assert str(tiny_store) not in r.text  # the store's path is for /stats, behind the key


def _raw(url: str, head: str, body: bytes = b"", wait_s: float = 10.0) -> tuple[int | None, bytes]:
    """Send a hand-written request (headers the HTTP clients will not write); the status and what came back."""
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=wait_s) as sock:
        sock.sendall(head.replace("\n", "\r\n").encode() + b"\r\n" + body)
        data = b""
        try:
            while b"\r\n\r\n" not in data or not data.rstrip().endswith(b"}"):
                chunk = sock.recv(65536)
                if not chunk:
                    break
                data += chunk
        except (socket.timeout, ConnectionResetError):
            return None, data
    return (int(data.split(b" ", 2)[1]) if data.startswith(b"HTTP/") else None), data


def _chunked(data: bytes, size: int = 4096) -> bytes:
    parts = [data[i:i + size] for i in range(0, len(data), size)]
    return b"".join(b"%x\r\n%s\r\n" % (len(p), p) for p in parts) + b"0\r\n\r\n"


def test_a_small_content_length_with_a_chunked_body_still_gets_413(keyed):
    """Content-Length: 5 plus Transfer-Encoding: chunked: the HTTP layer reads the chunks, so the limit
    must count what arrives; a 40 MiB body reached tokenization that way."""
    body = json.dumps({"prompt": "x" * 30_000, "max_tokens": 1}).encode()  # limit: 10 485 bytes
    head = (f"POST /v1/completions HTTP/1.1\nHost: 127.0.0.1\nAuthorization: Bearer {KEY}\n"
            "Content-Type: application/json\nContent-Length: 5\nTransfer-Encoding: chunked\n")
    status, data = _raw(keyed, head, _chunked(body))
    assert status == 413 and b"--max-body-mb" in data


def test_no_key_no_body_read(keyed):
    """Without the key the answer is 401 before any of the body is read: the client here never sends it."""
    for framing in ("Transfer-Encoding: chunked", "Content-Length: 9000"):
        start = time.monotonic()
        status, _ = _raw(keyed, f"POST /v1/completions HTTP/1.1\nHost: 127.0.0.1\n{framing}\n", wait_s=5)
        assert status == 401 and time.monotonic() - start < 0.9, framing  # under the 1 s body timeout


def test_a_body_that_does_not_arrive_gets_408(keyed):
    head = (f"POST /v1/completions HTTP/1.1\nHost: 127.0.0.1\nAuthorization: Bearer {KEY}\n"
            "Content-Type: application/json\nContent-Length: 100\n")
    start = time.monotonic()
    status, data = _raw(keyed, head, b'{"prompt": ', wait_s=10)  # the other 89 bytes never come
    assert status == 408 and b"--body-timeout-s" in data
    assert 0.9 < time.monotonic() - start < 5
    r = httpx.post(f"{keyed}/v1/chat/completions", json=CHAT, headers={"Authorization": f"Bearer {KEY}"},
                   timeout=TIMEOUT)
    assert r.status_code == 200


@pytest.mark.parametrize("host, status", [("attacker.example", 400), ("attacker.example:8000", 400),
                                          ("localhost", 200), ("LOCALHOST.:1234", 200), ("127.0.0.1", 200),
                                          ("[::1]:80", 200), ("10.1.2.3:8000", 200), ("api.example", 200),
                                          ("x.lan.example", 200), ("lan.example", 400), ("", 400)])
def test_host_header_is_checked_against_dns_rebinding(hosted, host, status):
    """A key-less loopback server answered any Host: a page of attacker.example rebound to 127.0.0.1 could
    use it. Loopback names, IPs, --host and --allowed-host ('api.example', '*.lan.example') are answered."""
    r = httpx.get(f"{hosted}/v1/models", headers={"Host": host}, timeout=TIMEOUT)
    assert r.status_code == status, r.text
    if status == 400:
        assert "--allowed-host" in r.json()["error"]["message"]


def test_allowed_host_star_answers_any_name(provider):
    with BackgroundServer(create_app(provider, config=ServeConfig(allowed_hosts=("*",)))) as url:
        assert httpx.get(f"{url}/v1/models", headers={"Host": "any.example"}, timeout=TIMEOUT).status_code == 200


def test_a_client_that_hangs_up_cancels_its_request(tiny_store):
    """A non-streaming request whose client disconnects stops at the next pass and frees its slot (it ran to
    its last token before)."""
    gen = GenerateConfig(ignore_eos=True)
    with Provider(tiny_store, device="cpu", max_batch=1, batch_window_ms=0, gen=gen) as p:
        step = p._loop.step  # the worker's decode loop, slowed so that 200 tokens take 10 s
        p._loop.step = lambda: time.sleep(0.05) or step()
        with BackgroundServer(create_app(p)) as url:
            with pytest.raises(httpx.ReadTimeout):
                httpx.post(f"{url}/v1/completions", json={"prompt": "Hi", "max_tokens": 200}, timeout=1.0)
            deadline = time.monotonic() + 5
            while p.metrics()["running"] and time.monotonic() < deadline:
                time.sleep(0.05)
            m = p.metrics()
            assert m["running"] == 0 and m["queue_depth"] == 0 and m["new_tokens"] < 150, m
            r = httpx.post(f"{url}/v1/completions", json={"prompt": "Hi", "max_tokens": 2}, timeout=TIMEOUT)
            assert r.status_code == 200


def test_oversized_body_gets_413_and_the_server_keeps_answering(keyed):
    auth = {"Authorization": f"Bearer {KEY}"}
    big = {"messages": [{"role": "user", "content": "x" * 20_000}]}  # limit 0.01 MB = 10 485 bytes
    r = httpx.post(f"{keyed}/v1/chat/completions", json=big, headers=auth, timeout=TIMEOUT)
    assert r.status_code == 413 and "--max-body-mb" in r.json()["error"]["message"]

    def chunked():  # no Content-Length: the limit is counted as the body arrives
        for _ in range(30):
            yield b"x" * 1000

    r = httpx.post(f"{keyed}/v1/completions", content=chunked(), headers=auth, timeout=TIMEOUT)
    assert r.status_code == 413
    assert httpx.post(f"{keyed}/v1/chat/completions", json=CHAT, headers=auth, timeout=TIMEOUT).status_code == 200


def test_cors_only_for_the_origins_given(keyed, open_server):
    preflight = {"Origin": "http://allowed.example", "Access-Control-Request-Method": "POST",
                 "Access-Control-Request-Headers": "authorization,content-type"}
    r = httpx.options(f"{keyed}/v1/chat/completions", headers=preflight, timeout=TIMEOUT)
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "http://allowed.example"
    other = httpx.options(f"{keyed}/v1/chat/completions", headers={**preflight, "Origin": "http://evil.example"},
                          timeout=TIMEOUT)
    assert "access-control-allow-origin" not in other.headers
    default = httpx.get(f"{open_server}/v1/models", headers={"Origin": "http://allowed.example"}, timeout=TIMEOUT)
    assert default.status_code == 200 and "access-control-allow-origin" not in default.headers


@pytest.mark.parametrize("host, loopback", [("127.0.0.1", True), ("127.0.0.2", True), ("::1", True),
                                            ("localhost", True), ("0.0.0.0", False), ("::", False),
                                            ("192.168.1.5", False), ("myhost.lan", False)])
def test_is_loopback(host, loopback):
    assert is_loopback(host) is loopback


def test_non_loopback_bind_needs_a_key_or_insecure():
    with pytest.raises(InsecureBindError, match="--api-key KEY or \\$AIRQUANT_API_KEY.*--insecure"):
        check_bind(ServeConfig(host="0.0.0.0"))
    check_bind(ServeConfig(host="0.0.0.0", api_key=KEY))
    check_bind(ServeConfig(host="0.0.0.0", insecure=True))
    check_bind(ServeConfig())


def test_cli_refuses_a_public_bind_before_loading(tiny_store, capsys, monkeypatch):
    monkeypatch.delenv("AIRQUANT_API_KEY", raising=False)
    assert main(["serve", str(tiny_store), "--host", "0.0.0.0", "--device", "cpu"]) == 2
    err = capsys.readouterr().err
    assert "refusing to listen on 0.0.0.0" in err and "not a loopback address" in err


def test_api_key_from_env(monkeypatch):
    monkeypatch.setenv("AIRQUANT_API_KEY", "from-env")
    assert api_key_from(None) == "from-env" and api_key_from("flag") == "flag"
    monkeypatch.setenv("AIRQUANT_API_KEY", " ")
    with pytest.raises(Exception, match="AIRQUANT_API_KEY is empty"):
        api_key_from(None)


def test_full_queue_gives_429_with_retry_after(open_server):
    """max_batch 1, max_queue 1: one request runs, one waits, the rest of a burst are turned away."""
    bodies = [{"prompt": f"Count {i}", "max_tokens": 24, "temperature": 0} for i in range(8)]

    async def burst():
        async with httpx.AsyncClient(base_url=open_server, timeout=TIMEOUT) as client:
            return await asyncio.gather(*[client.post("/v1/completions", json=b) for b in bodies])

    responses = asyncio.run(burst())
    codes = sorted(r.status_code for r in responses)
    assert set(codes) == {200, 429} and codes.count(200) >= 2, codes
    busy = next(r for r in responses if r.status_code == 429)
    assert int(busy.headers["retry-after"]) >= 1
    assert busy.json()["error"]["type"] == "rate_limit_error"
    metrics = httpx.get(f"{open_server}/metrics", timeout=TIMEOUT).text
    assert f'airquant_http_rejected_total{{status="429"}} {float(codes.count(429))}' in metrics


def test_metrics_is_prometheus_text(open_server):
    from prometheus_client.parser import text_string_to_metric_families

    httpx.post(f"{open_server}/v1/completions", json={"prompt": "Hi", "max_tokens": 2}, timeout=TIMEOUT)
    r = httpx.get(f"{open_server}/metrics", timeout=TIMEOUT)
    assert r.headers["content-type"].startswith("text/plain")
    families = {f.name: f for f in text_string_to_metric_families(r.text)}
    for name in ("airquant_queue_depth", "airquant_running_sequences", "airquant_tokens_per_second",
                 "airquant_new_tokens", "airquant_route_info"):
        assert name in families, sorted(families)
    assert families["airquant_new_tokens"].samples[0].value > 0
    assert families["airquant_route_info"].samples[0].labels["scheme"]
