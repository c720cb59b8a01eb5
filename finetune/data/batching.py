"""Batches: a map-style dataset over memory-mapped tokenized rows, and the sampler that plans every epoch.

The sampler is what makes a run exact and world-size invariant. It plans each epoch as a sequence of
optimizer steps, each a *window* of examples (per-device batch x world size x accumulation steps: the global
batch), shuffled by ``seed + epoch`` alone and grouped by length at the window level; a window is cut into
``accumulation_steps`` micro-batches of per-device batch x world size examples, and each of those is dealt out
to the ranks. Which examples share an optimizer step therefore depends only on the global batch: 2 processes x
batch 4 and 1 process x batch 4 x accumulation 2 train on the same windows, and either resumes the other's
checkpoint. It also fixes each batch's loss scale, the one place where the loss is normalised: ``world_size /
loss units in the window`` (units are examples for classification, trained tokens for language modelling and
tagging), so DDP's average over ranks of ``scale x summed loss`` is the mean loss per unit over the whole
window, the short last window of an epoch included, whatever the world size.

Lengths, loss units and the plan are numpy arrays: planning an epoch of ten million rows takes seconds, and
a batch's indices become a Python list only when the loader asks for it.
"""

from __future__ import annotations

import math

import datasets
import numpy as np
import pyarrow.compute as pc
import torch
from torch.utils.data import Dataset, Sampler

__all__ = ["GlobalBatchSampler", "PlannedBatch", "RankPlan", "TokenizedDataset", "pad_token_id", "padded_tokens"]

LENGTH, LOSS_UNITS = "length", "loss_units"
"""Columns every tokenized split carries beside what the model reads: tokens per row, loss units per row."""


def pad_token_id(tokenizer) -> int:
    """The id that pads rows of ``tokenizer``'s tokens: a tokenizer without a pad token pads with its end of text."""
    return tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id


def padded_tokens(batch: dict) -> int:
    """The token positions a batch puts through the model, padding included: its ``input_ids``, the ``prompt_ids``
    and ``reply_ids`` of a batch whose prompts each run once for their replies, or the ``input_ids_0``,
    ``input_ids_1``, ... of a batch of several texts a row, each text column padded apart."""
    return sum(value.numel() for key, value in batch.items()
               if key in ("input_ids", "prompt_ids", "reply_ids") or key.startswith("input_ids_"))


class TokenizedDataset(Dataset):
    """Map-style dataset over the tokenized rows of a ``datasets.Dataset`` (memory-mapped Arrow files).

    Rows are read from the Arrow table a batch at a time, so nothing per row lives in Python between
    batches. ``lengths`` and ``loss_units`` are numpy arrays, from the ``length`` and ``loss_units`` columns
    when present (tokens per row from ``input_ids`` and one unit per row otherwise). A batch holds the
    columns the collator takes: ``columns``, or every column but those two. An ``index`` column that the rows do
    not hold is each row's position.
    """

    def __init__(self, rows: datasets.Dataset, columns: list[str] | None = None):
        self.rows = rows
        self.columns = columns or [name for name in rows.column_names if name not in (LENGTH, LOSS_UNITS)]
        self._positions = "index" in self.columns and "index" not in rows.column_names
        self._batch_rows = rows.select_columns([c for c in self.columns if c != "index" or not self._positions])
        table = rows.data
        self.lengths = (_as_numpy(table.column(LENGTH)) if LENGTH in rows.column_names
                        else _as_numpy(pc.list_value_length(table.column("input_ids"))))
        self.loss_units = (_as_numpy(table.column(LOSS_UNITS)) if LOSS_UNITS in rows.column_names
                           else np.ones(len(rows), dtype=np.int64))

    @classmethod
    def from_dict(cls, columns: dict[str, list], loss_units: list[int] | None = None) -> TokenizedDataset:
        """A dataset held in memory, for rows made in Python (tests, small scripts)."""
        extra = {LOSS_UNITS: loss_units} if loss_units is not None else {}
        return cls(datasets.Dataset.from_dict({**columns, **extra}))

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index: int) -> dict:
        return self.__getitems__([index])[0]

    def __getitems__(self, indices: list[int]) -> list[dict]:
        batch = self._batch_rows[list(indices)]
        if self._positions:
            batch["index"] = [int(i) for i in indices]
        return [dict(zip(batch, values, strict=True)) for values in zip(*batch.values(), strict=True)]


def _as_numpy(column) -> np.ndarray:
    return np.asarray(column.to_numpy() if hasattr(column, "to_numpy") else column, dtype=np.int64)


