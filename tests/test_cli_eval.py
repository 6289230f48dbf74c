"""``airquant eval``, ``report``, ``env`` and ``pipeline`` from the command line, run in-process."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from airquant.cli import build_parser, main
from airquant.eval import read_rows


def test_eval_ppl_writes_the_row_and_prints_the_headline_last(tiny_store, eval_data, tmp_path, capsys):
    out = tmp_path / "ppl.json"
    argv = ["eval", "ppl", str(tiny_store), "--limit-tokens", "100", "--max-length", "64", "--stride", "32",
            "--device", "cpu", "--out", str(out)]
    assert main(argv) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    (row,) = read_rows(out)
    assert lines[0] == f"wrote {out}"
    assert lines[-1].startswith(f"perplexity {row.ppl:.4f}") and row.stride == 32 and row.n_tokens == 100


def test_eval_perf_sweep_writes_one_default_named_row_per_batch(tiny_store, eval_data, tmp_path, capsys):
    argv = ["eval", "perf", str(tiny_store), "--batch-sizes", "1,2", "--prompt-length", "8", "--max-new-tokens", "3",
            "--repeats", "1", "--device", "cpu", "--results", str(tmp_path)]
    assert main(argv) == 0
    names = sorted(p.name for p in tmp_path.glob("*.json"))
    assert [n.rsplit("__", 1)[-1] for n in names] == ["bs1.json", "bs2.json"]
    assert capsys.readouterr().out.strip().splitlines()[-1].startswith("decode ")


def test_eval_parity_against_the_resident_model_agrees(tiny_store, eval_data, tmp_path, capsys):
    out = tmp_path / "parity.json"
    argv = ["eval", "parity", str(tiny_store), "--reference-resident", "--limit-tokens", "80", "--max-length", "40",
            "--device", "cpu", "--out", str(out)]
    assert main(argv) == 0
    (row,) = read_rows(out)
    assert row.top1_agreement == 1.0 and row.cosine_min > 0.9999 and not row.reference_run.streamed
    assert capsys.readouterr().out.strip().splitlines()[-1].startswith("top-1 agreement 1.0000")


def test_eval_parity_needs_a_reference_or_a_kv_scheme(tiny_store, capsys):
    assert main(["eval", "parity", str(tiny_store), "--device", "cpu"]) == 2
    assert "needs something to compare with" in capsys.readouterr().err


def test_eval_kvmem_with_tq_and_report(tiny_store, eval_data, tmp_path, capsys):
    argv = ["eval", "kvmem", str(tiny_store), "--context-lengths", "32,128", "--kv", "tq", "--kv-window", "16",
            "--kv-block", "16", "--device", "cpu", "--results", str(tmp_path)]
    assert main(argv) == 0
    assert capsys.readouterr().out.strip().splitlines()[-1].startswith("KV cache ")
    assert main(["report", str(tmp_path), "--no-plots"]) == 0
    assert capsys.readouterr().out.strip() == f"wrote {tmp_path / 'RESULTS.md'}"
    assert "## KV cache memory" in (tmp_path / "RESULTS.md").read_text()


def test_kv_flags_map_to_kvconfig_fields():
    from airquant.cli.flags import kv_from_args

    args = build_parser().parse_args(["eval", "ppl", "s", "--kv", "tq", "--kv-bits-k", "3", "--kv-window", "64",
                                      "--kv-layer-bits", "0:4:4,2:4:3"])
    kv = kv_from_args(args)
    assert (kv.backend, kv.bits_k, kv.bits_v, kv.window, kv.layer_bits) == ("tq", 3, 2, 64, ((0, 4, 4), (2, 4, 3)))
    assert kv_from_args(build_parser().parse_args(["eval", "ppl", "s"])) is None


@pytest.mark.parametrize("argv", [["eval", "niah", "s", "--context-lengths", "0,5"],
                                  ["eval", "perf", "s", "--batch-sizes", "x"],
                                  ["eval", "ppl", "s", "--kv", "tq", "--kv-layer-bits", "0-4-4"]])
def test_bad_lists_are_rejected_by_the_parser(argv, capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(argv)
    assert "error:" in capsys.readouterr().err


def test_env_list_and_pipeline_help(capsys):
    assert main(["env", "list"]) == 0
    out = capsys.readouterr().out
    assert all(stage in out for stage in ("01-setup", "02-nf4", "03-turboquant", "04-validation"))
    args = build_parser().parse_args(["pipeline", "--quick", "--schemes", "bf16", "--store", "s"])
    assert (args.quick, args.schemes, args.store, args.model) == (True, ["bf16"], "s", "default")



def test_a_quick_pipeline_writes_to_a_results_folder_of_its_own(monkeypatch, capsys):
    """`make run` used to rebuild the committed results/RESULTS.md from committed and new rows mixed."""
    from airquant.pipeline import runner
    from airquant.pipeline.config import PipelineResult

    seen = []
    monkeypatch.setattr(runner, "run_pipeline", lambda cfg: seen.append(cfg) or PipelineResult((), None, 0.0))
    assert main(["pipeline", "--quick"]) == 0
    assert main(["pipeline", "--profile", "full"]) == 0
    assert main(["pipeline", "--quick", "--results", "elsewhere", "--reuse-earlier"]) == 0
    assert logging.getLogger("traitlets").level == logging.ERROR  # jupyter_client's zmq-context note
    assert [(c.results, c.reuse_earlier) for c in seen] == [
        ("results/local", False), ("results", False), ("elsewhere", True)]
    makefile = (Path(__file__).parents[1] / "Makefile").read_text()
    assert "RESULTS ?= results/local" in makefile
    assert "/results/local/" in (Path(__file__).parents[1] / ".gitignore").read_text().splitlines()
