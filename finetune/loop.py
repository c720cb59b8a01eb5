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
import signal
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors import SafetensorError
from torch.distributed.tensor import DTensor
from tqdm.auto import tqdm
from transformers import get_scheduler, set_seed

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
from finetune.checkpointing.preemption import StopSignals
from finetune.config import TrainConfig
from finetune.data.batching import GlobalBatchSampler
from finetune.data.cache import load_or_build
from finetune.distributed.ddp import pad_second_dim
from finetune.environment import LaunchEnvironment
from finetune.errors import Stopped, UserError
from finetune.hub.pusher import HubPusher, download_last_checkpoint, model_card
from finetune.models.loading import optimizer_param_groups
from finetune.observability.metering import TrainingMeter
from finetune.runtimes.base import Runtime, TrackerSettings
from finetune.runtimes.launcher import make_runtime
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
        return _prepare_only(task, cfg)

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
        if found_in_folder:
            resume_from = _main_process_choice(runtime, resume_from, cfg.output_dir)
        set_seed(cfg.seed)
        hub = HubPusher(enabled=cfg.push_to_hub and runtime.is_main_process, output_dir=cfg.output_dir,
                        repo_id=cfg.hub_model_id, token=cfg.hub_token, private=cfg.hub_private_repo,
                        revision=cfg.hub_revision, strategy=cfg.hub_strategy, timeout=cfg.hub_timeout)

        # -- data (tokenized once into a cache every process memory-maps) and model, from the task; training
        # batches planned globally (see finetune.data.cache and finetune.data.batching)
        tokenizer = task.load_tokenizer(cfg)
        data = load_or_build(task, cfg, tokenizer, runtime)
        setup = task.setup(cfg, tokenizer, data)
        sampler = GlobalBatchSampler(setup.train_set.lengths, cfg.per_device_train_batch_size, runtime.world_size,
                                     seed=cfg.seed, group_by_length=cfg.group_by_length,
                                     accumulation_steps=cfg.gradient_accumulation_steps,
                                     loss_units=setup.train_set.loss_units)
        train_loader = runtime.train_loader(setup.train_set, sampler, setup.collate)
        eval_loader = runtime.eval_loader(setup.eval_set, cfg.per_device_eval_batch_size,
                                          setup.eval_collate or setup.collate)

        # -- optimizer and schedule, both counted in optimizer steps
        # fused: one kernel over all parameters instead of a dozen passes over memory per step.
        optimizer = torch.optim.AdamW(optimizer_param_groups(setup.model, cfg.weight_decay), lr=cfg.learning_rate,
                                      fused=True)
        steps_per_epoch = math.ceil(sampler.batches_per_rank / cfg.gradient_accumulation_steps)
        max_steps = cfg.max_train_steps or cfg.num_train_epochs * steps_per_epoch
        num_epochs = math.ceil(max_steps / steps_per_epoch)
        scheduler = get_scheduler(cfg.lr_scheduler_type, optimizer, cfg.num_warmup_steps, max_steps)

        # -- resume: weights, optimizer, schedule, RNG and the position in the epoch, at another world size too
        # when the global batch is kept (a fresh run gets an identity of its own, which only the main process records),
        # on the frozen weights it was trained on (hashed while the model is whole, before it is sharded)
        progress = Progress(world_size=runtime.world_size, runtime=runtime.name, seed=cfg.seed, run_id=uuid.uuid4().hex,
                            per_device_train_batch_size=cfg.per_device_train_batch_size,
                            gradient_accumulation_steps=cfg.gradient_accumulation_steps,
                            frozen_weights=frozen_weights_digest(setup.model))
        model, optimizer, scheduler, train_loader, eval_loader = runtime.prepare(
            setup.model, optimizer, scheduler, train_loader, eval_loader)
        if resume_from:
            progress = resumed_progress(read_progress(resume_from), progress, resume_from, sampler.batches_per_rank)
            runtime.load_state(resume_from)
            runtime.print(f"resumed from {resume_from} at step {progress.global_step}")
        progress.launch_id = launch
        if runtime.is_main_process:  # only now that the run has all it needs may it remove what it replaces
            clear_output_dir(cfg.output_dir, progress, cfg.overwrite_output_dir, getattr(task, "run_files", ()))

        truncated = (int((sampler.lengths >= cfg.max_seq_length).sum()) if setup.truncated is None
                     else setup.truncated)
        runtime.print(
            f"training {task.name} on {data.source}: {len(setup.train_set)} examples ({truncated} cut "
            f"to --max_seq_length {cfg.max_seq_length}), {setup.summary}, {max_steps} steps, {runtime.world_size} "
            f"process(es) on {runtime.device.type}, {torch.get_num_threads()} CPU thread(s) each [{runtime.name}]")

        def evaluate_and_log():
            metrics, outputs = _evaluate(runtime, task, model, eval_loader, stop_if_signalled)
            runtime.log(metrics, step=progress.global_step)
            return metrics, outputs

        # A non-finite loss or gradient norm is noted on the device (no sync per step) and checked, on every
        # process, before anything is written or logged: no such weights reach a checkpoint, the model or the Hub.
        nonfinite_at = torch.full((), -1, dtype=torch.long, device=runtime.device)  # the first such step
        window_finite = torch.ones((), dtype=torch.bool, device=runtime.device)

        def check_finite() -> None:
            local = int(nonfinite_at.item())
            (first,) = runtime.max_over_processes([-local if local >= 0 else -math.inf])
            if first > -math.inf:
                raise UserError(
                    f"the loss or the gradient norm was not finite at step {int(-first)}, so nothing from that step on "
                    f"was saved; lower --learning_rate (now {cfg.learning_rate}), keep --max_grad_norm above 0, look "
                    "for extreme rows in the data, and resume from the last checkpoint")

        saved = {}  # step -> its checkpoint, so that a stop at that step does not write it again

        def save_checkpoint() -> Path:
            check_finite()
            _check_finite_model(runtime, model, progress.global_step, cfg.learning_rate)
            folder = saved[progress.global_step] = runtime.save_checkpoint(cfg.output_dir, progress,
                                                                         cfg.checkpoints_total_limit)
            hub.push_checkpoint(folder, progress.global_step, runtime.unwrap(model).config, tokenizer)
            return folder

        def stop_if_signalled() -> None:
            """A stop signal on any process: all save this step, then stop (the same flags resume it). Checked at
            every optimizer step and before every evaluation batch, so no long work runs after a signal."""
            signal_number, negative_time = runtime.max_over_processes([stop.number, -stop.at])
            if signal_number:
                folder = saved.get(progress.global_step) or save_checkpoint()
                progress_bar.close()
                _stop(runtime, hub, folder, int(signal_number), -negative_time, progress.global_step)

        # -- train (the output folder exists: the main process made it when it took the lock)
        # closed however the loop ends, so that an error is printed on a line of its own
        progress_bar = closing.enter_context(
            tqdm(total=max_steps, initial=progress.global_step, disable=not runtime.is_main_process))
        meter = TrainingMeter(runtime.device, runtime.reduce_sum, getattr(task, "logged_figures", ()))
        grad_norm = None
        metrics, eval_outputs, evaluated_at = {}, None, None
        for epoch in range(progress.epoch, num_epochs):
            progress.epoch = epoch
            model.train()
            plan = sampler.plan(epoch, runtime.rank)[progress.batches_in_epoch:]
            batches = runtime.epoch_batches(train_loader, epoch, skip_batches=progress.batches_in_epoch)
            for batch, planned in zip(batches, plan, strict=True):
                # forward backward update; gradients are all-reduced only at the end of a window
                with runtime.accumulate(model):
                    loss = task.loss(model, batch)
                    loss, figures = (loss, None) if torch.is_tensor(loss) else (loss.pop("loss"), loss)
                    runtime.backward(loss * planned.loss_scale)
                    window_finite &= torch.isfinite(loss.detach())
                    if runtime.sync_gradients:
                        if cfg.max_grad_norm > 0:  # clip the gradient; its norm before clipping is logged
                            grad_norm = runtime.clip_grad_norm_(model, cfg.max_grad_norm)
                            window_finite &= torch.isfinite(grad_norm)
                        optimizer.step()
                        scheduler.step()
                        optimizer.zero_grad()
                if planned.num_real:
                    meter.add(loss, planned.units, planned.num_real, real_tokens=int(sampler.lengths[planned].sum()),
                              processed_tokens=batch["input_ids"].numel(), figures=figures)
                progress.batches_in_epoch += 1
                if not runtime.sync_gradients:
                    continue
                progress.global_step += 1
                progress_bar.update(1)
                nonfinite_at = torch.where((nonfinite_at < 0) & ~window_finite, progress.global_step, nonfinite_at)
                window_finite.fill_(True)

                # log, evaluate and checkpoint at their cadence
                if progress.global_step % cfg.logging_steps == 0 or progress.global_step >= max_steps:
                    check_finite()
                    logs = {**meter.interval(), "learning_rate": scheduler.get_last_lr()[0], "epoch": epoch}
                    if grad_norm is not None:
                        logs["grad_norm"] = float(grad_norm)
                    _log_interval(runtime, cfg.output_dir, logs, progress.global_step)
                    progress_bar.set_postfix(loss=f"{logs['loss']:.4f}", lr=f"{logs['learning_rate']:.2e}",
                                             samples_per_s=f"{logs['samples_per_second']:.1f}")
                if cfg.eval_steps and progress.global_step % cfg.eval_steps == 0:
                    (metrics, eval_outputs), evaluated_at = evaluate_and_log(), progress.global_step
                    model.train()
                if cfg.checkpoint_every_steps and progress.global_step % cfg.checkpoint_every_steps == 0:
                    save_checkpoint()
                stop_if_signalled()
                if progress.global_step >= max_steps:
                    break
            if progress.batches_in_epoch == sampler.batches_per_rank:
                progress.epoch, progress.batches_in_epoch = epoch + 1, 0
                if cfg.checkpointing_steps == "epoch":
                    save_checkpoint()

            if evaluated_at != progress.global_step:  # --eval_steps may have just evaluated this model
                (metrics, eval_outputs), evaluated_at = evaluate_and_log(), progress.global_step
            runtime.print(f"epoch {epoch}: " + ", ".join(f"{k} {v:.4f}" for k, v in metrics.items()))
            if progress.global_step >= max_steps:
                break
        progress_bar.close()
        training = meter.totals()
        if evaluated_at != progress.global_step:  # resumed from a checkpoint taken after the last step
            metrics, eval_outputs = _evaluate(runtime, task, model, eval_loader, stop_if_signalled)

        # -- save: every process reaches this point, the main process writes the unwrapped model
        results = {
            **metrics,
            **training,
            "epoch": progress.global_step / steps_per_epoch,
            "global_step": progress.global_step,
            "runtime": runtime.name,
            "world_size": runtime.world_size,
        }
        # (no non-finite loss gets here: the last step is always logged, which checks it first)
        _check_finite_model(runtime, model, progress.global_step, cfg.learning_rate, metrics.get("eval_loss"))
        _save(runtime, task, cfg, model, tokenizer, data.source, hub, results, eval_outputs)
        runtime.wait_for_save()
        runtime.log({k: results[k] for k in results.keys() - metrics.keys() - UNTRACKED_RESULTS}, progress.global_step)
        runtime.print(f"saved the model to {cfg.output_dir}\n" + json.dumps(results, indent=2))

        # -- the end: only the main process waits for its uploads (bounded by --hub_timeout)
        _finish_pushes(hub, cfg, results, stopped_at=lambda: stop.at)
        return results


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


