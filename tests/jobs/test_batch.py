"""Batch jobs: resumable after a kill, a cut-off last line repaired, out-of-memory halving."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from airquant.cli import main
from airquant.config import GenerateConfig
from airquant.engine.runner import Engine
from airquant.jobs.batch import BatchJob, BatchJobError, finished_ids, read_prompts, run_batch

WORDS = "the quick brown fox jumps over a lazy dog while seven wise owls watch from an old oak".split()
N_PROMPTS = 16
GEN = GenerateConfig(max_new_tokens=6)


def _prompts(path: Path, n: int = N_PROMPTS) -> Path:
    rows = [{"id": f"p{k}", "prompt": " ".join(WORDS[: 2 + (k * 5) % len(WORDS)])} for k in range(n)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.fixture(scope="module")
def reference(tiny_store, tmp_path_factory):
    """Every prompt's output from one uninterrupted in-process run."""
    root = tmp_path_factory.mktemp("batch-ref")
    out = root / "out.jsonl"
    report = run_batch(tiny_store, BatchJob(_prompts(root / "in.jsonl"), out, batch_size=2, gen=GEN),
                       progress=False, engine=Engine.open(tiny_store, device="cpu"))
    assert report.done == N_PROMPTS and report.batch_sizes == [2]  # one decode loop of 2 slots
    return {r["id"]: r["output"] for r in _records(out)}


def test_killed_job_resumes_without_loss_or_duplicates(tiny_store, reference, tmp_path):
    inp, out = _prompts(tmp_path / "in.jsonl"), tmp_path / "out.jsonl"
    cmd = [sys.executable, "-m", "airquant.cli", "batch", str(tiny_store), "--input", str(inp), "--output", str(out),
           "--batch-size", "2", "--max-new-tokens", str(GEN.max_new_tokens), "--device", "cpu", "--quiet"]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and proc.poll() is None:
        if out.exists() and out.read_text().count("\n") >= 4:
            break
        time.sleep(0.02)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    killed_with = len(_records(out))
    assert 4 <= killed_with < N_PROMPTS, "the job should be killed part-way"
    with open(out, "a") as f:  # a kill in the middle of a write leaves half a record
        f.write('{"id": "p999", "prompt": "half a rec')
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert f"({killed_with} already there)" in done.stdout
    records = _records(out)
    ids = [r["id"] for r in records]
    assert len(ids) == len(set(ids)) == N_PROMPTS
    assert {r["id"]: r["output"] for r in records} == reference
    assert all(r["new_tokens"] > 0 and r["prompt_tokens"] > 0 and r["timings"]["total_s"] > 0 for r in records)


def test_out_of_memory_halves_the_slots_and_loses_nothing(tiny_store, reference, tmp_path, monkeypatch):
    engine = Engine.open(tiny_store, device="cpu")
    sizes = []
    original = engine.decode_loop

    def flaky(slots, **kw):
        sizes.append(slots)
        loop = original(slots, **kw)
        if slots > 2:  # the first pass after two records were written runs out of memory
            step = loop.step

            def failing():
                if loop.stats.passes >= 6:
                    raise torch.OutOfMemoryError("CUDA out of memory (injected)")
                return step()

            loop.step = failing
        return loop

    monkeypatch.setattr(engine, "decode_loop", flaky)
    out = tmp_path / "out.jsonl"
    report = run_batch(tiny_store, BatchJob(_prompts(tmp_path / "in.jsonl"), out, batch_size=8, gen=GEN),
                       engine=engine, progress=False)
    assert sizes == [8, 4, 2] and report.oom_halvings == 2 and report.batch_sizes == [2]
    records = _records(out)
    assert len(records) == report.done == N_PROMPTS
    assert {r["id"]: r["output"] for r in records} == reference


