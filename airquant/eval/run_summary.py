"""The first table of a pipeline run's RESULTS.md: this run's rows, its machine, settings and time.

A user who runs ``make run`` looks for the run just made, not for the rows committed from another machine. The
report is built from every row in the results folder; this section lists only the rows the run showed, and marks
any it read back from an earlier run (``RunSummary.started``) instead of measuring it.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any, Callable, Sequence

from airquant.eval import references as ref


@dataclass(frozen=True)
class RunSummary:
    rows: tuple  # the rows the run showed, measured or read back
    started: str | None = None  # ISO 8601 UTC; rows measured before it were read back from an earlier run
    settings: str = ""  # what the run was asked, e.g. "profile quick, device auto"
    command: str = "airquant pipeline"


def headline(row: Any) -> str:
    """The row's main number, as the CLI prints it last and the notebooks and this section tabulate it."""
    m = row.metric
    if m == "ppl":
        return f"perplexity {row.ppl:.4f} over {row.n_scored} tokens"
    if m == "rouge":
        return f"ROUGE-L {row.rougeL:.4f} (ROUGE-Lsum {row.rougeLsum:.4f}) over {row.n_samples} articles"
    if m == "niah":
        return f"NiAH recall {row.recall:.2f} ({row.recall_at_longest:.2f} at {row.longest_context} tokens)"
    if m == "perf":
        return (f"decode {row.decode_tokens_per_s:.2f} tok/s at batch {row.batch_size}, TTFT {row.ttft_s:.3f} s, "
                f"MBU {row.mbu:.1%}")
    if m == "parity":
        return f"top-1 agreement {row.top1_agreement:.4f}, KL {row.kl_mean:.5f} nats, cosine {row.cosine_mean:.5f}"
    if m == "kvmem":
        return f"KV cache {row.cache_bytes[-1] / 1e6:.2f} MB at {row.context_lengths[-1]} tokens"
    return m


def _when(text: str) -> datetime:
    return datetime.fromisoformat(text)


def _machine(run: Any) -> str:
    hw = run.hardware
    device = "CPU" if run.device == "cpu" else run.device_name
    return f"{device} — {hw.get('cpu', '?')}, {hw.get('cpu_count', '?')} cores, {hw.get('ram_gb', '?')} GB RAM"


def _earlier(row: Any, started: str | None) -> bool:
    return started is not None and _when(row.run.timestamp) < _when(started)


def section(summary: RunSummary, md_table: Callable[[list, list], list[str]]) -> list[str]:
    """Markdown: "This run" with one line per row; rows read back from an earlier run marked ``*``."""
    rows: Sequence[Any] = summary.rows
    if not rows:
        return ["## This run", "", "This run showed no rows.", ""]
    now = datetime.now(timezone.utc)
    first = min((_when(r.run.timestamp) for r in rows), default=now)
    start = _when(summary.started) if summary.started else first
    minutes = (now - start).total_seconds() / 60
    run = rows[0].run
    versions = ", ".join(f"{k} {v}" for k, v in run.versions.items() if k in ("python", "torch", "transformers"))
    out = ["## This run", "",
           f"`{summary.command}`" + (f" ({summary.settings})" if summary.settings else "") + f" on {_machine(run)}; "
           f"{versions}. Started {start.isoformat(timespec='seconds')}, report built "
           f"{now.isoformat(timespec='seconds')} ({minutes:.1f} min).", ""]
    table = [[ref.config_label(r.run.store_scheme, r.run.kv_scheme, r.run.streamed), r.metric, r.batch_size,
              headline(r) + (" *" if _earlier(r, summary.started) else ""), r.run.timestamp] for r in rows]
    out += md_table(["configuration", "metric", "batch", "result", "measured (UTC)"], table)
    if any(_earlier(r, summary.started) for r in rows):
        out += ["", "\\* read back from an earlier run (its time is in the last column), not measured by this one."]
    return out + [""]
