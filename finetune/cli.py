"""The ``finetune`` command: ``finetune launch`` is ``accelerate launch`` and ``finetune torchrun`` is ``torchrun``,
with the same options, run in this process so that a recipe's refusal reads as on one process: its one ``error:``
line and exit status 2 (143 for a stop after a checkpoint), in place of the launcher's traceback, its report of
the failed processes and its status 1. Any other failure shows what the launcher shows.

    finetune launch --num_processes 2 recipes/classify.py --train_file train.csv ...
    finetune torchrun --nproc_per_node=2 recipes/classify.py ...
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import tempfile
from collections.abc import Callable

from finetune.errors import USER_ERROR_EXIT_CODE, read_reports

__all__ = ["main"]

USAGE = ("usage: finetune launch [accelerate launch options] SCRIPT [args]\n"
         "       finetune torchrun [torchrun options] SCRIPT [args]")


def accelerate_launch(argv: list[str]) -> None:
    from accelerate.commands.launch import launch_command, launch_command_parser

    launch_command(launch_command_parser().parse_args(argv))


def torchrun(argv: list[str]) -> None:
    from torch.distributed.run import parse_args, run

    run(parse_args(argv))


COMMANDS: dict[str, Callable[[list[str]], None]] = {"launch": accelerate_launch, "torchrun": torchrun}


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] not in COMMANDS:
        print(f"{USAGE}\nerror: name a command, launch or torchrun", file=sys.stderr)
        sys.exit(USER_ERROR_EXIT_CODE)
    with tempfile.TemporaryDirectory(prefix="finetune-launch-") as folder:
        os.environ["FINETUNE_REPORT_DIR"] = folder  # the launchers pass their environment to every process
        with _agent_logs_unless_reported(folder):
            try:
                COMMANDS[argv[0]](argv[1:])
                return
            except (Exception, SystemExit):
                reports = read_reports(folder)
                if not reports:
                    raise
        _show(reports)


def _show(reports: dict[int, tuple[int, str]]) -> None:
    """Exit as the processes that ended early did: a refusal once (each rank named where their messages differ),
    else with the stop's status (its processes have said why)."""
    refusals = {rank: message for rank, (status, message) in sorted(reports.items())
                if status == USER_ERROR_EXIT_CODE}
    if not refusals:
        sys.exit(min(status for status, _ in reports.values()))
    first_rank = {message: rank for rank, message in reversed(refusals.items())}
    for message, rank in sorted(first_rank.items(), key=lambda item: item[1]):
        prefix = f"[rank {rank}] " if len(first_rank) > 1 else ""
        print(f"{prefix}error: {message}", file=sys.stderr, flush=True)
    sys.exit(USER_ERROR_EXIT_CODE)


@contextlib.contextmanager
def _agent_logs_unless_reported(folder: str):
    """torchrun's agent logs each process it stops and each that failed: once a process has reported a refusal or
    a stop, that is the launcher's report again, and its lines are dropped; until then they pass on as ever."""
    agent = logging.getLogger("torch.distributed.elastic")
    handler = _PassOnUnlessReported(folder)
    propagate, agent.propagate = agent.propagate, False
    agent.addHandler(handler)
    try:
        yield
    finally:
        agent.removeHandler(handler)
        agent.propagate = propagate


class _PassOnUnlessReported(logging.Handler):
    def __init__(self, folder: str):
        super().__init__()
        self.folder = folder

    def emit(self, record: logging.LogRecord) -> None:
        if not read_reports(self.folder):
            logging.getLogger("torch.distributed").handle(record)


if __name__ == "__main__":
    main()
