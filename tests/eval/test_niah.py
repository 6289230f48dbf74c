"""Needle in a haystack: placement and scoring against engines whose recall is known in advance."""

from __future__ import annotations

import re
from types import SimpleNamespace

import pytest
import torch

from airquant.eval.niah import default_context_lengths, normalize, place_needle, run_niah, score_response
from airquant.eval.plots import plot_niah_heatmap
from airquant.eval.rows import read_rows, write_row

NUMBER = re.compile(r"magic number mentioned in this text is (\d+)\.")


class WindowedRetriever:
    """Finds the needle only within the last ``window`` words of the prompt, as a model with a short
    attention span would; ``window=None`` sees everything."""

    def __init__(self, tokenizer, window: int | None, context: int = 4096):
        self.tokenizer, self.window = tokenizer, window
        self.config = SimpleNamespace(max_position_embeddings=context)
        self.device, self.dtype = torch.device("cpu"), torch.float32
        self.batches: list[int] = []

    def _tokens(self, prompt):
        # Counted through tokenize=True, a different path from the metric's own count.
        enc = self.tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=True,
                                                 add_generation_prompt=True)
        return len(enc["input_ids"])

    def generate(self, prompts, *, max_new_tokens, temperature, chat):
        assert chat and temperature == 0.0
        self.batches.append(len(prompts))
        out = []
        for p in prompts:
            seen = p if self.window is None else " ".join(p.split()[-self.window:])
            found = NUMBER.search(seen)
            text = found.group(1) if found else "I could not find it."
            out.append(SimpleNamespace(text=text, prompt_tokens=self._tokens(p), new_tokens=4))
        return out

    def describe(self):
        return {"model": "retriever", "store_scheme": "none", "dtype": "float32", "device_name": "cpu"}


def test_default_grid_and_scoring_rules():
    assert default_context_lengths(8192) == (1024, 2048, 4096, 8192)
    assert default_context_lengths(6000) == (1024, 2048, 4096, 6000)
    assert default_context_lengths(512) == (512,)
    assert normalize("The number is: 123,456!") == "the number is 123456"
    assert normalize("Pairs: 1,2 and 12,3456.") == "pairs 1 2 and 12 3456"
    assert score_response(" 482913.\n", "482913") == (1.0, True)
    assert score_response("It is 482913.", "482913") == (1.0, False)
    assert score_response("4829130", "482913") == (0.0, False)
    assert score_response("It is 482,913.", "482913") == (1.0, False)
    assert score_response("The magic number is 482913", "482913") == (1.0, False)


@pytest.mark.parametrize("depth, before, after", [
    (0, "", "One. Two three. Four."), (100, "One. Two three. Four.", ""), (50, "One.", "Two three. Four."),
    (80, "One. Two three.", "Four."), (75, "One.", "Two three. Four."),
])
def test_needle_goes_to_a_sentence_start(depth, before, after):
    assert place_needle("One. Two three. Four.", "N.", depth) == (before, after)


def test_seeing_retriever_recalls_everything_and_prompts_fill_the_context(tokenizer, small_text_file):
    engine = WindowedRetriever(tokenizer, window=None)
    row = run_niah(engine, data=small_text_file, context_lengths=(512, 1024), depths=(0, 50, 100), trials=2,
                   max_new_tokens=8, batch_size=4)
    assert row.recall == 1.0 and row.recall_at_longest == 1.0 and all(c.exact for c in row.cells)
    assert len(row.cells) == 12 and engine.batches == [4, 2, 4, 2]
    assert len({c.answer for c in row.cells}) == 12
    for c in row.cells:
        assert c.context_length - 8 - 12 <= c.prompt_tokens <= c.context_length - 8
        assert abs(c.needle_position - c.depth_percent / 100) < 0.1


def test_short_sighted_retriever_misses_deep_needles(tokenizer, small_text_file):
    row = run_niah(WindowedRetriever(tokenizer, window=150), data=small_text_file, context_lengths=(1024,),
                   depths=(0, 25, 50, 75, 100), max_new_tokens=8)
    by_depth = {c.depth_percent: c.recall for c in row.cells}
    # 150 words is ~20 % of a 1K-token prompt: only the needle at the very end is within reach.
    assert by_depth == {0.0: 0.0, 25.0: 0.0, 50.0: 0.0, 75.0: 0.0, 100.0: 1.0}
    assert row.recall == pytest.approx(0.2)


def test_answers_depend_on_the_cell_and_seed_only(tokenizer, small_text_file):
    kw = dict(data=small_text_file, depths=(0, 100), max_new_tokens=8)
    a = run_niah(WindowedRetriever(tokenizer, None), context_lengths=(512, 1024), **kw)
    b = run_niah(WindowedRetriever(tokenizer, None), context_lengths=(1024,), **kw)
    c = run_niah(WindowedRetriever(tokenizer, None), context_lengths=(1024,), seed=1, **kw)
    assert [x.answer for x in a.cells[2:]] == [x.answer for x in b.cells]
    assert [x.answer for x in b.cells] != [x.answer for x in c.cells]


def test_tiny_model_run_round_trips_and_plots(tiny_engine, small_text_file, tmp_path):
    row = run_niah(tiny_engine, data=small_text_file, context_lengths=(192, 384), depths=(0, 50, 100),
                   max_new_tokens=4, batch_size=3)
    assert row.context_lengths == (192, 384) and len(row.cells) == 6 and row.chat
    assert all(c.prompt_tokens <= c.context_length - 4 for c in row.cells)
    assert read_rows(write_row(row, tmp_path / "niah.json")) == [row]
    png = plot_niah_heatmap(row, tmp_path / "niah.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
