"""Experiment tracking for both runtimes: TensorBoard, MLflow and W&B through Accelerate's tracker classes.

Only the main process makes a ``Trackers``. Each tracker runs on a thread of its own, started at the first
``log`` (after the data is read, so no thread lives while a data step forks), and the training loop only puts
values on its queue: a tracker whose server hangs or whose disk is full costs the loop nothing. Its first
failure is printed once; the end of the run says what each tracker did not record.

A run has an id of ours, made when it starts and kept in every checkpoint (``tracking.json``). A resumed run
(``--resume_from_checkpoint``, a torchrun restart, a Slurm requeue) takes it from the checkpoint and continues
the same tracker runs: W&B's run of that id, the MLflow run tagged with it, the same TensorBoard folder. Steps
after the checkpoint that an earlier attempt logged are replaced (TensorBoard purges them) or kept (MLflow
keeps its first value of a step, W&B ignores a step it has), so no step appears twice.
"""

from __future__ import annotations

import json
import os
import queue
import sys
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from accelerate import PartialState
from accelerate.tracking import GeneralTracker, MLflowTracker, TensorBoardTracker, WandBTracker

from finetune.checkpointing.checkpoint import read_progress

__all__ = ["FLUSH_TIMEOUT", "RUN_FILE", "STOP_FLUSH_TIMEOUT", "TrackerSettings", "Trackers", "read_tracking_run"]

RUN_FILE = "tracking.json"
"""In each checkpoint: the tracking run's id and name, for a resumed run to continue."""

FLUSH_TIMEOUT = 60.0
"""Seconds the end of a run waits for the trackers to take what is queued and close."""
STOP_FLUSH_TIMEOUT = 10.0
"""The same when a stop signal ended the run."""

RUN_ID_TAG = "finetune_run_id"
"""The MLflow tag that holds our run id: MLflow makes its own run ids, so a resumed run looks the run up by it."""


@dataclass(frozen=True)
class TrackerSettings:
    """What a run reports, where, and as which run; made by ``for_run``."""

    trackers: tuple[str, ...]
    project: str
    """W&B's project and MLflow's experiment (``WANDB_PROJECT`` and ``MLFLOW_EXPERIMENT_NAME`` win)."""
    run_name: str
    logging_dir: str
    """TensorBoard writes to ``logging_dir/run_name``; W&B's local files go here unless ``WANDB_DIR`` is set."""
    config: dict = field(repr=False)
    run_id: str = field(default_factory=lambda: uuid.uuid4().hex[:16])
    resumed_at: int | None = None
    """The checkpoint's step when this run continues an earlier attempt."""
    record_command_line: bool = True
    """False when the command line holds a secret: W&B would record it with the run's metadata."""

    @classmethod
    def for_run(cls, trackers: tuple[str, ...], *, project: str, output_dir: str, run_name: str | None,
                config: dict, resume_from: Path | None, secret: str | None) -> TrackerSettings:
        """Settings for a fresh run, or for continuing the tracking run of ``resume_from`` where it recorded one.

        ``secret`` (the Hub token) must be missing from ``config``; W&B's metadata is left out when it is on
        the command line.
        """
        on_command_line = bool(secret) and any(secret in word for word in sys.argv)
        common = {"trackers": trackers, "project": project, "config": config,
                  "logging_dir": os.path.join(output_dir, "runs"), "record_command_line": not on_command_line}
        earlier = read_tracking_run(resume_from) if resume_from else None
        if earlier:
            return cls(**common, run_id=earlier["run_id"], run_name=earlier["run_name"],
                       resumed_at=read_progress(resume_from).global_step)
        return cls(**common, run_name=run_name or Path(output_dir).resolve().name)

    def write_run(self, folder: Path) -> None:
        """Record this tracking run in checkpoint ``folder``."""
        (folder / RUN_FILE).write_text(json.dumps({"run_id": self.run_id, "run_name": self.run_name}) + "\n")


def read_tracking_run(folder: Path) -> dict | None:
    """The tracking run a checkpoint recorded (``run_id``, ``run_name``); None for a run without trackers."""
    path = Path(folder) / RUN_FILE
    return json.loads(path.read_text()) if path.is_file() else None


class Trackers:
    """The trackers of one run, each on its own thread; ``log`` never waits for them."""

    def __init__(self, settings: TrackerSettings):
        # Accelerate's trackers log through Accelerate's logger, which needs its process state: an Accelerator
        # made it already; under raw DDP this makes it, adopting the process group that is there.
        PartialState()
        self.settings = settings
        self._threads = [_TrackerThread(name, settings) for name in settings.trackers]

    def log(self, values: dict[str, float], step: int) -> None:
        """Queue ``values`` at ``step`` for every tracker; returns at once."""
        for thread in self._threads:
            thread.put(dict(values), step)

    def close(self, timeout: float = FLUSH_TIMEOUT) -> None:
        """Let every tracker record what is queued and end its run, waiting at most ``timeout`` seconds in all;
        then say what each did not record."""
        deadline = time.monotonic() + timeout
        for thread in self._threads:
            thread.put(None, None)
        for thread in self._threads:
            if thread.is_alive():
                thread.join(max(0.0, deadline - time.monotonic()))
        for thread in self._threads:
            if report := thread.report(timeout):
                print(f"warning: {report}", file=sys.stderr, flush=True)


