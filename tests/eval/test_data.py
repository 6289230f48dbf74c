"""Data sources: the hub through ``datasets`` when it answers, the local copy when it does not."""

from __future__ import annotations

import json
import sys
import types

import pytest

from airquant.errors import EvalDataError
from airquant.eval import data


@pytest.fixture
def local_dir(tmp_path, monkeypatch):
    (tmp_path / "wikitext2_test.raw").write_text(" = A = \n text .\n")
    (tmp_path / "cnn_dailymail_test_250.jsonl").write_text(
        json.dumps({"id": "a", "article": "Art.", "highlights": "Hi ."}) + "\n")
    monkeypatch.setenv(data.DATA_DIR_ENV, str(tmp_path))
    monkeypatch.setattr(data, "_FALLBACK_DIRS", ())
    return tmp_path


def fake_datasets(monkeypatch, load):
    module = types.ModuleType("datasets")
    module.load_dataset = load
    monkeypatch.setitem(sys.modules, "datasets", module)


def test_hub_rows_are_joined_like_the_guide(monkeypatch, local_dir):
    calls = []
    fake_datasets(monkeypatch, lambda *a, **kw: calls.append((a, kw)) or {"text": ["", " = T = \n", " x \n"]})
    corpus = data.load_wikitext()
    assert calls == [(("wikitext", "wikitext-2-raw-v1"), {"split": "test"})]
    assert corpus.text == "\n\n = T = \n\n\n x \n" and corpus.source == "hf:wikitext/wikitext-2-raw-v1/test"


def test_unreachable_hub_falls_back_to_the_local_copy(monkeypatch, local_dir):
    def offline(*a, **kw):
        raise ConnectionError("Couldn't reach 'wikitext' on the Hub (LocalEntryNotFoundError)")

    fake_datasets(monkeypatch, offline)
    corpus = data.load_wikitext()
    assert corpus.text == " = A = \n text .\n" and "wikitext2_test.raw (sha256 " in corpus.source
    examples, source = data.load_cnn_dailymail(limit=5)
    assert [e.id for e in examples] == ["a"] and source.endswith(")")


def test_no_source_at_all_says_what_to_do(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "datasets", None)  # import datasets -> ImportError
    monkeypatch.setenv(data.DATA_DIR_ENV, str(tmp_path))
    monkeypatch.setattr(data, "_FALLBACK_DIRS", ())
    with pytest.raises(EvalDataError, match="pip install datasets.*--data FILE"):
        data.load_wikitext()
    with pytest.raises(EvalDataError, match="--data FILE"):
        data.load_haystack()


def test_bad_local_files_name_the_line(tmp_path):
    bad = tmp_path / "rows.jsonl"
    bad.write_text('{"text": "ok"}\n{"txt": "no"}\n')
    with pytest.raises(EvalDataError, match="row 2 has no string 'text'"):
        data.read_text_file(bad)
    bad.write_text('{"article": "a", "highlights": "h"}\n{oops\n')
    with pytest.raises(EvalDataError, match=r"rows.jsonl:2 is not valid JSON"):
        data.load_cnn_dailymail(bad)
    with pytest.raises(EvalDataError, match="no such file"):
        data.load_wikitext(tmp_path / "missing.txt")


def test_a_missing_datasets_package_is_said_once(monkeypatch, local_dir, caplog):
    """The suite loads WikiText-2 for every metric and configuration: the note came once per metric."""
    monkeypatch.setitem(sys.modules, "datasets", None)  # import datasets -> ImportError
    data._say_local.cache_clear()
    with caplog.at_level("INFO", logger="airquant.eval.data"):
        for _ in range(3):
            data.load_wikitext()
    assert sum("is not installed" in r.getMessage() for r in caplog.records) == 1
