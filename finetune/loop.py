"""The training loop every recipe shares: ``train(task, cfg)``.

It owns what is the same for every task: the process group and devices (through a ``Runtime``), the
global-batch plan and loss normalisation, accumulation, clipping, the schedule, logging, the evaluation
and checkpoint cadence, resume and restart, the final unwrapped save, ``all_results.json`` and the Hub
pushes. The task (``finetune.task.Task``) brings its data, model, loss, metrics and how it saves.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import sys
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from accelerate.utils import set_seed
from safetensors import SafetensorError
from tqdm.auto import tqdm

from finetune.checkpointing.checkpoint import (
    LOG_HISTORY,
    Progress,
    check_output_dir,
    check_unwrapped,
    checkpoint_path,
    clear_output_dir,
    disk_write_failure,
    find_latest_checkpoint,
    frozen_weights_digest,
    launch_id,
    output_dir_lock,
    read_progress,
    resolve_resume_checkpoint,
    resumed_progress,
    write_final_model,
)
from finetune.checkpointing.files import replacing
from finetune.checkpointing.guard import CheckpointGuard
from finetune.checkpointing.preemption import StopSignals
from finetune.config import TrainConfig
from finetune.data.batching import GlobalBatchSampler, padded_tokens
from finetune.data.cache import load_or_build
from finetune.environment import LaunchEnvironment
from finetune.errors import UserError
from finetune.evaluation import Evaluation
from finetune.hub.pusher import HubPusher, download_last_checkpoint, model_card
from finetune.models.loading import optimizer_param_groups
from finetune.models.lora import save_base_quantization
from finetune.models.memory import check_tiling, keep_less
from finetune.observability.metering import TrainingMeter
from finetune.runtimes.base import Runtime, TrackerSettings
from finetune.runtimes.launcher import make_runtime
from finetune.schedules import learning_rate_schedule
from finetune.startup import announce, prepare_only, training_sampler
from finetune.task import Task

__all__ = ["train"]

CARD_HYPER_PARAMETERS = ("learning_rate", "per_device_train_batch_size", "gradient_accumulation_steps",
                         "num_train_epochs", "max_train_steps", "lr_scheduler_type", "num_warmup_steps",
                         "weight_decay", "max_grad_norm", "max_seq_length", "seed", "group_by_length")
UNTRACKED_RESULTS = {"epoch", "global_step", "runtime", "world_size"}
"""``all_results`` entries the trackers do not get at the end: the step, the set-up, and ``epoch``, which each
logging interval records as the epoch's index."""