class PlannedBatch(list):
    """A rank's share of one global batch: dataset indices, and how its summed loss is scaled.

    A share is either all real examples or, when a global batch has fewer examples than ranks, one
    filler example that keeps the rank stepping with the others; a filler's ``loss_scale`` is 0.
    """

    def __init__(self, indices: list[int], num_real: int, units: int, loss_scale: float, window: int = 0,
                 tokens: tuple[int, int] | None = None):
        super().__init__(indices)
        self.num_real = num_real
        self.units = units
        """Loss units of the real examples in this share."""
        self.loss_scale = loss_scale
        self.window = window
        """Which window (optimizer step's global batch) of the epoch the share belongs to."""
        self.tokens = tokens
        """(real, processed) tokens of the batch, where it is not its examples' planned rows padded (a rollout's
        prompts, each run once, and their completions)."""


class RankPlan:
    """One rank's batches of one epoch, in order, as arrays; ``plan[k:]`` starts at its k-th batch without
    making the ones before it."""

    def __init__(self, offsets: np.ndarray, indices: np.ndarray, num_real: np.ndarray, units: np.ndarray,
                 loss_scale: np.ndarray, window: np.ndarray, start: int = 0):
        self.offsets, self.indices = offsets, indices
        self.num_real, self.units, self.loss_scale, self.window = num_real, units, loss_scale, window
        self.start = start

    def __len__(self) -> int:
        return len(self.num_real) - self.start

    def __getitem__(self, key):
        if isinstance(key, slice):
            if key.step not in (None, 1) or key.stop is not None:
                raise ValueError("a plan is sliced from a start only: plan[k:]")
            return RankPlan(self.offsets, self.indices, self.num_real, self.units, self.loss_scale, self.window,
                            self.start + min(key.start or 0, len(self)))
        batch = self.start + key
        return PlannedBatch(self.indices[self.offsets[batch]:self.offsets[batch + 1]].tolist(),
                            int(self.num_real[batch]), int(self.units[batch]), float(self.loss_scale[batch]),
                            int(self.window[batch]))

    def __iter__(self):
        for batch in range(len(self)):
            yield self[batch]


