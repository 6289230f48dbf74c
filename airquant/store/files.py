"""Every write into a store, and the one rule on what a store may hold: no symbolic links.

A write goes to a temp file in the store's own folder under a name no one can guess (the pid, for
``remove_stale_temps``, and 64 random bits), created with ``O_CREAT|O_EXCL|O_NOFOLLOW``: a link or
file planted at that name makes the create fail instead of writing through it. The temp file is
fsynced and renamed over the target (``rename`` replaces a link, never follows it), then the folder
is fsynced: a crash leaves the old file or the new one, never half of one.

Why no links at all: a store is often copied from elsewhere (a shared drive, a download). A link
inside it makes a read (``info --verify``, the engine) or a write (a resumed ``shard``) reach a file
outside the store, so a linked shard could pass ``--verify`` while it points anywhere.
"""

from __future__ import annotations

import errno
import os
import secrets
import shutil
import tempfile
from pathlib import Path
from typing import Callable

from airquant.errors import DiskSpaceError, StoreError

TMP_MARK = ".tmp-"
# Folders that keep their tokenizer files (``save_pretrained``) are readable by others, as files are.
_FOLDER_MODE = 0o755
_CREATE = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC


def temp_name(name: str) -> str:
    """``.NAME.tmp-PID-RANDOM``: the pid tells ``remove_stale_temps`` whether its writer is gone."""
    return f".{name}{TMP_MARK}{os.getpid()}-{secrets.token_hex(8)}"


def write_atomic(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` through a fresh temp file in its folder, fsync, rename, fsync the folder.

    A full disk removes the temp file and raises ``DiskSpaceError`` with the numbers; ``path`` is untouched."""
    tmp = path.parent / temp_name(path.name)
    fd = os.open(tmp, _CREATE, 0o666)  # the umask applies, as for open(path, "wb")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        if exc.errno not in (errno.ENOSPC, errno.EDQUOT):
            raise
        free = shutil.disk_usage(path.parent).free
        raise DiskSpaceError(f"the disk of {path.parent} is full: writing {path.name} needs {len(data) / 1e6:.1f} MB, "
                             f"{free / 1e6:.1f} MB are free. The files already written are kept; free space and "
                             "re-run the same command to continue.") from exc
    os.replace(tmp, path)
    fsync_dir(path.parent)


def replace_folder(path: Path, fill: Callable[[Path], None]) -> None:
    """Make folder ``path`` anew: ``fill(tmp)`` writes into a fresh temp folder (``mkdtemp``: created
    exclusively, under a random name), which then replaces ``path``."""
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}{TMP_MARK}{os.getpid()}-", dir=path.parent))
    try:
        fill(tmp)
        os.chmod(tmp, _FOLDER_MODE)
        if path.is_symlink():
            path.unlink()
        elif path.exists():
            shutil.rmtree(path)
        tmp.rename(path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    fsync_dir(path.parent)


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def remove_stale_temps(store: Path) -> list[str]:
    """Delete temp files and folders left by a writer that was killed (its pid is gone); returns their names."""
    removed = []
    for p in store.glob(f".*{TMP_MARK}*"):
        pid = p.name.rsplit(TMP_MARK, 1)[1].split("-", 1)[0]
        if not pid.isdigit() or _alive(int(pid)):
            continue
        if p.is_dir() and not p.is_symlink():
            shutil.rmtree(p)
        else:
            p.unlink(missing_ok=True)
        removed.append(p.name)
    legacy = store / ".tokenizer.tmp"  # the fixed name of versions before the random one
    if legacy.is_dir() and not legacy.is_symlink():
        shutil.rmtree(legacy)
        removed.append(legacy.name)
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's live process
        return True
    return True


def refuse_links(store: Path) -> None:
    """Raise ``StoreError`` naming the first symbolic link inside ``store`` (the store folder itself may be one)."""
    for folder, dirs, files in os.walk(store):
        for name in sorted(dirs + files):
            path = Path(folder) / name
            if path.is_symlink():
                raise StoreError(
                    f"{path} is a symbolic link (to {os.readlink(path)}); a store holds only its own files, so "
                    f"AirQuant neither reads nor writes through links in {store}. Replace the link with the file "
                    "itself (`cp --remove-destination TARGET LINK`), or re-run `airquant shard` into a new --store.")
