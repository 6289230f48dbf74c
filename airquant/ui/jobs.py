"""Batch jobs started from the UI: the CLI's resumable ``run_batch``, fed through the server's provider.

A job is a folder ``JOBS/<id>/`` with ``input.jsonl`` and ``output.jsonl``; the id is a hash of the
input bytes and the generation settings, so uploading the same file again resumes the same job (ids
already in the output are skipped, as ``airquant batch`` does). The job runs in a thread of the
server process and its progress is read from the output file, so a page reload (or a second browser)
sees the same job. Prompts go through ``Provider.submit(batch_job=True)``: the one loaded model serves
chat and batch work, sharing weight passes, instead of a second copy of the weights.

The input is taken only from the folder Gradio writes uploads to (``uploads``; a path the browser names
elsewhere, or a link out of it, is refused), the job folders are not served (the UI hands the output to
Gradio, which copies it to its cache), and the UI's messages name no server path.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from airquant.config import GenerateConfig
from airquant.errors import AirQuantError
from airquant.jobs.batch import BatchJob, read_prompts, run_batch
from airquant.store.side_files import load_tokenizer

log = logging.getLogger(__name__)


class ProviderEngine:
    """What ``run_batch`` needs of an engine (``tokenizer``, ``generate``, ``last_timings``),
    answered by the provider's worker thread, which owns the real engine."""

    def __init__(self, provider):
        self.provider = provider
        # The engine's tokenizer belongs to the worker thread; sizing the batch needs one of our own.
        self.tokenizer = load_tokenizer(provider.route.store / "tokenizer")
        self.last_timings: dict = {}

    def generate(self, prompts, gen: GenerateConfig, kv=None):  # kv: the provider's route decides
        start = time.perf_counter()
        out = self.provider.submit(list(prompts), batch_job=True, **asdict(gen)).result()
        self.last_timings = {"batch_size": len(prompts), "total_s": time.perf_counter() - start}
        return out


@dataclass(frozen=True)
class JobStatus:
    id: str
    state: str  # running | done | failed | stopped (not finished, no thread: start it again to resume)
    done: int
    total: int
    new_tokens: int  # written by this run
    tokens_per_s: float
    eta_s: float | None
    output: Path
    error: str | None = None

    def describe(self) -> str:
        eta = f", ETA {self.eta_s:.0f} s" if self.eta_s is not None and self.state == "running" else ""
        text = (f"job {self.id}: {self.state}, {self.done}/{self.total} prompts, {self.tokens_per_s:.1f} tok/s{eta}")
        return text + (f"\n{self.error}" if self.error else "")


def _count_output(path: Path) -> tuple[int, int]:
    """(complete records, their new tokens), reading only whole lines: the writer may be mid-line."""
    if not path.exists():
        return 0, 0
    data = path.read_bytes()
    lines = data[: data.rfind(b"\n") + 1].decode("utf-8", errors="replace").splitlines()
    records = [json.loads(line) for line in lines if line.strip()]
    return len(records), sum(int(r.get("new_tokens", 0)) for r in records)


