"""The rules for what a run writes and when it stops, in one object the training loop consults.

- No non-finite number reaches a checkpoint, the final model or the Hub: a loss or gradient norm that is not
  finite is noted on the device at the step it happened (no sync per step) and checked on every process before
  anything is written or logged; the weights themselves (each process's shards) are checked before each save.
- A step is checkpointed once: a stop at a step just checkpointed reuses that checkpoint.
- A stop signal on any process makes every process save at the same optimizer step and stop (``Stopped``).

The runtime and the Hub pusher are the loop's (``finetune.runtimes.base.Runtime``, ``finetune.hub.pusher``); only
their calls are used here, so this room imports neither.
"""

from __future__ import annotations

import math
import signal
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch.distributed.tensor import DTensor

from finetune.checkpointing.checkpoint import Progress
from finetune.checkpointing.preemption import StopSignals
from finetune.errors import Stopped, UserError

__all__ = ["CheckpointGuard"]


class CheckpointGuard:
    """Checkpoints, stops and the finiteness checks of one run, for the model ``model`` at ``progress``.

    ``before_stop`` runs before a stop is reported (the loop closes its progress bar there, so the report is a
    line of its own); ``task_state`` gives what a checkpoint keeps of the task (``Progress.task_state``).
    """

    def __init__(self, runtime, model, progress: Progress, stop: StopSignals, hub, *, output_dir: str,
                 checkpoints_total_limit: int | None, learning_rate: float, tokenizer,
                 before_stop: Callable[[], None] = lambda: None, task_state: Callable[[], dict] = dict):
        self.runtime, self.model, self.progress, self.stop, self.hub = runtime, model, progress, stop, hub
        self.output_dir, self.keep, self.learning_rate = output_dir, checkpoints_total_limit, learning_rate
        self.tokenizer, self.before_stop, self.task_state = tokenizer, before_stop, task_state
        self._saved: dict[int, Path] = {}
        self._first_nonfinite_step = torch.full((), -1, dtype=torch.long, device=runtime.device)
        self._window_finite = torch.ones((), dtype=torch.bool, device=runtime.device)

    def note(self, value: torch.Tensor) -> None:
        """A loss or gradient norm of the current optimizer step, checked later without a sync now."""
        self._window_finite &= torch.isfinite(value.detach())

    def step_done(self) -> None:
        """The optimizer step ``progress.global_step`` is over: remember it if anything noted in it was not finite."""
        self._first_nonfinite_step = torch.where((self._first_nonfinite_step < 0) & ~self._window_finite,
                                                 self.progress.global_step, self._first_nonfinite_step)
        self._window_finite.fill_(True)

    def check_finite(self) -> None:
        """Raises ``UserError`` on every process if any process noted a non-finite loss or gradient norm."""
        local = int(self._first_nonfinite_step.item())
        (first,) = self.runtime.max_over_processes([-local if local >= 0 else -math.inf])
        if first > -math.inf:
            raise UserError(
                f"the loss or the gradient norm was not finite at step {int(-first)}, so nothing from that step on "
                f"was saved; {self._advice()}")

    def check_model(self, eval_loss: float | None = None) -> None:
        """Raises ``UserError`` on every process when a weight (of any process's shard) or ``eval_loss`` is not
        finite: a finite loss and gradient can still be followed by an update that is not (a learning rate beyond
        float32), and such a model is never saved or pushed."""
        weights = [p.to_local() if isinstance(p, DTensor) else p for p in self.runtime.unwrap(self.model).parameters()]
        local = not bool(torch.stack([torch.isfinite(w).all() for w in weights]).all())
        bad_weights, bad_loss = self.runtime.max_over_processes(
            [float(local), float(not math.isfinite(eval_loss or 0.0))])
        what = "a weight" if bad_weights else "the evaluation loss" if bad_loss else None
        if what:
            raise UserError(f"{what} was not finite after step {self.progress.global_step}, so nothing from that step "
                            f"on was saved; {self._advice()}")

    def checkpoint(self) -> Path:
        """Check, write and queue for the Hub a checkpoint of this step (once a step); returns its folder."""
        step = self.progress.global_step
        if step not in self._saved:
            self.check_finite()
            self.check_model()
            self.progress.task_state = self.task_state()
            self._saved[step] = self.runtime.save_checkpoint(self.output_dir, self.progress, self.keep)
            self.hub.push_checkpoint(self._saved[step], step, self.runtime.unwrap(self.model), self.tokenizer)
        return self._saved[step]

    def stop_if_signalled(self) -> None:
        """A stop signal on any process: all save this step, then stop (the same flags resume it). Called at every
        optimizer step and before every evaluation batch, so no long work runs after a signal.

        Raises:
            Stopped: after the checkpoint is complete; what is left of the stop's time budget went to its push.
        """
        signal_number, negative_time = self.runtime.max_over_processes([self.stop.number, -self.stop.at])
        if not signal_number:
            return
        folder, step, signal_time = self.checkpoint(), self.progress.global_step, -negative_time
        self.before_stop()
        name = signal.Signals(int(signal_number)).name
        delay = time.time() - signal_time
        self.runtime.log({"stop_signal_to_checkpoint_seconds": delay}, step=step)
        self.runtime.print(f"stopped by {name} at step {step}: {folder} was complete on disk {delay:.1f} s after the "
                           "signal; run the same command with --resume_from_checkpoint latest to continue")
        self.hub.finish(stopped_at=lambda: signal_time)  # the uploader goes on by itself after that
        raise Stopped(f"stopped by {name} at step {step}")

    def _advice(self) -> str:
        return (f"lower --learning_rate (now {self.learning_rate}), keep --max_grad_norm above 0, look for extreme "
                "rows in the data, and resume from the last checkpoint")
