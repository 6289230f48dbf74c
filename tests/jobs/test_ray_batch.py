"""Batch jobs on Ray Data: two CPU engines give the single-process output; a killed driver or engine loses
nothing and writes no id twice."""

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from airquant.config import EngineConfig, GenerateConfig
from airquant.engine.runner import Engine
from airquant.errors import DependencyError
from airquant.jobs.batch import BatchJob, run_batch
from airquant.jobs.ray_batch import (
    ACTOR_PREFIX,
    ScaleConfig,
    StoreNotSharedError,
    check_store,
    require_ray,
    run_batch_ray,
    store_digest,
)

ray = pytest.importorskip("ray", reason="Ray Data is optional: pip install -r requirements-scale.txt")

WORDS = "the quick brown fox jumps over a lazy dog while seven wise owls watch from an old oak".split()
N_PROMPTS = 24
BATCH = 2  # 12 engine batches: enough for a kill to land mid-run
GEN = GenerateConfig(max_new_tokens=8)
CPU = EngineConfig(device="cpu")
TWO_CPU_ENGINES = ScaleConfig(engines=2, gpus_per_engine=0)


def _prompts(path: Path) -> Path:
    rows = [{"id": f"p{k}" if k % 3 else k, "prompt": " ".join(WORDS[: 2 + (k * 5) % len(WORDS)])}
            for k in range(N_PROMPTS)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def _by_id(records: list[dict]) -> dict:
    """Each record less its timings, by canonical id; asserts every id is there once."""
    keys = [json.dumps(r["id"]) for r in records]
    assert len(keys) == len(set(keys)), "an id was written twice"
    return {k: {f: v for f, v in r.items() if f != "timings"} for k, r in zip(keys, records)}


def _wait_for_records(path: Path, n: int, alive=lambda: True, timeout: float = 240) -> int:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and alive():
        if path.exists() and path.read_text().count("\n") >= n:
            break
        time.sleep(0.05)
    return len(_records(path)) if path.exists() else 0


@pytest.fixture(scope="module")
def local_ray():
    ray.init(num_cpus=2, num_gpus=0, include_dashboard=False)
    yield ray.get_runtime_context().gcs_address
    ray.shutdown()


@pytest.fixture(scope="module")
def reference(default_store, tmp_path_factory):
    """The records of one single-process ``airquant batch`` run with the same batch size."""
    root = tmp_path_factory.mktemp("ray-ref")
    out = root / "out.jsonl"
    run_batch(default_store, BatchJob(_prompts(root / "in.jsonl"), out, batch_size=BATCH, gen=GEN),
              engine=Engine.open(default_store, device="cpu"), progress=False)
    return _by_id(_records(out))


@pytest.mark.slow
def test_two_engines_write_the_single_process_records(default_store, local_ray, reference, tmp_path):
    job = BatchJob(_prompts(tmp_path / "in.jsonl"), tmp_path / "out.jsonl", batch_size=BATCH, gen=GEN)
    report = run_batch_ray(default_store, job, CPU, TWO_CPU_ENGINES, progress=False)
    assert report.done == N_PROMPTS and report.skipped == 0 and report.new_tokens > 0
    assert _by_id(_records(job.output)) == reference
    again = run_batch_ray(default_store, job, CPU, TWO_CPU_ENGINES, progress=False)
    assert again.done == 0 and again.skipped == N_PROMPTS  # the resume rule: nothing reruns


@pytest.mark.slow
def test_killed_driver_resumes_with_every_id_once(default_store, local_ray, reference, tmp_path):
    inp, out = _prompts(tmp_path / "in.jsonl"), tmp_path / "out.jsonl"
    cmd = [sys.executable, "-m", "airquant.cli", "batch", str(default_store), "--input", str(inp), "--output",
           str(out), "--batch-size", str(BATCH), "--max-new-tokens", str(GEN.max_new_tokens), "--device", "cpu",
           "--quiet", "--ray", local_ray, "--engines", "2", "--gpus-per-engine", "0"]
    proc = subprocess.Popen(cmd, env={**os.environ, "PYTHONUNBUFFERED": "1"}, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE)
    _wait_for_records(out, 4, alive=lambda: proc.poll() is None)
    proc.send_signal(signal.SIGKILL)
    _, err = proc.communicate()
    killed_with = len(_records(out))
    assert 4 <= killed_with < N_PROMPTS, f"the driver should be killed part-way ({killed_with}): {err[-2000:]}"
    with open(out, "a") as f:  # a kill in the middle of a write leaves half a record
        f.write('{"id": "p999", "prompt": "half a rec')
    report = run_batch_ray(default_store, BatchJob(inp, out, batch_size=BATCH, gen=GEN), CPU, TWO_CPU_ENGINES,
                           progress=False)
    assert report.skipped == killed_with and report.done == N_PROMPTS - killed_with
    assert _by_id(_records(out)) == reference


@pytest.mark.slow
def test_killed_engine_actor_is_restarted_and_its_batch_redone(default_store, local_ray, reference, tmp_path):
    job = BatchJob(_prompts(tmp_path / "in.jsonl"), tmp_path / "out.jsonl", batch_size=BATCH, gen=GEN)
    result: dict = {}
    worker = threading.Thread(target=lambda: result.update(
        report=run_batch_ray(default_store, job, CPU, TWO_CPU_ENGINES, progress=False)))
    worker.start()
    before = _wait_for_records(job.output, 4, alive=worker.is_alive)
    engines = [n for n in ray.util.list_named_actors() if n.startswith(ACTOR_PREFIX)]
    assert engines and before < N_PROMPTS, "an engine should be killed part-way"
    ray.kill(ray.get_actor(engines[0]), no_restart=False)
    worker.join(timeout=300)
    assert not worker.is_alive() and result["report"].done == N_PROMPTS
    assert _by_id(_records(job.output)) == reference


def test_engines_the_cluster_cannot_hold_are_refused(local_ray):
    from airquant.jobs.ray_batch import RayBatchError, engine_shape

    assert engine_shape(ray, ScaleConfig()) == (1, 0.0)  # no GPU: one CPU engine
    assert engine_shape(ray, TWO_CPU_ENGINES) == (2, 0.0)
    with pytest.raises(RayBatchError, match="--gpus-per-engine 0 for CPU engines"):
        engine_shape(ray, ScaleConfig(gpus_per_engine=1))


def test_a_node_without_the_store_gets_a_clear_error(default_store, tmp_path):
    digest = store_digest(default_store)
    check_store(default_store, digest)
    with pytest.raises(StoreNotSharedError, match="shared filesystem"):
        check_store(tmp_path / "nowhere", digest)
    (tmp_path / "manifest.json").write_text("{}")
    with pytest.raises(StoreNotSharedError, match="different store"):
        check_store(tmp_path, digest)


def test_missing_ray_names_the_install_command(monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)
    with pytest.raises(DependencyError, match="requirements-scale.txt"):
        require_ray()
