"""One exception type for mistakes a user can fix, and the entry point that reports them."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable

__all__ = ["UserError", "run_main"]

USER_ERROR_EXIT_CODE = 2


class UserError(Exception):
    """Bad input: the message names the problem and the fix, and is shown without a traceback."""


def run_main(main: Callable[[list[str] | None], object], argv: list[str] | None = None) -> None:
    """Run a recipe's ``main``; a ``UserError`` becomes one line on stderr and exit status 2."""
    try:
        main(argv)
    except UserError as err:
        world_size = int(os.environ.get("WORLD_SIZE", "1"))
        prefix = f"[rank {os.environ.get('RANK', '0')}] " if world_size > 1 else ""
        print(f"{prefix}error: {err}", file=sys.stderr, flush=True)
        sys.exit(USER_ERROR_EXIT_CODE)
