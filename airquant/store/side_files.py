"""A store's transformers files (``config.json``, ``tokenizer/``), read without running any code.

A store is data: AirQuant never imports Python shipped in one. transformers does when a config or
tokenizer config declares ``auto_map`` and ``trust_remote_code`` is left unset (it asks ``[y/N]`` on a
terminal, and fails with a traceback without one), so a store that declares code is refused with the
file named, and every config and tokenizer is built with ``trust_remote_code=False``.
"""

from __future__ import annotations

from pathlib import Path

from airquant.errors import StoreError
from airquant.models import declared_code


def refuse_code(store: Path) -> None:
    """Raise ``StoreError`` naming the first config of ``store`` that declares code of its own (``auto_map``)."""
    for folder in (store, store / "tokenizer"):
        check_no_code(folder)


def check_no_code(folder: Path) -> None:
    found = declared_code(folder)
    if found:
        path, names = found
        raise StoreError(
            f"{path} declares Python code of its own (auto_map: {names}); AirQuant never runs code shipped with a "
            f"store or tokenizer. If you made {folder} yourself, delete the \"auto_map\" entry from {path.name}; "
            "otherwise do not use it.")


def read_config(store: Path):
    """The store's transformers config."""
    from transformers import AutoConfig

    check_no_code(store)
    return AutoConfig.from_pretrained(store, trust_remote_code=False)


def load_tokenizer(folder: Path):
    """A tokenizer saved by ``save_pretrained`` (a store's ``tokenizer/``)."""
    from transformers import AutoTokenizer

    check_no_code(folder)
    return AutoTokenizer.from_pretrained(folder, trust_remote_code=False)
