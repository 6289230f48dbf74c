"""PNG plots for the results report: NiAH heatmaps, throughput vs batch, perplexity per scheme.

Figures are built with matplotlib's object API and the Agg canvas, so nothing touches pyplot's global
state or needs a display.
"""

from __future__ import annotations

import os
import statistics
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
    fig = Figure(figsize=(width, height), dpi=110)
    FigureCanvasAgg(fig)
    return fig


def _save(fig: Any, path: str | Path) -> Path:
    """Write the PNG beside its final name and rename, so a report never links a half-written image."""
    path = Path(path)
    fd, tmp = temp_beside(path)
    os.close(fd)
    try:
        fig.tight_layout()
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


def plot_niah_heatmap(row: Any, path: str | Path, title: str | None = None) -> Path:
    """Recall by context length (x) and needle depth (y) for one ``NiahRow``."""
    grid = niah_grid(row)
    fig = _figure(1.2 + 0.9 * len(row.context_lengths), 1.0 + 0.35 * len(row.depths))
    ax = fig.add_subplot()
    image = ax.imshow(grid, cmap="RdYlGn", vmin=0.0, vmax=1.0, aspect="auto")
    ax.set_xticks(range(len(row.context_lengths)), [_tokens_label(c) for c in row.context_lengths])
    ax.set_yticks(range(len(row.depths)), [f"{d:g}%" for d in row.depths])
    for y, line in enumerate(grid):
        for x, value in enumerate(line):
            ax.text(x, y, f"{value:.2f}", ha="center", va="center", fontsize=7)
    ax.set_xlabel("context length (tokens)")
    ax.set_ylabel("needle depth")
    ax.set_title(title or f"NiAH recall: {row.run.model} {row.run.store_scheme} kv={row.run.kv_scheme}", fontsize=9)
    fig.colorbar(image, ax=ax, label="recall")
    return _save(fig, path)


def plot_throughput_vs_batch(series: dict[str, list[tuple[int, float]]], path: str | Path,
                             title: str = "decode throughput vs batch size") -> Path:
    """One line per configuration: ``{label: [(batch_size, tokens_per_s), ...]}``."""
    fig = _figure(6.0, 4.0)
    ax = fig.add_subplot()
    for label, points in sorted(series.items()):
        points = sorted(points)
        ax.plot([b for b, _ in points], [v for _, v in points], marker="o", label=label)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("batch size")
    ax.set_ylabel("decode tokens/s")
    ax.set_title(title, fontsize=9)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7)
    return _save(fig, path)


def plot_ppl_by_scheme(bars: list[tuple[str, float, float | None]], path: str | Path,
                       title: str = "WikiText-2 perplexity by scheme") -> Path:
    """Bars of measured perplexity per configuration, with the reference figure as a marker when known."""
    fig = _figure(1.5 + 1.1 * len(bars), 4.0)
    ax = fig.add_subplot()
    xs = range(len(bars))
    rects = ax.bar(xs, [v for _, v, _ in bars], color="tab:blue", label="measured")
    ax.bar_label(rects, labels=[f"{v:.2f}" for _, v, _ in bars], fontsize=7)
    refs = [(x, r) for x, (_, _, r) in zip(xs, bars) if r is not None]
    if refs:
        ax.scatter([x for x, _ in refs], [r for _, r in refs], color="tab:red", marker="_", s=400, label="reference")
    ax.set_xticks(list(xs), [label for label, _, _ in bars], rotation=20, ha="right", fontsize=7)
    ax.set_yscale("log")
    ax.set_ylabel("perplexity (log scale)")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=7)
    return _save(fig, path)
