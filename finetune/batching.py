"""Batches: a cheap map-style dataset over tokenized rows, and the sampler that plans every epoch.

The sampler is what makes a run exact and world-size invariant. It plans each epoch as a sequence of
*global* batches (per-device batch size x world size), shuffled by ``seed + epoch`` alone and grouped by
length at the global level, and deals every global batch out to the ranks. It also fixes each batch's
loss scale, the one place where the loss is normalised: ``world_size / loss units in the accumulation
window`` (units are examples for classification, trained tokens for language modelling and tagging), so
DDP's average over ranks of ``scale x summed loss`` is the mean loss per unit over the whole window, the
short last window of an epoch included, whatever the world size.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch.utils.data import Dataset, Sampler

__all__ = ["GlobalBatchSampler", "PlannedBatch", "TokenizedDataset"]


class TokenizedDataset(Dataset):
    """Map-style dataset over tokenized rows, held as Python lists so fetching a batch is cheap.

    ``loss_units`` is what each row contributes to the loss (1 per example unless given).
    """

    def __init__(self, columns: dict[str, list], loss_units: list[int] | None = None):
        self.columns = columns
        self.length = len(columns["input_ids"])
        self.loss_units = loss_units if loss_units is not None else [1] * self.length

    def __len__(self) -> int:
        return self.length

    @property
    def lengths(self) -> list[int]:
        """Tokens per row, for grouping by length."""
        return [len(ids) for ids in self.columns["input_ids"]]

    def __getitem__(self, index: int) -> dict:
        return {name: values[index] for name, values in self.columns.items()}

    def __getitems__(self, indices: list[int]) -> list[dict]:
        return [self[i] for i in indices]


class PlannedBatch(list):
    """A rank's share of one global batch: dataset indices, and how its summed loss is scaled.

    A share is either all real examples or, when a global batch has fewer examples than ranks, one
    filler example that keeps the rank stepping with the others; a filler's ``loss_scale`` is 0.
    """

    def __init__(self, indices: list[int], num_real: int, units: int, loss_scale: float):
        super().__init__(indices)
        self.num_real = num_real
        self.units = units
        """Loss units of the real examples in this share."""
        self.loss_scale = loss_scale


@dataclass
class _Window:
    batches: list[list[int]]
    units: int


class GlobalBatchSampler(Sampler[list[int]]):
    """Yields each rank's share of every global batch of an epoch (see the module docstring).

    With ``rank=None`` it yields all ranks' shares in rank order, batch after batch, for a loader that
    shards batches itself round-robin (Accelerate's ``BatchSamplerShard``); ``for_rank`` gives the view
    of one rank. Every rank gets the same number of batches, so no rank waits on a collective the others
    skip.
    """

    def __init__(self, lengths: list[int], per_device_batch_size: int, num_replicas: int, *, seed: int,
                 group_by_length: bool, accumulation_steps: int = 1, loss_units: list[int] | None = None,
                 rank: int | None = None):
        self.lengths = lengths
        self.loss_units = loss_units if loss_units is not None else [1] * len(lengths)
        self.per_device_batch_size = per_device_batch_size
        self.num_replicas = num_replicas
        self.global_batch_size = per_device_batch_size * num_replicas
        self.seed = seed
        self.group_by_length = group_by_length
        self.accumulation_steps = accumulation_steps
        self.rank = rank
        self.epoch = 0

    def for_rank(self, rank: int) -> GlobalBatchSampler:
        """The same plan, yielding only ``rank``'s shares."""
        return GlobalBatchSampler(self.lengths, self.per_device_batch_size, self.num_replicas, seed=self.seed,
                                  group_by_length=self.group_by_length, accumulation_steps=self.accumulation_steps,
                                  loss_units=self.loss_units, rank=rank)

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    @property
    def batches_per_rank(self) -> int:
        return math.ceil(len(self.lengths) / self.global_batch_size)

    def __len__(self) -> int:
        return self.batches_per_rank * (self.num_replicas if self.rank is None else 1)

    def global_batches(self, epoch: int) -> list[list[int]]:
        """The global batches of ``epoch``; only the last may be short."""
        generator = torch.Generator().manual_seed(self.seed + epoch)
        order = torch.randperm(len(self.lengths), generator=generator).tolist()
        size = self.global_batch_size
        if self.group_by_length:
            # Sort within mega-batches of 50 global batches: close to fully sorted batches, while which
            # examples share a mega-batch still changes every epoch.
            mega = size * 50
            order = [i for start in range(0, len(order), mega)
                     for i in sorted(order[start:start + mega], key=lambda i: -self.lengths[i])]
        batches = [order[start:start + size] for start in range(0, len(order), size)]
        full = [batches[i] for i in torch.randperm(len(batches) - 1, generator=generator).tolist()]
        if self.group_by_length and full:
            # The longest batch first, as transformers' LengthGroupedSampler does: running out of memory
            # shows at the first step instead of hours in, and memory is at its peak from the start.
            longest = max(range(len(full)), key=lambda b: max(self.lengths[i] for i in full[b]))
            full.insert(0, full.pop(longest))
        return full + batches[-1:]

    def plan(self, epoch: int, rank: int) -> list[PlannedBatch]:
        """``rank``'s batches of ``epoch``, in order, each with its loss scale."""
        return [batch for window in self._windows(epoch) for batch in self._shares(window, [rank])]

    def __iter__(self):
        ranks = range(self.num_replicas) if self.rank is None else [self.rank]
        for window in self._windows(self.epoch):
            yield from self._shares(window, ranks)

    def _windows(self, epoch: int) -> list[_Window]:
        batches = self.global_batches(epoch)
        return [_Window(window, sum(self.loss_units[i] for batch in window for i in batch))
                for start in range(0, len(batches), self.accumulation_steps)
                for window in [batches[start:start + self.accumulation_steps]]]

    def _shares(self, window: _Window, ranks):
        # Units of zero (an example with nothing to train) cannot happen: tasks refuse such examples.
        scale = self.num_replicas / window.units
        for batch in window.batches:
            # Deal longest-first round-robin so each rank's share has a similar length profile.
            by_length = sorted(batch, key=lambda i: -self.lengths[i])
            for rank in ranks:
                share = by_length[rank::self.num_replicas]
                if share:
                    yield PlannedBatch(share, len(share), sum(self.loss_units[i] for i in share), scale)
                else:
                    yield PlannedBatch(by_length[:1], 0, 0, 0.0)
