"""benchmarks/graph_host_bench.py end to end on a tiny store: every variant ran with the entries they claim
(pass and static, with and without the carried input: no island; island: one; pass: the pass graph replayed every
measured step, the others never) and the figures are recorded."""

import json

from benchmarks import graph_host_bench


def test_quick_run_records_every_variant(tmp_path):
    graph_host_bench.main(["--layers", "2", "--steps", "3", "--rounds", "1", "--results", str(tmp_path)])
    r = json.loads((tmp_path / "graph_host_bench.json").read_text())
    assert r["layers"] == 2 and set(r["step_ms"]) == {"pass", "static", "island", "static_no_carry", "tq_pass", "tq_static",
                                                       "tq_island"}
    assert all(v > 0 for v in r["step_ms"].values()) and "island_extra_us_per_layer" in r
    assert "carry_saves_us_per_layer" in r and "pass_saves_us_per_layer" in r
    assert "tq_island_extra_us_per_layer_call" in r and "tq_pass_saves_us_per_layer_call" in r
