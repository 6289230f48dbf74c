"""Every metric loop longer than a few seconds shows a bar (``airquant eval`` was silent for a minute)."""

from __future__ import annotations

import pytest

from airquant.eval import progress
from airquant.eval.kvmem import run_kv_memory
from airquant.eval.niah import run_niah
from airquant.eval.perf import run_perf
from airquant.eval.perplexity import run_perplexity


@pytest.fixture
def bars(monkeypatch):
    made = []

    class Recorder(progress.tqdm):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            made.append((kwargs["desc"], kwargs["disable"]))

    monkeypatch.setattr(progress, "tqdm", Recorder)
    return made


def test_each_metric_shows_its_progress(tiny_engine, small_text_file, bars):
    run_perplexity(tiny_engine, data=small_text_file, limit_tokens=200, max_length=64, stride=64, batch_size=2)
    run_niah(tiny_engine, data=small_text_file, context_lengths=(200,), depths=(50,), max_new_tokens=2)
    run_perf(tiny_engine, data=small_text_file, prompt_length=16, max_new_tokens=2, batch_size=1, warmup=0,
             repeats=1)
    run_kv_memory(tiny_engine, context_lengths=(32,), data=small_text_file, vram_budget_gb=None)
    assert [desc for desc, _ in bars] == ["ppl", "niah", "perf bs=1 warm-up", "perf bs=1", "kv memory"]
    # On a terminal only (tqdm's None): a notebook kernel or a pipe gets no bar text in its output.
    assert {disable for _, disable in bars} == {None}


def test_quiet_hides_every_bar(tiny_engine, small_text_file, bars, monkeypatch):
    from airquant.cli import build_parser, main

    monkeypatch.setenv("TQDM_DISABLE", "0")  # recorded, so main's "1" is undone after the test
    assert build_parser().parse_args(["-q", "report", "x"]).quiet_all
    main(["-q", "report", "/nonexistent"])  # an error, but -q is applied first
    run_perplexity(tiny_engine, data=small_text_file, limit_tokens=100, max_length=64, stride=64)
    assert bars == [("ppl", True)]


def test_the_report_shows_its_plots_progress(tmp_path, bars):
    from airquant.eval.report import build_report
    from airquant.eval.rows import write_row
    from tests.eval.test_report import SMOL, perf, run

    for batch in (1, 4):
        write_row(perf(run(SMOL, "bfloat16", device="cpu"), 3.0 * batch, None, batch=batch), tmp_path / f"p{batch}.json")
    build_report(tmp_path)
    assert ("report plots", None) in bars
