"""One exception type for mistakes a user can fix, and the entry point that reports them."""

from __future__ import annotations

import sys
from collections.abc import Callable

from finetune.environment import LaunchEnvironment

__all__ = ["USER_ERROR_EXIT_CODE", "UserError", "run_main"]

USER_ERROR_EXIT_CODE = 2


class UserError(Exception):
    """Bad input: the message names the problem and the fix, and is shown without a traceback."""


def run_main(main: Callable[[list[str] | None], object], argv: list[str] | None = None) -> None:
    """Run a recipe's ``main``; a ``UserError`` becomes one line on stderr and exit status 2."""
    try:
        main(argv)
    except UserError as err:
        env = LaunchEnvironment.read()
        prefix = f"[rank {env.rank}] " if env.world_size > 1 else ""
        print(f"{prefix}error: {err}", file=sys.stderr, flush=True)
        sys.exit(USER_ERROR_EXIT_CODE)