def train(task: Task, cfg: TrainConfig, task_options=None) -> dict:
    """Fine-tune ``task``'s model as ``cfg`` says, save it to ``cfg.output_dir``; returns ``all_results``.

    ``task_options`` (the recipe's own dataclass) is recorded with ``cfg`` by the experiment trackers.

    Raises:
        UserError: bad input anywhere (data, flags, checkpoints, Hub access), or failed pushes under
            ``--hub_strict``.
    """
    if cfg.prepare_only:
        return prepare_only(task, cfg)

    # -- where the run starts: a fresh output folder, or a checkpoint to continue from
    env = LaunchEnvironment.read()
    launch = launch_id(env)
    resume_from, found_in_folder = _starting_checkpoint(cfg, env, launch)

    # The main process holds the output folder for the whole run (another run there is refused); a stop
    # signal from now on is noted, not obeyed at once: the loop saves at its next optimizer step.
    with contextlib.ExitStack() as closing:
        if env.rank == 0:
            closing.enter_context(output_dir_lock(cfg.output_dir))
        check_output_dir(cfg.output_dir, cfg.overwrite_output_dir, resume_from, found_in_folder)
        stop = closing.enter_context(StopSignals())
        runtime = closing.enter_context(make_runtime(cfg, _tracker_settings(task, cfg, task_options, resume_from)))
        check_tiling(cfg.tiled_mlp, runtime.shards_weights)
        if found_in_folder:
            resume_from = _main_process_choice(runtime, resume_from, cfg.output_dir)
        set_seed(cfg.seed)
        hub = HubPusher(enabled=cfg.push_to_hub and runtime.is_main_process, output_dir=cfg.output_dir,
                        repo_id=cfg.hub_model_id, token=cfg.hub_token, private=cfg.hub_private_repo,
                        revision=cfg.hub_revision, strategy=cfg.hub_strategy, timeout=cfg.hub_timeout,
                        save_beside_adapter=save_base_quantization)

        # -- data (tokenized once into a cache every process memory-maps) and model, from the task; training
        # batches planned globally (see finetune.data.cache and finetune.data.batching)
        tokenizer = task.load_tokenizer(cfg)
        data = load_or_build(task, cfg, tokenizer, runtime)
        if hasattr(task, "close"):
            closing.callback(task.close)
        setup = task.setup(cfg, tokenizer, data)
        keep_less(setup.model, cfg.gradient_checkpointing, cfg.tiled_mlp)
        sampler = training_sampler(setup, cfg, runtime)
        train_loader = runtime.train_loader(setup.train_set, sampler, setup.collate)
        eval_loader = runtime.eval_loader(setup.eval_set, cfg.per_device_eval_batch_size,
                                          setup.eval_collate or setup.collate)

        # -- optimizer and schedule, both counted in optimizer steps
        # fused: one kernel over all parameters instead of a dozen passes over memory per step.
        optimizer = torch.optim.AdamW(optimizer_param_groups(setup.model, cfg.weight_decay), lr=cfg.learning_rate,
                                      fused=True)
        schedule = Schedule.of(sampler.batches_per_rank, cfg)
        scheduler = learning_rate_schedule(cfg.lr_scheduler_type, optimizer, cfg.num_warmup_steps, schedule.max_steps)

        # -- resume: weights, optimizer, schedule, RNG and the position in the epoch, at another world size too
        # when the global batch is kept
        progress = _fresh_progress(cfg, runtime, setup.model)
        model, optimizer, scheduler, train_loader, eval_loader = runtime.prepare(
            setup.model, optimizer, scheduler, train_loader, eval_loader)
        if resume_from:
            progress = resumed_progress(read_progress(resume_from), progress, resume_from, sampler.batches_per_rank)
            runtime.load_state(resume_from)
            getattr(task, "load_state_dict", lambda state: None)(progress.task_state)
            runtime.print(f"resumed from {resume_from} at step {progress.global_step}")
        progress.launch_id = launch
        if runtime.is_main_process:  # only now that the run has all it needs may it remove what it replaces
            clear_output_dir(cfg.output_dir, progress, cfg.overwrite_output_dir, getattr(task, "run_files", ()))
        announce(task, cfg, runtime, data.source, setup, sampler, schedule.max_steps, model, progress.epoch)

        # -- train (the output folder exists: the main process made it when it took the lock); the bar is
        # closed however the loop ends, so that an error is printed on a line of its own
        progress_bar = closing.enter_context(
            tqdm(total=schedule.max_steps, initial=progress.global_step, disable=not runtime.is_main_process))
        guard = CheckpointGuard(runtime, model, progress, stop, hub, output_dir=cfg.output_dir,
                                checkpoints_total_limit=cfg.checkpoints_total_limit, learning_rate=cfg.learning_rate,
                                tokenizer=tokenizer, before_stop=progress_bar.close,
                                task_state=getattr(task, "state_dict", dict))
        evaluation = Evaluation(runtime, task, model, eval_loader, before_batch=guard.stop_if_signalled)
        if getattr(task, "evaluate_first", False) and progress.global_step == 0:
            metrics, _ = evaluation.at(0)  # the model before training, logged as step 0 to compare against
            runtime.print(f"before training: {_described(metrics)}")
        epochs = Epochs(runtime, task, cfg, model, optimizer, scheduler, sampler, train_loader, progress, guard,
                        evaluation, progress_bar, schedule.max_steps,
                        TrainingMeter(runtime.device, runtime.reduce_sum, getattr(task, "logged_figures", ())))
        for epoch in range(progress.epoch, schedule.num_epochs):
            if progress.global_step >= schedule.max_steps:  # (also a run resumed from its last step's checkpoint)
                break
            epochs.run(epoch)
            metrics, _ = evaluation.at(progress.global_step)  # --eval_steps may have just evaluated this model
            runtime.print(f"epoch {epoch}: {_described(metrics)}")
        progress_bar.close()

        # -- save: every process reaches this point, the main process writes the unwrapped model (a run resumed
        # from a checkpoint taken after its last step evaluates here)
        metrics, eval_outputs = evaluation.at(progress.global_step)
        results = {
            **metrics,
            **epochs.meter.totals(),
            "epoch": progress.global_step / schedule.steps_per_epoch,
            "global_step": progress.global_step,
            "runtime": runtime.name,
            "world_size": runtime.world_size,
        }
        # (no non-finite loss gets here: the last step is always logged, which checks it first)
        guard.check_model(metrics.get("eval_loss"))
        _save(runtime, task, cfg, model, tokenizer, data.source, hub, results, eval_outputs)
        runtime.wait_for_save()
        runtime.log({k: results[k] for k in results.keys() - metrics.keys() - UNTRACKED_RESULTS}, progress.global_step)
        runtime.print(f"saved the model to {cfg.output_dir}\n" + json.dumps(results, indent=2))

        # -- the end: only the main process waits for its uploads (bounded by --hub_timeout)
        _finish_pushes(hub, cfg, results, stopped_at=lambda: stop.at)
        return results


