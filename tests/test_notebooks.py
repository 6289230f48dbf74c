"""The staged notebooks: thin (no logic), parameterized, and executed end to end on a tiny model.

The pipeline test runs notebooks 01-03, then 04 alone, with papermill on this interpreter's kernel,
on a random 3-layer Llama with minimal sizes, and asserts on the rows and the report they leave.
"""

from __future__ import annotations

import ast
import json
import math
import os
from pathlib import Path

import pytest

from airquant.errors import PipelineError

NOTEBOOK_DIR = Path(__file__).resolve().parents[1] / "notebooks"
NOTEBOOKS = sorted(NOTEBOOK_DIR.glob("*.ipynb"))
# Every metric in a few seconds on the tiny model (context 256).
TINY_SIZES = {"gen_new_tokens": 4, "batch": 2, "ppl_tokens": 130, "ppl_max_length": 64, "ppl_stride": 64,
              "parity_tokens": 64, "rouge_samples": 1, "rouge_new_tokens": 4, "rouge_max_length": 256,
              "niah_contexts": [160], "niah_depths": [50.0], "niah_new_tokens": 4, "perf_prompt": 8,
              "perf_new_tokens": 3, "perf_batches": [1, 2], "kv_contexts": [64, 192], "kv_window": 16}


def code_cells(path: Path) -> list[dict]:
    return [c for c in json.loads(path.read_text(encoding="utf-8"))["cells"] if c["cell_type"] == "code"]


def source(cell: dict) -> str:
    return "".join(cell["source"]) if isinstance(cell["source"], list) else cell["source"]


def test_the_four_stages_are_there():
    from airquant.pipeline.runner import NOTEBOOKS as BY_STAGE

    assert [p.name for p in NOTEBOOKS] == sorted(BY_STAGE.values())


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_code_holds_no_logic(path):
    for i, cell in enumerate(code_cells(path)):
        tree = ast.parse(source(cell))
        found = [type(n).__name__ for n in ast.walk(tree)
                 if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda))]
        assert not found, f"{path.name} code cell {i} defines {found}: move that logic into airquant/"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_starts_with_parameters_then_setup(path):
    cells = code_cells(path)
    assert cells[0]["metadata"].get("tags") == ["parameters"]
    assert not any("parameters" in c["metadata"].get("tags", []) for c in cells[1:])
    params = {t.id: ast.literal_eval(node.value) for node in ast.parse(source(cells[0])).body
              for t in node.targets}
    assert params["model"] == "default" and params["device"] == "auto" and params["profile"] == "quick"
    assert params["store"] is None and params["results_dir"] == "results" and params["sizes"] == {}
    setup = source(cells[1])
    stage = ast.literal_eval(next(n.value for n in ast.parse(setup).body
                                  if isinstance(n, ast.Assign) and n.targets[0].id == "STAGE"))
    from airquant.pipeline.runner import NOTEBOOKS as BY_STAGE

    assert BY_STAGE[stage] == path.name
    for needed in ('environments/{STAGE}.txt', "drive.mount", "AIRQUANT_STORE", "requirements-models.txt"):
        assert needed in setup


@pytest.fixture(scope="module")
def pipeline_run(tmp_path_factory, tiny_llama, eval_data):
    """Stages 01-03, then 04 alone, asked to read back the earlier call's rows (so their reuse can be seen)."""
    from airquant.pipeline.runner import PipelineConfig, run_pipeline

    work = tmp_path_factory.mktemp("pipeline")
    cfg = PipelineConfig(model=str(tiny_llama), store=str(work / "store"), results=str(work / "results"),
                         device="cpu", kernels="current", sizes=TINY_SIZES, schemes=("bf16",),
                         stages=("01-setup", "02-nf4", "03-turboquant"))
    first = run_pipeline(cfg)
    before = {p.name: p.stat().st_mtime_ns for p in (work / "results").glob("*.json")}
    second = run_pipeline(PipelineConfig(**{**cfg.__dict__, "stages": ("04-validation",), "reuse_earlier": True}))
    return work, first, second, before


def _finite(value) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value)


