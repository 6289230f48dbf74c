"""The machinery of ``benchmarks/faults.py``: processes to kill, filesystems to fill, stores to damage,
servers to flood. Every process it ends is one it started (by its pid)."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import io
import json
import os
import shutil
import signal
import socket
import struct
import subprocess
import sys
import time
from pathlib import Path

import psutil

REPO = Path(__file__).resolve().parent.parent
ENV = {**os.environ, "PYTHONPATH": str(REPO), "TOKENIZERS_PARALLELISM": "false"}


# -- processes ---------------------------------------------------------------------------------
def cli(*argv) -> list[str]:
    return [sys.executable, "-m", "airquant.cli", *(str(a) for a in argv)]


def run_ok(cmd: list[str], timeout: float = 600) -> None:
    done = subprocess.run(cmd, cwd=REPO, env=ENV, capture_output=True, text=True, timeout=timeout)
    if done.returncode:
        raise RuntimeError(f"{' '.join(cmd[2:])} exited {done.returncode}: {done.stderr[-800:]}")


def timed_run(cmd: list[str], watch: Path, timeout: float = 600) -> tuple[float, float]:
    """Run to the end; (seconds it took, seconds until ``watch`` first existed: the work began)."""
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=REPO, env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    first = None
    while proc.poll() is None:
        if first is None and watch.exists():
            first = time.perf_counter() - start
        time.sleep(0.01)
        if time.perf_counter() - start > timeout:
            proc.kill()
            raise RuntimeError(f"{' '.join(cmd[2:])} ran over {timeout}s")
    took = time.perf_counter() - start
    if proc.returncode:
        raise RuntimeError(f"{' '.join(cmd[2:])} exited {proc.returncode}: {proc.stderr.read()[-800:]}")
    return took, first if first is not None else 0.0


def run_and_kill(cmd: list[str], at: float) -> bool:
    """Start ``cmd`` and SIGKILL it ``at`` seconds later; False when it had already finished."""
    proc = subprocess.Popen(cmd, cwd=REPO, env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        proc.wait(timeout=at)
        return False
    except subprocess.TimeoutExpired:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        return True


def in_process(*argv) -> tuple[int, str, str]:
    """``airquant ARGV`` in this process: (exit code, stdout, stderr)."""
    from airquant.cli import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            rc = main([str(a) for a in argv])
        except Exception as exc:  # an escaped exception is a failed case, not a crashed benchmark
            import traceback

            traceback.print_exception(exc, file=err)
            rc = 1
    return rc, out.getvalue(), err.getvalue()


# -- stores ------------------------------------------------------------------------------------
def tiny_model(folder: Path, layers: int = 6) -> Path:
    """A random Llama with the default model's tokenizer, saved as a Hugging Face folder."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(REPO / "tests" / "data" / "smollm2_tokenizer")
    torch.manual_seed(0)
    cfg = AutoConfig.for_model("llama", vocab_size=len(tok), hidden_size=64, intermediate_size=128,
                               num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                               max_position_embeddings=256, bos_token_id=tok.bos_token_id,
                               eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


def checksums(store: Path) -> dict[str, str]:
    body = json.loads((store / "manifest.json").read_text())
    return {g: e["checksum"] for g, e in body["shards"].items()}


def temp_files(store: Path) -> list[str]:
    from airquant.store.files import TMP_MARK

    return sorted(p.name for p in store.iterdir() if TMP_MARK in p.name or p.name.endswith(".tmp"))


def flip_bit(path: Path, pos: int, bit: int) -> None:
    with open(path, "r+b") as f:
        f.seek(pos)
        b = f.read(1)[0]
        f.seek(pos)
        f.write(bytes([b ^ (1 << bit)]))


def _edit_manifest(edit):
    def damage(store: Path) -> None:
        body = json.loads((store / "manifest.json").read_text())
        edit(body)
        (store / "manifest.json").write_text(json.dumps(body))
    return damage


def damage_cases(store: Path, rng, flips: int) -> list[tuple]:
    """(name, damage(store), text the error must contain) for every kind of damage."""
    shards = sorted(p.name for p in store.glob("*.safetensors"))
    cases = []
    for k in range(flips):  # one bit anywhere in a random shard: header or data
        name = rng.choice(shards)
        pos, bit = rng.randrange((store / name).stat().st_size), rng.randrange(8)
        cases.append((f"bit {bit} of byte {pos} in {name}", lambda s, n=name, p=pos, b=bit: flip_bit(s / n, p, b), name))
    victim = "layer_0001.safetensors"

    def truncate(s):
        data = (s / victim).read_bytes()
        (s / victim).write_bytes(data[: len(data) // 2])

    def extra(s):
        (s / "layer_0099.safetensors").write_bytes((s / victim).read_bytes())

    def add_field(b):
        b["shards"]["layer.1"]["note"] = "hand edit"

    def escape(b):
        b["shards"]["layer.1"]["file"] = "../../etc/passwd"

    def set_bytes(b):
        b["shards"]["layer.1"]["bytes"] += 1

    def set_checksum(b):
        b["shards"]["layer.1"]["checksum"] = "xxh3_128:" + "0" * 32

    cases += [("truncated shard", truncate, victim), ("missing shard", lambda s: (s / victim).unlink(), victim),
              ("extra shard", extra, "layer_0099.safetensors"),
              ("manifest: unknown field", _edit_manifest(add_field), "manifest"),
              ("manifest: file outside the store", _edit_manifest(escape), "manifest"),
              ("manifest: wrong size", _edit_manifest(set_bytes), victim),
              ("manifest: wrong checksum", _edit_manifest(set_checksum), victim),
              ("manifest: not JSON", lambda s: (s / "manifest.json").write_text("{\"shards\": "), "manifest.json")]
    return cases


# -- crafted stores and model folders (issue 35) -------------------------------------------------------
def copy_store(store: Path, dst: Path, old_format: bool = False) -> Path:
    """A copy of ``store``; ``old_format``: without read checksums, as an older AirQuant wrote it."""
    shutil.copytree(store, dst)
    if old_format:
        _edit_manifest(lambda b: [e.update(checksum="") for e in b["shards"].values()])(dst)
    return dst


def plant_temp_links(store: Path, victim: Path, pids: int = 16) -> None:
    """Links to ``victim`` at the temp name of the manifest for this process and the next pids."""
    for pid in range(os.getpid(), os.getpid() + pids):
        os.symlink(victim, store / f".manifest.json.tmp-{pid}")


def link_out(path: Path, elsewhere: Path) -> None:
    """Move ``path`` (a file or folder) out to ``elsewhere`` and leave a link to it in its place."""
    elsewhere.mkdir(parents=True, exist_ok=True)
    moved = elsewhere / path.name
    shutil.move(path, moved)
    path.symlink_to(moved)


EVIL = "import pathlib\npathlib.Path({marker!r}).write_text('code shipped in a store ran')\n"


def declare_code(config: Path, marker: Path) -> Path:
    """``auto_map`` in ``config`` naming a module beside it that writes ``marker`` when imported; returns marker."""
    body = json.loads(config.read_text())
    body["auto_map"] = {"AutoConfig": "evil.EvilConfig", "AutoTokenizer": ["evil.EvilTokenizer", None],
                        "AutoModelForCausalLM": "evil.EvilForCausalLM"}
    config.write_text(json.dumps(body))
    (config.parent / "evil.py").write_text(EVIL.format(marker=str(marker)))
    return marker


def one_prompt(path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"id": 0, "prompt": "Hi"}) + "\n")
    return path


def copy_model(model: str, dst: Path) -> Path:
    shutil.copytree(model, dst)
    return dst


def weights_outside(folder: Path, outside: Path, how: str) -> str:
    """Move the folder's weights to ``outside`` and name them from the folder: by an index entry (``relative``,
    ``absolute``) or a ``link``; returns the name the refusal must give."""
    from safetensors import safe_open

    outside.mkdir(parents=True, exist_ok=True)
    with safe_open(folder / "model.safetensors", framework="pt") as f:
        names = list(f.keys())
    shutil.move(folder / "model.safetensors", outside / "model.safetensors")
    if how == "link":
        (folder / "model.safetensors").symlink_to(outside / "model.safetensors")
        return "model.safetensors"
    entry = os.path.relpath(outside / "model.safetensors", folder) if how == "relative" \
        else str(outside / "model.safetensors")
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": dict.fromkeys(names, entry)}))
    return entry


CRAFTED = ("header length 2^62", "header past the file", "unknown dtype", "offsets past the data",
           "num_layers above the shards")


def craft(store: Path, how: str) -> str:
    """Damage ``store`` as ``how`` says, recording sizes and checksums to match; returns the file the error names."""
    import hashlib

    import xxhash

    victim = "layer_0001.safetensors"
    if how == "num_layers above the shards":
        _edit_manifest(lambda b: b.update(num_layers=b["num_layers"] + 2))(store)
        return "manifest.json"
    data = (store / victim).read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    header, body = json.loads(data[8:8 + n]), data[8 + n:]
    first = next(k for k in header if k != "__metadata__")
    if how == "header length 2^62":
        data = struct.pack("<Q", 2 ** 62) + data[8:]
    elif how == "header past the file":
        data = struct.pack("<Q", len(data)) + data[8:]
    else:
        if how == "unknown dtype":
            header[first]["dtype"] = "Q32"
        else:
            header[first]["data_offsets"] = [len(body), len(body) + 4]
        raw = json.dumps(header).encode()
        data = struct.pack("<Q", len(raw)) + raw + body
    (store / victim).write_bytes(data)

    def record(b):
        b["shards"]["layer.1"].update(bytes=len(data), sha256=hashlib.sha256(data).hexdigest(),
                                      checksum=f"xxh3_128:{xxhash.xxh3_128_hexdigest(data)}")
    _edit_manifest(record)(store)
    return victim


# -- filesystems -------------------------------------------------------------------------------
def split_room(need: int) -> int:
    """A tmpfs size that passes the split's up-front free-space check (estimate * 1.02 + 64 MB) with 8 MB spare."""
    return int(need * 1.02) + (64 << 20) + (8 << 20)


def mount_tmpfs(path: Path, size: int) -> str:
    """Mount a tmpfs of ``size`` bytes; returns why it could not ("" when mounted)."""
    path.mkdir(parents=True, exist_ok=True)
    if os.geteuid() != 0:
        return "mounting a tmpfs needs root"
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                          capture_output=True, text=True)
    return "" if done.returncode == 0 else f"mount not permitted here: {done.stderr.strip()[:200]}"