@dataclasses.dataclass(frozen=True)
class Schedule:
    """The run's length in optimizer steps."""

    steps_per_epoch: int
    max_steps: int
    num_epochs: int

    @classmethod
    def of(cls, batches_per_rank: int, cfg: TrainConfig) -> Schedule:
        steps_per_epoch = math.ceil(batches_per_rank / cfg.gradient_accumulation_steps)
        max_steps = cfg.max_train_steps or cfg.num_train_epochs * steps_per_epoch
        return cls(steps_per_epoch, max_steps, math.ceil(max_steps / steps_per_epoch))


@dataclasses.dataclass
class Epochs:
    """The epoch loop: forward and backward over each micro-batch, the optimizer step at the end of each
    accumulation window, and after each step what is due at that step: logging, evaluation, a checkpoint, a stop."""

    runtime: Runtime
    task: Task
    cfg: TrainConfig
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: Any
    sampler: GlobalBatchSampler
    train_loader: Any
    progress: Progress
    guard: CheckpointGuard
    evaluation: Evaluation
    progress_bar: tqdm
    max_steps: int
    meter: TrainingMeter
    grad_norm: torch.Tensor | None = None

    def run(self, epoch: int) -> None:
        """Train ``epoch`` from where ``progress`` stands in it, to its end or to the last step."""
        progress = self.progress
        progress.epoch = epoch
        self.model.train()
        plan = self.sampler.plan(epoch, self.runtime.rank)[progress.batches_in_epoch:]
        batches = zip(self.runtime.epoch_batches(self.train_loader, epoch, skip_batches=progress.batches_in_epoch),
                      plan, strict=True)
        if hasattr(self.task, "rollout"):  # an online task trains on what the model generates from each window
            batches = _rolled_out(batches, lambda window: self.task.rollout(self.runtime.unwrap(self.model), window,
                                                                            epoch))
        for batch, planned in batches:
            # An optimizer step every accumulation's micro-batches and at the epoch's end, counted here: a rollout
            # takes a whole window from the loader before it trains, so the loader's position cannot say.
            done = progress.batches_in_epoch + 1
            self._micro_step(batch, planned, ends_step=done % self.cfg.gradient_accumulation_steps == 0
                             or done == self.sampler.batches_per_rank)
            progress.batches_in_epoch += 1
            if self.runtime.sync_gradients:
                progress.global_step += 1
                self._after_step(epoch)
                if progress.global_step >= self.max_steps:
                    break
        if progress.batches_in_epoch == self.sampler.batches_per_rank:
            progress.epoch, progress.batches_in_epoch = epoch + 1, 0
            if self.cfg.checkpointing_steps == "epoch":
                self.guard.checkpoint()

    def _micro_step(self, batch: dict, planned, ends_step: bool) -> None:
        """Forward, backward, and the update at the end of a window, where gradients are all-reduced."""
        with self.runtime.accumulate(self.model, ends_step):
            loss = self.task.loss(self.model, batch)
            loss, figures = (loss, None) if torch.is_tensor(loss) else (loss.pop("loss"), loss)
            self.runtime.backward(loss * planned.loss_scale)
            self.guard.note(loss)
            if self.runtime.sync_gradients:
                if self.cfg.max_grad_norm > 0:  # clip the gradient; its norm before clipping is logged
                    self.grad_norm = self.runtime.clip_grad_norm_(self.model, self.cfg.max_grad_norm)
                self.optimizer.step()
                if self.runtime.optimizer_step_was_skipped():  # fp16's loss scale overflowed; the next is lower
                    self.grad_norm = None
                else:  # as transformers' Trainer: the schedule counts the updates made
                    self.scheduler.step()
                if self.grad_norm is not None:
                    self.guard.note(self.grad_norm)
                self.optimizer.zero_grad()
        if planned.num_real:
            real, processed = planned.tokens or (int(self.sampler.lengths[planned].sum()), padded_tokens(batch))
            self.meter.add(loss, planned.units, planned.num_real, real_tokens=real, processed_tokens=processed,
                           figures=figures)

    def _after_step(self, epoch: int) -> None:
        """Log, evaluate and checkpoint at their cadence, then stop if a signal came."""
        step, cfg = self.progress.global_step, self.cfg
        self.progress_bar.update(1)
        self.guard.step_done()
        if step % cfg.logging_steps == 0 or step >= self.max_steps:
            self.guard.check_finite()
            task_logs = getattr(self.task, "interval_logs", dict)()  # its timings end before the interval does
            logs = {**self.meter.interval(), **task_logs, "learning_rate": self.scheduler.get_last_lr()[0],
                    "epoch": epoch}
            if self.grad_norm is not None:
                logs["grad_norm"] = float(self.grad_norm)
            _log_interval(self.runtime, cfg.output_dir, logs, step)
            self.progress_bar.set_postfix(loss=f"{logs['loss']:.4f}", lr=f"{logs['learning_rate']:.2e}",
                                          samples_per_s=f"{logs['samples_per_second']:.1f}")
        if cfg.eval_steps and step % cfg.eval_steps == 0:
            self.evaluation.at(step)
        if cfg.checkpoint_every_steps and step % cfg.checkpoint_every_steps == 0:
            self.guard.checkpoint()
        self.guard.stop_if_signalled()


