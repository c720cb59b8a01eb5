"""What a run works out before its first step: the plan of training batches, each process's memory predicted
(and, where --gradient_checkpointing is unset, whether the layers are recomputed), the start-up line; and
``--prepare_only``, which stops there: the data cache, a preview of its rows, and the memory predicted on the
model's first layers, before the model itself loads."""

from __future__ import annotations

import contextlib
import json
import sys
from pathlib import Path

import torch

from finetune.config import TrainConfig
from finetune.data.batching import GlobalBatchSampler
from finetune.data.cache import load_or_build
from finetune.environment import LaunchEnvironment
from finetune.errors import UserError
from finetune.models.estimate import MemoryEstimate, extrapolated, longest_planned, predict_memory, weights_alive
from finetune.models.loading import first_layers_only, weight_dtypes
from finetune.models.memory import check_tiling, checkpoint_activations, is_four_bit, keep_less
from finetune.runtimes.base import Runtime
from finetune.runtimes.launcher import make_runtime
from finetune.task import Task, TaskSetup

__all__ = ["announce", "prepare_only", "training_sampler"]


def training_sampler(setup: TaskSetup, cfg: TrainConfig, runtime: Runtime):
    """The plan of training batches: the task's own, or global batches over its training set."""
    return setup.sampler or GlobalBatchSampler(
        setup.train_set.lengths, cfg.per_device_train_batch_size, runtime.world_size, seed=cfg.seed,
        group_by_length=cfg.group_by_length, accumulation_steps=cfg.gradient_accumulation_steps,
        loss_units=setup.train_set.loss_units)


def announce(task: Task, cfg: TrainConfig, runtime: Runtime, source: str, setup: TaskSetup, sampler, max_steps: int,
             model, epoch: int) -> None:
    """The start-up line, then each process's memory predicted (``finetune.models.estimate``), with a warning
    naming what would make it fit where it does not. Where --gradient_checkpointing is unset the prediction chooses
    it, for every process alike (``MemoryEstimate.needs_recompute``)."""
    unwrapped = runtime.unwrap(model)
    estimate = _predicted(task, cfg, runtime, setup, sampler, unwrapped, epoch)
    recompute = "layers recomputed in the backward pass, " if cfg.gradient_checkpointing else ""
    if _recompute_chosen(estimate, cfg, runtime):
        checkpoint_activations(unwrapped)
        estimate = estimate.recomputed()
        recompute = "layers recomputed in the backward pass (every activation kept would not fit), "
    if cfg.tiled_mlp:  # a micro-batch no longer than a tile runs its MLPs whole
        recompute += "MLPs run in tiles of positions, " if estimate.tile else \
            "MLPs whole (no micro-batch is longer than a tile), "
    truncated = (int((sampler.lengths >= cfg.max_seq_length).sum()) if setup.truncated is None else setup.truncated)
    runtime.print(f"training {task.name} on {source}: {len(setup.train_set)} examples ({truncated} cut "
                  f"to --max_seq_length {cfg.max_seq_length}), {setup.summary}, {weight_dtypes(setup.model)}, "
                  f"{recompute}{max_steps} steps, "
                  f"{runtime.world_size} process(es) on {runtime.device.type}, {torch.get_num_threads()} CPU "
                  f"thread(s) each [{runtime.name}]")
    _print_estimate(runtime, estimate)