def unmount(path: Path) -> None:
    subprocess.run(["umount", str(path)], capture_output=True)


def fill_disk(path: Path) -> None:
    """Write zeros until the filesystem is full (ENOSPC), in large then small blocks."""
    with open(path, "wb", buffering=0) as f:
        for size in (1 << 20, 4096):
            block = bytes(size)
            try:
                while True:
                    f.write(block)
            except OSError as exc:
                if exc.errno != errno.ENOSPC:
                    raise


# -- batch jobs --------------------------------------------------------------------------------
def write_prompts(path: Path, n: int) -> None:
    words = ["The river", "Once upon a time", "Hi", "Water boils at", "A list of colours:", "Dear"]
    path.write_text("".join(json.dumps({"id": i, "prompt": f"{words[i % len(words)]} {i}"}) + "\n"
                            for i in range(n)))


def complete_records(path: Path) -> list[dict]:
    if not path.exists():
        return []
    data = path.read_bytes()
    return [json.loads(line) for line in data[: data.rfind(b"\n") + 1].decode().splitlines() if line.strip()]


def short_gen():
    from airquant.config import GenerateConfig

    return GenerateConfig(max_new_tokens=4)


class OOMAbove:
    """An engine that runs out of memory with more than ``fits`` sequences at once, as a GPU would: the static
    path fails at once, the decode loop after ``after_steps`` steps (records already finished stay written)."""

    def __init__(self, engine, fits: int, after_steps: int = 3):
        self._engine, self.fits, self.after_steps, self.injected = engine, fits, after_steps, 0

    def __getattr__(self, name):
        return getattr(self._engine, name)

    def _oom(self, n: int):
        import torch

        self.injected += 1
        return torch.OutOfMemoryError(f"injected: {n} sequences do not fit")

    def generate(self, prompts, gen=None, **kw):
        if len(prompts) > self.fits:
            raise self._oom(len(prompts))
        return self._engine.generate(prompts, gen, **kw)

    def decode_loop(self, slots: int, **kw):
        loop = self._engine.decode_loop(slots, **kw)
        return loop if slots <= self.fits else _FailingLoop(loop, self, slots)


