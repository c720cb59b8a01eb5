"""The checkpoint, stop and finiteness rules of ``finetune.checkpointing.guard.CheckpointGuard``, on one process
with a runtime that records what it is asked to write (the rules' runs through the real loop are in
test_run_safety.py, test_preemption.py and test_fault_tolerance.py)."""

import math
import signal
import time
from pathlib import Path

import pytest
import torch

from finetune.checkpointing.checkpoint import Progress
from finetune.checkpointing.guard import CheckpointGuard
from finetune.errors import Stopped, UserError


class RecordingRuntime:
    """One process's runtime: collectives return their input, a checkpoint is a folder name in ``saved``."""

    device = torch.device("cpu")

    def __init__(self):
        self.saved, self.logged, self.printed = [], [], []

    def max_over_processes(self, values):
        return list(values)

    def unwrap(self, model):
        return model

    def save_checkpoint(self, output_dir, progress, keep):
        self.saved.append(progress.global_step)
        return Path(output_dir) / "checkpoints" / f"step_{progress.global_step}"

    def log(self, values, step):
        self.logged.append((step, values))

    def print(self, text):
        self.printed.append(text)


class RecordingHub:
    def __init__(self):
        self.pushed, self.finished = [], []

    def push_checkpoint(self, folder, step, model, tokenizer):
        self.pushed.append(step)

    def finish(self, stopped_at):
        self.finished.append(stopped_at())


class Signals:
    """What ``StopSignals`` notes, set by hand."""

    number, at = 0, math.inf


def guard(model=None, **kwargs):
    model = model or torch.nn.Linear(3, 2)
    model.config = "config"
    runtime, hub, progress, stop = RecordingRuntime(), RecordingHub(), Progress(), Signals()
    made = CheckpointGuard(runtime, model, progress, stop, hub, output_dir="out", checkpoints_total_limit=None,
                           learning_rate=0.5, tokenizer=None, **kwargs)
    return made, runtime, hub, progress, stop


def step(made, progress, *noted):
    progress.global_step += 1
    for value in noted:
        made.note(torch.tensor(value))
    made.step_done()


def test_a_step_is_checkpointed_and_pushed_once():
    made, runtime, hub, progress, _ = guard()
    step(made, progress, 0.7)
    first = made.checkpoint()
    assert made.checkpoint() == first == Path("out/checkpoints/step_1")
    step(made, progress, 0.6)
    made.checkpoint()
    assert runtime.saved == hub.pushed == [1, 2]


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf])
def test_the_first_non_finite_step_is_named_and_nothing_from_it_is_checkpointed(value):
    made, runtime, hub, progress, _ = guard()
    step(made, progress, 0.7, 1.2)
    made.check_finite()
    step(made, progress, 0.5, value)  # the gradient norm of step 2
    step(made, progress, value, 0.3)  # the loss of step 3
    with pytest.raises(UserError, match=r"^the loss or the gradient norm was not finite at step 2, so nothing from "
                                        r"that step on was saved; lower --learning_rate \(now 0.5\)"):
        made.checkpoint()
    assert runtime.saved == hub.pushed == []


def test_a_finite_step_after_a_non_finite_one_does_not_clear_it():
    made, _, _, progress, _ = guard()
    step(made, progress, math.nan)
    step(made, progress, 0.1)
    with pytest.raises(UserError, match="not finite at step 1"):
        made.check_finite()


def test_a_model_with_a_non_finite_weight_is_never_checkpointed():
    model = torch.nn.Linear(3, 2)
    with torch.no_grad():
        model.bias[1] = math.inf
    made, runtime, _, progress, _ = guard(model)
    step(made, progress, 0.7)
    with pytest.raises(UserError, match="^a weight was not finite after step 1"):
        made.checkpoint()
    assert runtime.saved == []


def test_a_non_finite_evaluation_loss_is_refused_and_a_finite_one_passes():
    made, _, _, progress, _ = guard()
    step(made, progress, 0.7)
    made.check_model(eval_loss=2.5)
    made.check_model()
    with pytest.raises(UserError, match="^the evaluation loss was not finite after step 1"):
        made.check_model(eval_loss=math.nan)


def test_no_signal_no_stop():
    made, runtime, _, progress, _ = guard()
    step(made, progress, 0.7)
    made.stop_if_signalled()
    assert runtime.saved == [] and runtime.printed == []


def test_a_signal_saves_this_step_once_reports_and_stops():
    closed = []
    made, runtime, hub, progress, stop = guard(before_stop=lambda: closed.append(len(runtime.saved)))
    step(made, progress, 0.7)
    made.checkpoint()  # this step's checkpoint was due anyway
    stop.number, stop.at = int(signal.SIGTERM), time.time() - 3
    with pytest.raises(Stopped, match="^stopped by SIGTERM at step 1$"):
        made.stop_if_signalled()
    assert runtime.saved == hub.pushed == [1]
    assert closed == [1]  # the progress bar closed after the checkpoint, before the report
    (line,) = runtime.printed
    assert line.startswith("stopped by SIGTERM at step 1: out/checkpoints/step_1 was complete on disk ")
    assert line.endswith("run the same command with --resume_from_checkpoint latest to continue")
    ((logged_step, logged),) = runtime.logged
    assert logged_step == 1 and 3 <= logged["stop_signal_to_checkpoint_seconds"] < 60
    assert hub.finished == [stop.at]  # the push waits only what is left of the stop's budget


def test_a_signal_on_a_non_finite_step_saves_nothing():
    made, runtime, _, progress, stop = guard()
    step(made, progress, math.nan)
    stop.number, stop.at = int(signal.SIGUSR1), time.time()
    with pytest.raises(UserError, match="not finite at step 1"):
        made.stop_if_signalled()
    assert runtime.saved == []
