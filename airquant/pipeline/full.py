"""The pipeline in one process: every configuration of the headline table, one store per weight scheme.

``airquant pipeline --profile full`` runs here instead of through papermill: seven configurations on
one model, each store opened once and shared by the configurations on it (NF4 carries three KV
caches), generation metrics batched (``Sizes.rouge_batch``, ``Sizes.batch``). What ran, where, with
which software and data goes to ``results/profiles/<label>.json``; the report reads it as the
headline table's provenance. ``only`` runs some configurations and ``metrics`` some metrics, so one
profile can be split over device calls, or over processes sharing one GPU (the quality metrics of
several configurations at once, then the speed metrics alone); each adds to the same provenance file,
under a lock.
"""

from __future__ import annotations

import fcntl
import json
import logging
import sys
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch

from airquant.errors import EvalDataError, PipelineError
from airquant.eval import build_report
from airquant.eval.data import file_source, find_local
from airquant.eval.headline import PROFILES_DIR
from airquant.eval.rows import package_versions, write_json_atomic
from airquant.pipeline import stores
from airquant.pipeline.config import PipelineConfig, PipelineResult, StageRun
from airquant.pipeline.sizes import Metric, Sizes
from airquant.pipeline.suite import evaluate, model_context, summary

log = logging.getLogger(__name__)

QUALITY: tuple[Metric, ...] = ("ppl", "rouge", "niah", "perf")
DATA_KINDS = {"ppl": "wikitext2", "parity": "wikitext2", "kvmem": "wikitext2", "rouge": "cnn_dailymail",
              "niah": "haystack"}


@dataclass(frozen=True)
class Configuration:
    """One row of the headline table: a store scheme, a KV cache, the metrics measured on it."""

    name: str  # what ``--only`` takes
    scheme: stores.Scheme
    kv: str  # stores.kv_config backend: none | tq | mixed
    metrics: tuple[Metric, ...]
    parity_against: str | None  # store scheme of parity's reference; None: this store without the KV cache


CONFIGURATIONS: tuple[Configuration, ...] = (
    Configuration("bf16", "bf16", "none", QUALITY + ("kvmem",), None),
    Configuration("nf4", "nf4", "none", QUALITY + ("parity",), "bf16"),
    Configuration("nf4-tq", "nf4", "tq", QUALITY + ("parity", "kvmem"), None),
    Configuration("nf4-mixed", "nf4", "mixed", QUALITY + ("parity", "kvmem"), None),
    Configuration("gguf", "gguf", "none", QUALITY + ("parity",), "bf16"),
    Configuration("gptq", "gptq", "none", QUALITY + ("parity",), "bf16"),
    Configuration("int2", "int2", "none", QUALITY + ("parity",), "bf16"),
)
NAMES = tuple(c.name for c in CONFIGURATIONS)


def chosen(cfg: PipelineConfig) -> list[Configuration]:
    """The configurations ``--only`` and ``--schemes`` leave, in the table's order."""
    unknown = sorted(set(cfg.only or ()) - set(NAMES))
    if unknown:
        raise PipelineError(f"--only {unknown}: not a configuration; choose from {', '.join(NAMES)}.")
    known = {m for c in CONFIGURATIONS for m in c.metrics}
    if cfg.metrics and set(cfg.metrics) - known:
        raise PipelineError(f"--metrics {sorted(set(cfg.metrics) - known)}: not a metric of the full profile; "
                            f"choose from {', '.join(sorted(known))}.")
    out = [c for c in CONFIGURATIONS if (not cfg.only or c.name in cfg.only)
           and (not cfg.schemes or c.scheme in cfg.schemes)]
    if not out:
        raise PipelineError(f"--only {cfg.only} with --schemes {cfg.schemes} leaves no configuration to run.")
    return out


def data_files(required: bool) -> dict[str, Path]:
    """Each metric's local data file. The reference figures were measured on ``wikitext2_test.raw``
    read as is (the hub copy tokenizes differently), so the full profile requires the local files."""
    found = {metric: find_local(kind) for metric, kind in DATA_KINDS.items()}
    missing = sorted({DATA_KINDS[m] for m, path in found.items() if path is None})
    if missing and required:
        raise EvalDataError(f"the full profile measures on the local copies of {', '.join(missing)}; put them in "
                            "$AIRQUANT_DATA_DIR (/work/shared/data has them) and re-run.")
    return {metric: path for metric, path in found.items() if path is not None}


