"""The two ways a run ends early on purpose: a mistake the user can fix (``UserError``, one line, exit 2) and a stop
on a signal after a checkpoint (``Stopped``, exit 143); and the entry point that reports them."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from pathlib import Path

from finetune.environment import LaunchEnvironment

__all__ = ["STOPPED_EXIT_CODE", "USER_ERROR_EXIT_CODE", "Stopped", "UserError", "read_reports", "run_main"]

USER_ERROR_EXIT_CODE = 2
STOPPED_EXIT_CODE = 143
"""128 + SIGTERM: what a process ended by SIGTERM reports, so schedulers read the job as stopped, not failed."""


class UserError(Exception):
    """Bad input: the message names the problem and the fix, and is shown without a traceback."""


class Stopped(Exception):
    """The run stopped on a signal after writing a checkpoint of its last step; it resumes from there."""


def run_main(main: Callable[[list[str] | None], object], argv: list[str] | None = None) -> None:
    """Run a recipe's ``main``; a ``UserError`` becomes one line on stderr and exit status 2, a stop on a
    signal (already reported) exit status 143. The main process also writes either status into
    ``FINETUNE_EXIT_STATUS_FILE`` when that is set; under ``finetune launch`` every process reports to it instead
    (``FINETUNE_REPORT_DIR``), which shows the refusal once."""
    env = LaunchEnvironment.read()
    try:
        main(argv)
    except Stopped:
        _exit(env, STOPPED_EXIT_CODE)
    except UserError as err:
        if not env.report_dir:
            prefix = f"[rank {env.rank}] " if env.world_size > 1 else ""
            print(f"{prefix}error: {err}", file=sys.stderr, flush=True)
        _exit(env, USER_ERROR_EXIT_CODE, str(err))


def _exit(env: LaunchEnvironment, status: int, message: str = "") -> None:
    # torchrun exits 1 whatever its workers' status; a batch script learns the main process's from this file.
    if env.exit_status_file and env.rank == 0:
        with open(env.exit_status_file, "w") as f:
            f.write(f"{status}\n")
    if env.report_dir:
        # renamed into place: the launcher reads the folder as soon as a process has ended
        report = Path(env.report_dir) / f"rank-{env.rank}"
        report.with_suffix(".partial").write_text(f"{status}\n{message}")
        os.replace(report.with_suffix(".partial"), report)
    sys.exit(status)


def read_reports(folder: str | Path) -> dict[int, tuple[int, str]]:
    """The processes that ended early under ``finetune launch``, by rank: their exit status and message."""
    reports = {}
    for path in Path(folder).glob("rank-*"):
        if path.suffix != ".partial":
            status, _, message = path.read_text().partition("\n")
            reports[int(path.name.removeprefix("rank-"))] = (int(status), message)
    return reports
