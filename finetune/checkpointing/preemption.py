"""Stopping on a scheduler's signal with the work kept: noting SIGTERM, SIGUSR1 and SIGINT without acting on them
in the handler, so the training loop can save a checkpoint at its next optimizer step and exit.

Clusters send a signal before they kill a job (Kubernetes and most schedulers SIGTERM, Slurm's ``--signal``
often SIGUSR1), and launchers pass signals on to their workers, so a worker may get the same stop twice within
milliseconds (from Slurm and from torchrun, or Ctrl-C's SIGINT from the terminal and from torchrun): repeats
change nothing, except a SIGINT seconds after the first stop signal, a second Ctrl-C, which stops at once.
"""

from __future__ import annotations

import signal
import threading
import time

__all__ = ["STOP_GRACE", "STOP_SIGNALS", "StopSignals"]

STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)
SECOND_CTRL_C_AFTER = 2.0
"""Seconds after the first stop signal from which a SIGINT is a person pressing Ctrl-C again."""
STOP_GRACE = 20.0
"""Seconds after a stop signal by which a run should be gone: what schedulers allow before SIGKILL is 30 s by
default (Slurm's KillWait, Kubernetes' grace period, torchrun's wait for its workers). Waiting for Hub pushes ends
then; the checkpoint itself is written whatever it takes."""


class StopSignals:
    """While entered, notes the first stop signal (``number``, and ``at``: its wall-clock time).

    Handlers are installed in the main thread only (Python allows no other); elsewhere nothing is noted.
    """

    def __init__(self):
        self.number = 0
        self.at = float("inf")
        self._previous: dict[int, object] = {}

    def __enter__(self) -> StopSignals:
        if threading.current_thread() is threading.main_thread():
            self._previous = {sig: signal.signal(sig, self._note) for sig in STOP_SIGNALS}
        return self

    def __exit__(self, *exc_info) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous = {}

    def _note(self, number, frame) -> None:
        if not self.number:
            self.number, self.at = number, time.time()
        elif number == signal.SIGINT and time.time() - self.at >= SECOND_CTRL_C_AFTER:
            signal.signal(number, signal.SIG_DFL)  # stop now, as Ctrl-C stops a process by default
            signal.raise_signal(number)
