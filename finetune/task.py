"""What a recipe plugs into the shared loop (``finetune.loop.train``): its data, model, loss, metrics and saving.

A task is any object with the attributes and methods of ``Task``; the loop owns everything else (devices,
processes, the data cache, accumulation, clipping, schedules, logging, evaluation cadence, checkpoints,
resume, the Hub).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

__all__ = ["CountedBatch", "ModelCardInfo", "Task", "TaskSetup"]


@dataclass
class CountedBatch:
    """A micro-batch the memory prediction counts (``finetune.models.estimate.predict_memory``): its rows, whose
    token lists the count may cut short, the collate that makes them a batch, and the loss of one."""

    rows: list[dict]
    collate: Callable[[list[dict]], dict]
    loss: Callable[[Any, dict], Any]
    """``loss(model, batch)``, as ``Task.loss``, leaving nothing in what the run logs."""
    tokens: str
    """Its size for the start-up line, as rows x tokens."""


@dataclass
class TaskSetup:
    """What ``Task.setup`` returns: the data as the loader reads it, the collators, the model (on the CPU,
    unwrapped)."""

    train_set: Any
    """A ``finetune.data.batching.TokenizedDataset``; its ``loss_units`` say what each example adds to the loss."""
    eval_set: Any
    collate: Callable[[list[dict]], dict]
    """Rows to a batch of tensors (padded per batch, or packed)."""
    model: Any
    summary: str
    """For the start-up line, e.g. ``"4 labels"``."""
    eval_collate: Callable[[list[dict]], dict] | None = None
    """Rows to an evaluation batch, when it differs from ``collate`` (packed training, padded evaluation)."""
    sampler: Any = None
    """The plan of training batches, for a task that plans its own (GRPO's ``RolloutSampler``); default the
    loop's ``GlobalBatchSampler`` over ``train_set``."""
    largest_batch: CountedBatch | None = None
    """For a task that plans its own batches (``sampler``), whose rows are made as the run goes: the largest
    micro-batch it can train on, for the memory prediction; None: its activations are not predicted."""
    truncated: int | None = None
    """How many training examples were cut to ``--max_seq_length``, for the start-up line; default: those whose
    length reaches it (a task whose lengths count more than one row says it)."""


@dataclass
class ModelCardInfo:
    """The task's part of the model card pushed to the Hub."""

    pipeline_tag: str
    what: str
    """``"text classification"``: what the model was fine-tuned for."""
    usage: str
    """Python that loads and uses the model; ``{repo_id}`` is filled in."""
    default_base_model: str
    """The Hub id of the recipe's embedded default model."""
    library_name: str = "transformers"


class Task(Protocol):
    name: str
    """Names the trackers' project, the data cache and the recipe in the model card (``classify``, ``sft``, ...)."""
    card: ModelCardInfo
    tokenizing_code: tuple[str, ...]
    """Modules (besides the recipe's own) whose code makes the tokens: a change to them rebuilds the data cache."""
    logged_figures: tuple[str, ...]
    """Optional: names of sums ``loss`` returns besides the loss; each logging interval logs each per loss unit,
    over every process (DPO's rewards)."""
    evaluate_first: bool
    """Optional: evaluate the model before its first step too, logged as step 0 (embeddings: the base model's
    retrieval is the figure to beat)."""
    run_files: tuple[str, ...]
    """Optional: files the task keeps in the output folder for a resume of the run (DPO's precomputed reference);
    a fresh start removes an earlier run's."""

    def load_tokenizer(self, cfg) -> Any:
        """The tokenizer (or processor) the data is tokenized with and that is saved beside the model."""

    def load_data(self, cfg) -> tuple[Any, str]:
        """``(raw train and validation splits as a datasets.DatasetDict, where they came from)``; cheap when the
        data was read before (``datasets`` keeps files as Arrow).

        Raises ``UserError`` for missing or unreadable data."""

    def data_options(self, cfg) -> dict:
        """Every option that changes the tokens (columns, length limit, ...): part of the data cache's key."""

    def tokenize(self, raw, tokenizer, cfg, tokenizing) -> dict:
        """Tokenize ``raw``'s ``train`` and ``validation`` splits through ``tokenizing.map``
        (``finetune.data.cache.Tokenizing``); returns JSON values ``setup`` needs (label names, ...). It runs
        once per cache key, on one process per node.

        Raises ``UserError`` for bad input."""

    def setup(self, cfg, tokenizer, data) -> TaskSetup:
        """The model and the batches' form, for the tokenized ``data`` (``finetune.data.cache.PreparedData``)."""

    def loss(self, model, batch: dict) -> Any:
        """The batch's loss summed over its loss units (a scalar tensor); the loop normalises it. A task with
        ``logged_figures`` returns ``{"loss": that, name: the figure summed over the batch's units, ...}``."""

    def eval_outputs(self, model, batch: dict) -> tuple:
        """Per-example tensors to gather across processes (batch dimension first; a second dimension may
        differ between batches and processes, and is padded with -100). ``model`` is unwrapped, in eval mode,
        under ``no_grad``."""

    def metrics(self, outputs: tuple) -> dict[str, float]:
        """Metrics (names without the ``eval_`` prefix) from every evaluation example's outputs, in order."""

    def write_predictions(self, outputs: tuple, output_dir: str) -> None:
        """Write ``eval_predictions.jsonl`` (main process only)."""

    def save(self, model, state_dict: dict, tokenizer, output_dir: str) -> None:
        """Save the unwrapped model (main process only): a full model or an adapter."""

    def rollout(self, model, window: list[tuple[dict, Any]], epoch: int) -> list[tuple[dict, Any]]:
        """Optional, for a task that trains on what the model generates (GRPO): a window's micro-batches of prompts
        (pairs of a batch and its ``finetune.data.batching.PlannedBatch``, every one of an optimizer step, or of
        several that reuse one rollout) to the micro-batches that train, each with its loss units and scale, known
        only once the completions are. ``model`` is unwrapped; every process calls it for the same windows."""

    def state_dict(self) -> dict:
        """Optional: what the task keeps across steps besides the model (GRPO's reward-failure counters), as JSON
        values the same on every process, for a checkpoint."""

    def load_state_dict(self, state: dict) -> None:
        """Optional: take back a checkpoint's ``state_dict()`` (``{}`` from a checkpoint without one)."""

    def interval_logs(self) -> dict[str, float]:
        """Optional: the task's own figures of the logging interval that ends (the same on every process, which
        all call it)."""

    def close(self) -> None:
        """Optional: release what the task started (GRPO's reward workers) when the run ends, however it ends."""

    def preview(self, data, tokenizer, count: int) -> list[dict]:
        """Optional (``--prepare_only --preview_rows``): the first ``count`` training rows as ``{"example": the data
        row it came from (from 1), "text": the row decoded, "trained": each run of trained tokens decoded}``."""
