"""``results/RESULTS.md`` from the row JSON files: one headline table at the reference settings first.

Order: the headline table (``eval/headline.py``: configurations × metrics at the reference settings,
each cell with its Δ against BF16) and its provenance, the 70B-class tolerances on those rows, the
speed benchmarks of the synthetic shapes (``benchmarks/*.py`` JSON), parity, NiAH heatmaps, KV
memory, then the smoke run (the quick profile, and any other settings) in the per-model layout, and
where every number came from. A table never mixes settings: rows at other settings go to the smoke run.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from datetime import datetime, timezone
from functools import partial
from pathlib import Path
from typing import Any, Callable

from airquant.errors import ResultsFileError
from airquant.eval import headline, kvmem, plots, run_summary
from airquant.eval import references as ref
from airquant.eval.benchtables import RENDERERS
from airquant.eval.progress import steps
from airquant.eval.results import LoadedRow, ResultsDir, best_row, load_results, md_table, render_json
from airquant.eval.rows import slug, write_text_atomic

log = logging.getLogger(__name__)

REPORT_NAME = "RESULTS.md"
MBU_NOTE = ("MBU n/a: rows measured before resident plans counted their device-memory reads recorded no bytes "
            "moved per decode step, so bandwidth use cannot be computed from them.")
_TABLE_METRICS = ("ppl", "rouge", "niah", "perf")
_QUALITY = ("ppl", "rouge", "niah")


@dataclass(frozen=True)
class Column:
    store_scheme: str
    kv_scheme: str
    synthetic: bool
    device: str = "cpu"  # "cpu" / "cuda": a GPU run gets columns of its own beside the CPU's
    rows: dict[str, list[LoadedRow]] = field(default_factory=dict)

    def best(self, metric: str) -> Any:
        chosen = best_row(self.rows.get(metric, []))
        return chosen.row if chosen else None

    @property
    def _any_row(self) -> Any:
        return self.best("perf") or next(r.row for rs in self.rows.values() for r in rs)

    @property
    def label(self) -> str:
        text = ref.config_label(self.store_scheme, self.kv_scheme, self._any_row.run.streamed)
        return text + (" †" if self.synthetic else "")

    @property
    def device_label(self) -> str:
        """The label with the device, for models measured on more than one device type."""
        return f"{self.label} · {'CPU' if self.device == 'cpu' else self._any_row.run.device_name}"


def headings(columns: list[Column]) -> dict[int, str]:
    """Column headings by ``id(column)``: labels, with the device when a model has CPU and GPU runs."""
    several = len({c.device for c in columns}) > 1
    return {id(c): c.device_label if several else c.label for c in columns}


def model_columns(results: ResultsDir) -> dict[str, list[Column]]:
    """Columns per model: rows with the same store and KV scheme on the same device type (any dtype)."""
    models: dict[str, dict[tuple, Column]] = {}
    for loaded in results.rows:
        run = loaded.row.run
        if loaded.row.metric not in _TABLE_METRICS:
            continue
        key = (run.store_scheme, run.kv_scheme, run.synthetic, run.device)
        column = models.setdefault(run.model, {}).setdefault(key, Column(*key))
        column.rows.setdefault(loaded.row.metric, []).append(loaded)
    return {m: sorted(cols.values(), key=lambda c: (c.device != "cpu", c.device,
                                                    ref.column_order(c.store_scheme, c.kv_scheme, c.synthetic)))
            for m, cols in sorted(models.items())}


def baseline(columns: list[Column], device: str | None = None) -> Column | None:
    """The full-precision, uncompressed-KV column the tolerances are checked against (on ``device``
    when it has one: a GPU column is checked against the GPU's own full-precision run)."""
    for dev in ([device] if device else []) + [None]:
        for synthetic in (False, True):
            for precision in ref.FULL_PRECISION:
                for c in columns:
                    if (c.store_scheme, c.kv_scheme, c.synthetic) == (precision, "none", synthetic) and \
                            (dev is None or c.device == dev):
                        return c
    return None


def _mbu(row: Any) -> str:
    return "n/a ‡" if not row.bytes_per_decode_step else f"{row.mbu:.1%}"


def _ppl_cell(row: Any, base: Any) -> str:
    return f"{row.ppl:.2f}" + ("" if base is None or ref.same_ppl_setup(row, base) else " ¹")


def _headline_lines(columns: list[Column]) -> list[list[str]]:
    fmt = {
        "PPL WikiText-2": ("ppl", None),  # marked against its device's baseline column
        "Decode throughput (tok/s)": ("perf", lambda r: f"{r.decode_tokens_per_s:.2f} (bs {r.batch_size})"),
        "ROUGE-L": ("rouge", lambda r: f"{r.rougeL:.4f}"),
        "NiAH recall @ longest context": ("niah", lambda r: f"{r.recall_at_longest:.2f} @ {r.longest_context}"),
        "Peak VRAM allocated (GB)": ("perf", lambda r: "n/a (CPU)" if r.peak_vram_allocated_gb is None
                                     else f"{r.peak_vram_allocated_gb:.2f}"),
        "ROUGE-Lsum": ("rouge", lambda r: f"{r.rougeLsum:.4f}"),
        "TTFT (s)": ("perf", lambda r: f"{r.ttft_s:.3f}"),
        "Prefill (tok/s)": ("perf", lambda r: f"{r.prefill_tokens_per_s:.1f}"),
        "Peak VRAM reserved (GB)": ("perf", lambda r: "n/a (CPU)" if r.peak_vram_reserved_gb is None
                                    else f"{r.peak_vram_reserved_gb:.2f}"),
        "Host RAM peak (GB)": ("perf", lambda r: f"{r.host_rss_peak_gb:.2f}"),
        "MBU": ("perf", lambda r: _mbu(r) + f" of {r.bandwidth.gb_per_s:.1f} GB/s {r.bandwidth.kind}"),
    }
    lines = []
    for name, (metric, render) in fmt.items():
        if not any(c.best(metric) for c in columns):
            continue
        cells = []
        for c in columns:
            row = c.best(metric)
            if render is None and row:
                base = baseline(columns, c.device)
                cells.append(_ppl_cell(row, base.best("ppl") if base else None))
                continue
            cells.append("n/a (synthetic)" if c.synthetic and metric in _QUALITY else render(row) if row else "—")
        lines.append([name] + cells)
    return lines


def _tolerance_lines(columns: list[Column]) -> list[list[str]]:
    lines = []
    for key, text in ref.TOLERANCES_70B:
        cells = []
        for c in columns:
            base = baseline(columns, c.device)
            if c.synthetic and key in _QUALITY:
                cells.append("n/a (synthetic)")
            elif key == "ppl":
                cells.append("baseline" if c is base else ref.check_ppl(c.best("ppl"), base and base.best("ppl")))
            elif key == "rouge":
                cells.append("baseline" if c is base else ref.check_rouge(c.best("rouge"), base and base.best("rouge")))
            elif key == "niah":
                cells.append(ref.check_niah(c.best("niah")))
            else:
                cells.append(ref.check_vram(c.best("perf")))
        lines.append([text] + cells)
    return lines


def _reference_section(model: str, columns: list[Column]) -> list[str]:
    figures = ref.reference_figures(model)
    if not figures:
        return []
    lines = []
    for fig in figures:
        matching = [c for s in fig.store for c in columns if c.store_scheme == s and not c.synthetic
                    and ref.figure_matches(fig, c.store_scheme, c.kv_scheme) and c.best("ppl")]
        if not matching:
            lines.append([fig.label, f"{fig.ppl:.2f} ({fig.note})", "not measured", "—", "—"])
            continue
        row = matching[0].best("ppl")
        setting = f"{row.n_tokens} tokens, window {row.max_length}, stride {row.stride}, {row.run.dtype}"
        differs = ref.differs_from_reference(row)
        if differs:
            setting += f" (differs from the reference's settings: {', '.join(differs)})"
        lines.append([fig.label, f"{fig.ppl:.2f} ({fig.note})", f"{row.ppl:.2f}", f"{row.ppl / fig.ppl - 1:+.1%}",
                      setting])
    settings = ", ".join(f"{k}={v}" for k, v in ref.REFERENCE_SETTINGS.items())
    return ["", f"Reference figures for this model (wikitext2_test.raw, sha256 {ref.REFERENCE_DATA_SHA}…, "
            f"{settings}). A 135M model is far more "
            "sensitive to compression than a 70B one: judge it by these, not by the 70B-class tolerances.", ""] + \
        md_table(["configuration", "reference PPL", "measured PPL", "Δ vs reference", "measured with"], lines)


def _model_section(model: str, columns: list[Column], plot_links: dict) -> list[str]:
    names = headings(columns)
    labels = [names[id(c)] for c in columns]
    headline = _headline_lines(columns)
    out = [f"### {model}", ""] + md_table(["metric"] + labels, headline)
    notes = []
    if any(c.synthetic for c in columns):
        notes.append("† synthetic: random weights of the real shapes; speed and memory only.")
    if any("¹" in x for line in headline for x in line):
        notes.append("¹ perplexity measured with other text, tokens, window or stride than the baseline column.")
    if any("‡" in x for line in headline for x in line):
        notes.append("‡ " + MBU_NOTE)
    out += [""] + notes if notes else []
    bases = list(dict.fromkeys(names[id(b)] for b in (baseline(columns, c.device) for c in columns) if b is not None))
    base_text = " / ".join(f"**{b}**" for b in bases) or "no full-precision column: relative checks show —"
    per = " (each device's columns against its own)" if len(bases) > 1 else ""
    out += ["", f"70B-class tolerances of the original design, checked against {base_text}{per}:", ""]
    out += md_table(["tolerance"] + labels, _tolerance_lines(columns))
    out += _reference_section(model, columns)
    for key, title in (("ppl", "Perplexity per scheme"), ("throughput", "Throughput vs batch size")):
        out += [line for path in plot_links.get((model, key), []) for line in ("", f"![{title}]({path.name})")]
    return out + [""]


# -- sections after the per-model tables ------------------------------------------------------------
def _label(run: Any) -> str:
    return ref.config_label(run.store_scheme, run.kv_scheme, run.streamed) + (" †" if run.synthetic else "")


def _parity_section(results: ResultsDir) -> list[str]:
    rows = [r.row for r in results.of("parity")]
    if not rows:
        return []
    table = [[r.run.model, _label(r.run), _label(r.reference_run), f"{r.cosine_mean:.5f}", f"{r.cosine_min:.4f}",
              f"{r.top1_agreement:.4f}", f"{r.kl_mean:.5f}", f"{r.kl_max:.4f}", r.n_positions] for r in rows]
    return ["## Logit parity", "", "Next-token logits against a reference engine on WikiText-2 test windows; "
            "KL(reference ‖ test) in nats.", ""] + \
        md_table(["model", "configuration", "reference", "cosine mean", "cosine min", "top-1 agreement", "KL mean",
                  "KL max", "positions"], table) + [""]


def _perf_section(results: ResultsDir) -> list[str]:
    rows = sorted((r.row for r in results.of("perf")), key=lambda r: (r.run.model, _label(r.run), r.batch_size))
    if not rows:
        return []
    table = [[r.run.model, _label(r.run), r.run.device_name, r.batch_size, r.prompt_length, r.max_new_tokens,
              f"{r.ttft_s:.3f}", f"{r.prefill_tokens_per_s:.1f}", f"{r.decode_tokens_per_s:.2f}",
              f"{_mbu(r)} ({r.bandwidth.kind} {r.bandwidth.gb_per_s:.1f} GB/s)",
              "—" if r.peak_vram_allocated_gb is None else f"{r.peak_vram_allocated_gb:.2f} / "
                                                            f"{r.peak_vram_reserved_gb or 0:.2f}",
              f"{r.host_rss_peak_gb:.2f}"] for r in rows]
    note = ["", "‡ " + MBU_NOTE] if any(not r.bytes_per_decode_step for r in rows) else []
    return ["## Performance detail", "", "Medians over the repeats, warm-up excluded. MBU: bytes moved per decode "
            "step / step time / the bandwidth measured in the same run.", ""] + \
        md_table(["model", "configuration", "device", "batch", "prompt", "new", "TTFT s", "prefill tok/s",
                  "decode tok/s", "MBU", "VRAM alloc / reserved GB", "host RAM GB"], table) + note + [""]


def _niah_section(results: ResultsDir, plot_links: dict) -> list[str]:
    loaded = results.of("niah")
    if not loaded:
        return []
    out = ["## Needle in a haystack", ""]
    for item in loaded:
        r = item.row
        recall = [f"{ref.niah_recall_at(r, c):.2f}" for c in r.context_lengths]
        out += [f"**{r.run.model}, {_label(r.run)}** ({item.path.name}): recall {r.recall:.2f} overall, "
                f"{r.recall_at_longest:.2f} at {r.longest_context} tokens", ""]
        out += md_table(["context"] + [str(c) for c in r.context_lengths], [["recall"] + recall])
        if id(r) in plot_links:
            out += ["", f"![NiAH heatmap]({plot_links[id(r)].name})"]
        out.append("")
    return out


def _extras_section(results: ResultsDir) -> list[str]:
    if not results.extras:
        return []

    known = [(p, d) for p, d in results.extras if p.name in RENDERERS and isinstance(d, dict)]
    other = [(p, d) for p, d in results.extras if (p, d) not in known]
    out = []
    if known:
        out += ["## Speed benchmarks: synthetic 8B / 70B and MoE shapes, and the benchmark scripts", "",
                "Headline figures of the benchmark scripts; every figure, with per-step timings, settings, device "
                "and versions, is in the JSON file named under each title.", ""]
        for path, data in sorted(known, key=lambda pd: list(RENDERERS).index(pd[0].name)):
            title, render = RENDERERS[path.name]
            out += [f"### {title}", "", f"`{path.name}`", ""] + render(data) + [""]
    if other:
        out += ["## Other benchmark results", "", "JSON written by other benchmarks, shown as found.", ""]
        for path, data in other:
            out += [f"### {path.name}", ""] + render_json(data) + [""]
    return out


def _provenance_section(results: ResultsDir) -> list[str]:
    table = []
    for item in sorted(results.rows, key=lambda r: (r.path.name, r.row.metric)):
        run, v = item.row.run, item.row.run.versions
        table.append([item.path.name, item.row.metric, run.model, _label(run), run.device_name, run.dtype,
                      item.row.batch_size, "yes" if run.synthetic else "no", v.get("torch"), v.get("transformers"),
                      v.get("airquant"), v.get("bitsandbytes"), run.timestamp])
    out = ["## Provenance", ""] + md_table(["file", "metric", "model", "configuration", "device", "dtype", "batch",
                                            "synthetic", "torch", "transformers", "airquant", "bitsandbytes",
                                            "measured (UTC)"], table)
    if results.skipped:
        out += ["", "Files left out:", ""] + [f"- `{p.name}`: {why}" for p, why in results.skipped]
    return out + [""]


# -- plots and assembly -----------------------------------------------------------------------------
def _device_name(row: Any) -> str:
    return "CPU" if row.run.device == "cpu" else row.run.device_name


def _throughput_figures(columns: list[Column]) -> dict[tuple[str, str], dict[str, list[tuple[int, float]]]]:
    """``{(device, setting): {column: [(batch, tok/s)]}}``: one figure per device and prompt size (a CPU's
    lines lay flat at 0 beside an H200's, and 32- and 512-token prompts shared an axis)."""
    figures: dict[tuple[str, str], dict] = {}
    for c in columns:
        latest: dict[tuple[str, str], dict[int, Any]] = {}
        for item in sorted(c.rows.get("perf", []), key=lambda r: r.row.run.timestamp):
            r = item.row
            key = (_device_name(r), f"prompt {r.prompt_length} tokens, {r.max_new_tokens} new")
            latest.setdefault(key, {})[r.batch_size] = r
        for key, by_batch in latest.items():
            if len(by_batch) >= 2:
                figures.setdefault(key, {})[c.label] = sorted((b, r.decode_tokens_per_s) for b, r in by_batch.items())
    return figures


def _ppl_figures(model: str, columns: list[Column]) -> dict[tuple[str, str], list[tuple[str, float, float | None]]]:
    """``{(device, setting): [(column, ppl, reference ppl)]}``: one figure per device and perplexity setting;
    the reference marker only on bars measured at the reference's own settings."""
    figures: dict[tuple[str, str], list] = {}
    for c in columns:
        if c.synthetic:
            continue
        latest: dict[tuple[str, str], Any] = {}
        for item in sorted(c.rows.get("ppl", []), key=lambda r: r.row.run.timestamp):
            r = item.row
            latest[(_device_name(r), f"{r.n_tokens} tokens, window {r.max_length}, stride {r.stride}")] = r
        for key, row in latest.items():
            known = [f.ppl for f in ref.reference_figures(model) if ref.figure_matches(f, c.store_scheme, c.kv_scheme)]
            mark = known[0] if known and not ref.differs_from_reference(row) else None
            figures.setdefault(key, []).append((c.label, row.ppl, mark))
    return figures


def _figure_name(kind: str, model: str, device: str, setting: str) -> str:
    return f"{kind}__{slug(model)}__{slug(device)}__{slug(setting.replace(' tokens', 't'))}.png"


def _make_plots(results: ResultsDir, by_model: dict[str, list[Column]], out_dir: Path,
                make_plots: bool | None) -> tuple[dict, list[str]]:
    """PNG files beside the report, keyed for linking; with ``make_plots=None`` a missing matplotlib is a note."""
    if make_plots is False:
        return {}, []
    if make_plots is None and not plots.matplotlib_available():
        return {}, [f"Plots were skipped: matplotlib is not installed ({plots.PIP_MATPLOTLIB})."]
    jobs: list[tuple[Any, Callable[[], Path]]] = []  # (link key, draw): drawn under one progress bar
    for model, columns in by_model.items():
        for (device, setting), bars in _ppl_figures(model, columns).items():
            path = out_dir / _figure_name("ppl", model, device, setting)
            jobs.append(((model, "ppl"), partial(plots.plot_ppl_by_scheme, bars, path, note=setting,
                                                 title=f"WikiText-2 perplexity: {model} on {device}")))
        for (device, setting), series in _throughput_figures(columns).items():
            path = out_dir / _figure_name("throughput_vs_batch", model, device, setting)
            jobs.append(((model, "throughput"), partial(plots.plot_throughput_vs_batch, series, path, note=setting,
                                                        title=f"Decode throughput: {model} on {device}")))
    niah = results.of("niah")
    for item in niah:
        same_file = [x for x in niah if x.path == item.path]
        suffix = f"_{same_file.index(item)}" if len(same_file) > 1 else ""
        jobs.append((id(item.row), partial(plots.plot_niah_heatmap, item.row,
                                           out_dir / f"heatmap__{item.path.stem}{suffix}.png")))
    links: dict = {}
    for key, draw in steps(jobs, "report plots", "plot"):
        if isinstance(key, tuple):
            links.setdefault(key, []).append(draw())
        else:
            links[key] = draw()
    return links, []


def _shown(folder: Path) -> str:
    """The folder as a user would type it: relative to the working directory when inside it (``results/local``,
    where the report said ``local``)."""
    try:
        return str(folder.resolve().relative_to(Path.cwd().resolve()))
    except ValueError:
        return str(folder)


def build_report(results_dir: str | Path = "results", *, make_plots: bool | None = None,
                 this_run: run_summary.RunSummary | None = None) -> Path:
    """Assemble ``results_dir/RESULTS.md`` (and PNG plots beside it) from every JSON file there.

    ``make_plots``: None plots when matplotlib is installed, True requires it, False skips plots.
    ``this_run``: a pipeline run's rows, tabulated first ("This run") before everything the folder holds.
    """
    results_dir = Path(results_dir)
    if not results_dir.is_dir():
        raise ResultsFileError(f"{results_dir}: no such folder; write rows there first with "
                               f"`airquant eval ... --out {results_dir}/NAME.json`.")
    results = load_results(results_dir)
    top, used = headline.headline_section(results, headline.load_profiles(results_dir))
    smoke = ResultsDir(tuple(r for r in results.rows if id(r.row) not in used), results.extras, results.skipped)
    by_model = model_columns(smoke)
    links, notes = _make_plots(results, by_model, results_dir, make_plots)
    built = datetime.now(timezone.utc).isoformat(timespec="seconds")
    files = len({r.path for r in results.rows})
    lines = ["# AirQuant results", "", f"Built {built} by `airquant report {_shown(results_dir)}` "
             f"(`{headline.FULL_COMMAND}` measures the headline rows and rebuilds it) from {len(results.rows)} rows in "
             f"{files} files. Each number comes from one `airquant.eval` function; every table names its "
             "command, device, package versions and data (sha256).", ""]
    lines += ["No result rows were found.", ""] if not results.rows else []
    lines += run_summary.section(this_run, md_table) if this_run is not None else []
    lines += top + _extras_section(results)
    lines += _parity_section(results) + _niah_section(results, links)
    lines += kvmem.markdown_section([r.row for r in results.of("kvmem")], md_table)
    if by_model:
        lines += ["## Smoke run and other settings", "", "Rows measured at other settings than the headline table: "
                  "the quick profile (`airquant pipeline --profile quick`, a CPU in minutes: a check that "
                  "everything runs, not a figure to quote; files `*__quick.json`) and earlier GPU runs at the "
                  "settings their rows record (`*__cuda__short.json`: `python benchmarks/suite_rows.py --device cuda "
                  "--sizes ...`, the sizes in its docstring). Devices, versions and data per file: Provenance.", ""]
        for model, columns in by_model.items():
            lines += _model_section(model, columns, links)
        lines += _perf_section(smoke)
    lines += _provenance_section(results) + notes
    return write_text_atomic("\n".join(lines).rstrip() + "\n", results_dir / REPORT_NAME)