def prepare_only(task: Task, cfg: TrainConfig) -> dict:
    """``--prepare_only``: make the data cache if it is missing; with ``--preview_rows``, the task's preview of its
    first training rows, printed and in ``data_preview.jsonl``; then each process's memory predicted as the run
    would predict it at its start, counted on the model's first layer and first two (``_predicted_before_loading``).

    Raises:
        UserError: ``--preview_rows`` for a task that has no preview, before anything is built.
    """
    if cfg.preview_rows and not hasattr(task, "preview"):
        raise UserError(f"--preview_rows: the {task.name} recipe has no preview of its rows; the chat recipes do")
    with contextlib.ExitStack() as closing:
        runtime = closing.enter_context(make_runtime(cfg, tracking=None))
        check_tiling(cfg.tiled_mlp, runtime.shards_weights)
        tokenizer = task.load_tokenizer(cfg)
        data = load_or_build(task, cfg, tokenizer, runtime)
        if cfg.preview_rows and runtime.is_main_process:
            rows = task.preview(data, tokenizer, cfg.preview_rows)
            Path(cfg.output_dir).mkdir(parents=True, exist_ok=True)
            with open(Path(cfg.output_dir) / "data_preview.jsonl", "w") as f:
                f.writelines(json.dumps(row) + "\n" for row in rows)
            for row in rows:  # what trains between guillemets
                runtime.print(f"-- example {row['example']}: " + _marked(row["text"], row["trained"]))
        estimate = _predicted_before_loading(task, cfg, tokenizer, data, runtime)
        if _recompute_chosen(estimate, cfg, runtime):
            estimate = estimate.recomputed()
            runtime.print("the run will recompute its layers in the backward pass (every activation kept would not "
                          "fit)")
        _print_estimate(runtime, estimate)
    return {}


def _predicted_before_loading(task: Task, cfg: TrainConfig, tokenizer, data, runtime: Runtime) -> MemoryEstimate:
    """The prediction ``announce`` makes, from the task's model cut to its first layer and to its first two
    (``finetune.models.loading.first_layers_only``), extrapolated to all of them; the task's model itself where
    it cannot be cut. Each model is let go before the next loads; the task is closed at the end."""
    estimates, weights, full = [], [], None
    with contextlib.ExitStack() as closing:
        closing.callback(getattr(task, "close", lambda: None))
        for layers in (1, 2):
            with first_layers_only(layers) as cut:
                setup = task.setup(cfg, tokenizer, data)
            if runtime.device.type != "cpu" and not is_four_bit(setup.model):  # 4-bit weights load onto the device
                setup.model.to(runtime.device)
            keep_less(setup.model, cfg.gradient_checkpointing, cfg.tiled_mlp)
            with runtime.autocast():  # as the prepared model's forward would run
                estimates.append(_predicted(task, cfg, runtime, setup, training_sampler(setup, cfg, runtime),
                                            setup.model, epoch=0))
            weights.append(weights_alive(runtime.device))
            del setup
            full = full or cut.full
            if full is None:  # it loaded whole: counted as it is
                return estimates[0]
    return extrapolated(*estimates, tuple(weights), full)


def _predicted(task: Task, cfg: TrainConfig, runtime: Runtime, setup: TaskSetup, sampler, model, epoch: int
               ) -> MemoryEstimate:
    """This process's peak training ``model`` (unwrapped) on its plan of ``epoch``, the activations counted where
    they can be."""
    counted, not_counted = None, ""
    if runtime.shards:
        not_counted = "a sharded model's forward needs its backward"
    elif setup.sampler is None:
        counted = longest_planned(setup.train_set, sampler.plan(epoch, runtime.rank), setup.collate, task.loss)
    elif setup.largest_batch is None:
        not_counted = "the batches are sampled as the run goes"
    else:
        counted = setup.largest_batch
    return predict_memory(model, counted, runtime.device, LaunchEnvironment.read().local_world_size,
                          bool(cfg.gradient_checkpointing), not_counted)


def _recompute_chosen(estimate: MemoryEstimate, cfg: TrainConfig, runtime: Runtime) -> bool:
    """Whether the run recomputes its layers though --gradient_checkpointing is unset: where any process needs it."""
    return cfg.gradient_checkpointing is None and bool(
        runtime.max_over_processes([float(estimate.needs_recompute())])[0])


def _print_estimate(runtime: Runtime, estimate: MemoryEstimate) -> None:
    runtime.print(estimate.line())
    if runtime.is_main_process and (advice := estimate.advice()):
        print(f"warning: {advice}", file=sys.stderr, flush=True)


def _marked(text: str, trained: list[str]) -> str:
    """``text`` with each of its ``trained`` runs, in order, between guillemets."""
    out, at = [], 0
    for run in trained:
        found = text.find(run, at)
        if found < 0:
            break
        out += [text[at:found], "\u00ab", run, "\u00bb"]
        at = found + len(run)
    return "".join(out) + text[at:]
