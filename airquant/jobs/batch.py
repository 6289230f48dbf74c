"""Batch jobs: many prompts through one streamed engine, continuously batched.

Streaming costs one pass over the weights per decode step whatever the batch size, so offline work
keeps as many sequences in flight as the KV cache allows (``auto``): the engine's decode loop
(``airquant.engine.decode``) runs them in slots, a sequence that ends frees its slot at once and the
next prompt takes it at the next pass. Each record may carry its own ``max_new_tokens``,
``temperature``, ``top_p``, ``seed`` and ``stop``; a record whose prompt does not fit the context gets an
``error`` record and the others run. Every finished record is appended to the output JSONL and
fsynced as soon as its sequence ends; a restart skips the ids already there, so a job killed at any
moment loses no finished output. A trailing partial line (a kill in the middle of a write) is cut off
on start. An out-of-memory error halves the slots and reruns the records not yet written.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Literal

import torch
from tqdm.auto import tqdm

from airquant.config import EngineConfig, GenerateConfig
from airquant.engine import runner  # runner.resolve_device at call time: tests give it a fake GPU
from airquant.engine.decode.loop import RequestSettingsError
from airquant.engine.memory.planner import tq_config
from airquant.engine.memory.router import Candidate, Hardware, RouteError, route, workload_for
from airquant.engine.memory.step_bound import PCIE3_GBPS
from airquant.engine.memory.throughput import JobShape, ThroughputPlan, choose_mix
from airquant.engine.prompts import token_counts
from airquant.engine.runner import Engine, hardware_for
from airquant.errors import AirQuantError, DiskSpaceError, PromptTooLongError
from airquant.eval.perf import measure_link_bandwidth
from airquant.store.side_files import load_tokenizer

if TYPE_CHECKING:
    from airquant.kv import KVConfig

log = logging.getLogger(__name__)

CPU_BATCH = 8  # CPU compute grows with the batch, so there is little to gain beyond a few sequences


class BatchJobError(AirQuantError):
    """The input or output file of a batch job cannot be used as it is."""


@dataclass(frozen=True)
class BatchJob:
    """``airquant batch``: ``--input --output --batch-size --max-batch`` plus the generation flags."""

    input: Path
    output: Path
    batch_size: int | None = None  # None: auto (the throughput planner's slots, KV offload and placement)
    max_batch: int = 256  # upper bound of the auto batch size
    gen: GenerateConfig = field(default_factory=GenerateConfig)
    # The KV cache (airquant.kv.KVConfig); None: the plain one; "auto": the planner's format (batch_size auto)
    kv: KVConfig | Literal["auto"] | None = None


# Per-record generation settings a JSONL line may carry, and the types each accepts.
RECORD_SETTINGS = {"max_new_tokens": (int,), "temperature": (int, float), "top_p": (int, float),
                   "seed": (int,), "stop": (str, list)}


@dataclass(frozen=True)
class Prompt:
    id: object  # str or int, as given in the input (the line number when absent)
    prompt: str | list
    key: str  # canonical JSON of the id: 1 and "1" are different ids
    settings: dict = field(default_factory=dict)  # the record's own generation settings (RECORD_SETTINGS)

    def gen(self, base: GenerateConfig) -> GenerateConfig:
        return replace(base, **self.settings)


@dataclass
class BatchReport:
    done: int = 0  # records written by this run
    skipped: int = 0  # ids already in the output
    new_tokens: int = 0
    elapsed_s: float = 0.0
    batch_sizes: list[int] = field(default_factory=list)
    oom_halvings: int = 0

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.elapsed_s if self.elapsed_s else 0.0


# -- files -------------------------------------------------------------------------------------
def read_prompts(path: Path, flag: str = "--input", shown: str | None = None) -> list[Prompt]:
    """Input lines ``{"id": ..., "prompt": ...}`` (or a bare JSON string); duplicate ids are an error.
    ``shown``: how errors name the file (the UI names an upload without the server's path)."""
    if not path.is_file():
        raise BatchJobError(f"{flag} {shown or path} does not exist.")
    name = shown or path
    prompts, seen = [], {}
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise BatchJobError(f"{name} line {n} is not JSON ({exc.msg}); each line must be "
                                '{"id": ..., "prompt": "..."}.') from exc
        if isinstance(row, str):
            row = {"prompt": row}
        if not isinstance(row, dict) or not isinstance(row.get("prompt"), (str, list)):
            raise BatchJobError(f'{name} line {n} has no "prompt" string; each line must be '
                                '{"id": ..., "prompt": "..."} (id optional: the line number).')
        pid = row.get("id", n)
        if not isinstance(pid, (str, int)) or isinstance(pid, bool):
            raise BatchJobError(f"{name} line {n}: id {pid!r} must be a string or an integer.")
        key = json.dumps(pid)
        if key in seen:
            raise BatchJobError(f"{name} has id {pid!r} twice (lines {seen[key]} and {n}); ids identify the "
                                "records of the output, so each must be unique.")
        seen[key] = n
        prompts.append(Prompt(id=pid, prompt=row["prompt"], key=key, settings=_settings(row, name, n)))
    return prompts


def _settings(row: dict, path: Path | str, n: int) -> dict:
    out = {}
    for name, types in RECORD_SETTINGS.items():
        if name not in row:
            continue
        value = row[name]
        ok = isinstance(value, types) and not isinstance(value, bool)
        if name == "stop" and isinstance(value, list):
            ok = all(isinstance(v, str) for v in value)
        if not ok:
            raise BatchJobError(f"{path} line {n}: {name}={value!r} must be {' or '.join(t.__name__ for t in types)}"
                                + (" (of strings)" if name == "stop" else "") + ".")
        out[name] = tuple([value] if isinstance(value, str) else value) if name == "stop" else value
    return out


# Every record ``_append`` writes starts so (json.dumps of a dict whose first key is "id").
RECORD_START = b'{"id": '


def finished_ids(path: Path) -> set[str]:
    """Keys of the records already in the output. A trailing partial record (a write cut short) is cut off,
    but only once every line has read as this tool's: a refused file is left byte for byte as it was."""
    if not path.exists():
        return set()
    data = path.read_bytes()
    end = data.rfind(b"\n") + 1
    lines = data[:end].split(b"\n")[:-1]
    done = set()
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            done.add(json.dumps(json.loads(line)["id"]))
        except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError) as exc:
            raise BatchJobError(f"--output {path} line {n} is not a record of this tool ({exc}); it is left "
                                "untouched. Pass another --output, or remove that line.") from exc
    tail = data[end:]
    if tail and not (RECORD_START.startswith(tail) or tail.startswith(RECORD_START)):
        raise BatchJobError(f"--output {path} ends with line {len(lines) + 1}, which has no newline and is not the "
                            "start of a record of this tool; it is left untouched. Pass another --output, or end "
                            "that line with a newline (or remove it).")
    if tail:
        log.warning("%s ends with a partial record (%d bytes, a write cut short); removing it", path, len(tail))
        with open(path, "r+b") as f:
            f.truncate(end)
            f.flush()
            os.fsync(f.fileno())
    return done


