"""The headline table of ``results/RESULTS.md``: configurations × metrics at one set of settings.

A row enters a column only when the settings it recorded are the column's (``HeadlineSettings``:
the reference settings, or a test's tiny slice named as such), and every cell of a column comes from
the same data file, so no column mixes settings. Each cell carries the settings text of the row it
came from and its Δ against the BF16 (full-precision, plain-cache) row of the same table; a cell
with no row says why in a footnote.
"""

from __future__ import annotations

import json
import logging
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from airquant.eval import references as ref
from airquant.eval.references import HeadlineSettings
from airquant.eval.results import LoadedRow, ResultsDir, md_table

log = logging.getLogger(__name__)

PROFILES_DIR = "profiles"  # what ``airquant pipeline --profile full`` records about its runs
FULL_COMMAND = "airquant pipeline --profile full --device cuda"


@dataclass(frozen=True)
class Column:
    title: str
    metric: str
    settings: Callable[[Any], str]  # the settings text of a row (or of HeadlineSettings: same fields read)
    value: Callable[[Any], float | None]
    fmt: str
    relative: bool  # Δ in percent (speed) or in the metric's own units (quality)
    batch: int | None = None  # perf columns: the batch size they show


def _ppl(r: Any) -> str:
    return f"WikiText-2 test, {r.limit_tokens} tokens, window {r.max_length}, stride {r.stride}"


def _rouge(r: Any) -> str:
    return f"CNN/DailyMail test, {r.n_samples} pairs, {r.max_new_tokens} new tokens, context ≤ {r.max_length}"


def _niah(r: Any) -> str:
    ctx = r.context_lengths
    return f"{len(ctx)} contexts {ctx[0]}–{ctx[-1]} × {len(r.depths)} depths, {r.max_new_tokens} new tokens"


def _perf(r: Any) -> str:
    return f"batch {r.batch_size}, prompt {r.prompt_length}, {r.max_new_tokens} new tokens"


def columns(s: HeadlineSettings) -> list[Column]:
    small, large = min(s.perf_batches), max(s.perf_batches)
    cols = [
        Column("PPL ↓", "ppl", _ppl, lambda r: r.ppl, "{:.2f}", False),
        Column("ROUGE-L ↑", "rouge", _rouge, lambda r: r.rougeL, "{:.4f}", False),
        Column("NiAH recall ↑", "niah", _niah, lambda r: r.recall, "{:.2f}", False),
        Column(f"NiAH @ {s.niah_contexts[-1]} ↑", "niah", _niah, lambda r: r.recall_at_longest, "{:.2f}", False),
        Column("TTFT s ↓", "perf", _perf, lambda r: r.ttft_s, "{:.3f}", True, small),
        Column("prefill tok/s ↑", "perf", _perf, lambda r: r.prefill_tokens_per_s, "{:.0f}", True, small),
        Column("decode tok/s ↑", "perf", _perf, lambda r: r.decode_tokens_per_s, "{:.1f}", True, small),
    ]
    if large != small:
        cols.append(Column("decode tok/s ↑", "perf", _perf, lambda r: r.decode_tokens_per_s, "{:.1f}", True, large))
    cols.append(Column("peak VRAM GB ↓", "perf", _perf, lambda r: r.peak_vram_allocated_gb, "{:.2f}", False, large))
    return cols


def wanted_settings(col: Column, s: HeadlineSettings) -> str:
    """The settings text a row must have to enter ``col``."""
    fake = {
        "ppl": dict(limit_tokens=s.ppl_tokens, max_length=s.ppl_max_length, stride=s.ppl_stride),
        "rouge": dict(n_samples=s.rouge_samples, max_new_tokens=s.rouge_new_tokens, max_length=s.rouge_max_length),
        "niah": dict(context_lengths=tuple(s.niah_contexts), depths=tuple(s.niah_depths),
                     max_new_tokens=s.niah_new_tokens),
        "perf": dict(batch_size=col.batch, prompt_length=s.perf_prompt, max_new_tokens=s.perf_new_tokens),
    }[col.metric]
    return col.settings(type("Settings", (), fake))


@dataclass(frozen=True)
class Cell:
    text: str
    settings: str | None  # the settings text of the row the value came from, data file included
    row: Any = None


@dataclass
class HeadlineTable:
    settings: HeadlineSettings
    model: str
    device: str
    configurations: list[str] = field(default_factory=list)
    columns: list[Column] = field(default_factory=list)
    cells: list[list[Cell]] = field(default_factory=list)  # [configuration][column]
    footnotes: list[str] = field(default_factory=list)
    used: list[LoadedRow] = field(default_factory=list)

    def header(self) -> list[str]:
        return ["configuration"] + [f"{c.title} ({wanted_settings(c, self.settings)})" for c in self.columns]

    def markdown(self) -> list[str]:
        body = [[label] + [c.text for c in row] for label, row in zip(self.configurations, self.cells)]
        notes = [f"{i}. {text}" for i, text in enumerate(self.footnotes, 1)]
        return md_table(self.header(), body) + ([""] + notes if notes else [])


