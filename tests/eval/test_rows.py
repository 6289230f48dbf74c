"""Row storage: atomic writes that never leave a half-written results file, and strict reading."""

from __future__ import annotations

import json
import os

import pytest

from airquant.errors import ResultsFileError
from airquant.eval.perplexity import PerplexityRow
from airquant.eval.rows import RunInfo, default_row_name, kv_label, read_rows, row_to_dict, write_row, write_rows


def make_row(ppl: float = 24.49, **run_fields) -> PerplexityRow:
    fields = dict(model="HuggingFaceTB/SmolLM2-135M-Instruct", store_scheme="nf4", kv_scheme="tq-k4v2",
                  dtype="float32", device="cpu", device_name="cpu", synthetic=False, streamed=True,
                  hardware={"cpu": "x"}, versions={"torch": "2.13.0"}, timestamp="2026-11-29T10:00:00+00:00")
    fields.update(run_fields)
    return PerplexityRow(run=RunInfo(**fields), ppl=ppl, mean_nll=3.2, n_tokens=8192, n_scored=8191, n_windows=15,
                         max_length=1024, stride=512, limit_tokens=8192, batch_size=4, data_source="x", seconds=1.0)


def test_round_trip_and_file_name(tmp_path):
    row = make_row()
    assert default_row_name(row) == "ppl__smollm2-135m-instruct__nf4__kv-tq-k4v2__bs4.json"
    assert default_row_name(make_row(synthetic=True)).endswith("__bs4__synthetic.json")
    assert default_row_name(make_row(streamed=False)).endswith("__bs4__resident.json")
    assert read_rows(write_row(row, tmp_path / "sub" / "a.json")) == [row]
    rows = [make_row(1.0), make_row(2.0)]
    assert read_rows(write_rows(rows, tmp_path / "b.json")) == rows
    assert json.loads((tmp_path / "sub" / "a.json").read_text())["metric"] == "ppl"


def test_unencodable_row_leaves_the_old_file_alone(tmp_path):
    path = write_row(make_row(1.0), tmp_path / "r.json")
    before = path.read_bytes()
    with pytest.raises(TypeError):
        write_row(make_row(2.0, hardware={"cpu": object()}), path)
    assert path.read_bytes() == before and sorted(os.listdir(tmp_path)) == ["r.json"]


def test_crash_before_the_rename_leaves_the_old_file_alone(tmp_path, monkeypatch):
    path = write_row(make_row(1.0), tmp_path / "r.json")
    before = path.read_bytes()

    def disk_full(fd):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "fsync", disk_full)
    with pytest.raises(OSError, match="No space"):
        write_row(make_row(2.0), path)
    assert path.read_bytes() == before and sorted(os.listdir(tmp_path)) == ["r.json"]


@pytest.mark.parametrize("mutate, match", [
    (lambda d: d | {"metric": "bleu"}, "metric 'bleu'"),
    (lambda d: d | {"schema_version": 99}, "schema_version 99"),
    (lambda d: {k: v for k, v in d.items() if k != "ppl"}, "not a valid ppl row"),
])
def test_foreign_or_damaged_rows_are_refused(tmp_path, mutate, match):
    path = tmp_path / "x.json"
    path.write_text(json.dumps(mutate(row_to_dict(make_row()))))
    with pytest.raises(ResultsFileError, match=match):
        read_rows(path)


def test_kv_labels():
    class KV:
        backend, bits_k, bits_v = "tq", 4, 2

    assert kv_label(None) == "none" and kv_label(None, default="fp8") == "fp8"
    assert kv_label(KV()) == "tq-k4v2"
    KV.backend = "none"
    assert kv_label(KV()) == "none"


def test_rewritten_and_new_files_keep_readable_modes(tmp_path):
    """A re-run used to leave results 0600 (mkstemp's mode) through the rename; a kept file keeps its own mode."""
    from airquant.eval.plots import plot_throughput_vs_batch

    old = os.umask(0o022)
    try:
        kept = tmp_path / "kept.json"
        kept.write_text("{}")
        kept.chmod(0o664)
        write_row(make_row(), kept)
        fresh = write_row(make_row(), tmp_path / "new.json")
        png = plot_throughput_vs_batch({"a": [(1, 1.0), (2, 2.0)]}, tmp_path / "t.png")
    finally:
        os.umask(old)
    assert oct(kept.stat().st_mode & 0o777) == oct(0o664)
    assert oct(fresh.stat().st_mode & 0o777) == oct(png.stat().st_mode & 0o777) == oct(0o644)
