"""Loading a recipe's train and validation splits from files, the Hub or an embedded default, with errors a
user can act on, and checks of the rows every recipe needs.
"""

from __future__ import annotations

import csv
import functools
import json
import os
from collections.abc import Callable

import datasets
import xxhash
from huggingface_hub import constants

from finetune.data.embedded import EmbeddedDataset
from finetune.errors import UserError

__all__ = ["FILE_BUILDERS", "check_columns", "file_digest", "load_splits", "read_file"]

FILE_BUILDERS = {".csv": "csv", ".tsv": "csv", ".json": "json", ".jsonl": "json", ".parquet": "parquet"}
"""File extensions ``datasets`` reads, and the builder for each."""


def load_splits(cfg, default: EmbeddedDataset, readers: dict[str, Callable[[str], datasets.Dataset]] | None = None
                ) -> tuple[datasets.DatasetDict, str]:
    """``(DatasetDict with train and validation, a description of the source)`` for ``cfg``'s data options
    (``--train_file``/``--validation_file``, ``--dataset_name``/``--dataset_config_name``, ``--trust_remote_code``,
    ``--overwrite_cache``).

    Files are read by extension (``FILE_BUILDERS``, plus a recipe's own ``readers``); without files or a
    dataset name, the recipe's ``default`` is the data. ``datasets`` keeps its Arrow copy of a file per content
    (``file_digest``), so an edit that keeps the file's modification time is read; ``--overwrite_cache``
    reads the files again even so.

    Raises:
        UserError: missing or unreadable files, a Hub dataset that cannot be had or lacks a split, an empty split.
    """
    if cfg.train_file:
        readers, reread = readers or {}, cfg.overwrite_cache
        raw = datasets.DatasetDict(train=_load_file(cfg.train_file, "--train_file", readers, reread),
                                   validation=_load_file(cfg.validation_file, "--validation_file", readers, reread))
        source = f"{cfg.train_file} + {cfg.validation_file}"
    elif cfg.dataset_name:
        raw = _load_hub_dataset(cfg.dataset_name, cfg.dataset_config_name, cfg.trust_remote_code)
        source = cfg.dataset_name + (f"/{cfg.dataset_config_name}" if cfg.dataset_config_name else "")
    else:
        return default.make(), default.name
    for split, flag in (("train", "--train_file"), ("validation", "--validation_file")):
        if len(raw[split]) == 0:
            raise UserError(f"{split} data is empty; give {flag} a file with at least one row")
    return raw, source


def read_file(path: str, flag: str, readers: dict[str, Callable[[str], datasets.Dataset]] | None = None
              ) -> datasets.Dataset:
    """One file's rows, read as ``load_splits`` reads a training file (raising its ``UserError``s)."""
    return _load_file(path, flag, readers or {}, reread=False)


def check_columns(raw: datasets.DatasetDict, columns: list[str], flags: str,
                  validation_columns: list[str] | None = None) -> datasets.DatasetDict:
    """Both splits cut to ``columns`` (the validation split to ``validation_columns`` where evaluation reads fewer).

    Raises:
        UserError: a split lacks one of them; ``flags`` names the options that pick them.
    """
    kept = {"train": columns, "validation": columns if validation_columns is None else validation_columns}
    for split, columns in kept.items():
        missing = [c for c in columns if c not in raw[split].column_names]
        if missing:
            raise UserError(
                f"{split} data has no column {', '.join(map(repr, missing))} (columns: "
                f"{', '.join(raw[split].column_names)}); pass {flags} to name the right ones")
    return datasets.DatasetDict({split: raw[split].select_columns(columns) for split, columns in kept.items()})


def file_digest(path: str) -> str:
    """A hash (xxh3-128) of the file's content: what names a local file in the data cache's key, since an edit may
    keep the modification time (``touch -r``, a copy with ``cp -p``) that ``datasets`` goes by. It reads the whole
    file at memory speed (about 10 GB/s once the file is in the page cache), once per process and version of the
    file."""
    stat = os.stat(path)
    return _digest(os.path.realpath(path), stat.st_dev, stat.st_ino, stat.st_size, stat.st_mtime_ns, stat.st_ctime_ns)


