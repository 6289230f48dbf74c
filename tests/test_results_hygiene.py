"""Results carry no machine's paths: data files by name and sha256, stores by name."""

import json
import re
from pathlib import Path

RESULTS = Path(__file__).resolve().parent.parent / "results"
# An absolute POSIX path of two or more parts, a home-relative one, or a Windows drive path.
ABSOLUTE = re.compile(r"(?:^|[\s('\"=:,])(?:~?/(?:[\w.+-]+/)+[\w.+-]*|[A-Za-z]:\\[\w\\. -]+)")


def strings(value):
    if isinstance(value, str):
        yield value
    elif isinstance(value, dict):
        for k, v in value.items():
            yield k
            yield from strings(v)
    elif isinstance(value, list):
        for v in value:
            yield from strings(v)


def machine_paths(body) -> list[str]:
    return [s for s in strings(body) if ABSOLUTE.search(s)]


def test_the_check_finds_paths():
    assert machine_paths({"data": "/work/shared/data/wikitext2_test.raw (sha256 173c)"})
    assert machine_paths({"a": ["x", {"store": "~/stores/llama"}]})
    assert machine_paths({"f": "C:\\Users\\me\\data.txt"})
    assert not machine_paths({"data": "wikitext2_test.raw (sha256 173c)", "unit": "tok/s", "hf": "hf:wikitext/x"})


def test_results_json_have_no_machine_paths():
    found = {}
    for path in sorted(RESULTS.glob("*.json")):
        hits = machine_paths(json.loads(path.read_text()))
        if hits:
            found[path.name] = hits[:3]
    assert found == {}, "record data files by name + sha256 (airquant.eval.data.file_source), not by path"