class JobRunner:
    """Starts, resumes and reports the UI's batch jobs (one at a time: they share the provider anyway)."""

    def __init__(self, provider, jobs_dir: Path, uploads: Path, batch_size: int | None = None):
        self.provider, self.jobs_dir, self.uploads = provider, Path(jobs_dir), Path(uploads)
        self.batch_size = batch_size or provider.config.max_batch
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._current: str | None = None
        self._started: dict[str, tuple[float, int, int]] = {}  # id -> (time, records, tokens) at start
        self._errors: dict[str, str] = {}
        self._engine: ProviderEngine | None = None

    def uploaded(self, path: str | Path) -> Path:
        """``path`` resolved (links followed), if it is a file inside the upload folder; else UploadError."""
        real, root = Path(os.path.realpath(path)), Path(os.path.realpath(self.uploads))
        if real == root or not real.is_relative_to(root) or not real.is_file():
            raise UploadError("the batch input must be a JSONL file uploaded on this page; upload it again.")
        return real

    def start(self, upload: str | Path, gen: GenerateConfig) -> str:
        """Copy ``upload`` (a file in the upload folder) into the job folder, checked first, and run it;
        returns the job id."""
        data = self.uploaded(upload).read_bytes()
        settings = json.dumps(asdict(gen), sort_keys=True).encode()
        job_id = hashlib.sha256(data + b"\0" + settings).hexdigest()[:12]
        folder = self.jobs_dir / job_id
        folder.mkdir(parents=True, exist_ok=True)
        staged = folder / "input.jsonl.tmp"
        staged.write_bytes(data)
        try:  # a bad file fails here, before any output exists
            read_prompts(staged, flag="the uploaded file", shown="the uploaded file")
        except (AirQuantError, UnicodeDecodeError) as exc:
            staged.unlink()
            if isinstance(exc, UnicodeDecodeError):
                raise UploadError("the uploaded file is not UTF-8 text; a JSONL file is.") from None
            raise
        os.replace(staged, folder / "input.jsonl")
        (folder / "settings.json").write_text(settings.decode())
        with self._lock:
            if self._thread is not None and self._thread.is_alive():
                raise JobBusyError(f"job {self._current} is still running; wait for it to finish.")
            self._current = job_id
            self._errors.pop(job_id, None)
            self._started[job_id] = (time.perf_counter(), *_count_output(folder / "output.jsonl"))
            job = BatchJob(input=folder / "input.jsonl", output=folder / "output.jsonl",
                           batch_size=self.batch_size, gen=gen)
            self._thread = threading.Thread(target=self._run, args=(job_id, job), name=f"airquant-job-{job_id}",
                                            daemon=True)
            self._thread.start()
        return job_id

    def _run(self, job_id: str, job: BatchJob) -> None:
        try:
            if self._engine is None:
                self._engine = ProviderEngine(self.provider)
            run_batch(self.provider.route.store, job, engine=self._engine, progress=False)
        except Exception as exc:  # shown in the UI; the finished records stay in the output
            log.exception("batch job %s failed", job_id)
            self._errors[job_id] = self.public(f"{type(exc).__name__}: {exc}")

    def public(self, message: str) -> str:
        """``message`` with the server's folders (jobs, uploads, the store) replaced by what they are."""
        store = Path(self.provider.route.store)
        for folder, name in ((self.jobs_dir, "<jobs>"), (self.uploads, "<uploads>"), (store, store.name)):
            for form in {str(folder.resolve()), str(folder)}:
                message = message.replace(form, name)
        return message

    def latest(self) -> str | None:
        """The job started last in this process, else the newest job folder (after a server restart)."""
        if self._current is not None:
            return self._current
        folders = [p for p in self.jobs_dir.glob("*/input.jsonl")] if self.jobs_dir.exists() else []
        return max(folders, key=lambda p: p.stat().st_mtime).parent.name if folders else None

    def status(self, job_id: str | None = None) -> JobStatus | None:
        job_id = job_id or self.latest()
        if job_id is None or not (self.jobs_dir / job_id / "input.jsonl").exists():
            return None
        folder = self.jobs_dir / job_id
        total = len(read_prompts(folder / "input.jsonl"))
        done, tokens = _count_output(folder / "output.jsonl")
        running = job_id == self._current and self._thread is not None and self._thread.is_alive()
        since, done0, tokens0 = self._started.get(job_id, (time.perf_counter(), done, tokens))
        elapsed = max(time.perf_counter() - since, 1e-9)
        rate = (done - done0) / elapsed
        error = self._errors.get(job_id)
        state = "running" if running else "failed" if error else "done" if done >= total else "stopped"
        return JobStatus(id=job_id, state=state, done=done, total=total, new_tokens=tokens - tokens0,
                         tokens_per_s=(tokens - tokens0) / elapsed if job_id in self._started else 0.0,
                         eta_s=(total - done) / rate if rate > 0 else None, output=folder / "output.jsonl",
                         error=error)


class UploadError(AirQuantError):
    """The batch input is not a file uploaded through the UI (or not text)."""


class JobBusyError(AirQuantError):
    """A job is already running; the UI runs one at a time (they would share the one provider anyway)."""