@functools.cache
def _digest(path: str, *version) -> str:
    """``file_digest`` of ``path`` as it is while its stat values are ``version`` (a write changes the ctime)."""
    digest = xxhash.xxh3_128()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 23), b""):
            digest.update(block)
    return digest.hexdigest()


def _load_file(path: str, flag: str, readers: dict[str, Callable[[str], datasets.Dataset]],
               reread: bool) -> datasets.Dataset:
    if not os.path.isfile(path):
        raise UserError(f"{flag} {path}: no such file; check the path")
    extension = os.path.splitext(path)[1].lower()
    if extension in readers:
        return readers[extension](path)
    if extension not in FILE_BUILDERS:
        known = [*FILE_BUILDERS, *readers]
        raise UserError(f"{flag} {path}: unsupported file type {extension or '(none)'}; use one of {', '.join(known)}")
    if _is_blank(path):
        raise UserError(f"{flag} {path} holds no rows; give it at least one example")
    # In a TSV a quote is text: a text that starts with one must not swallow the rows after it.
    options = {"delimiter": "\t", "quoting": csv.QUOTE_NONE} if extension == ".tsv" else {}
    # datasets keys its Arrow copy by the file's path and modification time: a copy per content is never stale.
    copy = os.path.join(datasets.config.HF_DATASETS_CACHE, "finetune-files", file_digest(path))
    try:
        return datasets.load_dataset(FILE_BUILDERS[extension], data_files=path, split="train", cache_dir=copy,
                                     download_mode="force_redownload" if reread else None, **options)
    except Exception as err:  # the builders raise many types (ArrowInvalid, DatasetGenerationError, ...)
        if "corresponds to no data" in str(err):  # datasets' words for a file with a header and no rows
            raise UserError(f"{flag} {path} holds no rows; give it at least one example") from None
        if FILE_BUILDERS[extension] == "json" and (line := _first_bad_json_line(path)):
            number, reason = line
            raise UserError(f"{flag} {path} line {number} is not a JSON object ({reason}); fix the line") from None
        cause = err.__cause__ or err
        reason = str(cause).strip().splitlines()[0] if str(cause).strip() else type(cause).__name__
        raise UserError(f"{flag} {path} could not be read as {extension[1:]} ({reason}); fix the file") from None


def _is_blank(path: str) -> bool:
    """Whether the file holds nothing but white space (the readers fail on it with no words of their own)."""
    with open(path, "rb") as f:
        return not any(block.strip() for block in iter(lambda: f.read(1 << 16), b""))


def _first_bad_json_line(path: str) -> tuple[int, str] | None:
    """``(number, reason)`` of the first line of a JSON-lines file that is not a JSON object, counting from 1 as an
    editor does (pyarrow names a row counted from 0 within a block); None for a file that is not JSON lines, such as
    one JSON document over many lines."""
    with open(path, encoding="utf-8", errors="replace") as f:
        for number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                value = json.loads(line)
            except ValueError as err:
                return None if number == 1 and path.lower().endswith(".json") else (number, err.msg)
            if not isinstance(value, dict):
                return number, f"a {type(value).__name__}"
    return None


def _load_hub_dataset(name: str, config_name: str | None, trust_remote_code: bool) -> datasets.DatasetDict:
    try:
        raw = datasets.load_dataset(name, config_name, trust_remote_code=trust_remote_code or None)
    except Exception as err:
        offline = " (HF_HUB_OFFLINE is set: use a cached dataset or --train_file)" if constants.HF_HUB_OFFLINE else ""
        first_line = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise UserError(f"--dataset_name {name} could not be loaded{offline}: {first_line}") from None
    if "train" not in raw or "validation" not in raw:
        raise UserError(f"--dataset_name {name} has splits {', '.join(raw)}; it needs 'train' and 'validation'")
    return raw
