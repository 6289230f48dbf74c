"""Notebook plumbing: sizes, store names, row reuse across stages, headlines."""

from __future__ import annotations

from pathlib import Path

import pytest

from airquant.errors import EvalConfigError
from airquant.pipeline import stores, suite
from airquant.pipeline.sizes import Sizes

TINY = Sizes.preset(True, {"ppl_tokens": 70, "ppl_max_length": 32, "ppl_stride": 32, "batch": 2})


def test_presets_overrides_and_fit():
    assert Sizes.preset(False) == Sizes()
    quick = Sizes.preset(True, {"niah_contexts": [128, 4096], "kv_contexts": [64]})
    assert quick.label == "quick" and quick.niah_contexts == (128, 4096) and quick.kv_contexts == (64,)
    fitted = quick.fit(256)
    assert fitted.niah_contexts == (128, 256) and fitted.ppl_max_length == 256 and fitted.ppl_stride <= 256
    assert fitted.rouge_max_length == 256 and fitted.kv_contexts == (64,)
    with pytest.raises(EvalConfigError, match="ppl_tokenz"):
        Sizes.preset(True, {"ppl_tokenz": 1})


@pytest.mark.parametrize("model, slug", [("default", "default"), ("meta-llama/Llama-3.1-8B", "meta-llama-llama-3.1-8b"),
                                         ("/x/SmolLM2.Q4.gguf", "smollm2.q4")])
def test_store_names(model, slug):
    assert stores.store_path("st", model, "nf4") == Path("st") / f"{slug}-nf4"


def test_find_stores_points_to_stage_01(tmp_path):
    with pytest.raises(Exception, match="01_setup_and_sharding"):
        stores.find_stores(tmp_path, "default")


def test_a_row_measured_once_is_reused_with_the_same_settings_only(tiny_store, eval_data, tmp_path, monkeypatch):
    (row,) = suite.evaluate(tiny_store, ["ppl"], TINY, device="cpu", results_dir=tmp_path)
    path = suite.row_path(tmp_path, row, "quick")
    assert path.name.endswith("__bs2__quick.json") and path.is_file()

    def no_engine(*args, **kwargs):
        raise AssertionError("the row should have been reused")

    monkeypatch.setattr(suite, "open_engine", no_engine)
    (again,) = suite.evaluate(tiny_store, ["ppl"], TINY, device="cpu", results_dir=tmp_path, reuse=True)
    assert again == row
    other = Sizes.preset(True, {**TINY.__dict__, "ppl_tokens": 80, "label": "quick"})
    assert suite.find_rows(tmp_path, tiny_store, "ppl", other, device="cpu") == []
    kv = stores.kv_config("tq", TINY)
    assert suite.find_rows(tmp_path, tiny_store, "ppl", TINY, kv=kv, device="cpu") == []
    assert suite.headline(row).startswith("perplexity ")
    # A pipeline run reads back only rows measured since it began: an earlier run's row is measured again.
    assert suite.find_rows(tmp_path, tiny_store, "ppl", TINY, device="cpu", since=row.run.timestamp) == [row]
    assert suite.find_rows(tmp_path, tiny_store, "ppl", TINY, device="cpu", since="2999-01-01T00:00:00+00:00") == []


def test_only_stage_04_is_told_when_the_run_began():
    from airquant.pipeline.config import PipelineConfig

    when = "2026-12-03T10:00:00+00:00"
    assert PipelineConfig().parameters("04-validation", when).items() >= {"run_started": when, "reuse_rows": True}.items()
    assert PipelineConfig(reuse_earlier=True).parameters("04-validation", when)["reuse_rows"] == "any"
    assert "run_started" not in PipelineConfig().parameters("02-nf4", when)


def test_configurations_fall_back_to_bf16_for_the_kv_column(tmp_path):
    only_bf16 = suite.configurations({"bf16": tmp_path}, TINY)
    assert [(c["store"], c["kv"] is None) for c in only_bf16] == [(tmp_path, True), (tmp_path, False)]
    both = suite.configurations({"bf16": tmp_path / "a", "nf4": tmp_path / "b"}, TINY)
    assert [c["name"] for c in both] == ["bf16 + KV none", "nf4 + KV none", "nf4 + KV tq"]


def test_full_profile_is_the_reference_settings_and_overrides_relabel_it():
    from airquant.eval.references import REFERENCE

    full = Sizes.preset("full")
    assert full.label == "full" and full.headline_settings() == REFERENCE
    assert (full.ppl_tokens, full.ppl_max_length, full.ppl_stride, full.rouge_samples) == (8192, 1024, 512, 250)
    assert Sizes.preset("full", {"ppl_tokens": 256}).label == "custom"  # never passes for the full profile's rows
    tiny = Sizes.preset("full", {"ppl_tokens": 256, "label": "tiny"})
    assert tiny.headline_settings().name == "tiny" and tiny.headline_settings().ppl_tokens == 256
    assert Sizes.preset("full", {"gen_new_tokens": 8}).label == "full"  # sample answers only: same measurements
    with pytest.raises(EvalConfigError, match="profile 'huge'"):
        Sizes.preset("huge")


def test_kv_configs_of_the_configurations():
    assert stores.kv_config("none") is None
    tq, mixed = stores.kv_config("tq", TINY), stores.kv_config("mixed", TINY, num_layers=30)
    assert (tq.bits_k, tq.bits_v, tq.layer_bits) == (4, 2, ())
    assert mixed.layer_bits and mixed.bits_per_element(64, 30) <= 3.0