@contextmanager
def _locked(path: Path):
    """Hold an exclusive lock beside ``path`` while it is read, changed and rewritten: several pipeline
    processes (``--only``/``--metrics`` split over one GPU) may add to one provenance file at once."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_name(path.name + ".lock"), "a+") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _provenance(cfg: PipelineConfig, sizes: Sizes, data: dict[str, Path], device_name: str) -> Path:
    """``results/profiles/<label>.json``, created or extended with this call."""
    path = Path(cfg.results) / PROFILES_DIR / f"{sizes.label}.json"
    with _locked(path):
        _write_provenance(cfg, sizes, data, device_name, path)
    return path


def _write_provenance(cfg: PipelineConfig, sizes: Sizes, data: dict[str, Path], device_name: str,
                      path: Path) -> None:
    old = json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}
    record = {
        "profile": cfg.profile, "label": sizes.label, "sizes": asdict(sizes),
        "headline": asdict(sizes.headline_settings()), "model": cfg.model, "device": device_name,
        "versions": package_versions(("rouge-score", "turboquant")),
        "data": {metric: file_source(p) for metric, p in sorted(data.items())},
        "calls": old.get("calls", []), "configurations": old.get("configurations", {}),
    }
    # `airquant pipeline ...` as typed (the console script's path is left out), else the interpreter's argv.
    command = " ".join(["airquant"] + sys.argv[1:]) if Path(sys.argv[0]).name == "airquant" else " ".join(sys.argv)
    record["calls"].append({"command": command, "started": datetime.now(timezone.utc).isoformat(timespec="seconds")})
    write_json_atomic(record, path)


def _record(path: Path, name: str, seconds: float, rows: list) -> None:
    """Add this call's rows to the configuration's; a metric measured again replaces its earlier rows."""
    with _locked(path):
        record = json.loads(path.read_text(encoding="utf-8"))
        new = summary(rows)
        remeasured = {(r["metric"], r["batch"]) for r in new}
        old = record["configurations"].get(name, {})
        kept = [r for r in old.get("rows", []) if (r["metric"], r["batch"]) not in remeasured]
        record["configurations"][name] = {"seconds": round(old.get("seconds", 0.0) + seconds, 1),
                                          "rows": kept + new}
        write_json_atomic(record, path)


def _device_name(device: str) -> str:
    from airquant.engine.runner import resolve_device

    dev = resolve_device(device)
    if dev.type == "cuda":
        return torch.cuda.get_device_name(dev)
    return "cpu"


def run_configuration(conf: Configuration, built: dict[str, Path], engine: Any, sizes: Sizes, cfg: PipelineConfig,
                      data: dict[str, Path]) -> list:
    """One configuration's metrics on its store's open engine; parity's reference opened for it."""
    kv = stores.kv_config(conf.kv, sizes, num_layers=engine.manifest.num_layers)
    reference = built[conf.parity_against] if conf.parity_against else None
    rows = []
    for metric in (m for m in conf.metrics if not cfg.metrics or m in cfg.metrics):
        t0 = time.perf_counter()
        rows += evaluate(built[conf.scheme], [metric], sizes, kv=kv, reference=reference if metric == "parity"
                         else None, device=cfg.device, results_dir=cfg.results, data=data, engine=engine)
        log.info("%s %s: %.1f s", conf.name, metric, time.perf_counter() - t0)
    return rows


def run_in_process(cfg: PipelineConfig) -> PipelineResult:
    """Shard what the chosen configurations need, measure them store by store, then rebuild RESULTS.md."""
    start, runs = time.perf_counter(), []
    sizes = Sizes.preset(cfg.profile, cfg.sizes)
    confs = chosen(cfg)
    needed = list(dict.fromkeys([c.scheme for c in confs] + [c.parity_against for c in confs if c.parity_against]))
    built = {}
    for scheme in needed:
        t0 = time.perf_counter()
        built[scheme] = Path(stores.shard(cfg.model, cfg.store, scheme, device=cfg.device)["store"])
        log.info("store %s ready in %.1f s", scheme, time.perf_counter() - t0)
    sizes = sizes.fit(model_context(built[needed[0]]))
    data = data_files(required=cfg.profile == "full")
    provenance = _provenance(cfg, sizes, data, _device_name(cfg.device))
    for scheme in dict.fromkeys(c.scheme for c in confs):
        engine = stores.open_engine(built[scheme], cfg.device,
                                    batch_size=max(sizes.batch, sizes.rouge_batch, *sizes.perf_batches))
        try:
            for conf in (c for c in confs if c.scheme == scheme):
                t0 = time.perf_counter()
                rows = run_configuration(conf, built, engine, sizes, cfg, data)
                _record(provenance, conf.name, time.perf_counter() - t0, rows)
                runs.append(StageRun(conf.name, provenance, "in-process", time.perf_counter() - t0))
                log.info("configuration %s done in %.0f s", conf.name, runs[-1].seconds)
        finally:
            engine.close()
    report = build_report(cfg.results) if cfg.report else Path(cfg.results) / "RESULTS.md"
    return PipelineResult(tuple(runs), report, time.perf_counter() - start)
