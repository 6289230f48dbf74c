"""Sliding-window perplexity against the transformers guide's loop, run directly on the resident model."""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass

import pytest
import torch

from airquant.errors import EvalConfigError
from airquant.eval.perplexity import Window, plan_windows, run_perplexity
from airquant.eval.rows import read_rows, write_row


def guide_perplexity(model, ids: torch.Tensor, max_length: int, stride: int) -> float:
    """The loop of https://huggingface.co/docs/transformers/perplexity, written out independently."""
    seq_len = ids.size(1)
    nll_sum, n_tokens, prev_end_loc = 0.0, 0, 0
    for begin_loc in range(0, seq_len, stride):
        end_loc = min(begin_loc + max_length, seq_len)
        trg_len = end_loc - prev_end_loc
        input_ids = ids[:, begin_loc:end_loc]
        target_ids = input_ids.clone()
        target_ids[:, :-trg_len] = -100
        with torch.no_grad():
            loss = model(input_ids, labels=target_ids).loss
        num_loss_tokens = (target_ids != -100).sum().item() - target_ids.size(0)
        nll_sum += loss.item() * num_loss_tokens
        n_tokens += num_loss_tokens
        prev_end_loc = end_loc
        if end_loc == seq_len:
            break
    return math.exp(nll_sum / n_tokens)


@pytest.mark.parametrize("n, max_length, stride, expected", [
    (10, 4, 2, [(0, 4, 1), (2, 6, 4), (4, 8, 6), (6, 10, 8)]),
    (10, 4, 4, [(0, 4, 1), (4, 8, 5), (8, 10, 9)]),
    (3, 8, 4, [(0, 3, 1)]),
    (9, 4, 3, [(0, 4, 1), (3, 7, 4), (6, 9, 7)]),
])
def test_plan_windows_table(n, max_length, stride, expected):
    assert plan_windows(n, max_length, stride) == [Window(*w) for w in expected]


@pytest.mark.parametrize("n, max_length, stride", [(1000, 128, 32), (1000, 128, 128), (257, 256, 7), (50, 64, 16)])
def test_each_token_is_scored_at_most_once_and_only_with_context(n, max_length, stride):
    windows = plan_windows(n, max_length, stride)
    scored = [t for w in windows for t in range(w.target_begin, w.end)]
    # Overlapping windows score every token but the first; disjoint chunks also skip each chunk's first.
    unscored = {0} if stride < max_length else {w.begin for w in windows}
    assert scored == [t for t in range(n) if t not in unscored]
    assert all(w.length <= max_length and w.target_begin > w.begin for w in windows)


@pytest.mark.parametrize("max_length, stride", [(256, 64), (200, 200), (300, 110)])
def test_matches_transformers_guide(tiny_engine, small_text_file, max_length, stride):
    row = run_perplexity(tiny_engine, data=small_text_file, limit_tokens=1000, max_length=max_length, stride=stride)
    ids = torch.tensor([tiny_engine.tokenizer(small_text_file.read_text())["input_ids"][:1000]])
    reference = guide_perplexity(tiny_engine.model, ids, max_length, stride)
    assert row.n_tokens == 1000
    assert row.n_scored == (999 if stride < max_length else 1000 - row.n_windows)
    assert abs(row.ppl / reference - 1) < 0.005, (row.ppl, reference)


def test_one_window_equals_float64_full_sequence(tiny_engine, small_text_file):
    row = run_perplexity(tiny_engine, data=small_text_file, limit_tokens=400, max_length=512, stride=128)
    ids = torch.tensor(tiny_engine.tokenizer(small_text_file.read_text())["input_ids"][:400])
    with torch.no_grad():
        logits = tiny_engine.model(ids[None]).logits[0].double()  # [S, V]
    logp = torch.log_softmax(logits[:-1], dim=-1).gather(1, ids[1:, None])  # [S-1, 1]
    assert row.n_windows == 1
    assert row.mean_nll == pytest.approx(-logp.mean().item(), rel=1e-5)


def test_batched_windows_match_one_at_a_time(tiny_engine, small_text_file):
    kw = dict(data=small_text_file, limit_tokens=700, max_length=128, stride=64)
    one = run_perplexity(tiny_engine, batch_size=1, **kw)
    four = run_perplexity(tiny_engine, batch_size=4, **kw)
    assert four.ppl == pytest.approx(one.ppl, rel=1e-5)
    assert (four.n_scored, four.n_windows, four.batch_size) == (one.n_scored, one.n_windows, 4)


@dataclass(frozen=True)
class FakeKV:
    backend: str = "tq"
    bits_k: int = 4
    bits_v: int = 2


def test_kv_config_reaches_the_engine_and_the_row(tiny_engine, small_text_file):
    tiny_engine.forward_kv.clear()
    row = run_perplexity(tiny_engine, data=small_text_file, limit_tokens=300, max_length=128, stride=64,
                         kv=FakeKV())
    assert tiny_engine.forward_kv and all(k == FakeKV() for k in tiny_engine.forward_kv)
    assert row.run.kv_scheme == "tq-k4v2" and row.run.kv_config == {"backend": "tq", "bits_k": 4, "bits_v": 2}


def test_jsonl_rows_are_joined_like_the_guide(tiny_engine, tmp_path):
    rows = ["", " = Title = \n", "", " Some text about a thing . \n", " More text . \n"] * 20
    jsonl = tmp_path / "rows.jsonl"
    jsonl.write_text("".join(json.dumps({"text": r}) + "\n" for r in rows))
    plain = tmp_path / "joined.txt"
    plain.write_text("\n\n".join(rows))
    a = run_perplexity(tiny_engine, data=jsonl, max_length=64, stride=32)
    b = run_perplexity(tiny_engine, data=plain, max_length=64, stride=32)
    assert (a.ppl, a.n_tokens) == (b.ppl, b.n_tokens)


@pytest.mark.parametrize("max_length, stride", [(128, 256), (128, 0), (1, 1), (4096, 512)])
def test_bad_windows_are_refused(tiny_engine, small_text_file, max_length, stride):
    with pytest.raises(EvalConfigError):
        run_perplexity(tiny_engine, data=small_text_file, max_length=max_length, stride=stride)


def test_row_round_trips_through_json(tiny_engine, small_text_file, tmp_path):
    row = run_perplexity(tiny_engine, data=small_text_file, limit_tokens=200, max_length=128, stride=64)
    path = write_row(row, tmp_path / "ppl.json")
    assert read_rows(path) == [row]
    assert {"torch", "transformers", "airquant", "python"} <= set(row.run.versions)


@pytest.mark.slow
@pytest.mark.skipif(not os.environ.get("AIRQUANT_SLOW"), reason="set AIRQUANT_SLOW=1 (2-5 minutes on 2 shared cores)")
def test_default_model_reference_figure(default_engine, wikitext_file):
    """The 135M default model, fp32, first 8192 tokens, window 1024, stride 512: PPL 24.49."""
    row = run_perplexity(default_engine, data=wikitext_file, limit_tokens=8192, max_length=1024, stride=512,
                         batch_size=4)
    ids = torch.tensor([default_engine.tokenizer(wikitext_file.read_text())["input_ids"][:8192]])
    assert abs(row.ppl / guide_perplexity(default_engine.model, ids, 1024, 512) - 1) < 0.005
    assert row.ppl == pytest.approx(24.49, abs=0.05)
