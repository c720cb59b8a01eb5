"""What the training loop measures: the loss and throughput of each logging interval, and of the whole run.

Losses are summed on the device, so a step costs no host synchronisation; counts come from the epoch plan and
the batches' shapes. Every process meters its own batches and the figures are summed over the processes when
they are read, which each process does at the same steps.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

__all__ = ["TrainingMeter"]


class TrainingMeter:
    """Sums of one process's micro-batches; ``reduce_sum`` sums a tensor over every process.

    ``figures`` names a task's own sums (``Task.logged_figures``), added with each micro-batch's loss and, like
    it, logged per loss unit of the interval over every process."""

    def __init__(self, device: torch.device, reduce_sum: Callable[[torch.Tensor], torch.Tensor],
                 figures: tuple[str, ...] = ()):
        self._device, self._reduce_sum, self._figures = device, reduce_sum, figures
        # the loss, then each figure
        self._interval_sums = torch.zeros(1 + len(figures), device=device)
        self._interval_units = self._interval_examples = 0
        self._total_loss, self._total_units, self._total_examples = 0.0, 0, 0
        self._real_tokens = self._processed_tokens = 0  # for padding efficiency
        self._start = self._last_log = time.perf_counter()

    def add(self, loss: torch.Tensor, units: int, examples: int, real_tokens: int, processed_tokens: int,
            figures: dict[str, torch.Tensor] | None = None) -> None:
        """A micro-batch: its loss summed over its ``units`` (tokens or examples), its real examples and tokens,
        the tokens it processed with its padding, and each of the meter's ``figures`` summed over its units."""
        sums = [loss, *(figures[name] for name in self._figures)]
        self._interval_sums += torch.stack([value.detach().float() for value in sums])
        self._interval_units += units
        self._interval_examples += examples
        self._real_tokens += real_tokens
        self._processed_tokens += processed_tokens

    def interval(self) -> dict[str, float]:
        """The mean loss (and figures) per loss unit and the examples per second since the last interval, over
        every process; starts the next interval."""
        counts = torch.tensor([self._interval_units, self._interval_examples], device=self._device)
        loss_sum, *figure_sums, units, examples = self._reduce_sum(torch.cat([self._interval_sums, counts])).tolist()
        self._total_loss, self._total_units = self._total_loss + loss_sum, self._total_units + int(units)
        self._total_examples += int(examples)
        now = time.perf_counter()
        logs = {"loss": loss_sum / units, **{name: value / units for name, value in zip(self._figures, figure_sums,
                                                                                         strict=True)},
                "samples_per_second": examples / (now - self._last_log)}
        self._interval_sums.zero_()
        self._interval_units = self._interval_examples = 0
        self._last_log = now
        return logs

    def totals(self) -> dict[str, float]:
        """``all_results``' training figures, from the start to now, over the logged intervals of every process."""
        runtime = time.perf_counter() - self._start
        real, processed = self._reduce_sum(
            torch.tensor([self._real_tokens, self._processed_tokens], device=self._device)).tolist()
        return {
            "train_loss": self._total_loss / max(self._total_units, 1),
            "train_runtime": runtime,
            "train_samples_per_second": self._total_examples / runtime,
            "train_tokens_per_second": real / runtime,
            "padding_efficiency": real / max(processed, 1),
        }
