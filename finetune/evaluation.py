"""Evaluation: exact metrics over the whole evaluation set, whatever the number of processes, at most once a step."""

from __future__ import annotations

from collections.abc import Callable

import torch

from finetune.distributed.ddp import pad_second_dim
from finetune.runtimes.base import Runtime
from finetune.task import Task

__all__ = ["Evaluation"]


class Evaluation:
    """Exact metrics over the whole evaluation set (each example once, whatever the world size) and every
    example's outputs in order, computed at most once a step and logged to the trackers; ``before_batch`` runs
    before each batch, so an evaluation (which may generate for minutes) never keeps a stop waiting."""

    def __init__(self, runtime: Runtime, task: Task, model, eval_loader, before_batch: Callable[[], None]):
        self.runtime, self.task, self.model, self.eval_loader = runtime, task, model, eval_loader
        self.before_batch = before_batch
        self._step, self._latest = None, ({}, ())

    def at(self, step: int) -> tuple[dict[str, float], tuple]:
        """The ``eval_*`` metrics and the outputs of the model at optimizer step ``step``; the model's mode is kept."""
        if step != self._step:
            training = self.model.training
            self._latest, self._step = self._evaluate(), step
            self.runtime.log(self._latest[0], step=step)
            self.model.train(training)
        return self._latest

    def _evaluate(self) -> tuple[dict[str, float], tuple]:
        self.model.eval()
        batches = []
        with torch.no_grad():
            for batch in self.eval_loader:
                self.before_batch()
                outputs = self.task.eval_outputs(self.runtime.unwrap(self.model), batch)
                batches.append([values.cpu() for values in self.runtime.gather_for_metrics(outputs)])
        outputs = tuple(_concat_padded(list(column)) for column in zip(*batches, strict=True))
        return {f"eval_{name}": value for name, value in self.task.metrics(outputs).items()}, outputs


def _concat_padded(tensors: list[torch.Tensor], pad_index: int = -100) -> torch.Tensor:
    """Concatenate along the batch dimension, padding a second dimension with ``pad_index`` to the longest."""
    if tensors[0].dim() > 1:
        longest = max(t.shape[1] for t in tensors)
        tensors = [pad_second_dim(t, longest, pad_index) for t in tensors]
    return torch.cat(tensors)
