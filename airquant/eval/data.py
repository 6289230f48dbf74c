"""Evaluation data: the Hugging Face copy when ``datasets`` can reach it, local files otherwise.

``data=None`` means "the standard set": first ``datasets.load_dataset`` (if the package is installed
and the hub answers), then the offline copy found in ``$AIRQUANT_DATA_DIR``, ``~/.cache/airquant/data``
or ``/work/shared/data``. A path given as ``data`` is always used as is.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path

from airquant.errors import EvalDataError

log = logging.getLogger(__name__)

DATA_DIR_ENV = "AIRQUANT_DATA_DIR"
_FALLBACK_DIRS = (Path.home() / ".cache" / "airquant" / "data", Path("/work/shared/data"))
# The HF perplexity guide joins WikiText rows with a blank line; local .jsonl copies get the same.
ROW_JOINER = "\n\n"


@dataclass(frozen=True)
class HubSpec:
    path: str
    name: str | None
    split: str

    def __str__(self) -> str:
        return f"hf:{self.path}/{self.name}/{self.split}"


WIKITEXT2 = HubSpec("wikitext", "wikitext-2-raw-v1", "test")
CNN_DAILYMAIL = HubSpec("abisee/cnn_dailymail", "3.0.0", "test")
LOCAL_DEFAULTS = {
    "wikitext2": "wikitext2_test.raw",
    "cnn_dailymail": "cnn_dailymail_test_250.jsonl",
    "haystack": "haystack_moby_dick_pg2701.txt",
}


@dataclass(frozen=True)
class TextCorpus:
    text: str
    source: str  # "hf:..." or "<file name> (sha256 <prefix>)"


@dataclass(frozen=True)
class SummaryExample:
    id: str
    article: str
    highlights: str  # reference bullets, one per line


def data_dirs() -> list[Path]:
    env = os.environ.get(DATA_DIR_ENV)
    dirs = [Path(p) for p in env.split(os.pathsep) if p] if env else []
    return dirs + list(_FALLBACK_DIRS)


def find_local(kind: str) -> Path | None:
    """The offline copy of a standard data set, or None."""
    name = LOCAL_DEFAULTS[kind]
    return next((d / name for d in data_dirs() if (d / name).is_file()), None)


def file_source(path: Path) -> str:
    """A data file as results record it: its name and content hash, never the machine's path to it."""
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    return f"{path.name} (sha256 {digest[:16]})"


def read_jsonl(path: Path) -> list[dict]:
    rows = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as exc:
                raise EvalDataError(f"{path}:{lineno} is not valid JSON ({exc}); fix or remove that line.") from exc
    return rows


def read_text_file(path: str | Path, *, field: str = "text") -> str:
    """Plain text as is; ``.jsonl`` as its ``field`` values joined with a blank line."""
    path = Path(path)
    if not path.is_file():
        raise EvalDataError(f"--data {path}: no such file; give a plain-text file or a .jsonl with a "
                            f"{field!r} field.")
    if path.suffix == ".jsonl":
        rows = read_jsonl(path)
        bad = next((i for i, r in enumerate(rows) if not isinstance(r.get(field), str)), None)
        if bad is not None:
            raise EvalDataError(f"{path}: row {bad + 1} has no string {field!r} field; every row needs one.")
        return ROW_JOINER.join(r[field] for r in rows)
    return path.read_text(encoding="utf-8")


@functools.cache
def _say_local(spec: HubSpec) -> None:
    # Once per data set and process: the suite loads the same set for every configuration and metric.
    log.info("`datasets` is not installed; using the local copy of %s", spec)


def hub_dataset(spec: HubSpec):
    """The ``datasets`` split, or None when the package is missing or the hub cannot be reached."""
    try:
        import datasets
    except ImportError:
        _say_local(spec)
        return None
    try:
        return datasets.load_dataset(spec.path, spec.name, split=spec.split)
    # Offline failures surface as ConnectionError / FileNotFoundError / DatasetNotFoundError: all OSError.
    except OSError as exc:
        log.warning("could not load %s from the hub (%s); using the local copy", spec, exc)
        return None


def _missing(kind: str, spec: HubSpec | None) -> EvalDataError:
    hub = f"`pip install datasets` with network access to {spec}, or " if spec else ""
    return EvalDataError(f"no {kind} data: {hub}pass --data FILE, or put {LOCAL_DEFAULTS[kind]} in "
                         f"${DATA_DIR_ENV} (searched {', '.join(map(str, data_dirs()))}).")


def load_wikitext(data: str | Path | None = None) -> TextCorpus:
    """WikiText-2 raw test (or ``data``) as one string."""
    if data is not None:
        return TextCorpus(read_text_file(data), file_source(Path(data)))
    ds = hub_dataset(WIKITEXT2)
    if ds is not None:
        return TextCorpus(ROW_JOINER.join(ds["text"]), str(WIKITEXT2))
    local = find_local("wikitext2")
    if local is None:
        raise _missing("wikitext2", WIKITEXT2)
    return TextCorpus(read_text_file(local), file_source(local))


def _summary_rows(rows: list[dict], source: str) -> list[SummaryExample]:
    out = []
    for i, r in enumerate(rows):
        if not isinstance(r.get("article"), str) or not isinstance(r.get("highlights"), str):
            raise EvalDataError(f"{source}: row {i + 1} needs string 'article' and 'highlights' fields.")
        out.append(SummaryExample(id=str(r.get("id", i)), article=r["article"], highlights=r["highlights"]))
    return out


def load_cnn_dailymail(data: str | Path | None = None, limit: int | None = None) -> tuple[list[SummaryExample], str]:
    """CNN/DailyMail test pairs (or a JSONL with article/highlights) and where they came from."""
    if data is not None:
        path = Path(data)
        if not path.is_file():
            raise EvalDataError(f"--data {path}: no such file; give a .jsonl with article and highlights fields.")
        rows, source = read_jsonl(path), file_source(path)
    else:
        ds = hub_dataset(CNN_DAILYMAIL)
        if ds is not None:
            ds = ds.select(range(min(limit, len(ds)))) if limit else ds
            rows, source = [dict(r) for r in ds], str(CNN_DAILYMAIL)
        else:
            local = find_local("cnn_dailymail")
            if local is None:
                raise _missing("cnn_dailymail", CNN_DAILYMAIL)
            rows, source = read_jsonl(local), file_source(local)
    rows = rows[:limit] if limit else rows
    return _summary_rows(rows, source), source


def load_haystack(data: str | Path | None = None) -> TextCorpus:
    """Filler text for needle-in-a-haystack (Moby-Dick by default); there is no hub copy."""
    if data is not None:
        return TextCorpus(read_text_file(data), file_source(Path(data)))
    local = find_local("haystack")
    if local is None:
        raise _missing("haystack", None)
    return TextCorpus(read_text_file(local), file_source(local))
