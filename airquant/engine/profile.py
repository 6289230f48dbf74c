"""The per-layer profile of a streamed pass: copy time against compute time, and what bounds it."""

from __future__ import annotations

import math


def summarize(rows: list[dict]) -> dict:
    """Totals of ``Engine.layer_profile()`` rows: copy and compute ms, link GB/s, the bound."""
    copy = sum(r["copy_ms"] for r in rows if not math.isnan(r["copy_ms"]))
    compute = sum(r["compute_ms"] for r in rows)
    nbytes = sum(r["bytes"] for r in rows)
    return {"layers": len(rows), "copy_ms": copy, "compute_ms": compute,
            "copy_gbps": nbytes / copy / 1e6 if copy else float("nan"),
            "bound": "copy" if copy >= compute else "compute"}


def profile_table(rows: list[dict], limit: int = 12) -> str:
    """A short text table: the first ``limit`` layers, then the totals."""
    if not rows:
        return "no layer profile (streamed layers on CUDA with --profile only)"
    lines = [f"{'layer':>5} {'MB':>9} {'copy ms':>9} {'compute ms':>11} {'GB/s':>7}"]
    for r in rows[:limit]:
        gbps = r["bytes"] / r["copy_ms"] / 1e6 if r["copy_ms"] else float("nan")
        lines.append(f"{r['layer']:>5} {r['bytes'] / 1e6:>9.1f} {r['copy_ms']:>9.3f} {r['compute_ms']:>11.3f} "
                     f"{gbps:>7.1f}")
    if len(rows) > limit:
        lines.append(f"  ... {len(rows) - limit} more")
    s = summarize(rows)
    lines.append(f"total: {s['layers']} layer passes, copy {s['copy_ms']:.1f} ms ({s['copy_gbps']:.1f} GB/s), "
                 f"compute {s['compute_ms']:.1f} ms: {s['bound']}-bound")
    return "\n".join(lines)
