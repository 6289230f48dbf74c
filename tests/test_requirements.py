"""What the README and pyproject promise about the environment holds: the Python version the pins need, and a
`make run` environment without the test-only packages (Ray, Gradio/Selenium, Triton: 3 GB for a CPU smoke run)."""

from __future__ import annotations

import re
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).parents[1]
TEST_ONLY = ("ray", "gradio", "selenium", "triton", "fastapi", "uvicorn", "httpx", "hypothesis", "pytest")


def test_requires_python_is_what_the_pins_need():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert project["requires-python"] == ">=3.11"
    assert project["license"] == "Apache-2.0"  # the SPDX string: the table form is deprecated by setuptools
    assert "Python 3.11+" in (ROOT / "README.md").read_text() and "3.10+" not in (ROOT / "README.md").read_text()


def _recipe(makefile: str, target: str) -> str:
    return re.search(rf"^{re.escape(target)}:.*?\n((?:\t.*\n)+)", makefile, re.M).group(1)


def test_make_run_installs_no_test_only_package():
    makefile = (ROOT / "Makefile").read_text()
    assert re.search(r"^run: \$\(RUN_STAMP\)$", makefile, re.M)
    run = _recipe(makefile, "$(RUN_STAMP)")
    assert "requirements-eval.txt" in run and "requirements-models.txt" in run
    for heavy in ("requirements-dev.txt", "requirements-ui.txt", "requirements-scale.txt"):
        assert heavy not in run
    test = _recipe(makefile, "$(STAMP)")
    assert all(f in test for f in ("requirements-dev.txt", "requirements-ui.txt", "requirements-scale.txt"))
    light = "".join((ROOT / f).read_text() for f in ("requirements-core.txt", "requirements-eval.txt"))
    assert not [p for p in TEST_ONLY if re.search(rf"^{p}\b", light, re.M)]


def test_the_pipeline_imports_without_the_test_only_packages():
    blocked = "\n".join([
        "import sys",
        f"for name in {TEST_ONLY!r}:",
        "    sys.modules[name] = None  # import fails; importlib.util.find_spec says absent",
        "import airquant.pipeline.runner, airquant.pipeline.stores, airquant.pipeline.suite",
        "import airquant.eval, airquant.eval.report, airquant.cli.doctor_cmds, airquant.engine.runner",
        "from airquant.cli import main",
        "print('ok')",
    ])
    done = subprocess.run([sys.executable, "-c", blocked], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-2000:]


def test_the_readme_says_how_to_call_the_cli_and_lists_every_command():
    readme = (ROOT / "README.md").read_text()
    assert ".venv/bin/airquant" in readme and "source .venv/bin/activate" in readme
    assert "results/local/RESULTS.md" in readme and "2-core machine" in readme
    synopsis = readme.split("## Command line", 1)[1].split("```", 2)[1]
    for command in ("airquant info STORE", "airquant serve", "airquant ui", "airquant doctor", "airquant env list"):
        assert command in synopsis, command