def _append(f, record: dict) -> None:
    f.write(json.dumps(record, ensure_ascii=False) + "\n")
    f.flush()
    os.fsync(f.fileno())


# -- sizing ------------------------------------------------------------------------------------
def prompt_lengths(tokenizer, prompts: list[Prompt], chat: bool) -> list[int]:
    """Token counts as ``Engine.encode`` makes them (one encoder: engine/prompts.py)."""
    return token_counts(tokenizer, [p.prompt for p in prompts], chat)


def planned_kv(kv: KVConfig | None) -> str:
    """The planner's KV scheme for a job's cache: AirQuant's TurboQuant is sized as such; the PyPI turboquant
    package is sized as plain (a lower bound: it keeps an FP16 copy besides its codes)."""
    return "tq" if kv is not None and kv.backend == "tq" else "none"


def auto_batch_size(store: Path, cfg: EngineConfig, context: int, limit: int, kv: KVConfig | None = None) -> int:
    """The largest batch whose KV cache (plain or TurboQuant) and activations fit beside the weights the
    engine keeps on the GPU, by the router's arithmetic (``airquant plan``), KV offload included."""
    if runner.resolve_device(cfg.device).type != "cuda":
        return min(CPU_BATCH, limit)
    hw = Hardware.detect("cuda", max_vram_gb=cfg.max_vram_gb, max_ram_gb=cfg.max_ram_gb)
    wl = workload_for(cfg, context=context, mode="resident" if cfg.resident else "streamed",
                      kv_schemes=(planned_kv(kv),))
    try:
        batch = route([Candidate.open(store)], hw, wl).max_batch
    except RouteError as exc:
        batch, why = 0, str(exc)
    else:
        why = f"the router's largest batch at {context} tokens is 0"
    if batch < 1:
        raise BatchJobError(f"not even one sequence of {context} tokens fits ({why}); lower --max-new-tokens, "
                            "shorten the prompts, raise --max-vram, or use --host-embedding, --kv tq, "
                            "--kv-offload or a compressed store.")
    return min(batch, limit)


