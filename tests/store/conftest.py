"""Fixtures and helpers of the store tests: a writable copy of the tiny store, the CLI run in process."""

from __future__ import annotations

import contextlib
import io
import shutil

import pytest

from airquant.cli import main


def run_cli(*argv):
    """``airquant ARGV`` in this process: (exit code, stdout, stderr)."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = main([str(a) for a in argv])
    return rc, out.getvalue(), err.getvalue()


@pytest.fixture
def store(tmp_path, tiny_store):
    """A copy of the session's tiny store that a test may damage."""
    dst = tmp_path / "store"
    shutil.copytree(tiny_store, dst)
    return dst