def test_records_carry_their_own_settings_and_a_too_long_one_fails_alone(tiny_store, tmp_path):
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    rows = [{"id": "short", "prompt": "the quick brown fox", "max_new_tokens": 2},
            {"id": "long", "prompt": "word " * 400},
            {"id": "free", "prompt": "the quick brown fox", "max_new_tokens": 9}]
    inp.write_text("".join(json.dumps(r) + "\n" for r in rows))
    engine = Engine.open(tiny_store, device="cpu")
    run_batch(tiny_store, BatchJob(inp, out, batch_size=2, gen=GenerateConfig(max_new_tokens=6, ignore_eos=True)),
              engine=engine, progress=False)
    got = {r["id"]: r for r in _records(out)}
    assert "exceeds the context" in got["long"]["error"] and "output" not in got["long"]
    assert got["short"]["new_tokens"] == 2 and got["free"]["new_tokens"] == 9
    assert got["free"]["output"].startswith(got["short"]["output"])
    stop = got["free"]["output"][3:6]
    inp.write_text(json.dumps({"id": "s", "prompt": "the quick brown fox", "max_new_tokens": 9, "stop": [stop]}) + "\n")
    run_batch(tiny_store, BatchJob(inp, tmp_path / "stop.jsonl", batch_size=2,
                                   gen=GenerateConfig(ignore_eos=True)), engine=engine, progress=False)
    (rec,) = _records(tmp_path / "stop.jsonl")
    assert rec["output"] == got["free"]["output"][: got["free"]["output"].index(stop)] and rec["finish_reason"] == "stop"
    inp.write_text(json.dumps({"id": 1, "prompt": "x", "max_new_tokens": "many"}) + "\n")
    with pytest.raises(BatchJobError, match="max_new_tokens='many' must be int"):
        read_prompts(inp)


def test_a_record_that_cannot_be_sampled_fails_alone_and_is_not_rerun(tiny_store, tmp_path):
    """temperature 1e-300 failed the whole job on every rerun (NaN probabilities in multinomial); a seed over
    2^64 did too. Now the first is greedy, the second gets its own error record, the job completes, and a
    rerun has nothing left to do."""
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    rows = [{"id": "tiny", "prompt": "the quick brown fox", "temperature": 1e-300},
            {"id": "seed", "prompt": "the quick brown fox", "temperature": 0.5, "seed": 2**64},
            {"id": "greedy", "prompt": "the quick brown fox"}]
    inp.write_text("".join(json.dumps(r) + "\n" for r in rows))
    job = BatchJob(inp, out, batch_size=3, gen=GenerateConfig(max_new_tokens=4, ignore_eos=True))
    engine = Engine.open(tiny_store, device="cpu")
    run_batch(tiny_store, job, engine=engine, progress=False)
    got = {r["id"]: r for r in _records(out)}
    assert got["tiny"]["output"] == got["greedy"]["output"] and got["tiny"]["new_tokens"] == 4
    assert "seed=18446744073709551616 is out of range" in got["seed"]["error"]
    report = run_batch(tiny_store, job, engine=engine, progress=False)
    assert report.done == 0 and report.skipped == 3


def test_a_sequence_that_fails_gets_its_own_error_record(tiny_store, tmp_path, monkeypatch):
    from airquant.engine.decode import loop as decode_loop

    real = decode_loop.sample

    def flaky(logits, temperature, top_p, generator):  # this record's sampling fails, the others' does not
        if temperature == 0.123:
            raise RuntimeError("simulated sampling failure")
        return real(logits, temperature, top_p, generator)

    monkeypatch.setattr(decode_loop, "sample", flaky)
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    rows = [{"id": "bad", "prompt": "the quick brown fox", "temperature": 0.123},
            {"id": "good", "prompt": "the quick brown fox", "temperature": 0.5, "seed": 1}]
    inp.write_text("".join(json.dumps(r) + "\n" for r in rows))
    run_batch(tiny_store, BatchJob(inp, out, batch_size=2, gen=GenerateConfig(max_new_tokens=4, ignore_eos=True)),
              engine=Engine.open(tiny_store, device="cpu"), progress=False)
    got = {r["id"]: r for r in _records(out)}
    assert "simulated sampling failure" in got["bad"]["error"] and got["good"]["new_tokens"] == 4


def test_a_finished_output_is_not_rerun(tiny_store, tmp_path, capsys):
    inp, out = _prompts(tmp_path / "in.jsonl", 3), tmp_path / "out.jsonl"
    args = ["batch", str(tiny_store), "--input", str(inp), "--output", str(out), "--max-new-tokens", "3",
            "--device", "cpu", "--quiet"]
    assert main(args) == 0
    assert "3 new records (0 already there)" in capsys.readouterr().out
    before = out.read_bytes()
    assert main(args) == 0
    assert "0 new records (3 already there)" in capsys.readouterr().out and out.read_bytes() == before


