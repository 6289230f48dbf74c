"""benchmarks/uva_bench.py end to end on tiny shapes (CPU, Triton's interpreter in a process of its own): every
launch of the tiered kernel it sweeps computes what the code's launch does, and the fastest is recorded."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def test_quick_sweep_records_launches_that_agree(tmp_path):
    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(REPO)}
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "uva_bench.py"), "--quick", "--results",
                           str(tmp_path), "--host-memory", "pinned,hugepages"], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = json.loads((tmp_path / "uva_bench.json").read_text())
    assert r["quick"] and {x["offset"] for x in r["read"]} == {0, 64}
    rows = r["tiered"]
    assert {(x["proj"], x["split"], x["prefetch"]) for x in rows} >= {("down", True, False), ("up", False, True)}
    for x in rows:  # bf16 outputs: a program per pair sums in another order (within a bf16 rounding)
        assert "error" not in x and x["max_rel_diff"] <= 1e-2, x
    assert set(r["tiered_best"]) == {"tiny up", "tiny down", "tiny up hugepages", "tiny down hugepages"}
    assert {x["host_memory"] for x in rows} == {"pinned", "hugepages"}


def test_an_unknown_host_memory_is_refused_by_name():
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "uva_bench.py"), "--quick", "--host-memory",
                           "pinned,huge"], cwd=REPO, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(REPO)})
    assert proc.returncode == 2 and "--host-memory: unknown huge" in proc.stderr
