"""ROUGE-L: the scorer against an LCS written out here, and the pipeline end to end."""

from __future__ import annotations

import json
from collections import Counter
from types import SimpleNamespace

import pytest
import torch

from airquant.eval.data import DATA_DIR_ENV
from airquant.eval.rouge import run_rouge, score_summaries, split_sentences
from airquant.eval.rows import read_rows, write_row


def lcs_table(a: list[str], b: list[str]) -> list[list[int]]:
    t = [[0] * (len(b) + 1) for _ in range(len(a) + 1)]
    for i, x in enumerate(a):
        for j, y in enumerate(b):
            t[i + 1][j + 1] = t[i][j] + 1 if x == y else max(t[i][j + 1], t[i + 1][j])
    return t


def lcs_positions(a: list[str], b: list[str]) -> set[int]:
    """Indices into ``a`` of one longest common subsequence (backtracking the DP table)."""
    t, i, j, out = lcs_table(a, b), len(a), len(b), set()
    while i and j:
        if a[i - 1] == b[j - 1]:
            out.add(i - 1)
            i, j = i - 1, j - 1
        elif t[i - 1][j] >= t[i][j - 1]:
            i -= 1
        else:
            j -= 1
    return out


def f1(hits: int, n_pred: int, n_ref: int) -> float:
    p, r = hits / n_pred, hits / n_ref
    return 0.0 if hits == 0 else 2 * p * r / (p + r)


def words(text: str) -> list[str]:
    # Only short lowercase words are used below, so the stemmer (tokens > 3 chars) never applies.
    return text.lower().replace(".", " ").split()


def rouge_l(pred: str, ref: str) -> float:
    a, b = words(ref), words(pred)
    return f1(lcs_table(a, b)[-1][-1], len(b), len(a))


def rouge_lsum(pred_sents: list[str], ref_sents: list[str]) -> float:
    preds, refs = [words(s) for s in pred_sents], [words(s) for s in ref_sents]
    ref_left = Counter(w for s in refs for w in s)
    pred_left = Counter(w for s in preds for w in s)
    hits = 0
    for ref in refs:
        union = set().union(*(lcs_positions(ref, p) for p in preds))
        for k in sorted(union):
            w = ref[k]
            if ref_left[w] > 0 and pred_left[w] > 0:
                hits, ref_left[w], pred_left[w] = hits + 1, ref_left[w] - 1, pred_left[w] - 1
    return f1(hits, sum(map(len, preds)), sum(map(len, refs)))


CASES = [
    ("The cat sat on the mat.", "the cat was on a mat .", ["The cat sat on the mat."], ["the cat was on a mat ."]),
    ("A dog ran far. It was fun to see.", "the dog ran .\nwe saw it was fun .",
     ["A dog ran far.", "It was fun to see."], ["the dog ran .", "we saw it was fun ."]),
    ("One two six. Ten.", "ten one .\ntwo six .", ["One two six.", "Ten."], ["ten one .", "two six ."]),
    ("No way.", "yes sir .", ["No way."], ["yes sir ."]),
]


@pytest.mark.parametrize("pred, ref, pred_sents, ref_sents", CASES)
def test_scores_match_an_independent_lcs(pred, ref, pred_sents, ref_sents):
    (rl, rls), = score_summaries([pred], [ref])
    assert split_sentences(pred) == "\n".join(pred_sents)
    assert rl == pytest.approx(rouge_l(pred, ref))
    assert rls == pytest.approx(rouge_lsum(pred_sents, ref_sents))


def test_sentence_split_keeps_numbers_and_bullets():
    assert split_sentences("He said 3.5 is fine! Then?  Done.") == "He said 3.5 is fine!\nThen?\nDone."
    assert split_sentences("bullet one .\nbullet two") == "bullet one .\nbullet two"


class OracleEngine:
    """Answers every article with its reference: ROUGE must then be exactly 1."""

    def __init__(self, tokenizer, references: dict[str, str]):
        self.tokenizer, self.references = tokenizer, references
        self.config = SimpleNamespace(max_position_embeddings=8192)
        self.device, self.dtype = torch.device("cpu"), torch.float32
        self.calls: list[dict] = []

    def generate(self, prompts, **kw):
        self.calls.append(kw)
        out = []
        for p in prompts:
            ref = next(r for start, r in self.references.items() if start in p)
            out.append(SimpleNamespace(text=ref, prompt_tokens=len(p.split()), new_tokens=len(ref.split())))
        return out

    def describe(self):
        return {"model": "oracle", "store_scheme": "none", "dtype": "float32", "device_name": "cpu"}


@pytest.fixture(scope="module")
def cnn_file(tmp_path_factory):
    rows = [{"id": f"doc{i}", "article": f"Story number {i}. " + "The ship sailed on. " * (40 + 30 * i),
             "highlights": f"Ship {i} sailed .\nCrew of {i} was safe ."} for i in range(5)]
    path = tmp_path_factory.mktemp("cnn") / "cnn.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path, rows


def test_oracle_scores_one_and_flags_are_passed(tokenizer, cnn_file):
    path, rows = cnn_file
    engine = OracleEngine(tokenizer, {f"Story number {i}.": r["highlights"] for i, r in enumerate(rows)})
    row = run_rouge(engine, data=path, limit=4, batch_size=3, max_new_tokens=32)
    assert row.n_samples == 4 and [s.id for s in row.samples] == ["doc0", "doc1", "doc2", "doc3"]
    assert row.rougeL == pytest.approx(1.0) and row.rougeLsum == pytest.approx(1.0)
    assert [c["max_new_tokens"] for c in engine.calls] == [32, 32]
    assert all(c["chat"] and c["temperature"] == 0.0 and "kv" not in c for c in engine.calls)


def test_tiny_model_end_to_end_with_truncation(tiny_engine, cnn_file, tmp_path):
    path, _ = cnn_file
    row = run_rouge(tiny_engine, data=path, limit=3, max_new_tokens=6, max_length=160, batch_size=2)
    assert row.max_length == 160 and row.chat and row.n_truncated >= 1
    assert all(s.prompt_tokens + row.max_new_tokens <= 160 for s in row.samples)
    assert row.samples[-1].truncated and row.samples[-1].prompt_tokens > 120
    rescored = score_summaries([s.prediction for s in row.samples], [json.loads(line)["highlights"] for line in
                                                                     path.read_text().splitlines()[:3]])
    assert row.rougeL == pytest.approx(sum(r for r, _ in rescored) / 3)
    assert read_rows(write_row(row, tmp_path / "rouge.json")) == [row]


def test_local_cnn_dailymail_copy_is_found(tokenizer, monkeypatch):
    from airquant.eval.data import find_local, load_cnn_dailymail

    if find_local("cnn_dailymail") is None:
        pytest.skip("no local CNN/DailyMail copy on this machine")
    monkeypatch.delenv(DATA_DIR_ENV, raising=False)
    examples, source = load_cnn_dailymail(None, limit=2)
    assert len(examples) == 2 and "cnn_dailymail_test_250.jsonl" in source and examples[0].highlights