class GlobalBatchSampler(Sampler[list[int]]):
    """Yields each rank's share of every global batch of an epoch (see the module docstring).

    With ``rank=None`` it yields all ranks' shares in rank order, batch after batch, for a loader that
    shards batches itself round-robin (Accelerate's ``BatchSamplerShard``); ``for_rank`` gives the view
    of one rank. Every rank gets the same number of batches, so no rank waits on a collective the others
    skip.
    """

    def __init__(self, lengths, per_device_batch_size: int, num_replicas: int, *, seed: int, group_by_length: bool,
                 accumulation_steps: int = 1, loss_units=None, rank: int | None = None):
        self.lengths = np.asarray(lengths, dtype=np.int64)
        self.loss_units = (np.ones(len(self.lengths), dtype=np.int64) if loss_units is None
                           else np.asarray(loss_units, dtype=np.int64))
        self.per_device_batch_size = per_device_batch_size
        self.num_replicas = num_replicas
        self.global_batch_size = per_device_batch_size * num_replicas
        self.seed = seed
        self.group_by_length = group_by_length
        self.accumulation_steps = accumulation_steps
        self.rank = rank
        self.epoch = 0
        self.skip_batches = 0

    def for_rank(self, rank: int) -> GlobalBatchSampler:
        """The same plan, yielding only ``rank``'s shares."""
        return GlobalBatchSampler(self.lengths, self.per_device_batch_size, self.num_replicas, seed=self.seed,
                                  group_by_length=self.group_by_length, accumulation_steps=self.accumulation_steps,
                                  loss_units=self.loss_units, rank=rank)

    def set_epoch(self, epoch: int, skip_batches: int = 0) -> None:
        """Plan ``epoch`` next, starting after each rank's first ``skip_batches`` batches (a resumed epoch):
        the skipped ones are never made, let alone read."""
        self.epoch = epoch
        self.skip_batches = skip_batches

    @property
    def batches_per_rank(self) -> int:
        return math.ceil(len(self.lengths) / self.global_batch_size)

    def __len__(self) -> int:
        return (self.batches_per_rank - self.skip_batches) * (self.num_replicas if self.rank is None else 1)

    def global_batches(self, epoch: int) -> list[np.ndarray]:
        """The micro-batches of ``epoch`` across all ranks (arrays of dataset indices), in order; only the last
        of each window may be short, and only the last window."""
        order, starts, _ = self._micro_batches(epoch)
        return np.split(order, starts[1:])

    def plan(self, epoch: int, rank: int) -> RankPlan:
        """``rank``'s batches of ``epoch``, in order, each with its loss scale."""
        return self._rank_plans(epoch, [rank])[0]

    def __iter__(self):
        ranks = range(self.num_replicas) if self.rank is None else [self.rank]
        plans = [plan[self.skip_batches:] for plan in self._rank_plans(self.epoch, ranks)]
        for batch in range(len(plans[0])):
            for plan in plans:
                yield plan[batch]

    def _windows(self, epoch: int) -> tuple[np.ndarray, np.ndarray]:
        """Every example once, window after window, and where each window starts."""
        count, size = len(self.lengths), self.global_batch_size * self.accumulation_steps
        generator = torch.Generator().manual_seed(self.seed + epoch)
        order = torch.randperm(count, generator=generator).numpy()
        if self.group_by_length:
            # Sort within mega-batches of 50 windows: close to fully sorted windows, while which examples share
            # a mega-batch still changes every epoch.
            order = order[_longest_first_within(np.arange(count) // (size * 50), self.lengths[order])]
        starts = np.arange(0, count, size)
        full = torch.randperm(len(starts) - 1, generator=generator).numpy()
        if self.group_by_length and len(full):
            # The longest window first, as transformers' LengthGroupedSampler does: running out of memory
            # shows at the first step instead of hours in, and memory is at its peak from the start.
            longest = int(np.argmax(np.maximum.reduceat(self.lengths[order], starts)[full]))
            full = np.concatenate([full[longest:longest + 1], np.delete(full, longest)])
        windows = np.concatenate([full, [len(starts) - 1]])  # the last, perhaps short, window stays last
        sizes = np.diff(np.append(starts, count))[windows]
        # Gather the windows in their new order: each example's position in the sorted order.
        positions = np.repeat(starts[windows] - np.cumsum(sizes) + sizes, sizes) + np.arange(count)
        return order[positions], np.cumsum(sizes) - sizes

    def _micro_batches(self, epoch: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``(order, where each micro-batch starts, each micro-batch's window)``: windows cut into micro-batches
        of per-device batch x world size, each dealt longest first."""
        order, window_starts = self._windows(epoch)
        count, size = len(order), self.global_batch_size
        per_window = -(-np.diff(np.append(window_starts, count)) // size)
        first_of_window = np.cumsum(per_window) - per_window
        window_of_batch = np.repeat(np.arange(len(window_starts)), per_window)
        within = np.arange(per_window.sum()) - first_of_window[window_of_batch]
        starts = window_starts[window_of_batch] + within * size
        if not self.group_by_length:  # (grouped windows are slices of a mega-batch sorted that way already)
            batch_of = np.repeat(np.arange(len(starts)), np.diff(np.append(starts, count)))
            order = order[_longest_first_within(batch_of, self.lengths[order])]
        return order, starts, window_of_batch

    def _rank_plans(self, epoch: int, ranks) -> list[RankPlan]:
        order, starts, window_of_batch = self._micro_batches(epoch)
        count, world = len(order), self.num_replicas
        batch_of = np.repeat(np.arange(len(starts)), np.diff(np.append(starts, count)))
        # Deal longest-first round-robin so each rank's share has a similar length profile.
        dealt_to = (np.arange(count) - starts[batch_of]) % world
        window_units = np.bincount(window_of_batch[batch_of], weights=self.loss_units[order])
        # Units of zero (an example with nothing to train) cannot happen: tasks refuse such examples.
        scale = world / window_units[window_of_batch]
        plans = []
        for rank in ranks:
            mine = dealt_to == rank
            num_real = np.bincount(batch_of[mine], minlength=len(starts))
            units = np.bincount(batch_of[mine], weights=self.loss_units[order[mine]], minlength=len(starts))
            # A rank with no example in a global batch steps on a filler: the batch's longest, weighted 0.
            fillers = num_real == 0
            sizes = np.where(fillers, 1, num_real)
            indices = np.empty(sizes.sum(), dtype=np.int64)
            offsets = np.concatenate([[0], np.cumsum(sizes)])
            indices[offsets[:-1][fillers]] = order[starts[fillers]]
            real_slots = np.ones(len(indices), dtype=bool)
            real_slots[offsets[:-1][fillers]] = False
            indices[real_slots] = order[mine]
            plans.append(RankPlan(offsets, indices, num_real, units.astype(np.int64), np.where(fillers, 0.0, scale),
                                  window_of_batch))
        return plans


def _longest_first_within(groups: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """Positions that order by group (non-negative), then longest first; ties keep their order."""
    top = int(lengths.max()) + 1
    return np.argsort(groups * top + (top - 1 - lengths), kind="stable")
