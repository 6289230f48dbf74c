"""Progress of a metric's work: one tqdm bar per loop that can take more than a few seconds.

``airquant eval`` printed nothing for a minute and more while a metric ran. The bars go to stderr on a terminal
only (tqdm's ``disable=None``): a notebook kernel, a pipe or pytest's capture sees nothing, so the notebooks'
outputs and rows stay as they were. ``airquant -q`` (tqdm's own ``TQDM_DISABLE``) hides them everywhere.
"""

from __future__ import annotations

import os
from typing import Iterable, TypeVar

from tqdm import tqdm

T = TypeVar("T")


def shown() -> bool | None:
    """tqdm's ``disable``: True when turned off (``TQDM_DISABLE``), else None (off unless stderr is a terminal)."""
    return True if os.environ.get("TQDM_DISABLE", "").lower() in ("1", "true", "yes") else None


def steps(items: Iterable[T], desc: str, unit: str, total: int | None = None) -> Iterable[T]:
    """``items`` with a bar over them that is removed when the loop ends (the metric prints its own result)."""
    return tqdm(items, desc=desc, unit=unit, total=total, disable=shown(), leave=False)


def bar(total: int, desc: str, unit: str) -> tqdm:
    """A bar to ``update`` by hand (a loop whose steps are of several sizes); close it when done."""
    return tqdm(total=total, desc=desc, unit=unit, disable=shown(), leave=False)
