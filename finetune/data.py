"""Data for classification: loading, label ids, tokenization, and the global-batch sampler.

The sampler is what makes a run exact and world-size invariant. It plans each epoch as a sequence of
*global* batches (per-device batch size x world size), shuffled by ``seed + epoch`` alone and grouped by
length at the global level, then deals every global batch out to the ranks. Each rank's share carries a
loss weight of ``world_size / examples in the accumulation window``, so DDP's gradient average equals
the mean loss over the window whatever the world size, including the short last batch of an epoch.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

import datasets
import torch
from huggingface_hub import constants
from torch.utils.data import Dataset, Sampler
from transformers import DataCollatorWithPadding, PreTrainedTokenizerBase

from finetune.config import ClassifyConfig
from finetune.default_dataset import make_support_tickets
from finetune.errors import UserError

__all__ = [
    "ClassificationData",
    "GlobalBatchSampler",
    "PlannedBatch",
    "TokenizedDataset",
    "collate_with_padding",
    "load_classification_data",
    "tokenize",
]

_FILE_BUILDERS = {".csv": "csv", ".tsv": "csv", ".json": "json", ".jsonl": "json", ".parquet": "parquet"}


@dataclass
class ClassificationData:
    train: datasets.Dataset
    validation: datasets.Dataset
    label_names: list[str]
    """Label id -> name; the ``label`` column of both splits holds ids into this list."""
    source: str


def load_classification_data(cfg: ClassifyConfig) -> ClassificationData:
    """Load train and validation splits and map labels to ids ``0..num_labels-1``.

    Raises:
        UserError: missing or unsupported files, missing columns, empty splits, unusable labels.
    """
    if cfg.train_file:
        raw = datasets.DatasetDict(
            train=_load_file(cfg.train_file, "--train_file"),
            validation=_load_file(cfg.validation_file, "--validation_file"),
        )
        source = f"{cfg.train_file} + {cfg.validation_file}"
    elif cfg.dataset_name:
        raw = _load_hub_dataset(cfg)
        source = cfg.dataset_name + (f"/{cfg.dataset_config_name}" if cfg.dataset_config_name else "")
    else:
        raw = make_support_tickets()
        source = "support tickets (embedded default)"

    columns = [cfg.text_column, cfg.label_column] + ([cfg.text_pair_column] if cfg.text_pair_column else [])
    for split, flag in (("train", "--train_file"), ("validation", "--validation_file")):
        missing = [c for c in columns if c not in raw[split].column_names]
        if missing:
            raise UserError(
                f"{split} data has no column {', '.join(map(repr, missing))} (columns: "
                f"{', '.join(raw[split].column_names)}); pass --text_column/--label_column to name the right ones"
            )
        if len(raw[split]) == 0:
            raise UserError(f"{split} data is empty; give {flag} a file with at least one row")
        raw[split] = raw[split].select_columns(columns)

    label_names, train, validation = _encode_labels(raw["train"], raw["validation"], cfg.label_column)
    return ClassificationData(train, validation, label_names, source)


def _load_file(path: str, flag: str) -> datasets.Dataset:
    if not os.path.isfile(path):
        raise UserError(f"{flag} {path}: no such file; check the path")
    extension = os.path.splitext(path)[1].lower()
    if extension not in _FILE_BUILDERS:
        raise UserError(
            f"{flag} {path}: unsupported file type {extension or '(none)'}; use one of {', '.join(_FILE_BUILDERS)}"
        )
    options = {"delimiter": "\t"} if extension == ".tsv" else {}
    try:
        return datasets.load_dataset(_FILE_BUILDERS[extension], data_files=path, split="train", **options)
    except Exception as err:  # the builders raise many types (ArrowInvalid, DatasetGenerationError, ...)
        if "corresponds to no data" in str(err):  # datasets' words for a file with a header and no rows
            raise UserError(f"{flag} {path} holds no rows; give it at least one example") from None
        cause = err.__cause__ or err
        reason = str(cause).strip().splitlines()[0] if str(cause).strip() else type(cause).__name__
        raise UserError(f"{flag} {path} could not be read as {extension[1:]} ({reason}); fix the file") from None


def _load_hub_dataset(cfg: ClassifyConfig) -> datasets.DatasetDict:
    try:
        raw = datasets.load_dataset(
            cfg.dataset_name, cfg.dataset_config_name, trust_remote_code=cfg.trust_remote_code or None
        )
    except Exception as err:
        offline = " (HF_HUB_OFFLINE is set: use a cached dataset or --train_file)" if constants.HF_HUB_OFFLINE else ""
        first_line = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise UserError(f"--dataset_name {cfg.dataset_name} could not be loaded{offline}: {first_line}") from None
    if "train" not in raw or "validation" not in raw:
        raise UserError(
            f"--dataset_name {cfg.dataset_name} has splits {', '.join(raw)}; it needs 'train' and 'validation'"
        )
    return raw


def _encode_labels(train: datasets.Dataset, validation: datasets.Dataset, column: str):
    feature = train.features[column]
    if isinstance(feature, datasets.ClassLabel):
        names = list(feature.names)
        encode = None
    else:
        names = [str(v) for v in sorted(set(_label_values(train, column, "train")))]
        encode = {name: i for i, name in enumerate(names)}
    if len(names) < 2:
        raise UserError(f"training labels have a single class ({names[0]!r}); classification needs at least two")
    if encode is None:
        eval_feature = validation.features[column]
        if not isinstance(eval_feature, datasets.ClassLabel) or list(eval_feature.names) != names:
            raise UserError("validation labels are not the same classes as training labels; use one label set")
        if column != "labels":
            train, validation = train.rename_column(column, "labels"), validation.rename_column(column, "labels")
        return names, train, validation

    unseen = sorted({str(v) for v in _label_values(validation, column, "validation")} - set(encode))
    if unseen:
        raise UserError(
            f"validation data has label(s) {', '.join(unseen[:5])} that training data never has; "
            "add examples of them to training or remove them"
        )

    def to_ids(batch):
        return {"labels": [encode[str(v)] for v in batch[column]]}

    return (
        names,
        train.map(to_ids, batched=True, remove_columns=[column], keep_in_memory=True),
        validation.map(to_ids, batched=True, remove_columns=[column], keep_in_memory=True),
    )


def _label_values(split: datasets.Dataset, column: str, name: str) -> list:
    values = split[column]
    for row, value in enumerate(values):
        if value is None or (isinstance(value, float) and math.isnan(value)):
            raise UserError(f"{name} data row {row + 1} has no label in column {column!r}; fill it in or drop the row")
        if isinstance(value, float) and not value.is_integer():
            raise UserError(
                f"{name} data row {row + 1} has label {value} in column {column!r}; labels must be class names or ids"
            )
    return [int(v) if isinstance(v, float) else v for v in values]


def tokenize(
    split: datasets.Dataset, tokenizer: PreTrainedTokenizerBase, cfg: ClassifyConfig, name: str
) -> datasets.Dataset:
    """Tokenize without padding (batches are padded per batch), truncating to ``max_seq_length``.

    Raises:
        UserError: a text that is missing, empty or not a string, with its row in split ``name``.
    """

    def encode(batch, rows):
        texts = batch[cfg.text_column]
        pairs = batch[cfg.text_pair_column] if cfg.text_pair_column else None
        checked = [(cfg.text_column, texts)] + ([(cfg.text_pair_column, pairs)] if pairs is not None else [])
        for column, values in checked:
            for row, value in zip(rows, values, strict=True):
                if not isinstance(value, str):
                    raise UserError(f"{name} data row {row + 1}: column {column!r} holds {value!r}, not text; "
                                    "fix the data or pick the right --text_column")
                if not value.strip():
                    raise UserError(f"{name} data row {row + 1}: column {column!r} is empty; fill it in or drop "
                                    "the row")
        return tokenizer(texts, pairs, truncation=True, max_length=cfg.max_seq_length)

    text_columns = [c for c in (cfg.text_column, cfg.text_pair_column) if c]
    return split.map(encode, batched=True, with_indices=True, remove_columns=text_columns, keep_in_memory=True)


class PlannedBatch(list):
    """A rank's share of one global batch: dataset indices, the first ``num_real`` of them real.

    The rest (only when a global batch has fewer examples than ranks) are fillers that keep every rank
    stepping together; they get loss weight 0.
    """

    def __init__(self, indices: list[int], num_real: int, loss_scale: float):
        super().__init__(indices)
        self.num_real = num_real
        self.loss_scale = loss_scale


class TokenizedDataset(Dataset):
    """Map-style dataset over tokenized rows, held as Python lists so fetching a batch is cheap."""

    def __init__(self, split: datasets.Dataset):
        self.columns = split.to_dict()
        self.length = len(split)

    def __len__(self) -> int:
        return self.length

    @property
    def lengths(self) -> list[int]:
        """Tokens per row, for grouping by length."""
        return [len(ids) for ids in self.columns["input_ids"]]

    def __getitem__(self, index: int) -> dict:
        return {name: values[index] for name, values in self.columns.items()}

    def __getitems__(self, indices: list[int]) -> list[dict]:
        rows = [self[i] for i in indices]
        if isinstance(indices, PlannedBatch):
            for position, row in enumerate(rows):
                row["loss_weight"] = indices.loss_scale if position < indices.num_real else 0.0
        return rows


def collate_with_padding(tokenizer: PreTrainedTokenizerBase) -> DataCollatorWithPadding:
    """Pad each batch to its own longest row (dynamic padding)."""
    return DataCollatorWithPadding(tokenizer, return_tensors="pt")


class GlobalBatchSampler(Sampler[list[int]]):
    """Yields each rank's share of every global batch of an epoch (see the module docstring).

    With ``rank=None`` it yields all ranks' shares in rank order, batch after batch, for a loader that
    shards batches itself round-robin (Accelerate's ``BatchSamplerShard``); with a rank, only that rank's.
    Every rank gets the same number of batches, so no rank waits on a collective the others skip.
    """

    def __init__(
        self,
        lengths: list[int],
        per_device_batch_size: int,
        num_replicas: int,
        *,
        seed: int,
        group_by_length: bool,
        accumulation_steps: int = 1,
        rank: int | None = None,
    ):
        self.lengths = lengths
        self.num_replicas = num_replicas
        self.global_batch_size = per_device_batch_size * num_replicas
        self.seed = seed
        self.group_by_length = group_by_length
        self.accumulation_steps = accumulation_steps
        self.rank = rank
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    @property
    def batches_per_rank(self) -> int:
        return math.ceil(len(self.lengths) / self.global_batch_size)

    def __len__(self) -> int:
        return self.batches_per_rank * (self.num_replicas if self.rank is None else 1)

    def global_batches(self) -> list[list[int]]:
        """This epoch's global batches; only the last may be short."""
        generator = torch.Generator().manual_seed(self.seed + self.epoch)
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

    def __iter__(self):
        batches = self.global_batches()
        ranks = range(self.num_replicas) if self.rank is None else [self.rank]
        for window_start in range(0, len(batches), self.accumulation_steps):
            window = batches[window_start:window_start + self.accumulation_steps]
            loss_scale = self.num_replicas / sum(len(batch) for batch in window)
            for batch in window:
                # Deal longest-first round-robin so each rank's share has a similar length profile.
                by_length = sorted(batch, key=lambda i: -self.lengths[i])
                for rank in ranks:
                    share = by_length[rank::self.num_replicas]
                    yield PlannedBatch(share or by_length[:1], len(share), loss_scale)