def test_pipeline_writes_rows_report_and_executed_notebooks(pipeline_run):
    from airquant.eval import read_rows

    work, first, second, before = pipeline_run
    results = work / "results"
    assert [r.stage for r in first.stages + second.stages] == ["01-setup", "02-nf4", "03-turboquant", "04-validation"]
    assert sorted(p.name for p in (results / "notebooks").glob("*.ipynb")) == [p.name for p in NOTEBOOKS]
    rows = {p.name: row for p in results.glob("*.json") for row in read_rows(p)}
    metrics = {r.metric for r in rows.values()}
    assert metrics == {"ppl", "rouge", "niah", "perf", "parity", "kvmem"}
    assert all(name.endswith("__quick.json") for name in rows)
    for r in rows.values():
        assert r.run.device == "cpu" and r.run.store_scheme == "bfloat16"
        if r.metric == "ppl":
            assert _finite(r.ppl) and r.ppl > 1 and r.n_tokens == 130
        elif r.metric == "rouge":
            assert 0 <= r.rougeL <= 1 and r.n_samples == 1
        elif r.metric == "niah":
            assert 0 <= r.recall <= 1 and r.context_lengths == (160,)
        elif r.metric == "perf":
            assert _finite(r.decode_tokens_per_s) and r.decode_tokens_per_s > 0 and r.batch_size in (1, 2)
        elif r.metric == "parity":
            assert 0 <= r.top1_agreement <= 1 and _finite(r.kl_mean) and r.cosine_mean > 0.5
        else:
            assert all(b > 0 for b in r.cache_bytes) and r.context_lengths == (64, 192)
    kv = {r.run.kv_scheme: r for r in rows.values() if r.metric == "kvmem"}
    assert kv["tq-k4v2"].cache_bytes[-1] < kv["none"].cache_bytes[-1]
    model = next(iter(rows.values())).run.model
    report = (results / "RESULTS.md").read_text()
    assert second.report == results / "RESULTS.md"
    assert f"## {model}" in report and "## KV cache memory" in report and "## Logit parity" in report
    for plot in ("ppl__*.png", "throughput_vs_batch__*.png", "heatmap__*.png"):
        assert list(results.glob(plot)), f"no {plot} beside RESULTS.md"


def test_stage_04_reuses_rows_of_earlier_stages(pipeline_run):
    work, _, _, before = pipeline_run
    ppl = [name for name in before if name.startswith("ppl__")]
    assert ppl, "stages 02/03 wrote perplexity rows"
    for name in ppl:
        assert (work / "results" / name).stat().st_mtime_ns == before[name], f"{name} was measured again"


def test_the_report_opens_with_this_run_and_marks_rows_read_back(pipeline_run):
    work, *_ = pipeline_run
    report = (work / "results" / "RESULTS.md").read_text()
    first = report.split("\n## ", 2)[1]
    assert first.startswith("This run\n") and "profile quick, device cpu" in first and " cores, " in first
    perplexity = [line for line in first.splitlines() if "| ppl |" in line]
    assert perplexity and all(line.count(" * |") == 1 for line in perplexity), "rows of the earlier call are marked"
    assert "read back from an earlier run" in first