def config_key(run: Any) -> tuple:
    mixed = bool((run.kv_config or {}).get("layer_bits"))
    return (run.store_scheme, run.kv_scheme, mixed)


def config_name(key: tuple, streamed: bool) -> str:
    label = ref.config_label(key[0], key[1], streamed)
    return label.replace(ref.kv_text(key[1]), "TQ-KV mixed (≤ 3 bits)") if key[2] else label


def _matching(results: ResultsDir, s: HeadlineSettings) -> dict[tuple, list[LoadedRow]]:
    """Rows at these settings, by (model, device name)."""
    cols = columns(s)
    out: dict[tuple, list[LoadedRow]] = {}
    for item in results.rows:
        r = item.row
        if r.run.synthetic or not any(c.metric == r.metric and c.settings(r) == wanted_settings(c, s) for c in cols
                                      if c.batch in (None, getattr(r, "batch_size", None))):
            continue
        out.setdefault((r.run.model, r.run.device_name), []).append(item)
    return out


def _delta(col: Column, value: float, base: float) -> str:
    if col.relative:
        return f"{value / base - 1:+.1%}" if base else "—"
    return ("{:+" + col.fmt[2:]).format(value - base)


class _Notes:
    def __init__(self) -> None:
        self.texts: list[str] = []

    def mark(self, text: str) -> str:
        if text not in self.texts:
            self.texts.append(text)
        return f"[{self.texts.index(text) + 1}]"


def _cell(col: Column, row: Any, base: Any, is_base: bool, notes: _Notes) -> Cell:
    if row is None:
        return Cell("n/a " + notes.mark("Not measured at these settings: no row of this configuration in results/ "
                                         "(the run left it out, see Provenance)."), None)
    settings = f"{col.settings(row)} · data {ref.data_id(row.data_source)}"
    value = col.value(row)
    if value is None:
        return Cell("n/a " + notes.mark(f"Measured on {row.run.device_name}: no device memory to report."),
                    settings, row)
    text = col.fmt.format(value)
    if is_base:
        return Cell(f"{text} (baseline)", settings, row)
    if base is None or col.value(base) is None:
        return Cell(text + " " + notes.mark("No BF16 row at these settings: no Δ."), settings, row)
    return Cell(f"{text} (Δ {_delta(col, value, col.value(base))})", settings, row)


def _pick(items: list[LoadedRow], col: Column, s: HeadlineSettings, data: str | None) -> LoadedRow | None:
    want = wanted_settings(col, s)
    fits = [i for i in items if i.row.metric == col.metric and col.settings(i.row) == want
            and (data is None or ref.data_id(i.row.data_source) == data)]
    return max(fits, key=lambda i: i.row.run.timestamp) if fits else None


def build_table(model: str, device: str, items: list[LoadedRow], s: HeadlineSettings) -> HeadlineTable:
    table, notes = HeadlineTable(s, model, device, columns=columns(s)), _Notes()
    keys = sorted({config_key(i.row.run) for i in items}, key=lambda k: ref.column_order(k[0], k[1], False) + k[2:])
    base_key = next((k for k in keys if ref.is_full_precision(k[0]) and k[1] == "none"), None)
    by_key = {k: [i for i in items if config_key(i.row.run) == k] for k in keys}
    for k in keys:
        table.configurations.append(config_name(k, by_key[k][0].row.run.streamed))
        cells = []
        for col in table.columns:
            base = _pick(by_key[base_key], col, s, None) if base_key else None
            # One data file per column: the baseline's (or the first row's when there is no baseline).
            data = ref.data_id(base.row.data_source) if base else None
            chosen = _pick(by_key[k], col, s, data)
            if chosen is not None and chosen not in table.used:
                table.used.append(chosen)
            cells.append(_cell(col, chosen and chosen.row, base and base.row, k == base_key, notes))
        table.cells.append(cells)
    table.footnotes = notes.texts
    if any(k[0] == "gguf" for k in keys) and re.search(r"\.(Q\d|IQ\d|F16|BF16)", model, re.IGNORECASE):
        # A reader seeing GGUF equal BF16 to the last digit should not have to guess why.
        table.footnotes.append(f"{model} is itself a GGUF file: the BF16 store holds its weights dequantized, and "
                               "the GGUF store keeps the same blocks packed, so both give the same logits; the GGUF "
                               "row shows what keeping the blocks packed costs in speed and saves in memory.")
    if any(k[0] == "gptq" for k in keys):
        table.footnotes.append("The GPTQ row's store is written by `airquant pipeline` in GPTQ's layout (4-bit, group "
                               "128, symmetric) by round-to-nearest, without GPTQ's Hessian-based rounding: it "
                               "measures the packed GPTQ/AWQ kernels, not GPTQ's calibration. A checkpoint "
                               "quantized by GPTQ itself is split as it is (`airquant shard`).")
    return table


def headline_tables(results: ResultsDir, s: HeadlineSettings) -> list[HeadlineTable]:
    return [build_table(model, device, items, s) for (model, device), items in sorted(_matching(results, s).items())]