def test_input_errors_name_the_line(tmp_path):
    path = tmp_path / "in.jsonl"
    path.write_text('{"id": 1, "prompt": "a"}\n\n{"prompt": "b"}\n{"id": 1, "prompt": "c"}\n')
    with pytest.raises(BatchJobError, match=r"id 1 twice \(lines 1 and 4\)"):
        read_prompts(path)
    path.write_text('{"prompt": "a"}\n{"id": "x", "prompt": "b"}\n{"id": 1, "prompt": "c"}\n')
    with pytest.raises(BatchJobError, match=r"id 1 twice \(lines 1 and 3\)"):  # a line-number id collides
        read_prompts(path)
    path.write_text('{"prompt": "a"}\n{"id": "x", "prompt": "b"}\n')
    assert [p.id for p in read_prompts(path)] == [1, "x"]
    path.write_text('{"id": "x"}\n')
    with pytest.raises(BatchJobError, match='line 1 has no "prompt"'):
        read_prompts(path)


def test_partial_last_line_is_cut_and_other_damage_is_refused(tmp_path):
    out = tmp_path / "out.jsonl"
    out.write_text('{"id": "a", "output": "x"}\n{"id": 2, "output": "y"}\n{"id": "c", "outp')
    assert finished_ids(out) == {'"a"', "2"}
    assert out.read_text().endswith('"y"}\n')
    out.write_text('{"id": "a"}\nnot json\n{"id": "b"}\n')
    with pytest.raises(BatchJobError, match="line 2 is not a record"):
        finished_ids(out)


def test_batch_runs_through_the_turboquant_cache(tiny_store, tmp_path, capsys):
    """``--kv tq`` reaches the engine: with a 4-token window the history is quantized, and every record lands."""
    inp, out = _prompts(tmp_path / "in.jsonl", 4), tmp_path / "out.jsonl"
    argv = ["batch", str(tiny_store), "--input", str(inp), "--output", str(out), "--batch-size", "2",
            "--max-new-tokens", "6", "--device", "cpu", "--quiet", "--kv", "tq", "--kv-window", "4", "--kv-block", "2"]
    assert main(argv) == 0
    records = _records(out)
    assert len(records) == 4 and all(1 <= r["new_tokens"] <= 6 for r in records)
    plain = tmp_path / "plain.jsonl"
    assert main(argv[:argv.index("--kv")] + ["--output", str(plain)]) == 0
    assert [r["id"] for r in _records(plain)] == [r["id"] for r in records]


def test_auto_batch_size_follows_the_kv_cache(tiny_store, default_store, monkeypatch):
    """On a GPU the batch comes from the router: a compressed cache fits more sequences (SmolLM2's 30 layers at
    1 024 tokens: on the tiny store's two layers the TurboQuant decode attention's gathered histories, one layer's
    cache twice, outweigh what the codes save), none fitting is an error."""
    from airquant.config import EngineConfig
    from airquant.engine import runner
    from airquant.jobs.batch import auto_batch_size
    from airquant.kv import KVConfig

    assert auto_batch_size(tiny_store, EngineConfig(device="cpu"), 64, 256) == 8  # CPU: a fixed batch
    monkeypatch.setattr(runner, "resolve_device", lambda device: torch.device("cuda"))
    # the router keeps 0.27 GB of workspace, and the plan leaves 0.25 GiB of the budget to the allocator
    cfg = EngineConfig(device="cuda", max_vram_gb=1.0, kv_offload=False)
    plain = auto_batch_size(default_store, cfg, 1024, 10_000)
    tq = auto_batch_size(default_store, cfg, 1024, 10_000, KVConfig(backend="tq"))
    assert 1 <= plain < tq
    assert auto_batch_size(default_store, cfg, 1024, 3, KVConfig(backend="tq")) == 3  # --max-batch caps it
    cfg = EngineConfig(device="cuda", max_vram_gb=0.55, kv_offload=False)
    with pytest.raises(BatchJobError, match="--kv tq"):
        auto_batch_size(tiny_store, EngineConfig(device="cuda", max_vram_gb=0.01, kv_offload=False), 256, 256)
    with pytest.raises(BatchJobError, match="exceeds the model's 256 tokens"):
        auto_batch_size(tiny_store, cfg, 2048, 256)