def kv_schemes(kv: KVConfig | Literal["auto"] | None) -> tuple[str, ...]:
    """The KV formats the throughput planner may choose for a job's ``kv``."""
    return ("none", "tq") if kv == "auto" else (planned_kv(kv),)


def job_shape(lengths: list[int], prompts: list[Prompt], job: BatchJob, limit: int | None, source: str) -> JobShape:
    """The job's length distribution: each prompt's tokens and its own ``max_new_tokens``; records over the
    model's context (``limit``) are left out (they get an error record and take no slot)."""
    rows = [(n, p.gen(job.gen).max_new_tokens) for n, p in zip(lengths, prompts)]
    rows = [(n, m) for n, m in rows if n > 0 and (limit is None or n + m <= limit)]
    if not rows:
        raise BatchJobError(f"no prompt of {source} fits the model's context of {limit} tokens with its new tokens; "
                            "shorten the prompts or lower --max-new-tokens.")
    return JobShape(tuple(n for n, _ in rows), tuple(m for _, m in rows), source=source)


def link_for(hw, device: torch.device) -> tuple[float | None, str]:
    """The host->GPU link a plan's passes move layers over: measured on a GPU; PCIe 3 assumed for a plan made
    for a GPU where there is none (``--max-vram`` on a laptop); none on a CPU run."""
    if hw.vram_bytes is None:
        return None, " (a CPU run: layers are used in host memory)"
    if device.type != "cuda":
        return PCIE3_GBPS, " (PCIe 3, assumed: no GPU here to measure)"

    return measure_link_bandwidth(device, nbytes=128 << 20, repeats=5).gb_per_s, " (measured, pinned host->GPU)"


def plan_job(store: Path, job: BatchJob, cfg: EngineConfig, shape: JobShape, hw=None,
             device: torch.device | None = None, disk_gbps: float | None = None) -> ThroughputPlan:
    """The throughput planner's mix for this job (``engine/memory/throughput.choose_mix``): what ``airquant plan --job``
    prints and ``--batch-size auto`` runs. ``hw``: budgets detected already (default: this run's); ``disk_gbps``:
    the store's read speed (``airquant doctor STORE``), for plans that read layers from disk; on the CPU the
    slots are at most ``CPU_BATCH``."""
    device = device or runner.resolve_device(cfg.device)
    hw = hw or hardware_for(cfg, device)
    link, note = link_for(hw, device)
    limit = job.max_batch if hw.vram_bytes is not None else min(CPU_BATCH, job.max_batch)
    return choose_mix(Candidate.open(store), hw, cfg, shape, link_gbps=link, disk_gbps=disk_gbps, link_note=note,
                      max_slots=limit, kv_schemes=kv_schemes(job.kv))


# -- the job -----------------------------------------------------------------------------------
def run_batch(store: str | Path, job: BatchJob, cfg: EngineConfig | None = None, *, engine=None,
              progress: bool = True) -> BatchReport:
    """Run every prompt of ``job.input`` not yet in ``job.output``; ``engine`` reuses an open one."""
    # The job runs through the decode loop (passes of its token budget): the reserve holds one pass's activations,
    # not every prompt's at once (placement.pass_tokens); engines without the loop prefill in groups that fit it.
    store, cfg = Path(store), replace(cfg or EngineConfig(), prefill="chunked")
    report, todo = pending(job)
    if not todo:
        return report
    tokenizer = engine.tokenizer if engine is not None else load_tokenizer(store / "tokenizer")
    lengths, context, todo = _measured(tokenizer, store, todo, job)
    owned, placement = engine is None, None
    # --resident and --reserve leave the planner out: nothing is streamed, or the reserve does not follow the slots.
    if owned and job.batch_size is None and not cfg.resident and cfg.reserve_gb is None:
        mix = plan_job(store, job, cfg, job_shape(lengths, todo, job, store_context_limit(store), str(job.input)))
        log.info("throughput plan:\n%s", mix.describe())
        size, cfg, placement = mix.choice.slots, mix.engine_config(cfg), mix.choice.plan
        if job.kv == "auto":
            job = replace(job, kv=tq_config() if mix.choice.kv == "tq" else None)
    elif job.kv == "auto":
        raise BatchJobError("--kv auto lets the throughput planner choose the cache, which it does for a streamed "
                            "job with --batch-size auto; pass --kv none or --kv tq here.")
    else:
        size = job.batch_size or auto_batch_size(store, cfg, context, job.max_batch, job.kv)
    if owned:
        # The reserve in the job's KV format: a batch sized for TurboQuant planned as plain asked for the plain
        # cache's bytes and did not open (issue 38: a 70B NF4 job under 15 GB).
        engine = Engine.open(store, replace(cfg, batch_size=size, context=context, kv_cache=planned_kv(job.kv)),
                             placement=placement)
    log.info("batch job: %d prompts (%d already done), batch size %d, context %d", len(todo), report.skipped,
             size, context)
    try:
        _drain(engine, todo, size, job, report, progress, context)
    finally:
        if owned:
            engine.close()
    return report