def tolerance_lines(table: HeadlineTable) -> list[list[str]]:
    """The 70B-class criteria for each configuration of a headline table, against its BF16 row."""
    rows = {m: [next((c.row for c in cells if c.row is not None and c.row.metric == m), None)
                for cells in table.cells] for m in ("ppl", "rouge", "niah")}
    perf = [next((c.row for c, col in zip(cells, table.columns) if c.row is not None and col.title.startswith("peak")),
                 None) for cells in table.cells]
    base = next((i for i, cells in enumerate(table.cells) if any("(baseline)" in c.text for c in cells)), None)
    out = []
    for i, label in enumerate(table.configurations):
        b = (lambda m: rows[m][base]) if base is not None else (lambda m: None)  # noqa: E731
        out.append([label,
                    "baseline" if i == base else ref.check_ppl(rows["ppl"][i], b("ppl")),
                    "baseline" if i == base else ref.check_rouge(rows["rouge"][i], b("rouge")),
                    ref.check_niah(rows["niah"][i]), ref.check_vram(perf[i])])
    return out


def tolerance_table(table: HeadlineTable) -> list[str]:
    return md_table(["configuration"] + [text for _, text in ref.TOLERANCES_70B], tolerance_lines(table))


# -- sections of the report: the tables and their provenance ---------------------------------------------------------
def load_profiles(results_dir: Path) -> dict[str, dict]:
    """``profiles/<label>.json`` written by the in-process pipeline, by label (unreadable ones left out)."""
    out = {}
    for path in sorted((results_dir / PROFILES_DIR).glob("*.json")):
        try:
            out[path.stem] = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, json.JSONDecodeError) as exc:
            log.warning("report: skipping %s: %s", path, exc)
    return out


def settings_of(record: dict) -> ref.HeadlineSettings | None:
    """The headline settings a profile record names (JSON lists back to tuples)."""
    fields = {k: tuple(v) if isinstance(v, list) else v for k, v in record.get("headline", {}).items()}
    try:
        return ref.HeadlineSettings(**fields) if fields else None
    except TypeError:  # written by another version: its rows still show in the smoke run
        return None


def headline_settings(profiles: dict[str, dict]) -> list[ref.HeadlineSettings]:
    """The reference settings, then those of every other profile recorded (a test's tiny slice)."""
    out = [ref.REFERENCE]
    for record in profiles.values():
        settings = settings_of(record)
        if settings is not None and settings not in out:
            out.append(settings)
    return out


def _table_provenance(record: dict | None, table: HeadlineTable) -> list[str]:
    rows = [i.row for i in table.used]
    versions = {k: v for k, v in rows[0].run.versions.items()} if rows else {}
    data = sorted({r.data_source for r in rows})
    when = f"{min(r.run.timestamp for r in rows)} – {max(r.run.timestamp for r in rows)} (UTC)" if rows else ""
    lines = [f"- measured on **{table.device}**, {len(rows)} rows, {when}",
             "- versions: " + ", ".join(f"{k} {v}" for k, v in versions.items()),
             "- data: " + "; ".join(f"`{d}`" for d in data)]
    if record and record.get("device", table.device) == table.device:
        lines.insert(0, "- command: " + "; ".join(f"`{c['command']}`" for c in record.get("calls", [])))
    elif record:  # the profile's calls ran on another device: they did not write these rows
        lines.insert(0, f"- command: not the profile's run (that ran on {record['device']}); these rows were "
                        "written by `airquant eval` or a pipeline run on this device, each file says its settings")
    else:
        lines.insert(0, f"- command: `{FULL_COMMAND}` (no profiles/ record beside these rows)")
    return ["Provenance of this table:", ""] + lines


def headline_section(results: ResultsDir, profiles: dict[str, dict]) -> tuple[list[str], set[int]]:
    """(Markdown, ids of the rows the headline tables used)."""
    out, used = [], set()
    for settings in headline_settings(profiles):
        tables = headline_tables(results, settings)
        reference = settings == ref.REFERENCE
        title = "Headline: every configuration at the reference settings" if reference else \
            f"Headline table at the '{settings.name}' settings — NOT the reference settings"
        out += [f"## {title}", ""]
        if not tables:
            out += [f"No rows at these settings yet. `{FULL_COMMAND}` measures them (about 30 minutes on an H200 "
                    "in one process) and rebuilds this file; until then the smoke run below is all there is.", ""]
            continue
        record = next((r for r in profiles.values() if settings_of(r) == settings), None)
        for table in tables:
            used |= {id(i.row) for i in table.used}
            out += [f"### {table.model} on {table.device}", "", "Each cell: the value, then its Δ against the BF16 "
                    "row of this table. Column headings give the settings every cell of the column was measured "
                    "at.", ""] + table.markdown() + [""]
            out += ["70B-class tolerances of the original design, on these rows:", ""]
            out += tolerance_table(table) + [""] + _table_provenance(record, table) + [""]
    return out, used
