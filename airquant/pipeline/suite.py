"""One configuration's metrics, run or reused: what notebooks 02-04 and ``airquant pipeline`` measure.

``evaluate(store, metrics, sizes, kv=...)`` opens the store once, runs each ``airquant.eval`` metric
with the settings ``sizes`` gives it and writes each row under ``results_dir``. With ``reuse=True`` a
metric whose row is already there, measured with the same settings on the same store, scheme, KV
cache and device (by an earlier stage, say), is read back instead of measured again.
"""

from __future__ import annotations

import json
import logging
import math
from datetime import datetime
from pathlib import Path
from typing import Any, Sequence

from airquant.eval import default_row_name, write_row
from airquant.eval.metrics import METRICS as METRIC_SPECS
from airquant.eval.metrics import metric_spec
from airquant.eval.results import load_results, md_table
from airquant.eval.rows import kv_label
from airquant.eval.run_summary import headline  # noqa: F401  (suite.headline: the notebooks' and CLI's name)
from airquant.pipeline.sizes import Metric, Sizes
from airquant.pipeline.stores import kv_config, open_engine
from airquant.store.manifest import load_manifest

log = logging.getLogger(__name__)

METRICS: tuple[Metric, ...] = tuple(METRIC_SPECS)
# (store scheme, KV backend) columns of the results table, in order.
CONFIGURATIONS = (("bf16", "none"), ("nf4", "none"), ("nf4", "tq"))


def configurations(stores: dict[str, Path], sizes: Sizes) -> list[dict]:
    """``{"name", "store", "kv"}`` for every column the stores at hand allow.

    Without an NF4 store (no bitsandbytes) the TurboQuant column runs on the bf16 store.
    """
    wanted = CONFIGURATIONS if "nf4" in stores else (("bf16", "none"), ("bf16", "tq"))
    return [{"name": f"{scheme} + KV {backend}", "store": stores[scheme], "kv": kv_config(backend, sizes)}
            for scheme, backend in wanted if scheme in stores]


def settings(metric: Metric, sizes: Sizes) -> tuple[dict, dict]:
    """(keyword arguments of the metric's ``run_*`` function, the row fields that record them)."""
    spec = metric_spec(metric)
    kw = spec.sized(sizes)
    return kw, spec.recorded(kw)


def row_path(results_dir: str | Path, row: Any, label: str = "full") -> Path:
    """``results_dir/<default_row_name>``, with ``__<label>`` before ``.json`` for other than full sizes."""
    name = default_row_name(row)
    return Path(results_dir) / (name if label == "full" else name.replace(".json", f"__{label}.json"))


# -- reuse ------------------------------------------------------------------------------------------
def _same(a: Any, b: Any) -> bool:
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, float) or isinstance(b, float):
        return a is not None and b is not None and math.isclose(a, b)
    return a == b


def _identity(store: Path, kv: Any, device: str) -> dict:
    from airquant.engine.runner import resolve_device

    manifest = load_manifest(store)
    return {"model": str(manifest.source.get("name")), "store_scheme": manifest.scheme, "kv_scheme": kv_label(kv),
            "device": resolve_device(device).type, "streamed": True}


def find_rows(results_dir: str | Path, store: Path, metric: Metric, sizes: Sizes, *, kv: Any = None,
              reference: Path | None = None, device: str = "auto", since: str | None = None) -> list:
    """Rows already in ``results_dir`` that measured exactly this (empty when any is missing); with ``since``
    (ISO 8601) only rows measured from then on, so a run never passes off an earlier run's rows as its own."""
    if not Path(results_dir).is_dir():
        return []
    want = _identity(store, kv, device)
    ref_want = _identity(reference or store, None, device) if metric == "parity" else None
    _, fields = settings(metric, sizes)
    found = {}
    for loaded in load_results(Path(results_dir)).of(metric):
        row = loaded.row
        if any(getattr(row.run, k) != v for k, v in want.items()):
            continue
        if since is not None and datetime.fromisoformat(row.run.timestamp) < datetime.fromisoformat(since):
            continue
        if ref_want and any(getattr(row.reference_run, k) != v for k, v in ref_want.items()
                            if k in ("model", "store_scheme", "kv_scheme")):
            continue
        if all(_same(getattr(row, k, None), v) for k, v in fields.items()):
            found[row.batch_size] = row
    if metric == "perf":
        return [found[b] for b in sizes.perf_batches] if all(b in found for b in sizes.perf_batches) else []
    return list(found.values())[:1]