def longest_first(tokenizer, store: Path, todo: list[Prompt], job: BatchJob) -> tuple[int, list[Prompt]]:
    """The job's context (``job_context``) and its prompts longest first: a batch that does not fit fails at
    the start, not after hours (``run_batch`` and the Ray driver order a job this way)."""
    _, context, ordered = _measured(tokenizer, store, todo, job)
    return context, ordered


def _measured(tokenizer, store: Path, todo: list[Prompt], job: BatchJob) -> tuple[list[int], int, list[Prompt]]:
    """Each prompt's tokens, the job's context and the prompts, all longest first."""
    lengths = prompt_lengths(tokenizer, todo, job.gen.chat)
    context = job_context(store, lengths, todo, job)
    ordered = sorted(zip(lengths, todo), key=lambda t: -t[0])
    return [n for n, _ in ordered], context, [p for _, p in ordered]


def pending(job: BatchJob) -> tuple[BatchReport, list[Prompt]]:
    """The prompts of ``job.input`` not yet in ``job.output`` (the resume rule), and a report counting the rest."""
    prompts = read_prompts(job.input)
    done = finished_ids(job.output)
    report = BatchReport(skipped=sum(p.key in done for p in prompts))
    return report, [p for p in prompts if p.key not in done]


def job_context(store: Path, lengths: list[int], prompts: list[Prompt], job: BatchJob) -> int:
    """Tokens per sequence: the longest prompt + its new tokens, at most the model's context (a record over
    it gets an error record)."""
    context = max(n + p.gen(job.gen).max_new_tokens for n, p in zip(lengths, prompts))
    limit = store_context_limit(store)
    return min(context, limit) if limit else context


def store_context_limit(store: Path) -> int | None:
    """The model's context (``max_position_embeddings``; None: not stated)."""
    path = store / "config.json"
    cfg = json.loads(path.read_text()) if path.is_file() else {}
    return cfg.get("max_position_embeddings") or cfg.get("text_config", {}).get("max_position_embeddings")


def generate_records(engine, prompts: list[Prompt], job: BatchJob, *, slots: int | None = None,
                     context: int | None = None, on_record=None) -> list[dict]:
    """Output records of ``prompts`` through one decode loop of ``slots`` sequences on an open ``engine``.

    Records come in the order sequences finish; ``on_record(record)`` is called as each one does (the
    job appends and fsyncs it there). A prompt over the context, a setting the loop refuses (a seed out of
    range) or a sequence that fails on its own (``finish_reason="error"``) gets ``{"id", "prompt", "error"}``:
    that record is done (a rerun skips it) and the others run.
    """
    slots = slots or job.batch_size or CPU_BATCH
    requests, records = [], []

    def emit(record: dict) -> None:
        records.append(record)
        if on_record is not None:
            on_record(record)

    loop = engine.decode_loop(slots, context=context, kv=job.kv)
    for p in prompts:
        gen = p.gen(job.gen)
        try:
            seq = loop.submit(engine.request(engine.prompt_ids(p.prompt, gen.chat), gen))
        except (PromptTooLongError, RequestSettingsError) as exc:
            emit({"id": p.id, "prompt": p.prompt, "error": str(exc)})
            continue
        seq.owner = p
        requests.append(seq)
    while not loop.idle:
        for event in loop.step():
            if event.finish_reason == "error":
                emit({"id": event.seq.owner.id, "prompt": event.seq.owner.prompt, "error": event.seq.error})
            elif event.finish_reason is not None:
                emit(_record(engine, event.seq))
    return records