def _check_finite_model(runtime: Runtime, model, step: int, learning_rate: float, eval_loss: float | None = None
                        ) -> None:
    """Raise on every process when a weight of the model (of any process's shard) or ``eval_loss`` is not finite:
    a finite loss and gradient can still be followed by an update that is not (a learning rate beyond float32), and
    such a model is never saved or pushed.

    Raises:
        UserError: the first of the two that is not finite, named.
    """
    weights = [p.to_local() if isinstance(p, DTensor) else p for p in runtime.unwrap(model).parameters()]
    local = not bool(torch.stack([torch.isfinite(w).all() for w in weights]).all())
    bad_weights, bad_loss = runtime.max_over_processes([float(local), float(not math.isfinite(eval_loss or 0.0))])
    what = "a weight" if bad_weights else "the evaluation loss" if bad_loss else None
    if what:
        raise UserError(f"{what} was not finite after step {step}, so nothing from that step on was saved; lower "
                        f"--learning_rate (now {learning_rate}), keep --max_grad_norm above 0, look for extreme rows "
                        "in the data, and resume from the last checkpoint")


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


def _prepare_only(task: Task, cfg: TrainConfig) -> dict:
    """``--prepare_only``: make the data cache if it is missing, and nothing else (no output folder, no model)."""
    with make_runtime(cfg, tracking=None) as runtime:
        load_or_build(task, cfg, task.load_tokenizer(cfg), runtime)
    return {}


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