# -- running ----------------------------------------------------------------------------------------
def _run(metric: Metric, engine: Any, sizes: Sizes, kv: Any, reference: Path | None, device: str,
         data: Path | None) -> list:
    spec, (kw, _) = metric_spec(metric), settings(metric, sizes)
    if not spec.takes_reference:
        return spec.run(engine, data=data, kv=kv, **kw)
    ref_engine = open_engine(reference, device) if reference is not None else None
    try:
        return spec.run(engine, data=data, kv=kv, reference=ref_engine, **kw)
    finally:
        if ref_engine is not None:
            ref_engine.close()


def model_context(store: Path) -> int:
    config = json.loads((Path(store) / "config.json").read_text(encoding="utf-8"))
    return int(config.get("max_position_embeddings") or 2048)


def evaluate(store: str | Path, metrics: Sequence[Metric], sizes: Sizes, *, kv: Any = None,
             reference: str | Path | None = None, device: str = "auto", results_dir: str | Path = "results",
             reuse: bool = False, since: str | None = None, data: dict[str, Path] | None = None,
             engine: Any = None) -> list:
    """Every metric of ``metrics`` on ``store`` (streamed, with ``kv``); each row written under ``results_dir``.

    ``reference`` is parity's reference store (default: the same store without ``kv``). ``data`` maps a
    metric to its data file (default: the standard set, ``airquant.eval.data``). ``engine``, already open
    on ``store``, is used and left open (the full profile runs several KV caches on one engine). With
    ``reuse``, ``since`` limits the rows read back to those measured from then on (a pipeline run's start).
    """
    store = Path(store)
    reference = Path(reference) if reference is not None else None
    sizes = sizes.fit(model_context(store))
    rows, own = [], engine is None
    try:
        for metric in metrics:
            old = find_rows(results_dir, store, metric, sizes, kv=kv, reference=reference, device=device,
                            since=since) if reuse else []
            if old:
                log.info("%s on %s: reusing %d row(s) already in %s", metric, store.name, len(old), results_dir)
                rows += old
                continue
            if engine is None:
                engine = open_engine(store, device, batch_size=max(sizes.batch, sizes.rouge_batch, *sizes.perf_batches))

            for row in _run(metric, engine, sizes, kv, reference, device, (data or {}).get(metric)):
                write_row(row, row_path(results_dir, row, sizes.label))
                rows.append(row)
    finally:
        if own and engine is not None:
            engine.close()
    return rows


# -- what a row says in one line --------------------------------------------------------------------
def summary(rows: Sequence[Any]) -> list[dict]:
    """One record per row (configuration, metric, headline) for a notebook table."""
    return [{"store": r.run.store_scheme, "kv": r.run.kv_scheme, "metric": r.metric, "batch": r.batch_size,
             "result": headline(r)} for r in rows]


# -- notebook tables --------------------------------------------------------------------------------
def table(records: Sequence[dict]) -> str:
    """Markdown table of records (the keys of the first record are the columns)."""
    if not records:
        return "(nothing)"
    columns = list(records[0])
    return "\n".join(md_table(columns, [[r.get(c) for c in columns] for r in records]))


def kv_memory_table(rows: Sequence[Any]) -> list[dict]:
    """Per context: measured MB of each KV scheme, the ratio to the plain cache, and the planned largest batch."""
    by_kv = {r.run.kv_scheme: r for r in rows}
    plain = by_kv.get("none")
    out = []
    for i, ctx in enumerate(rows[0].context_lengths):
        rec: dict[str, Any] = {"context": ctx}
        for name, r in by_kv.items():
            rec[f"{name} MB"] = round(r.cache_bytes[i] / 1e6, 3)
            if plain is not None and r is not plain:
                rec[f"{name} / none"] = round(r.cache_bytes[i] / plain.cache_bytes[i], 3)
        for name, r in by_kv.items():
            if r.vram_budget_gb is not None:
                rec[f"max batch {name} ({r.vram_budget_gb:g} GiB)"] = r.planned_max_batch[i]
        out.append(rec)
    return out