def _described(metrics: dict[str, float]) -> str:
    """Metrics for a printed line: ``eval_accuracy 0.9630, eval_loss 0.1234``."""
    return ", ".join(f"{name} {value:.4f}" for name, value in metrics.items())


def _rolled_out(batches, rollout: Callable[[list], list]):
    """``batches`` (pairs of a batch and its ``PlannedBatch``) a window at a time through ``rollout``, which turns
    a window's prompts into the batches that train on the completions it generates."""
    window: list = []
    for pair in batches:
        if window and pair[1].window != window[0][1].window:
            yield from rollout(window)
            window = []
        window.append(pair)
    if window:
        yield from rollout(window)


def _fresh_progress(cfg: TrainConfig, runtime: Runtime, model) -> Progress:
    """A fresh run's progress, with an identity of its own (which only the main process records) and the hash of
    the frozen weights it trains on (taken while the model is whole, before it is sharded), which a resume checks."""
    return Progress(world_size=runtime.world_size, runtime=runtime.name, seed=cfg.seed, run_id=uuid.uuid4().hex,
                    per_device_train_batch_size=cfg.per_device_train_batch_size,
                    gradient_accumulation_steps=cfg.gradient_accumulation_steps,
                    frozen_weights=frozen_weights_digest(model))


def _finish_pushes(hub: HubPusher, cfg: TrainConfig, results: dict, stopped_at: Callable[[], float]) -> None:
    """Wait for the run's pushes (less once a stop signal comes: ``stopped_at``) and add their outcomes to
    ``all_results.json``.

    Raises:
        UserError: a push failed under ``--hub_strict``.
    """
    pushes = hub.finish(stopped_at=stopped_at)
    if pushes:
        results["hub_pushes"] = pushes
        _write_json(Path(cfg.output_dir) / "all_results.json", results)
        failed = [p for p in pushes if "error" in p]
        if failed and cfg.hub_strict:
            raise UserError(f"{len(failed)} of {len(pushes)} Hub pushes failed and --hub_strict is set; "
                            f"the model is saved in {cfg.output_dir}")


def _starting_checkpoint(cfg: TrainConfig, env: LaunchEnvironment, launch: str) -> tuple[Path | None, bool]:
    """The checkpoint this process would resume from, and whether it looked for it in the output folder (then the
    main process chooses for all: ``_main_process_choice``); the latter is the same on every process."""
    restarted = bool((env.restart_count or env.requeue_count) and launch)
    if restarted:
        # torchrun restarted the workers after a failure, or Slurm requeued the job: continue from the newest
        # checkpoint this launch wrote, not from the start or an older --resume_from_checkpoint again, and not
        # from another run's (which --overwrite_output_dir removes only once the run has started).
        own = find_latest_checkpoint(cfg.output_dir, launch)
        if own:
            return own, True
    spec = cfg.resume_from_checkpoint
    if spec and spec.startswith("hub:"):
        spec = str(download_last_checkpoint(spec, cfg.hub_revision, cfg.hub_token))
    return resolve_resume_checkpoint(spec, cfg.output_dir), restarted or spec == "latest"


