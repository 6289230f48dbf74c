"""The detokenizer, the one owner of stop strings: cut across token boundaries, possible starts held back."""

import pytest

from airquant.engine.decode.text import Detokenizer


class Pieces:
    """A tokenizer double: token i decodes to ``pieces[i]`` (a piece may end inside a character: U+FFFD)."""

    def __init__(self, pieces: list[str]):
        self.pieces = pieces

    def decode(self, ids, skip_special_tokens=True):
        return "".join(self.pieces[i] for i in ids)


@pytest.mark.parametrize("stops, pieces, sent, finish_reason", [
    ((), ["Hel", "lo"], ["Hel", "lo"], None),
    (("\n\n",), ["a\n", "\nb"], ["a", ""], "stop"),  # the stop string spans two tokens: nothing of it leaks
    (("END",), ["xE", "N", "Dy"], ["x", "", ""], "stop"),
    (("END",), ["xE", "Nz"], ["x", "ENz"], None),  # a false start is released once it cannot match
    (("ab", "b"), ["ab"], [""], "stop"),  # the earliest stop wins
])
def test_stop_strings_are_cut_and_held_back(stops, pieces, sent, finish_reason):
    detok = Detokenizer(Pieces(pieces), stops)
    assert [detok.push([i]) for i in range(len(pieces))] == sent
    assert detok.finish_reason == finish_reason
    assert "".join(sent) + detok.flush() == detok.text  # what was released adds up to the text kept


def test_the_text_is_cut_where_the_stop_string_starts():
    detok = Detokenizer(Pieces(["one ", "two", " STO", "P more"]), ("STOP",))
    assert [detok.push([i]) for i in range(4)] == ["one ", "two", " ", ""]  # "STO" held back, then cut
    assert (detok.text, detok.finish_reason, detok.flush()) == ("one two ", "stop", "")


def test_a_partial_character_is_held_until_it_decodes():
    detok = Detokenizer(Pieces(["caf", "\ufffd"]))
    assert detok.push([0]) == "caf"
    assert detok.push([1]) == ""  # ends inside a character
    assert detok.flush() == ""  # the sequence ended there: the broken character stays out
