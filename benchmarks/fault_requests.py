"""Malformed OpenAI-shaped requests as a ``hypothesis`` strategy: each one must be answered 4xx.

Every drawn request is wrong in at least one way the server must catch: a body that is not JSON
(or not UTF-8), a JSON value of the wrong shape, a field of the wrong type or out of range (``max_tokens``
far beyond any context), unicode garbage in place of the fields, or a body far larger than any prompt.
"""

from __future__ import annotations

import json

from hypothesis import strategies as st

COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"
JSON = {"content-type": "application/json"}
OVERSIZED_BYTES = 5 << 20  # above the server's default body limit (--max-body-mb 4) and any prompt

_garbage = st.text(st.characters(codec="utf-8", exclude_categories=["Cs"]), min_size=1, max_size=64)
# Words only: pydantic's lax mode reads "12" as an integer, so a wrong-type string must not be numeric.
_word = st.text(st.characters(categories=["L"]), min_size=1, max_size=16)
_not_a_string = st.one_of(st.integers(), st.floats(allow_nan=False), st.booleans(), st.none(),
                          st.dictionaries(_word, st.integers(), max_size=3), st.lists(st.integers(), min_size=1))
_bad_max_tokens = st.one_of(st.integers(max_value=0), st.integers(min_value=10**7, max_value=10**18), _word,
                            st.floats(allow_nan=False, allow_infinity=False).filter(lambda x: x != int(x)),
                            st.lists(st.integers(), max_size=2), st.booleans().map(lambda b: {"n": b}))
_bad_temperature = st.one_of(st.floats(min_value=2.0, exclude_min=True, allow_infinity=False),
                             st.floats(max_value=0.0, exclude_max=True, allow_infinity=False), _word)


def _not_json(data: bytes) -> bool:
    try:
        json.loads(data)
    except (ValueError, UnicodeDecodeError):
        return True
    return False


def _dump(body) -> bytes:
    return json.dumps(body, ensure_ascii=False).encode("utf-8", "surrogatepass")


@st.composite
def _field_errors(draw):
    """A body whose one field has the wrong type or an out-of-range value."""
    chat = draw(st.booleans())
    body = {"messages": [{"role": "user", "content": "Hi"}]} if chat else {"prompt": "Hi"}
    which = draw(st.sampled_from(["input", "max_tokens", "temperature", "role", "content"] if chat
                                 else ["input", "max_tokens", "temperature"]))
    if which == "input":
        body = {k: draw(st.one_of(_not_a_string, st.just([]), st.just(""))) for k in body}
    elif which == "max_tokens":
        body["max_tokens"] = draw(_bad_max_tokens)
    elif which == "temperature":
        body["temperature"] = draw(_bad_temperature)
    elif which == "role":
        body["messages"][0]["role"] = draw(_garbage.filter(lambda r: r not in ("system", "user", "assistant")))
    else:
        body["messages"][0]["content"] = draw(_not_a_string)
    return (CHAT if chat else COMPLETIONS, _dump(body), JSON)


@st.composite
def _garbage_bodies(draw):
    """Unicode garbage instead of the fields (the required ``prompt``/``messages`` missing)."""
    body = draw(st.dictionaries(_garbage.filter(lambda k: k not in ("prompt", "messages")), _garbage, max_size=6))
    return (draw(st.sampled_from([COMPLETIONS, CHAT])), _dump(body), JSON)


@st.composite
def _wrong_shapes(draw):
    value = draw(st.one_of(st.lists(_garbage, max_size=3), _garbage, st.integers(), st.none(), st.booleans()))
    return (draw(st.sampled_from([COMPLETIONS, CHAT])), _dump(value), JSON)


@st.composite
def _not_json_bodies(draw):
    data = draw(st.one_of(st.binary(min_size=1, max_size=512),
                          _garbage.map(lambda s: ("{" + s).encode("utf-8", "surrogatepass"))).filter(_not_json))
    return (draw(st.sampled_from([COMPLETIONS, CHAT])), data, JSON)


@st.composite
def _oversized(draw):
    words = " ".join(draw(st.lists(_word, min_size=1, max_size=8)))
    prompt = (words + " ") * (OVERSIZED_BYTES // (len(words.encode()) + 1) + 1)
    return (COMPLETIONS, _dump({"prompt": prompt, "max_tokens": 4}), JSON)


def malformed():
    """(path, body bytes, headers) of a request the server must refuse with a 4xx."""
    return st.one_of(_field_errors(), _garbage_bodies(), _wrong_shapes(), _not_json_bodies(), _oversized())
