"""Fold the results of device chains that each started from the same committed results file into one.

A device call holds the machine for one chain; chains of one session each copy ``results/<bench>.json`` at
the start and write their own rows into that copy. Applied one after the other, the later copy would drop the
earlier one's rows. This keeps, from each run in order, only what that run changed against the base:

- row lists (``expert_aware``, ``whole_layer``): the run's new or re-measured rows, merged by case
  (``moe_bench.merge_rows``: a re-measured case replaces the older row);
- dicts (``details``, ``profiles``, ``seconds``): the sub-keys the run changed;
- anything else: the run's value.

Derived keys and targets are then recomputed from the merged rows (``moe_bench --part report``), never copied.
``--changes-only`` leaves the base's own content out: a file of the runs' rows alone (an A/B on another card than
the committed file's, kept beside it rather than mixed into it).

    python benchmarks/merge_runs.py results/moe_bench.json RUN_A.json RUN_B.json [--out results/moe_bench.json]
    python benchmarks/merge_runs.py results/moe_bench.json RUN_A.json RUN_B.json --changes-only --out AB.json
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.moe_bench import merge_rows  # noqa: E402

ROWS = ("expert_aware", "whole_layer")
META = ("device", "synthetic", "quick", "versions")  # what a file of changes alone keeps of the last run as it is


def fold(base: dict, runs: list[dict], changes_only: bool = False) -> dict:
    """``base`` with each run's changes applied in order (runs later in the list win where two changed a key);
    ``changes_only``: the changes alone, nothing of ``base`` that no run changed, and the last run's ``META``."""
    out = {k: runs[-1][k] for k in META if k in runs[-1]} if changes_only else json.loads(json.dumps(base))
    for run in runs:
        for key, value in run.items():
            old = base.get(key)
            if value == old:
                continue
            if key in ROWS and isinstance(value, list):
                before = {json.dumps(r, sort_keys=True) for r in old or []}
                out[key] = merge_rows(out.get(key, []),
                                      [r for r in value if json.dumps(r, sort_keys=True) not in before])
            elif isinstance(value, dict) and isinstance(old, dict):
                merged = out.setdefault(key, {})
                for sub, v in value.items():
                    if old.get(sub) != v:
                        merged[sub] = v
            else:
                out[key] = value
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("base", type=Path, help="the committed results file every run started from")
    p.add_argument("runs", type=Path, nargs="+", help="each run's copy of it, in the order they ran")
    p.add_argument("--out", type=Path, default=None, help="where to write (default: over the base)")
    p.add_argument("--changes-only", action="store_true",
                   help="write only what the runs changed (their rows and keys), not the base's own content")
    a = p.parse_args(argv)
    if a.changes_only and (a.out is None or a.out.resolve() == a.base.resolve()):
        p.error("--changes-only writes a file of its own: pass --out PATH other than the base")
    merged = fold(json.loads(a.base.read_text()), [json.loads(r.read_text()) for r in a.runs], a.changes_only)
    out = a.out or a.base
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp) / a.base.name
        work.write_text(json.dumps(merged, indent=2) + "\n")
        if a.base.name == "moe_bench.json":  # derived keys and targets from the merged rows
            bench = Path(__file__).with_name("moe_bench.py")
            subprocess.run([sys.executable, str(bench), "--results", tmp, "--part", "report"], check=True,
                           stdout=subprocess.DEVNULL)
        out.write_text(work.read_text())
    print(f"wrote {out} from {a.base} and {len(a.runs)} run(s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
