"""What a pipeline run is asked (``PipelineConfig``) and what it gives back, shared by the papermill runner
(``pipeline/runner.py``) and the in-process full profile (``pipeline/full.py``) without either importing
the other's module for them."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from airquant.errors import PipelineError
from airquant.pipeline.envs import STAGES
from airquant.pipeline.sizes import PROFILES, Profile


@dataclass(frozen=True)
class PipelineConfig:
    """``airquant pipeline --model --store --profile --results --device --stages --kernels --schemes --cell-timeout``
    (and ``--only``, ``--metrics``, ``--no-report``, ``--runner``)."""

    model: str = "default"
    store: str = "store"
    profile: Profile = "quick"
    results: str = "results"
    device: Literal["auto", "cpu", "cuda"] = "auto"
    stages: tuple[str, ...] = STAGES
    kernels: Literal["auto", "current"] = "auto"  # auto: a stage's own kernel when registered
    sizes: dict = field(default_factory=dict)  # Sizes overrides (tests use tiny ones)
    schemes: tuple[str, ...] | None = None  # stores stage 01 builds; None: every one this environment can
    cell_timeout_s: int | None = None
    notebooks: str | None = None  # folder holding the stage notebooks; None: the checkout's notebooks/
    progress: bool = False  # a progress bar over each notebook's cells (stderr)
    # auto: the full profile in this process, the others through papermill
    runner: Literal["auto", "papermill", "inprocess"] = "auto"
    only: tuple[str, ...] | None = None  # full profile, in process: run these configurations only (their names)
    metrics: tuple[str, ...] | None = None  # full profile, in process: measure these metrics only
    report: bool = True  # in process: rebuild RESULTS.md at the end
    reuse_earlier: bool = False  # stage 04 may read back earlier runs' rows (marked in RESULTS.md), not only this run's

    def __post_init__(self) -> None:
        if self.profile not in PROFILES:
            raise PipelineError(f"profile {self.profile!r} is unknown; choose one of {', '.join(PROFILES)}.")

    @property
    def in_process(self) -> bool:
        return self.runner == "inprocess" or (self.runner == "auto" and self.profile == "full")

    def parameters(self, stage: str, started: str | None = None) -> dict:
        """The ``parameters`` cell values of a stage's notebook; paths absolute, since a kernel's cwd may differ.

        ``started`` (ISO 8601 UTC, the run's start) tells stage 04 which rows this run measured: only those are
        read back instead of measured again, unless ``reuse_earlier``."""
        params = {"model": self.model, "store": str(Path(self.store).resolve()), "device": self.device,
                  "profile": self.profile, "results_dir": str(Path(self.results).resolve()),
                  "sizes": dict(self.sizes)}
        if stage == "01-setup" and self.schemes:
            params["schemes"] = list(self.schemes)
        if stage == "04-validation":
            params |= {"run_started": started, "reuse_rows": "any" if self.reuse_earlier else True}
        return params


@dataclass(frozen=True)
class StageRun:
    stage: str
    notebook: Path  # the executed copy
    kernel: str
    seconds: float


@dataclass(frozen=True)
class PipelineResult:
    stages: tuple[StageRun, ...]
    report: Path
    seconds: float
