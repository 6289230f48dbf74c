"""The fast cases of the fault-injection suite (benchmarks/faults.py runs the full counts)."""

import pytest

from benchmarks import faults


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    return tmp_path_factory.mktemp("faults")


def _check(row: faults.CaseResult) -> None:
    assert row.tried > 0, row
    assert row.survived == row.tried and row.records_lost == 0, row.detail


@pytest.mark.slow
def test_kill_9_of_shard_then_rerun_completes(work, tiny_llama):
    _check(faults.shard_kill(str(tiny_llama), work / "shard_kill", moments=2))


def test_disk_full_during_split(work, tiny_llama):
    row = faults.disk_full(str(tiny_llama), work / "disk_full")
    if row.skipped:
        pytest.skip(row.skipped)
    _check(row)


def test_damaged_files_give_named_errors(work, tiny_store):
    _check(faults.damaged(tiny_store, work / "damaged", flips=3))


@pytest.mark.slow
def test_kill_9_of_batch_loses_nothing(work, tiny_store):
    _check(faults.batch_kill(tiny_store, work / "batch_kill", moments=2, prompts=8))


def test_oom_mid_batch_halves_and_loses_nothing(work, tiny_store):
    _check(faults.oom(tiny_store, work / "oom"))


@pytest.mark.slow
def test_server_under_load_answers_or_refuses(tiny_store):
    _check(faults.server_load(tiny_store, clients=16, seconds=4.0, max_queue=4))


@pytest.mark.slow
def test_malformed_requests_all_4xx(tiny_store):
    pytest.importorskip("hypothesis")
    _check(faults.server_fuzz(tiny_store, examples=40))


def _held(row: faults.CaseResult) -> None:
    _check(row)
    assert row.crossed_scope == 0, row.detail


def test_server_attacks_are_refused_and_cross_no_scope(tiny_store):
    pytest.importorskip("httpx")
    _held(faults.server_attacks(tiny_store))


def test_ui_attacks_are_refused_and_cross_no_scope(work, tiny_store):
    pytest.importorskip("gradio")
    _held(faults.ui_attacks(tiny_store, work / "ui_attacks"))


def test_records_that_cannot_be_sampled_lose_nothing(work, tiny_store):
    _held(faults.batch_sampling(tiny_store, work / "batch_sampling"))


# -- attacks on the store (issue 35) ----------------------------------------------------------------
def test_links_in_a_store_are_refused_and_write_nothing_outside(work, tiny_store, tiny_llama):
    _held(faults.store_links(tiny_store, str(tiny_llama), work / "store_links"))


def test_code_shipped_in_a_store_or_model_never_runs(work, tiny_store, tiny_llama):
    _held(faults.store_code(tiny_store, str(tiny_llama), work / "store_code"))


def test_weights_outside_the_model_folder_are_refused(work, tiny_llama):
    _held(faults.weight_map_escape(str(tiny_llama), work / "weight_map_escape"))


def test_malformed_headers_give_named_errors(work, tiny_store):
    _held(faults.malformed_header(tiny_store, work / "malformed_header"))


