"""Batch jobs past one GPU: Ray Data spreads the prompts over one AirQuant engine per GPU.

The output rules are those of ``airquant batch`` (``airquant.jobs.batch``): a restart skips the ids already
in OUT.jsonl, each id is written once, and every record is appended and fsynced. Only the driver writes:
engine actors return records, the driver appends them as they stream back. A kill of the driver at any
moment therefore loses no written record, and a record that an actor computed but the driver never wrote is
computed again on the next run. When an actor dies, Ray restarts it (``max_restarts``) and re-runs its
unfinished batch; a record that arrives twice is written once.

The driver reads and checks the input with the single-process rules (ids default to line numbers and must be
unique over the whole file, which no per-block reader can see) and hands Ray Data blocks of prompts, longest
first; each actor runs its blocks through ``airquant.jobs.batch.generate_records`` (continuous batching in
``--batch-size`` slots), the single-process job's own function.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import time
import uuid
import warnings
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from tqdm.auto import tqdm

from airquant.config import EngineConfig
from airquant.engine.runner import Engine
from airquant.errors import AirQuantError, DependencyError, StoreError
from airquant.jobs.batch import (
    BatchJob,
    BatchJobError,
    BatchReport,
    Prompt,
    auto_batch_size,
    longest_first,
    pending,
    run_records,
)
from airquant.store.side_files import load_tokenizer

log = logging.getLogger(__name__)

INSTALL = "pip install -r requirements-scale.txt  (or: pip install 'ray[data]')"
MANIFEST = "manifest.json"  # the file whose bytes identify a store (airquant.store.manifest.MANIFEST)
ACTOR_PREFIX = "airquant-engine-"
# Prompts per actor call, in slots: the decode loop refills a slot as a sequence ends, so a call of several
# slots' worth keeps them full until its tail; records stream back to the driver once per call.
CALL_SLOTS = 4


class StoreNotSharedError(AirQuantError):
    """A node of the Ray cluster cannot read the store, or reads a different one at the same path."""


class RayBatchError(BatchJobError):
    """The Ray cluster cannot run the job as asked (resources, a failed batch)."""


@dataclass(frozen=True)
class ScaleConfig:
    """``airquant batch --ray [ADDRESS] --engines N --gpus-per-engine G``."""

    address: str = "local"  # "local": a new Ray on this machine; "auto" or HOST:PORT: join a running cluster
    engines: int | None = None  # None: one per gpus_per_engine GPUs in the cluster (1 without GPUs)
    gpus_per_engine: float | None = None  # None: 1 when the cluster has GPUs, else 0 (CPU engines)
    max_restarts: int = 4  # times Ray restarts a dead engine actor (and retries its batch)


def require_ray():
    """The ``ray`` module with Ray Data, or DependencyError with the pip command."""
    try:
        import ray
        import ray.data  # noqa: F401  (ray without the [data] extra lacks pyarrow)
    except ImportError as exc:
        raise DependencyError(f"airquant batch --ray needs Ray Data ({exc.name or 'ray'} is missing): {INSTALL}") from exc
    return ray


# -- records ---------------------------------------------------------------------------------------
def engine_records(engine, prompts: list[Prompt], job: BatchJob, slots: int, context: int) -> tuple[list[dict], int]:
    """Records of ``prompts`` on an open engine, as ``airquant batch`` writes them, and the slots that fit:
    ``run_records``, the single-process job's own function and out-of-memory policy (each id kept once)."""
    done: dict[str, dict] = {}
    slots = run_records(engine, prompts, job, slots, context, lambda r: done.setdefault(json.dumps(r["id"]), r))
    return list(done.values()), slots


# -- the store on every node -------------------------------------------------------------------
def store_digest(store: Path) -> str:
    """sha256 of the store's manifest: the same path on two nodes must hold the same store."""
    path = Path(store) / MANIFEST
    try:
        return hashlib.sha256(path.read_bytes()).hexdigest()
    except OSError as exc:
        raise StoreNotSharedError(f"{os.uname().nodename} cannot read {path} ({exc.strerror}); every node that "
                                  "runs an engine needs the store at this path: put it on a shared filesystem "
                                  "or copy it to the same path on each node.") from exc


