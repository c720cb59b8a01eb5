"""Files and folders written whole or not at all: into ``NAME.partial`` beside their final name, then renamed over
it, so that a reader (a push in flight, a resumed run, a user) finds the old one or the new one, never half of one."""

from __future__ import annotations

import contextlib
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

__all__ = ["fsync_directory", "replacing"]


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
