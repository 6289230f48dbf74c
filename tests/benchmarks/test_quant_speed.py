"""benchmarks/quant_speed.py end to end on tiny shapes (CPU): every scheme streams and is recorded."""

import json

from benchmarks.quant_speed import main


def test_quick_run_records_every_scheme_and_batch(tmp_path):
    out = tmp_path / "quant_speed.json"
    assert main(["--quick", "--workdir", str(tmp_path / "work"), "--out", str(out)]) == 0
    r = json.loads(out.read_text())
    assert r["synthetic"] and r["quick"] and r["link_pinned_gbps"] > 0
    assert list(r["schemes"]) == ["gptq", "nf4", "bfloat16"]
    for plans in r["schemes"].values():
        assert list(plans) == ["auto", "streamed"] and plans["streamed"]["vram_layers"] == 0
        for s in plans.values():
            assert s["vram_layers"] + s["ram_layers"] + s["disk_layers"] == 2
            for n in ("1", "2"):
                row = s["batches"][n]
                assert row["batch"] == int(n) and row["step_s"] > 0 and row["bytes_per_step"] > 0
    sizes = {k: s["auto"]["store_gb"] for k, s in r["schemes"].items()}
    assert sizes["gptq"] < sizes["bfloat16"] and sizes["nf4"] < sizes["bfloat16"]
    assert not (tmp_path / "work" / "llama2-7b-gptq").exists()  # stores are dropped after each scheme