def _record(engine, seq) -> dict:
    c = engine.completion(seq)
    return {"id": seq.owner.id, "prompt": seq.owner.prompt, "output": c.text, "prompt_tokens": c.prompt_tokens,
            "new_tokens": c.new_tokens, "finish_reason": c.finish_reason,
            "timings": {"ttft_s": c.ttft_s, "total_s": c.latency_s}}


# -- on an open engine: the one out-of-memory policy of batch jobs ------------------------------------
ONE_PROMPT_OOM = ("one prompt alone runs out of GPU memory; lower --max-new-tokens, raise --max-vram, or use "
                  "--host-embedding / a compressed store.")


def run_records(engine, prompts: list[Prompt], job: BatchJob, slots: int, context: int | None, on_record, *,
                on_halve=None, on_batch=None) -> int:
    """Run ``prompts`` on an open engine, ``on_record(record)`` as each finishes; return the slots that fit.

    Engines that run AirQuant's decode loop go through ``generate_records`` (continuous batching in ``slots``),
    others through static batches of ``slots`` (``static_records``). The out-of-memory policy of ``airquant
    batch`` and of its Ray actors alike: halve the slots (``on_halve()``) and rerun only the records not handed
    to ``on_record`` yet; one slot that still runs out raises BatchJobError. ``on_batch(n)``: each static
    batch's size, or once the slots of the decode loop that finished the prompts."""
    finished: set[str] = set()

    def keep(record: dict) -> None:
        finished.add(json.dumps(record["id"]))
        on_record(record)

    todo = list(prompts)
    while True:
        try:
            if hasattr(engine, "decode_loop") and engine.loop_supported:
                generate_records(engine, todo, job, slots=slots, context=context, on_record=keep)
                if on_batch is not None:
                    on_batch(slots)
            else:
                static_records(engine, todo, job, slots, keep, on_batch)
            return slots
        except torch.OutOfMemoryError:
            if slots == 1:
                raise BatchJobError(ONE_PROMPT_OOM) from None
            todo = [p for p in todo if p.key not in finished]
            slots //= 2
            log.warning("out of GPU memory with %d slots: rerunning %d records with %d", 2 * slots, len(todo), slots)
            if on_halve is not None:
                on_halve()
            if torch.cuda.is_available():
                torch.cuda.empty_cache()


def static_records(engine, prompts: list[Prompt], job: BatchJob, size: int, on_record, on_batch=None) -> None:
    """Engines without the decode loop: ``size`` prompts per ``Engine.generate`` call."""
    for i in range(0, len(prompts), size):
        chunk = prompts[i:i + size]
        completions = engine.generate([p.prompt for p in chunk], job.gen, kv=job.kv)
        timings = {k: engine.last_timings.get(k) for k in ("batch_size", "ttft_s", "decode_s", "total_s")}
        for p, c in zip(chunk, completions):
            on_record({"id": p.id, "prompt": p.prompt, "output": c.text, "prompt_tokens": c.prompt_tokens,
                       "new_tokens": c.new_tokens, "timings": timings})
        if on_batch is not None:
            on_batch(len(chunk))


def _drain(engine, todo: list[Prompt], slots: int, job: BatchJob, report: BatchReport, progress: bool,
           context: int) -> None:
    """``todo`` through ``run_records``, every record appended (and fsynced) to the output as it finishes."""
    start = time.perf_counter()
    bar = tqdm(total=len(todo), desc="batch", unit="prompt", disable=not progress)
    job.output.parent.mkdir(parents=True, exist_ok=True)

    def on_record(record: dict) -> None:
        _append(f, record)
        report.done += 1
        report.new_tokens += record.get("new_tokens", 0)
        report.elapsed_s = time.perf_counter() - start
        bar.update(1)
        bar.set_postfix(tok_s=f"{report.tokens_per_s:.1f}")

    def on_halve() -> None:
        report.oom_halvings += 1

    try:
        with open(job.output, "a", encoding="utf-8") as f:
            run_records(engine, todo, job, slots, context, on_record, on_halve=on_halve,
                        on_batch=report.batch_sizes.append)
    except OSError as exc:
        if exc.errno not in (errno.ENOSPC, errno.EDQUOT):
            raise
        raise DiskSpaceError(
            f"the disk of --output {job.output} is full ({report.done} records written by this run, every one "
            f"fsynced and kept; a record cut short is removed on the next run). Free space, then re-run the same "
            "command: it continues with the prompts not yet in the output.") from exc
    finally:
        bar.close()