def test_failing_notebook_names_the_cell_and_keeps_the_old_report(tmp_path):
    import nbformat
    from nbformat.v4 import new_code_cell, new_notebook

    from airquant.pipeline.runner import NOTEBOOKS as BY_STAGE
    from airquant.pipeline.runner import PipelineConfig, run_pipeline

    params = new_code_cell('model = "default"')
    params.metadata["tags"] = ["parameters"]
    nb = new_notebook(cells=[params, new_code_cell("x = 1"), new_code_cell('raise ValueError("boom in stage one")')])
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    (tmp_path / "nb").mkdir()
    nbformat.write(nb, tmp_path / "nb" / BY_STAGE["01-setup"])
    results = tmp_path / "results"
    results.mkdir()
    (results / "RESULTS.md").write_text("the previous report\n")
    cfg = PipelineConfig(store=str(tmp_path / "store"), results=str(results), kernels="current",
                         notebooks=str(tmp_path / "nb"), stages=("01-setup", "02-nf4"))
    with pytest.raises(PipelineError) as err:
        run_pipeline(cfg)
    message = str(err.value)
    assert "01_setup_and_sharding.ipynb" in message and "cell" in message and "boom in stage one" in message
    assert "raise ValueError" in message
    assert (results / "RESULTS.md").read_text() == "the previous report\n"
    assert (results / "notebooks" / BY_STAGE["01-setup"]).is_file()
    assert not (results / "notebooks" / BY_STAGE["02-nf4"]).exists()


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_setup_cell_on_colab_mounts_drive_clones_and_installs_its_stage(path, monkeypatch):
    """The setup cell run as on Colab (a stand-in ``google.colab``; commands recorded, not run)."""
    import os
    import subprocess
    import sys
    import types

    cells = code_cells(path)
    mounted, commands, moved_to = [], [], []
    colab = types.ModuleType("google.colab")
    colab.drive = types.SimpleNamespace(mount=mounted.append)
    monkeypatch.setitem(sys.modules, "google", types.ModuleType("google"))
    monkeypatch.setitem(sys.modules, "google.colab", colab)
    monkeypatch.setattr(subprocess, "run", lambda cmd, check: commands.append(cmd))
    monkeypatch.setattr(os, "chdir", moved_to.append)
    monkeypatch.setattr(sys, "path", list(sys.path))
    real_isdir = os.path.isdir
    monkeypatch.setattr(os.path, "isdir", lambda p: False if str(p).startswith("/content") else real_isdir(p))

    ns: dict = {}
    exec(source(cells[0]), ns)
    with pytest.raises(RuntimeError, match="set repo_url"):  # no repository on the Colab machine, no URL
        exec(source(cells[1]), dict(ns))
    ns["repo_url"] = "https://example.org/airquant.git"
    commands.clear()
    exec(source(cells[1]), ns)
    stage = ns["STAGE"]
    assert mounted[-1] == "/content/drive" and moved_to == ["/content/airquant"]
    assert commands[0] == ["git", "clone", "--depth", "1", "https://example.org/airquant.git", "/content/airquant"]
    assert commands[1][-2:] == ["-r", f"/content/airquant/environments/{stage}.txt"]
    assert "/content/airquant/requirements-models.txt" in commands[2] and commands[2][-2:] == ["-e", "/content/airquant"]
    assert (Path(__file__).parents[1] / "environments" / f"{stage}.txt").is_file()
    assert ns["store"] == "/content/drive/MyDrive/airquant/store"  # stages exchange shards through Drive
    assert ns["results_dir"] == "/content/drive/MyDrive/airquant/results"


@pytest.mark.skipif(os.name != "posix", reason="unix sockets")
def test_the_current_kernel_talks_over_unix_sockets(tmp_path):
    """Over TCP ipykernel warned on every stage's start that its traffic was not encrypted (make run's output)."""
    from airquant.pipeline.runner import current_kernel_manager

    assert current_kernel_manager(tmp_path).transport == "ipc"


def test_each_stage_kernel_is_shut_down_after_its_notebook(tmp_path, monkeypatch):
    """Kernels lived until the pipeline exited (4 of them in make run), then printed "Parent appears to have exited"."""
    import nbformat
    from nbformat.v4 import new_code_cell, new_notebook

    from airquant.pipeline import runner

    managers = []
    make = runner.current_kernel_manager
    monkeypatch.setattr(runner, "current_kernel_manager", lambda d: managers.append(make(d)) or managers[-1])
    params = new_code_cell('model = "default"')
    params.metadata["tags"] = ["parameters"]
    nb = new_notebook(cells=[params, new_code_cell("x = 1")])
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    (tmp_path / "nb").mkdir()
    nbformat.write(nb, tmp_path / "nb" / runner.NOTEBOOKS["01-setup"])
    runner.run_pipeline(runner.PipelineConfig(store=str(tmp_path / "store"), results=str(tmp_path / "results"),
                                              kernels="current", notebooks=str(tmp_path / "nb"), stages=("01-setup",)))
    (km,) = managers
    assert not km.has_kernel