class _TrackerThread(threading.Thread):
    """One tracker: made, started, fed and finished on this thread, so a call that hangs holds up nothing else."""

    def __init__(self, name: str, settings: TrackerSettings):
        super().__init__(name=f"tracker-{name}", daemon=True)
        self.tracker_name = name
        self.settings = settings
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._queued: list[int] = []  # the step of every log put on the queue, in order
        self._taken = 0  # how many of them this thread has handled, recorded or not
        self._failed: list[int] = []
        self._error: str | None = None
        self._finished = False
        self._tracker: GeneralTracker | None = None

    def put(self, values: dict | None, step: int | None) -> None:
        if values is not None:
            self._queued.append(step)
        elif not self._queued:
            return  # nothing was ever logged: no run was started, none to end
        if self.ident is None:
            self.start()
        self._queue.put((values, step))

    def run(self) -> None:
        started = self._attempt("its start", self._start)
        while True:
            values, step = self._queue.get()
            if values is None:
                break
            if not (started and self._attempt(f"step {step}", self._tracker.log, values, step=step)):
                self._failed.append(step)
            self._taken += 1
        self._finished = started and self._attempt("the end of the run", self._tracker.finish)

    def _start(self) -> None:
        self._tracker = _start_tracker(self.tracker_name, self.settings)

    def _attempt(self, what: str, function, *args, **kwargs) -> bool:
        """Call ``function``; False after a failure, the first of which is printed."""
        try:
            function(*args, **kwargs)
            return True
        except Exception as err:  # a tracker's failure of any kind must not end the run
            if self._error is None:
                first_line = str(err).strip().splitlines()[0][:300] if str(err).strip() else ""
                self._error = f"{type(err).__name__}: {first_line}"
                print(f"warning: {self.tracker_name} failed at {what} ({self._error}); training goes on, and the end "
                      "of the run says what it did not record", file=sys.stderr, flush=True)
            return False

    def report(self, timeout: float) -> str | None:
        """What this tracker did not record, in words; None when it recorded everything and ended its run."""
        if not self._queued:
            return None
        missed = self._failed + self._queued[self._taken:]
        if not missed and self._finished:
            return None
        parts = []
        if missed:
            parts.append(f"did not record {len(missed)} of {len(self._queued)} logs (steps {_ranges(missed)})")
        if not self._finished:
            parts.append("did not end its run" + ("" if not self.is_alive() else f" within {timeout:.0f} s"))
        return f"{self.tracker_name} " + " and ".join(parts) + (f"; first error: {self._error}" if self._error else "")


def _ranges(steps: list[int]) -> str:
    """``[1, 2, 3, 7]`` as ``1-3, 7``."""
    spans: list[list[int]] = []
    for step in sorted(set(steps)):
        if spans and step == spans[-1][1] + 1:
            spans[-1][1] = step
        else:
            spans.append([step, step])
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in spans)


def _start_tracker(name: str, settings: TrackerSettings) -> GeneralTracker:
    """Tracker ``name`` with its run started (a new one, or the run ``settings`` continues)."""
    if name == "tensorboard":
        # A fresh run hides whatever an older run left in the same folder; a continued one, what an attempt
        # logged after the checkpoint it resumes from.
        purge = 0 if settings.resumed_at is None else settings.resumed_at + 1
        tracker = TensorBoardTracker(settings.run_name, settings.logging_dir, purge_step=purge)
    elif name == "mlflow":
        tracker = _MLflowRun(settings)
    else:
        import wandb

        local_files = os.environ.get("WANDB_DIR", settings.logging_dir)
        os.makedirs(local_files, exist_ok=True)  # else W&B writes to a temporary folder
        tracker = WandBTracker(
            os.environ.get("WANDB_PROJECT", settings.project), name=settings.run_name, id=settings.run_id,
            resume="allow", dir=local_files, settings=wandb.Settings(x_disable_meta=not settings.record_command_line))
    tracker.start()
    if not _continues_a_run(tracker, settings):  # a continued run has it (and MLflow refuses to change a param)
        tracker.store_init_configuration(settings.config)
    return tracker


def _continues_a_run(tracker: GeneralTracker, settings: TrackerSettings) -> bool:
    if isinstance(tracker, _MLflowRun):
        return tracker.continued
    if isinstance(tracker, WandBTracker):
        return tracker.run.resumed  # offline, each attempt has files of its own
    return settings.resumed_at is not None


class _MLflowRun(MLflowTracker):
    """Accelerate's MLflow tracker, finding the run to continue by our run id, and skipping steps it has."""

    def __init__(self, settings: TrackerSettings):
        super().__init__(experiment_name=settings.project, run_name=settings.run_name)
        self.our_id = settings.run_id
        self.resuming = settings.resumed_at is not None
        self.continued = False
        self.recorded_up_to: dict[str, int] = {}

    def start(self):
        import mlflow

        experiment = self.resuming and self.run_id is None and mlflow.get_experiment_by_name(self.experiment_name)
        if experiment:
            runs = mlflow.search_runs([experiment.experiment_id], filter_string=f"tags.{RUN_ID_TAG} = '{self.our_id}'",
                                      output_format="list")
            if runs:
                self.run_id, self.continued = runs[0].info.run_id, True
                client = mlflow.MlflowClient()
                # An attempt that died after its last checkpoint logged some of the steps this one is about to.
                self.recorded_up_to = {key: max(m.step for m in client.get_metric_history(self.run_id, key))
                                       for key in runs[0].data.metrics}
        super().start()
        mlflow.set_tag(RUN_ID_TAG, self.our_id)

    def log(self, values, step=None, **kwargs):
        values = {k: v for k, v in values.items() if step is None or step > self.recorded_up_to.get(k, -1)}
        if values:
            super().log(values, step=step, **kwargs)
