"""Notebook plumbing: sizes, store names, row reuse across stages, headlines."""

from __future__ import annotations

from pathlib import Path

import pytest

from airquant import stages, suite
from airquant.errors import EvalConfigError

TINY = stages.Sizes.preset(True, {"ppl_tokens": 70, "ppl_max_length": 32, "ppl_stride": 32, "batch": 2})


def test_presets_overrides_and_fit():
    assert stages.Sizes.preset(False) == stages.Sizes()
    quick = stages.Sizes.preset(True, {"niah_contexts": [128, 4096], "kv_contexts": [64]})
    assert quick.label == "quick" and quick.niah_contexts == (128, 4096) and quick.kv_contexts == (64,)
    fitted = quick.fit(256)
    assert fitted.niah_contexts == (128, 256) and fitted.ppl_max_length == 256 and fitted.ppl_stride <= 256
    assert fitted.rouge_max_length == 256 and fitted.kv_contexts == (64,)
    with pytest.raises(EvalConfigError, match="ppl_tokenz"):
        stages.Sizes.preset(True, {"ppl_tokenz": 1})


@pytest.mark.parametrize("model, slug", [("default", "default"), ("meta-llama/Llama-3.1-8B", "meta-llama-llama-3.1-8b"),
                                         ("/x/SmolLM2.Q4.gguf", "smollm2.q4")])
def test_store_names(model, slug):
    assert stages.store_path("st", model, "nf4") == Path("st") / f"{slug}-nf4"


def test_find_stores_points_to_stage_01(tmp_path):
    with pytest.raises(Exception, match="01_setup_and_sharding"):
        stages.find_stores(tmp_path, "default")


def test_a_row_measured_once_is_reused_with_the_same_settings_only(tiny_store, eval_data, tmp_path, monkeypatch):
    (row,) = suite.evaluate(tiny_store, ["ppl"], TINY, device="cpu", results_dir=tmp_path)
    path = suite.row_path(tmp_path, row, "quick")
    assert path.name.endswith("__bs2__quick.json") and path.is_file()

    def no_engine(*args, **kwargs):
        raise AssertionError("the row should have been reused")

    monkeypatch.setattr(suite, "open_engine", no_engine)
    (again,) = suite.evaluate(tiny_store, ["ppl"], TINY, device="cpu", results_dir=tmp_path, reuse=True)
    assert again == row
    other = stages.Sizes.preset(True, {**TINY.__dict__, "ppl_tokens": 80, "label": "quick"})
    assert suite.find_rows(tmp_path, tiny_store, "ppl", other, device="cpu") == []
    kv = stages.kv_config("tq", TINY)
    assert suite.find_rows(tmp_path, tiny_store, "ppl", TINY, kv=kv, device="cpu") == []
    assert suite.headline(row).startswith("perplexity ")


def test_configurations_fall_back_to_bf16_for_the_kv_column(tmp_path):
    only_bf16 = suite.configurations({"bf16": tmp_path}, TINY)
    assert [(c["store"], c["kv"] is None) for c in only_bf16] == [(tmp_path, True), (tmp_path, False)]
    both = suite.configurations({"bf16": tmp_path / "a", "nf4": tmp_path / "b"}, TINY)
    assert [c["name"] for c in both] == ["bf16 + KV none", "nf4 + KV none", "nf4 + KV tq"]
