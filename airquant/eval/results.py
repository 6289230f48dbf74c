"""Reading a results folder: typed rows, other benchmarks' JSON, and files that could not be read.

Nothing in here raises on a bad file: the report lists it with the reason instead, so one broken
or foreign JSON file never hides the rest of the results.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from airquant.errors import ResultsFileError
from airquant.eval.rows import is_row_payload, rows_from_payload

log = logging.getLogger(__name__)

# Written by benchmarks/ scripts; their schema is theirs, so they are shown as found.
KNOWN_EXTRAS = ("stream_bench.json", "quant_quality.json", "kv_quality.json")
_MAX_TABLE_ROWS = 60
_MAX_TABLE_COLUMNS = 14
_MAX_JSON_CHARS = 4000
_MAX_CELL_CHARS = 40
_MAX_DEPTH = 3


@dataclass(frozen=True)
class LoadedRow:
    row: Any
    path: Path


@dataclass(frozen=True)
class ResultsDir:
    rows: tuple[LoadedRow, ...]
    extras: tuple[tuple[Path, Any], ...]  # parsed JSON that is not a row
    skipped: tuple[tuple[Path, str], ...]  # (file, why it was left out)

    def of(self, metric: str) -> list[LoadedRow]:
        return [r for r in self.rows if r.row.metric == metric]


def _extra_order(path: Path) -> tuple:
    return (path.name not in KNOWN_EXTRAS, KNOWN_EXTRAS.index(path.name) if path.name in KNOWN_EXTRAS else 0,
            path.name)


def load_results(results_dir: Path) -> ResultsDir:
    rows, extras, skipped = [], [], []
    # Dot files are write_row's temporary files (or editors'); they are never results.
    for path in sorted(p for p in results_dir.glob("*.json") if not p.name.startswith(".")):
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            skipped.append((path, f"not readable as JSON ({exc})"))
            continue
        if not is_row_payload(data):
            extras.append((path, data))
            continue
        try:
            rows += [LoadedRow(r, path) for r in rows_from_payload(data, source=path.name)]
        except ResultsFileError as exc:
            skipped.append((path, str(exc)))
    for path, why in skipped:
        log.warning("report: skipping %s: %s", path, why)
    return ResultsDir(tuple(rows), tuple(sorted(extras, key=lambda e: _extra_order(e[0]))), tuple(skipped))


def _coverage(row: Any) -> tuple:
    """How much a row measured: the fullest run of a configuration is the one the table shows."""
    if row.metric == "ppl":
        return (row.n_scored,)
    if row.metric == "rouge":
        return (row.n_samples,)
    if row.metric == "niah":
        return (row.longest_context, len(row.cells))
    if row.metric == "perf":
        # Streaming is what the table is about (resident runs stay in the detail table); batch 1 is the
        # headline latency figure.
        return (row.run.streamed, -row.batch_size)
    return ()


def best_row(candidates: list[LoadedRow]) -> LoadedRow | None:
    if not candidates:
        return None
    return max(candidates, key=lambda r: (_coverage(r.row), r.row.run.timestamp))


# -- markdown ---------------------------------------------------------------------------------------
def cell(value: Any) -> str:
    if value is None:
        return "—"
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value).replace("|", "\\|").replace("\n", " ")


def md_table(header: list[str], rows: list[list[Any]]) -> list[str]:
    lines = ["| " + " | ".join(cell(h) for h in header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(cell(v) for v in r) + " |" for r in rows]
    return lines


def _scalar(v: Any) -> bool:
    return v is None or isinstance(v, (str, int, float, bool))


def _compact(value: Any) -> Any:
    if _scalar(value):
        return value
    text = json.dumps(value, default=str)
    return text if len(text) <= _MAX_CELL_CHARS else text[:_MAX_CELL_CHARS - 1] + "…"


def _records_table(records: list[dict]) -> list[str]:
    columns: list[str] = []
    for r in records:
        columns += [k for k in r if k not in columns]
    columns = columns[:_MAX_TABLE_COLUMNS]
    lines = md_table(columns, [[_compact(r.get(c)) for c in columns] for r in records[:_MAX_TABLE_ROWS]])
    if len(records) > _MAX_TABLE_ROWS:
        lines.append(f"\n({len(records) - _MAX_TABLE_ROWS} more records not shown)")
    return lines


def _json_block(data: Any) -> list[str]:
    text = json.dumps(data, indent=1, default=str)
    if len(text) > _MAX_JSON_CHARS:
        text = text[:_MAX_JSON_CHARS] + "\n… (truncated)"
    return ["```json", text, "```"]


def render_json(data: Any, depth: int = 0) -> list[str]:
    """Markdown for JSON of unknown schema: tables for flat dicts and lists of records, else JSON text."""
    if isinstance(data, list) and data and all(isinstance(r, dict) for r in data):
        return _records_table(data)
    if not isinstance(data, dict) or depth >= _MAX_DEPTH:
        return _json_block(data)
    lines: list[str] = []
    flat = {k: v for k, v in data.items() if _scalar(v)}
    if flat:
        lines += md_table(["key", "value"], [[k, v] for k, v in flat.items()])
    for key, value in data.items():
        if not _scalar(value):
            lines += ["", f"**{cell(key)}**", ""] + render_json(value, depth + 1)
    return lines
