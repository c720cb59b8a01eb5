"""Files and folders written whole or not at all: into ``NAME.partial`` beside their final name, then renamed over
it, so that a reader (a push in flight, a resumed run, a user) finds the old one or the new one, never half of one;
and a new output checked before the work that makes it."""

from __future__ import annotations

import contextlib
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

from finetune.errors import UserError

__all__ = ["check_new_output", "fsync_directory", "replacing"]


def check_new_output(path: Path, flag: str) -> None:
    """Refuse to write ``path`` (named by ``flag``) over what is there, or into a folder that is missing or not
    this user's to write.

    Raises:
        UserError: either, in one line.
    """
    if path.exists():
        raise UserError(f"{flag} {path} exists: remove it or give another")
    if not path.parent.is_dir() or not os.access(path.parent, os.W_OK):
        raise UserError(f"{flag} {path}: {path.parent} is not a folder this user can write")


@contextlib.contextmanager
def replacing(path: Path, durable: bool = False) -> Iterator[Path]:
    """Where to write ``path``'s new content (a file or a folder): renamed over ``path`` when the block ends, and
    with ``durable`` flushed to disk first (a checkpoint relies on it); a block that raises leaves ``path`` as it
    was and nothing beside it. A folder replaces only a missing or empty one."""
    partial = path.with_name(path.name + ".partial")
    _remove(partial)  # what a killed writer left
    try:
        yield partial
        if durable:
            with open(partial, "rb") as written:
                os.fsync(written.fileno())
        os.replace(partial, path)
        if durable:
            fsync_directory(path.parent)
    finally:
        _remove(partial)


def fsync_directory(path: Path) -> None:
    """Make a rename inside ``path`` durable."""
    descriptor = os.open(path, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)
