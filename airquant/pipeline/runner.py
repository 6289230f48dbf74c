"""``airquant pipeline``: notebooks 01-04 executed headlessly with papermill, then results/RESULTS.md.

A stage is one notebook. Each runs on its stage's Jupyter kernel (``airquant env create STAGE``) when
one is registered, on this interpreter otherwise. Executed notebooks are kept under
``results/notebooks/``. A failing notebook stops the pipeline with the notebook and cell named; rows
written before it stay, and RESULTS.md is only ever replaced whole, by the last stage.

The ``full`` profile runs in this process by default (``airquant.pipeline.full``): it measures seven
configurations, and a kernel start plus store re-opening per notebook would cost more device time
than the 135M model's metrics.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

from airquant.errors import DependencyError, PipelineError
from airquant.pipeline.config import PipelineConfig, PipelineResult, StageRun
from airquant.pipeline.envs import STAGES, find_kernel, repo_root
from airquant.pipeline.full import run_in_process

log = logging.getLogger(__name__)

NOTEBOOKS = {
    "01-setup": "01_setup_and_sharding.ipynb",
    "02-nf4": "02_inference_baseline_nf4.ipynb",
    "03-turboquant": "03_turboquant_kv_stack.ipynb",
    "04-validation": "04_validation_suite.ipynb",
}
CURRENT_KERNEL = "airquant-current"
PIP_PAPERMILL = "pip install papermill==2.7.0 nbformat==5.11.1 nbclient==0.11.0 ipykernel==7.4.0"


def _papermill():
    try:
        import papermill
    except ImportError as exc:
        raise DependencyError(f"the pipeline needs papermill: {PIP_PAPERMILL}") from exc
    return papermill


def current_kernel_manager(kernel_dir: Path):
    """A kernel manager for this interpreter, whatever kernels Jupyter has registered as ``python3``."""
    from jupyter_client.kernelspec import KernelSpecManager
    from jupyter_client.manager import KernelManager

    spec_dir = kernel_dir / CURRENT_KERNEL
    spec_dir.mkdir(parents=True, exist_ok=True)
    spec = {"argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
            "display_name": f"AirQuant ({sys.executable})", "language": "python"}
    (spec_dir / "kernel.json").write_text(json.dumps(spec), encoding="utf-8")
    specs = KernelSpecManager(kernel_dirs=[str(kernel_dir)], ensure_native_kernel=False)
    # Unix sockets where there are any: over TCP, ipykernel 7 warns on every start that its traffic is not
    # encrypted (a line per notebook in `make run`'s output, for a kernel that only this process talks to).
    transport = "ipc" if os.name == "posix" else "tcp"
    return KernelManager(kernel_name=CURRENT_KERNEL, kernel_spec_manager=specs, transport=transport)


def failed_cell(notebook: Path, exc: Exception) -> str:
    """Which cell failed, from papermill's error and the executed copy it saved."""
    index = getattr(exc, "cell_index", None)
    what = f"{getattr(exc, 'ename', type(exc).__name__)}: {getattr(exc, 'evalue', exc)}"
    source = str(getattr(exc, "source", "") or "")
    if index is None and notebook.is_file():
        cells = json.loads(notebook.read_text(encoding="utf-8")).get("cells", [])
        for i, cell in enumerate(cells):
            if any(o.get("output_type") == "error" for o in cell.get("outputs", [])):
                index, source = i, "".join(cell.get("source", ""))
                break
    first = next((line for line in source.splitlines() if line.strip() and not line.startswith("#")), "")
    where = f"cell {index}" if index is not None else "a cell"
    return f"{where} (`{first.strip()[:80]}`) raised {what}"


def run_stage(stage: str, cfg: PipelineConfig, out_dir: Path, kernel_dir: Path, started: str | None = None) -> StageRun:
    papermill = _papermill()
    from nbclient.exceptions import CellTimeoutError, DeadKernelError
    source = Path(cfg.notebooks or repo_root() / "notebooks") / NOTEBOOKS[stage]
    target = out_dir / NOTEBOOKS[stage]
    kernel = find_kernel(stage) if cfg.kernels == "auto" else None
    engine_kwargs = {} if kernel else {"km": current_kernel_manager(kernel_dir)}
    log.info("stage %s: %s on kernel %s", stage, source.name, kernel or CURRENT_KERNEL)
    start = time.perf_counter()
    try:
        papermill.execute_notebook(str(source), str(target), parameters=cfg.parameters(stage, started),
                                   kernel_name=kernel or CURRENT_KERNEL, progress_bar=cfg.progress, cwd=str(Path.cwd()),
                                   execution_timeout=cfg.cell_timeout_s, **engine_kwargs)
    except papermill.PapermillExecutionError as exc:
        raise PipelineError(f"notebook {source.name} failed in {failed_cell(target, exc)}. The executed copy is "
                            f"{target}; rows written before it are kept in {cfg.results}/ and RESULTS.md was not "
                            "rebuilt. Fix the cause and re-run: finished stores and rows are reused.") from exc
    except (DeadKernelError, CellTimeoutError) as exc:
        # The kernel died (out of memory, say) or a cell ran past --cell-timeout: there is no cell error to show.
        raise PipelineError(f"notebook {source.name} stopped: {type(exc).__name__}: {str(exc)[:300]}. The executed "
                            f"copy is {target}; earlier rows are kept and RESULTS.md was not rebuilt.") from exc
    finally:
        # nbclient leaves a kernel manager it was given running: each stage's kernel (its engines and tensors)
        # lived until the pipeline exited, then printed "Parent appears to have exited".
        km = engine_kwargs.get("km")
        if km is not None and km.has_kernel:
            km.shutdown_kernel(now=False)
    return StageRun(stage, target, kernel or CURRENT_KERNEL, time.perf_counter() - start)


def run_pipeline(cfg: PipelineConfig) -> PipelineResult:
    """Run the stages in order; the report is the one stage 04 wrote (in process: the one built last)."""
    if cfg.in_process:
        return run_in_process(cfg)
    unknown = [s for s in cfg.stages if s not in NOTEBOOKS]
    if unknown:
        raise PipelineError(f"unknown stage(s) {unknown}; choose from {', '.join(STAGES)}.")
    results = Path(cfg.results)
    out_dir = results / "notebooks"
    out_dir.mkdir(parents=True, exist_ok=True)
    report = results / "RESULTS.md"
    before = report.stat().st_mtime_ns if report.exists() else None
    start, runs = time.perf_counter(), []
    # Whole seconds, as rows record their time: a row measured in the run's first second counts as this run's.
    started = datetime.now(timezone.utc).replace(microsecond=0).isoformat()
    with tempfile.TemporaryDirectory(prefix="airquant-kernels-") as kernel_dir:
        for stage in cfg.stages:
            runs.append(run_stage(stage, cfg, out_dir, Path(kernel_dir), started))
            log.info("stage %s done in %.0f s", stage, runs[-1].seconds)
    if "04-validation" in cfg.stages and (not report.exists() or report.stat().st_mtime_ns == before):
        raise PipelineError(f"notebook {NOTEBOOKS['04-validation']} finished without writing {report}; "
                            f"open {out_dir / NOTEBOOKS['04-validation']} to see why.")
    return PipelineResult(tuple(runs), report, time.perf_counter() - start)