class _FailingLoop:
    def __init__(self, loop, owner: OOMAbove, slots: int):
        self._loop, self._owner, self._slots, self._steps = loop, owner, slots, 0

    def __getattr__(self, name):
        return getattr(self._loop, name)

    def step(self):
        self._steps += 1
        if self._steps > self._owner.after_steps:
            raise self._owner._oom(self._slots)
        return self._loop.step()


# -- servers -----------------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def health(url: str) -> int:
    import httpx

    try:
        return httpx.get(f"{url}/health", timeout=10).status_code
    except httpx.HTTPError:
        return 0


class ServerProcess:
    """``airquant serve STORE --device cpu`` on a free loopback port, killed (by pid) on exit."""

    def __init__(self, store: Path, *extra: str, start_timeout_s: float = 120):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.cmd = cli("serve", store, "--device", "cpu", "--host", "127.0.0.1", "--port", self.port, *extra)
        self.start_timeout_s = start_timeout_s

    def __enter__(self) -> "ServerProcess":
        self.proc = subprocess.Popen(self.cmd, cwd=REPO, env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        deadline = time.monotonic() + self.start_timeout_s
        while health(self.url) != 200:
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.__exit__()
                raise RuntimeError(f"airquant serve did not start: {self.proc.stderr.read()[-800:]!r}")
            time.sleep(0.2)
        return self

    def alive(self) -> bool:
        return self.proc.poll() is None

    def rss_mb(self) -> float:
        return psutil.Process(self.proc.pid).memory_info().rss / 1e6

    def __exit__(self, *exc) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                os.kill(self.proc.pid, signal.SIGKILL)
                self.proc.wait()


def flood(server: ServerProcess, clients: int, seconds: float) -> dict:
    """``clients`` loops of short completions for ``seconds``; counts and the server's RSS once a second."""
    import httpx

    counts = {"requests": 0, "ok": 0, "rejected": 0, "other": {}}
    rss = [server.rss_mb()]

    async def client(http, k: int, deadline: float):
        while time.monotonic() < deadline:
            body = {"prompt": f"Client {k} says", "max_tokens": 4, "temperature": 0}
            counts["requests"] += 1
            try:
                status = (await http.post("/v1/completions", json=body)).status_code
            except httpx.HTTPError as exc:
                status = type(exc).__name__
            if status == 200:
                counts["ok"] += 1
            elif status == 429:
                counts["rejected"] += 1
                await asyncio.sleep(0.05)  # as a client honouring Retry-After would
            else:
                counts["other"][str(status)] = counts["other"].get(str(status), 0) + 1

    async def sample(deadline: float):
        while time.monotonic() < deadline:
            await asyncio.sleep(1.0)
            rss.append(server.rss_mb())

    async def run():
        deadline = time.monotonic() + seconds
        limits = httpx.Limits(max_connections=clients, max_keepalive_connections=clients)
        async with httpx.AsyncClient(base_url=server.url, timeout=httpx.Timeout(120.0), limits=limits) as http:
            await asyncio.gather(sample(deadline), *[client(http, k, deadline) for k in range(clients)])

    asyncio.run(run())
    return {**counts, "rss_mb": rss}


def fuzz(url: str, examples: int, seed: int = 0) -> list[int]:
    """POST ``examples`` malformed requests drawn by hypothesis; their status codes."""
    import httpx
    from hypothesis import HealthCheck, given, settings
    from hypothesis import seed as hseed

    from benchmarks.fault_requests import malformed

    statuses: list[int] = []
    with httpx.Client(base_url=url, timeout=httpx.Timeout(120.0)) as http:
        @hseed(seed)
        @settings(max_examples=examples, deadline=None, database=None, derandomize=False,
                  suppress_health_check=list(HealthCheck))
        @given(malformed())
        def send(req):
            path, content, headers = req
            try:
                statuses.append(http.post(path, content=content, headers=headers).status_code)
            except httpx.HTTPError:
                statuses.append(0)

        send()
    return statuses


# -- results -----------------------------------------------------------------------------------
def table_line(row: dict) -> str:
    if row["skipped"]:
        return f"{row['part']:<14} skipped: {row['skipped']}"
    return (f"{row['part']:<14} {row['case']:<32} tried {row['tried']:>6}  survived {row['survived']:>6}  "
            f"lost {row['records_lost']}  crossed {row.get('crossed_scope', 0)}  {'ok' if row['ok'] else 'FAILED'}  "
            f"({row['seconds']}s) {row['detail'][:90]}")


def write_results(path: Path, rows: list[dict], *, quick: bool, model: str) -> None:
    import platform

    from airquant import __version__

    old = json.loads(path.read_text()) if path.is_file() else {}
    parts = {r["part"]: r for r in old.get("parts", [])} if old.get("quick") == quick else {}
    parts.update({r["part"]: r for r in rows})
    body = {"benchmark": "faults", "quick": quick, "model": model, "airquant": __version__,
            "python": platform.python_version(), "machine": platform.machine(), "cpus": os.cpu_count(),
            "parts": list(parts.values()),
            "totals": {"tried": sum(r["tried"] for r in parts.values()),
                       "survived": sum(r["survived"] for r in parts.values()),
                       "records_lost": sum(r["records_lost"] for r in parts.values()),
                       "crossed_scope": sum(r.get("crossed_scope", 0) for r in parts.values())}}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(body, indent=1) + "\n")