def _stop(runtime: Runtime, hub: HubPusher, checkpoint: Path, signal_number: int, signal_time: float,
          step: int) -> None:
    """Report the stop, give the checkpoint's push what is left of the stop's time budget (the uploader goes on
    by itself after that), and raise ``Stopped``; leaving the runtime's context then flushes the trackers."""
    delay = time.time() - signal_time
    runtime.log({"stop_signal_to_checkpoint_seconds": delay}, step=step)
    runtime.print(f"stopped by {signal.Signals(signal_number).name} at step {step}: {checkpoint} was complete on disk "
                  f"{delay:.1f} s after the signal; run the same command with --resume_from_checkpoint latest to "
                  "continue")
    hub.finish(stopped_at=lambda: signal_time)
    raise Stopped(f"stopped by {signal.Signals(signal_number).name} at step {step}")


def _evaluate(runtime: Runtime, task: Task, model, eval_loader, stop_if_signalled: Callable[[], None]
              ) -> tuple[dict[str, float], tuple]:
    """Exact metrics over the whole evaluation set (each example once, whatever the world size), and
    every example's outputs in order. ``stop_if_signalled`` runs before each batch: an evaluation (which may
    generate for minutes) never keeps a stop waiting."""
    model.eval()
    batches = []
    with torch.no_grad():
        for batch in eval_loader:
            stop_if_signalled()
            gathered = runtime.gather_for_metrics(task.eval_outputs(runtime.unwrap(model), batch))
            batches.append([values.cpu() for values in gathered])
    outputs = tuple(_concat_padded(list(column)) for column in zip(*batches, strict=True))
    return {f"eval_{name}": value for name, value in task.metrics(outputs).items()}, outputs


def _concat_padded(tensors: list[torch.Tensor], pad_index: int = -100) -> torch.Tensor:
    """Concatenate along the batch dimension, padding a second dimension with ``pad_index`` to the longest."""
    if tensors[0].dim() > 1:
        longest = max(t.shape[1] for t in tensors)
        tensors = [pad_second_dim(t, longest, pad_index) for t in tensors]
    return torch.cat(tensors)


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
    with open(path, "w") as f:
        json.dump(values, f, indent=2)


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
