"""Logit parity against the same statistics computed in float64 numpy."""

from __future__ import annotations

import copy
from dataclasses import dataclass

import numpy as np
import pytest
import torch

from airquant.errors import EvalConfigError
from airquant.eval.parity import run_parity
from airquant.eval.rows import read_rows, write_row


@dataclass(frozen=True)
class FakeKV:
    backend: str = "tq"
    bits_k: int = 3
    bits_v: int = 2


def numpy_stats(test: np.ndarray, ref: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """cosine, top-1 match and KL(ref || test) per row of [T, V] float64 logits."""
    cos = (test * ref).sum(-1) / (np.linalg.norm(test, axis=-1) * np.linalg.norm(ref, axis=-1))
    agree = test.argmax(-1) == ref.argmax(-1)

    def log_softmax(x):
        x = x - x.max(-1, keepdims=True)
        return x - np.log(np.exp(x).sum(-1, keepdims=True))

    lp, lq = log_softmax(ref), log_softmax(test)
    return cos, agree, (np.exp(lp) * (lp - lq)).sum(-1)


@pytest.fixture(scope="module")
def noisy_engine(tiny_engine, make_engine):
    """The tiny model with 5 % Gaussian noise on every weight: close to, but not the reference."""
    model = copy.deepcopy(tiny_engine.model)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.05 * p.std())
    return make_engine(model, name="tiny-llama", store_scheme="noisy")


def test_matches_float64_numpy(tiny_engine, noisy_engine, small_text_file, tmp_path):
    row = run_parity(noisy_engine, reference=tiny_engine, data=small_text_file, limit_tokens=300, max_length=128)
    ids = torch.tensor(tiny_engine.tokenizer(small_text_file.read_text())["input_ids"][:300])
    stats = []
    with torch.no_grad():
        for begin in range(0, 300, 128):  # disjoint windows; a window's last logit predicts past it
            window = ids[None, begin:begin + 128]
            test = noisy_engine.model(window).logits[0, :-1].double().numpy()
            ref = tiny_engine.model(window).logits[0, :-1].double().numpy()
            stats.append(numpy_stats(test, ref))
    cos, agree, kl = (np.concatenate(s) for s in zip(*stats))
    assert row.n_positions == len(cos) == 300 - 3 and row.n_windows == 3
    assert row.cosine_mean == pytest.approx(cos.mean(), rel=1e-5)
    assert row.cosine_min == pytest.approx(cos.min(), rel=1e-5)
    assert row.top1_agreement == pytest.approx(agree.mean())
    assert row.kl_mean == pytest.approx(kl.mean(), rel=1e-3)
    assert row.kl_max == pytest.approx(kl.max(), rel=1e-3)
    assert 0 < row.kl_mean and row.top1_agreement < 1 and row.cosine_mean < 1
    assert row.run.store_scheme == "noisy" and row.reference_run.store_scheme == "float32"
    assert read_rows(write_row(row, tmp_path / "parity.json")) == [row]


def test_kv_against_the_same_engine_without_it(tiny_engine, small_text_file):
    tiny_engine.forward_kv.clear()
    row = run_parity(tiny_engine, kv=FakeKV(), data=small_text_file, limit_tokens=400, max_length=96, stride=64,
                     batch_size=2)
    # This stand-in engine ignores kv: both passes are the same computation.
    assert row.cosine_mean == pytest.approx(1.0, abs=1e-6) and row.top1_agreement == 1.0
    assert abs(row.kl_mean) < 1e-6 and row.n_positions == 399
    assert row.run.kv_scheme == "tq-k3v2" and row.reference_run.kv_scheme == "none"
    assert FakeKV() in tiny_engine.forward_kv and None in tiny_engine.forward_kv


def test_self_parity_without_kv_is_refused(tiny_engine, small_text_file):
    with pytest.raises(EvalConfigError, match="compares nothing"):
        run_parity(tiny_engine, data=small_text_file)
