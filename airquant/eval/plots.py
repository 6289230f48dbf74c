"""PNG plots for the results report: NiAH heatmaps, throughput vs batch, perplexity per scheme.

Figures are built with matplotlib's object API and the Agg canvas, so nothing touches pyplot's global
state or needs a display.
"""

from __future__ import annotations

import os
import statistics
import textwrap
from pathlib import Path
from typing import Any

from airquant.errors import DependencyError
from airquant.eval.rows import temp_beside

PIP_MATPLOTLIB = "pip install matplotlib==3.11.2"


def matplotlib_available() -> bool:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def _figure(width: float, height: float):
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as exc:
        raise DependencyError(f"plots need matplotlib: {PIP_MATPLOTLIB}") from exc
    # Constrained layout keeps titles, tick labels and the colorbar inside the canvas (tight_layout cut the
    # quick NiAH heatmap's title, wider than its one-column figure).
    fig = Figure(figsize=(width, height), dpi=110, layout="constrained")
    FigureCanvasAgg(fig)
    return fig


def _title(ax: Any, text: str, width_in: float) -> None:
    """A title wrapped to the figure's width (about 13 characters an inch at 9 pt)."""
    ax.set_title(textwrap.fill(text, max(24, int(width_in * 13))), fontsize=9)


def _wide(values: list[float], ratio: float) -> bool:
    """Whether ``values`` span more than ``ratio``: a log axis helps only then."""
    positive = [v for v in values if v > 0]
    return bool(positive) and max(positive) / min(positive) > ratio


def _save(fig: Any, path: str | Path) -> Path:
    """Write the PNG beside its final name and rename, so a report never links a half-written image."""
    path = Path(path)
    fd, tmp = temp_beside(path)
    os.close(fd)
    try:
        fig.savefig(tmp, format="png")
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def _tokens_label(n: int) -> str:
    return f"{n // 1024}K" if n % 1024 == 0 else str(n)


def niah_grid(row: Any) -> list[list[float]]:
    """Mean recall per [depth][context length] over trials."""
    grid = []
    for depth in row.depths:
        grid.append([statistics.fmean(c.recall for c in row.cells if c.depth_percent == depth
                                      and c.context_length == ctx) for ctx in row.context_lengths])
    return grid


def niah_figure(row: Any, title: str | None = None) -> Any:
    """Recall by context length (x) and needle depth (y) for one ``NiahRow``."""
    grid = niah_grid(row)
    width = max(4.2, 1.8 + 0.9 * len(row.context_lengths))
    fig = _figure(width, 1.6 + 0.35 * len(row.depths))
    ax = fig.add_subplot()
    image = ax.imshow(grid, cmap="RdYlGn", vmin=0.0, vmax=1.0, aspect="auto")
    ax.set_xticks(range(len(row.context_lengths)), [_tokens_label(c) for c in row.context_lengths])
    ax.set_yticks(range(len(row.depths)), [f"{d:g}%" for d in row.depths])
    for y, line in enumerate(grid):
        for x, value in enumerate(line):
            ax.text(x, y, f"{value:.2f}", ha="center", va="center", fontsize=7)
    ax.set_xlabel("context length (tokens)")
    ax.set_ylabel("needle depth")
    _title(ax, title or f"NiAH recall: {row.run.model} {row.run.store_scheme} kv={row.run.kv_scheme}", width)
    fig.colorbar(image, ax=ax, label="recall")
    return fig


def plot_niah_heatmap(row: Any, path: str | Path, title: str | None = None) -> Path:
    return _save(niah_figure(row, title), path)


def throughput_figure(series: dict[str, list[tuple[int, float]]], title: str = "decode throughput vs batch size",
                      note: str = "") -> Any:
    """One line per configuration: ``{label: [(batch_size, tokens_per_s), ...]}``, of one device and setting
    (``note`` names them under the axis)."""
    fig = _figure(6.0, 4.0)
    ax = fig.add_subplot()
    markers = "osD^v<>"
    for i, (label, points) in enumerate(sorted(series.items())):
        points = sorted(points)
        # Markers and dashes differ per line: equal figures (bf16 and NF4 on a CPU) stay visible.
        ax.plot([b for b, _ in points], [v for _, v in points], marker=markers[i % len(markers)],
                linestyle=("-", "--", ":", "-.")[i % 4], label=label)
    batches = [b for points in series.values() for b, _ in points]
    if _wide(batches, 4):
        ax.set_xscale("log", base=2)
    ax.set_xticks(sorted(set(batches)), [str(b) for b in sorted(set(batches))])
    ax.set_ylim(bottom=0)
    ax.set_xlabel("batch size" + (f"\n{note}" if note else ""))
    ax.set_ylabel("decode tokens/s")
    _title(ax, title, 6.0)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7)
    return fig


def plot_throughput_vs_batch(series: dict[str, list[tuple[int, float]]], path: str | Path,
                             title: str = "decode throughput vs batch size", note: str = "") -> Path:
    return _save(throughput_figure(series, title, note), path)


def ppl_figure(bars: list[tuple[str, float, float | None]], title: str = "WikiText-2 perplexity by scheme",
               note: str = "") -> Any:
    """Bars of measured perplexity per configuration (one device and setting, ``note``), with the reference
    figure as a marker when known; a log axis only when the bars span more than 10x (int2 beside bf16)."""
    width = max(4.2, 1.5 + 1.1 * len(bars))
    fig = _figure(width, 4.0)
    ax = fig.add_subplot()
    xs = range(len(bars))
    rects = ax.bar(xs, [v for _, v, _ in bars], color="tab:blue", label="measured")
    ax.bar_label(rects, labels=[f"{v:.2f}" for _, v, _ in bars], fontsize=7)
    refs = [(x, r) for x, (_, _, r) in zip(xs, bars) if r is not None]
    if refs:
        ax.scatter([x for x, _ in refs], [r for _, r in refs], color="tab:red", marker="_", s=400, label="reference")
    ax.set_xticks(list(xs), [label for label, _, _ in bars], rotation=20, ha="right", fontsize=7)
    log = _wide([v for _, v, _ in bars] + [r for _, r in refs], 10)
    if log:
        ax.set_yscale("log")
    ax.set_ylabel("perplexity" + (" (log scale)" if log else ""))
    if note:
        ax.set_xlabel(note, fontsize=7)
    _title(ax, title, width)
    ax.legend(fontsize=7)
    return fig


def plot_ppl_by_scheme(bars: list[tuple[str, float, float | None]], path: str | Path,
                       title: str = "WikiText-2 perplexity by scheme", note: str = "") -> Path:
    return _save(ppl_figure(bars, title, note), path)
