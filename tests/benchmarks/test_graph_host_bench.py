"""benchmarks/graph_host_bench.py end to end on a tiny store: both variants ran with the entries they claim
(static: no island; island: one) and the figures are recorded."""

import json

from benchmarks import graph_host_bench


def test_quick_run_records_both_variants(tmp_path):
    graph_host_bench.main(["--layers", "2", "--steps", "3", "--rounds", "1", "--results", str(tmp_path)])
    r = json.loads((tmp_path / "graph_host_bench.json").read_text())
    assert r["layers"] == 2 and set(r["step_ms"]) == {"static", "island"}
    assert all(v > 0 for v in r["step_ms"].values()) and "island_extra_us_per_layer" in r