def check_store(store: Path, digest: str) -> None:
    """Raise StoreNotSharedError unless ``store`` here is the store the driver read."""
    if store_digest(store) != digest:
        raise StoreNotSharedError(f"{os.uname().nodename} has a different store at {store} (its manifest.json "
                                  "differs from the driver's); copy the driver's store to the same path on each "
                                  "node, or use a shared filesystem.")


def check_store_on_nodes(ray, store: Path, digest: str, gpus: float) -> None:
    """Check the store on each node, other than the driver's, that can host an engine (one task per node)."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    here = ray.get_runtime_context().get_node_id()
    need = "GPU" if gpus else "CPU"
    nodes = [n for n in ray.nodes() if n["Alive"] and n["NodeID"] != here and n["Resources"].get(need, 0) > 0]
    probe = ray.remote(num_cpus=0)(_node_check)
    refs = [probe.options(scheduling_strategy=NodeAffinitySchedulingStrategy(n["NodeID"], soft=False))
            .remote(str(store), digest) for n in nodes]
    problems = [msg for msg in ray.get(refs) if msg]
    if problems:
        raise StoreNotSharedError(" ".join(problems))


def _node_check(store: str, digest: str) -> str | None:
    try:
        check_store(Path(store), digest)
    except StoreNotSharedError as exc:
        return str(exc)
    return None


# -- the engine actor --------------------------------------------------------------------------
class EngineActor:
    """One AirQuant engine per Ray actor; ``__call__`` turns a batch of prompts into JSON records."""

    def __init__(self, store: str, cfg: EngineConfig, job: BatchJob, digest: str, cpus: float = 1.0,
                 gpus: float = 0.0):
        torch.set_num_threads(engine_threads(cpus, gpus))
        check_store(Path(store), digest)
        self.job, self.slots = job, job.batch_size
        start = time.perf_counter()
        self.engine = Engine.open(store, cfg)
        self.open_s = time.perf_counter() - start  # reported once, with the first batch

    def __call__(self, batch: dict) -> dict:
        start = time.perf_counter()
        prompts = [Prompt(id=row["id"], prompt=row["prompt"], key=key, settings=_settings(row["settings"]))
                   for key, row in zip(batch["key"], map(json.loads, batch["row"]))]
        # An OOM halving holds for this actor's later batches, as it does for the rest of a single-process job.
        records, self.slots = engine_records(self.engine, prompts, self.job, self.slots, self.engine.cfg.context)
        # The call's seconds (and the engine's open, once) shared over its rows, so that the driver's sums are
        # exact however Ray splits or repeats blocks: it logs where the job's time went.
        n = max(len(records), 1)
        took, self.open_s, opened = (time.perf_counter() - start) / n, 0.0, self.open_s / n
        return {"key": [json.dumps(r["id"]) for r in records],
                "line": [json.dumps(r, ensure_ascii=False) for r in records],
                "new_tokens": [int(r.get("new_tokens", 0)) for r in records],
                "call_s": [took] * len(records), "open_s": [opened] * len(records)}


def engine_threads(cpus: float, gpus: float) -> int:
    """Torch threads of an engine actor: its share of the node's cores less one, at least 1.

    Ray sets OMP_NUM_THREADS to the actor's num_cpus: 1 for a GPU engine, whose host-side work (loading
    layers, host embeddings, offloaded KV) then runs on one core where a plain job has them all, so a GPU
    engine takes its GPUs' share of the node's cores. One core stays free either way: the driver and Ray's
    processes run beside the engine, and torch threads that spin on every core while they run slowed a CPU
    engine 4-5x (the engine's own time for the same records, 2 cores: 2 threads 10.6-12.2 s, 1 thread 2.0-2.5 s).
    """
    import ray

    share = cpus
    if gpus:
        here = ray.get_runtime_context().get_node_id()
        node = next((n["Resources"] for n in ray.nodes() if n["NodeID"] == here), {})
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
        share = min(cores, node.get("CPU", cores)) / max(node.get("GPU", 1), 1) * gpus
    return max(1, int(share) - 1)


def _settings(row: dict) -> dict:
    # JSON has no tuples: ``stop`` comes back a list, and Prompt keeps it a tuple (batch.read_prompts).
    return {k: tuple(v) if k == "stop" else v for k, v in row.items()}


def _auto_size(store: str, cfg: EngineConfig, context: int, limit: int, kv) -> int:
    return auto_batch_size(Path(store), cfg, context, limit, kv)


# -- the driver --------------------------------------------------------------------------------
def connect(ray, address: str) -> bool:
    """Start or join Ray; True when this call started it (and the job should shut it down)."""
    if ray.is_initialized():
        return False
    ray.init(address=address, include_dashboard=False, log_to_driver=True)
    return True


def engine_shape(ray, scale: ScaleConfig) -> tuple[int, float]:
    """(engines, GPUs per engine) from the flags and the cluster's resources."""
    total = ray.cluster_resources().get("GPU", 0)
    gpus = scale.gpus_per_engine if scale.gpus_per_engine is not None else (1.0 if total else 0.0)
    if gpus > total:
        raise RayBatchError(f"--gpus-per-engine {gpus:g} but the Ray cluster has {total:g} GPU(s); pass "
                            "--gpus-per-engine 0 for CPU engines, or join a cluster with GPUs (--ray ADDRESS).")
    engines = scale.engines or (int(total // gpus) if gpus else 1)
    if engines < 1 or engines * gpus > total:
        raise RayBatchError(f"--engines {engines} x --gpus-per-engine {gpus:g} needs {engines * gpus:g} GPUs; "
                            f"the Ray cluster has {total:g}. Lower --engines or add nodes.")
    return engines, gpus


def run_batch_ray(store: str | Path, job: BatchJob, cfg: EngineConfig | None = None,
                  scale: ScaleConfig | None = None, *, progress: bool = True) -> BatchReport:
    """Run every prompt of ``job.input`` not yet in ``job.output`` on engines spread by Ray Data."""
    ray = require_ray()
    store, cfg, scale = Path(store), cfg or EngineConfig(), scale or ScaleConfig()
    if not (store / MANIFEST).is_file():
        raise StoreError(f"{store} is not a store (no {MANIFEST}); pass the folder `airquant shard` or "
                         "`airquant synth` wrote.")
    if job.kv == "auto":
        raise BatchJobError("--kv auto (the throughput planner's cache) runs in one process, not yet with --ray; "
                            "pass --kv none or --kv tq.")
    digest = store_digest(store)
    report, todo = pending(job)
    if not todo:
        return report
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="airquant-prep") as pool:
        # Starting Ray (seconds) and the driver's tokenizer pass overlap: neither needs the other.
        prepared = pool.submit(_prepare, store, todo, job)
        owned = connect(ray, scale.address)
    try:
        context, todo = prepared.result()
        engines, gpus = engine_shape(ray, scale)
        check_store_on_nodes(ray, store, digest, gpus)
        if gpus == 0 and cfg.device == "auto":
            cfg = replace(cfg, device="cpu")  # an actor without a GPU must not pick up the node's
        cfg = replace(cfg, prefill="chunked")  # the actors run the decode loop: a pass's activations, as run_batch
        size = job.batch_size or ray.get(ray.remote(num_gpus=gpus)(_auto_size).remote(
            str(store), cfg, context, job.max_batch, job.kv))
        job = replace(job, batch_size=size)
        ray.data.DataContext.get_current().enable_progress_bars = progress
        log.info("ray batch job: %d prompts (%d already done), %d engine(s) x %g GPU, batch size %d, context %d",
                 len(todo), report.skipped, engines, gpus, size, context)
        call = min(size * CALL_SLOTS, max(size, math.ceil(len(todo) / engines)))  # every engine gets work
        records = _engines(ray, _dataset(ray, todo, call), replace(cfg, batch_size=size, context=context), job,
                           (str(store), digest), (engines, gpus, scale.max_restarts, call))
        _write(ray, records, todo, job, report, progress)
    finally:
        if owned:
            ray.shutdown()
    return report


def _prepare(store: Path, todo: list[Prompt], job: BatchJob) -> tuple[int, list[Prompt]]:
    """``run_batch``'s order and context for the job (``longest_first``), with the store's tokenizer."""
    return longest_first(load_tokenizer(store / "tokenizer"), store, todo, job)


def _dataset(ray, todo: list[Prompt], size: int):
    """Blocks of ``size`` prompts, longest first: one block is one actor call."""
    import pyarrow as pa

    # The prompt row travels as JSON text: ids mix str and int, prompts may be chat message lists.
    rows = [json.dumps({"id": p.id, "prompt": p.prompt, "settings": p.settings}, ensure_ascii=False) for p in todo]
    keys = [p.key for p in todo]
    return ray.data.from_arrow([pa.table({"key": keys[i:i + size], "row": rows[i:i + size]})
                                for i in range(0, len(todo), size)])


def _engines(ray, ds, cfg: EngineConfig, job: BatchJob, store: tuple[str, str], shape: tuple[int, float, int, int]):
    """The dataset of records: ``ds`` mapped by ``engines`` EngineActors of ``gpus`` GPUs each."""
    engines, gpus, restarts, call = shape
    cpus = _cpus_per_engine(ray, engines, gpus)
    with warnings.catch_warnings():
        # Ray 2.60 deprecates passing actor options (max_restarts, a name per actor) this way but offers no
        # named parameter for them yet; requirements-scale.txt pins the version that accepts them.
        warnings.filterwarnings("ignore", message=".*ray_remote_args.*deprecated", category=DeprecationWarning)
        return ds.map_batches(
            EngineActor, batch_size=call, batch_format="numpy", concurrency=engines, num_gpus=gpus,
            num_cpus=cpus, fn_constructor_kwargs={"store": store[0], "cfg": cfg, "job": job, "digest": store[1],
                                                  "cpus": cpus, "gpus": gpus},
            max_restarts=restarts, max_task_retries=restarts, ray_remote_args_fn=_actor_name)


def _cpus_per_engine(ray, engines: int, gpus: float) -> float:
    """A GPU engine needs one core to drive it; CPU engines share the cluster's cores (``engine_threads``)."""
    if gpus:
        return 1.0
    return max(1.0, math.floor(ray.cluster_resources().get("CPU", 1) / engines))


def _actor_name() -> dict:
    # A name per actor makes the engines visible (`ray list actors`) and reachable with ray.get_actor.
    return {"name": f"{ACTOR_PREFIX}{uuid.uuid4().hex[:12]}"}


def _write(ray, records, todo: list[Prompt], job: BatchJob, report: BatchReport, progress: bool) -> None:
    """Append each record once as it streams back; one fsync per returned batch."""
    start, written, engine_s = time.perf_counter(), set(), [0.0, 0.0]  # engine_s: opening, generating
    bar = tqdm(total=len(todo), desc="batch (ray)", unit="prompt", disable=not progress)
    job.output.parent.mkdir(parents=True, exist_ok=True)
    with open(job.output, "a", encoding="utf-8") as f:
        try:
            for batch in records.iter_batches(batch_size=None, batch_format="numpy"):
                engine_s[0] += float(batch["open_s"].sum())
                engine_s[1] += float(batch["call_s"].sum())
                fresh = [i for i, key in enumerate(batch["key"]) if key not in written]
                if not fresh:
                    continue
                f.write("".join(batch["line"][i] + "\n" for i in fresh))
                f.flush()
                os.fsync(f.fileno())
                written.update(batch["key"][i] for i in fresh)
                report.done += len(fresh)
                report.new_tokens += int(sum(batch["new_tokens"][i] for i in fresh))
                report.batch_sizes.append(len(fresh))
                report.elapsed_s = time.perf_counter() - start
                bar.update(len(fresh))
                bar.set_postfix(tok_s=f"{report.tokens_per_s:.1f}")
        except ray.exceptions.RayError as exc:
            raise RayBatchError(f"a batch failed on the Ray cluster after {report.done} new records were written "
                                f"to {job.output} ({type(exc).__name__}: {str(exc).splitlines()[0]}); fix the "
                                "cause and re-run the same command: finished ids are skipped.") from exc
        finally:
            bar.close()
    log.info("ray batch job: %.3f s from the first dispatch to the last record; the engines spent %.3f s opening "
             "the store and %.3f s generating (summed over engines), the rest is actor start-up and transfers",
             time.perf_counter() - start, *engine_s)
    missing = len({p.key for p in todo} - written)
    if missing:
        raise RayBatchError(f"{missing} prompt(s) got no record from the Ray cluster; re-run the same command to "
                            "run them (finished ids are skipped).")
