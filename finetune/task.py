"""What a recipe plugs into the shared loop (``finetune.loop.train``): its data, model, loss, metrics and saving.

A task is any object with the attributes and methods of ``Task``; the loop owns everything else (devices,
processes, accumulation, clipping, schedules, logging, evaluation cadence, checkpoints, resume, the Hub).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

__all__ = ["ModelCardInfo", "Task", "TaskSetup"]


@dataclass
class TaskSetup:
    """What ``Task.setup`` returns: the data, the model (on the CPU, unwrapped) and its tokenizer."""

    train_set: Any
    """A ``finetune.batching.TokenizedDataset``; its ``loss_units`` say what each example adds to the loss."""
    eval_set: Any
    collate: Callable[[list[dict]], dict]
    """Rows to a batch of tensors (padded per batch, or packed)."""
    model: Any
    tokenizer: Any
    """Saved beside the model (a tokenizer or processor)."""
    summary: str
    """For the start-up line, e.g. ``"4 labels"``."""
    data_source: str
    """Where the data came from, for the start-up line and the model card."""
    eval_collate: Callable[[list[dict]], dict] | None = None
    """Rows to an evaluation batch, when it differs from ``collate`` (packed training, padded evaluation)."""


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
    """Names the trackers' project and the recipe in the model card (``classify``, ``sft``, ...)."""
    card: ModelCardInfo

    def setup(self, cfg) -> TaskSetup:
        """Load and tokenize the data, build the model (``cfg`` is the shared ``TrainConfig``).

        Raises ``UserError`` for bad input."""

    def loss(self, model, batch: dict) -> Any:
        """The batch's loss summed over its loss units (a scalar tensor); the loop normalises it."""

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