@pytest.mark.parametrize("content", [
    b'{"id": "a", "output": "x"}\nnot json\n{"id": "c", "outp',  # a damaged line, then a cut last line
    b"notes of mine, not a batch output",  # one line of another file, no newline at its end
])
def test_a_refused_output_is_left_byte_for_byte(tmp_path, content):
    out = tmp_path / "out.jsonl"
    out.write_bytes(content)
    with pytest.raises(BatchJobError, match="left untouched"):
        finished_ids(out)
    assert out.read_bytes() == content


def test_a_full_disk_during_a_batch_is_a_named_error_and_loses_nothing(tmp_path, tiny_store, monkeypatch):
    import errno

    from airquant.errors import DiskSpaceError
    from airquant.jobs import batch

    inp, out = _prompts(tmp_path / "in.jsonl", 4), tmp_path / "out.jsonl"
    job = BatchJob(inp, out, batch_size=2, gen=GenerateConfig(max_new_tokens=2))
    real, written = batch._append, []

    def fill_after_two(f, record):
        if len(written) == 2:
            f.write('{"id": "p')  # the start of a record, cut short by the full disk
            raise OSError(errno.ENOSPC, "No space left on device")
        real(f, record)
        written.append(record["id"])

    monkeypatch.setattr(batch, "_append", fill_after_two)
    with pytest.raises(DiskSpaceError, match=rf"disk of --output {out} is full \(2 records .* re-run the same"):
        run_batch(tiny_store, job, engine=Engine.open(tiny_store, device="cpu"), progress=False)
    lines = out.read_text().split("\n")
    assert [json.loads(line)["id"] for line in lines[:-1]] == written and lines[-1] == '{"id": "p'
    monkeypatch.setattr(batch, "_append", real)
    report = run_batch(tiny_store, job, engine=Engine.open(tiny_store, device="cpu"), progress=False)
    assert report.skipped == 2 and sorted(r["id"] for r in _records(out)) == [f"p{k}" for k in range(4)]


def test_plan_job_prints_the_throughput_table(tiny_store, tmp_path, capsys):
    inp = _prompts(tmp_path / "in.jsonl", 5)
    assert main(["plan", str(tiny_store), "--job", str(inp), "--max-new-tokens", "6", "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert f"job       : 5 requests ({inp})" in out and "new tokens 6-6" in out
    assert "plain    on device: 5 slots" in out and "TQ K4/V2 on device: 5 slots" in out
    assert "choice    : plain KV on the device, 5 slots" in out  # a tie: the plainer cache


@pytest.mark.parametrize("content, message", [
    (None, "--job {path} does not exist"),
    ("", "--job {path} has no prompts; each line must be"),
    ('{"id": 1, "prompt": "a"}\nnot json\n', "{path} line 2 is not JSON"),
])
def test_plan_job_names_a_bad_job_file_and_the_fix(tiny_store, tmp_path, capsys, content, message):
    path = tmp_path / "job.jsonl"
    if content is not None:
        path.write_text(content)
    assert main(["plan", str(tiny_store), "--job", str(path), "--device", "cpu"]) != 0
    assert message.format(path=path) in capsys.readouterr().err


def test_batch_size_auto_runs_the_planners_choice(tiny_store, tmp_path, capsys, caplog):
    """``--batch-size auto --kv auto`` on CPU: the planner's slots and cache, every record written. Ten requests of
    four new tokens take two waves in 5 slots as in 8 (the CPU's most): the fewer slots are chosen."""
    inp, out = _prompts(tmp_path / "in.jsonl", 10), tmp_path / "out.jsonl"
    with caplog.at_level("INFO", logger="airquant.jobs.batch"):
        assert main(["batch", str(tiny_store), "--input", str(inp), "--output", str(out), "--max-new-tokens", "4",
                     "--device", "cpu", "--quiet", "--kv", "auto"]) == 0
    assert "10 new records" in capsys.readouterr().out and len(_records(out)) == 10
    assert "choice    : plain KV on the device, 5 slots" in caplog.text
    with pytest.raises(BatchJobError, match="--kv auto lets the throughput planner choose"):
        run_batch(tiny_store, BatchJob(inp, tmp_path / "fixed.jsonl", batch_size=2, kv="auto", gen=GEN),
                  progress=False)