def _main_process_choice(runtime: Runtime, chosen: Path | None, output_dir: str) -> Path | None:
    """The checkpoint the main process chose, for every process: each looked at the folder at its own moment, and
    a checkpoint completed in between would have them resume from different steps. A checkpoint outside the
    output folder came from the command line, the same for all."""
    if not runtime.is_main_process:
        mine = -math.inf
    elif chosen is None:
        mine = -1
    elif Path(chosen).resolve().parent == (Path(output_dir) / "checkpoints").resolve():
        mine = read_progress(chosen).global_step
    else:
        mine = -2
    (step,) = runtime.max_over_processes([mine])
    if step == -2:
        return chosen
    return None if step < 0 else checkpoint_path(output_dir, int(step))


def _save(runtime: Runtime, task: Task, cfg: TrainConfig, model, tokenizer, data_source: str, hub: HubPusher,
          results: dict, eval_outputs: tuple) -> None:
    """The final model, ``all_results.json``, the predictions and the model card, written beside the output folder's
    contents and then moved over them (``write_final_model``); the final push of exactly those files."""
    state_dict = runtime.unwrapped_state_dict(model)
    check_unwrapped(state_dict)
    if not runtime.is_main_process:
        return

    def write(folder: Path) -> None:
        task.save(runtime.unwrap(model), state_dict, tokenizer, str(folder))
        _write_json(folder / "all_results.json", results)
        task.write_predictions(eval_outputs, str(folder))
        if cfg.push_to_hub:
            local_model = cfg.model_name_or_path and os.path.isdir(os.path.expanduser(cfg.model_name_or_path))
            base_model = None if local_model else cfg.model_name_or_path or task.card.default_base_model
            card = model_card(base_model=base_model, task=task.card,
                              recipe=task.name, repo_id=hub.repo_id, title=Path(cfg.output_dir).name,
                              data_source=data_source, results=results, command=sys.argv, token=hub.token,
                              hyper_parameters={name: getattr(cfg, name) for name in CARD_HYPER_PARAMETERS})
            card.save(str(folder / "README.md"))

    try:
        files = write_final_model(cfg.output_dir, write)
    except (OSError, RuntimeError, SafetensorError) as err:
        if (reason := disk_write_failure(err)) is None:
            raise
        raise UserError(f"cannot write the model to {cfg.output_dir} ({reason}); free disk space or choose another "
                        "--output_dir; the model there before is intact") from None
    hub.push_final(cfg.output_dir, files, results["global_step"])


def _write_json(path: Path, values: dict) -> None:
    # A new file renamed over the old, never the old rewritten: a push still running holds the old one's hard link.
    with replacing(path) as partial:
        partial.write_text(json.dumps(values, indent=2))


def _log_interval(runtime: Runtime, output_dir: str, logs: dict[str, float], step: int) -> None:
    """An interval's metrics to the trackers and to ``log_history.jsonl``."""
    runtime.log(logs, step=step)
    if runtime.is_main_process:
        with open(Path(output_dir) / LOG_HISTORY, "a") as f:
            f.write(json.dumps({"step": step, **logs}) + "\n")


def _tracker_settings(task: Task, cfg: TrainConfig, task_options, resume_from: Path | None) -> TrackerSettings | None:
    """What the trackers record of this run (the flags and the recipe's options, never the Hub token), and as
    which run: the one ``resume_from`` recorded, if any."""
    if not cfg.trackers:
        return None
    options = {**dataclasses.asdict(cfg), **(dataclasses.asdict(task_options) if task_options else {})}
    tracked = {k: v for k, v in options.items() if isinstance(v, (int, float, str, bool)) and k != "hub_token"}
    return TrackerSettings.for_run(cfg.trackers, project=task.name, output_dir=cfg.output_dir, run_name=cfg.run_name,
                                   config=tracked, resume_from=resume_from, secret=cfg.hub_token)
