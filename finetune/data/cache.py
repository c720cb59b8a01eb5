"""Tokenized data, made once and shared: every recipe's splits go through this cache.

A task turns its raw splits into tokenized rows (``Task.tokenize``, through ``Tokenizing.map``). That
happens once per *cache key*: the result stays on disk as Arrow files (token ids as int32), in a folder
named by a hash of everything that changes a token: the raw splits (a local file by its size and a hash of
its content, a Hub dataset by the fingerprint ``datasets`` derives from its revision), the tokenizer's files
(its chat template included), the task and the options it names (``Task.data_options``), the source of
the code that tokenizes, and the versions of the libraries that do (transformers, tokenizers, jinja2, datasets).
A later run, a resume or a restart with the same key memory-maps the files and starts in seconds at any size;
the pages are the OS's, shared by every process of a node, so a process's memory does not grow with the data.

One process per node builds (local rank 0, under a file lock in the cache folder, so nodes that share the
folder build it once); the others wait on a barrier with no practical time limit, then open it. A build is
written into ``FOLDER.partial``, flushed to disk and renamed when complete, and a build that fails on a bad row
leaves nothing: a later run never reads a half-made cache. ``prepared.json`` records each file's size and
checksum; a folder that no longer matches them (a truncated or changed file, no ``prepared.json``) is built
again. Every process opens the folder under the lock, so an ``--overwrite_cache`` build elsewhere never removes
it while it is being opened (once open, the memory-mapped files stay readable).
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import hashlib
import importlib
import importlib.metadata
import json
import os
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import datasets
import filelock
import xxhash

from finetune.checkpointing.files import fsync_directory
from finetune.data.batching import LENGTH, LOSS_UNITS
from finetune.data.sources import file_digest
from finetune.environment import LaunchEnvironment
from finetune.errors import UserError

__all__ = ["TOKEN_IDS", "PreparedData", "Tokenizing", "cache_folder", "fitting_prefixes", "load_or_build"]

IGNORE = -100
TOKEN_IDS = datasets.Sequence(datasets.Value("int32"))
"""How token ids (and token labels) are stored: int32, a quarter of what Python and int64 take."""
META_FILE = "prepared.json"
DISK_FULL = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)
"""Why a write fails when the disk is to blame: full, a quota, a file size limit."""


@dataclass
class PreparedData:
    """A task's tokenized splits, memory-mapped from the cache, and what it recorded while tokenizing."""

    train: datasets.Dataset
    validation: datasets.Dataset
    info: dict
    """JSON values the task's ``setup`` needs (label names, tags, counts)."""
    source: str
    """Where the raw data came from, for the start-up line and the model card."""
    folder: Path


class Tokenizing:
    """Runs a task's batched function over a split while the cache is built (``Task.tokenize`` gets one).

    ``map(split, fn, name, features)`` calls ``fn(batch, rows)`` (columns of a batch of rows, and their row
    numbers) in ``--preprocessing_num_workers`` processes and writes what it returns, typed by ``features``,
    into the cache. A ``length`` (tokens) and ``loss_units`` column are added unless ``fn`` returns them: one
    unit per row, or per label other than -100 when labels are lists. ``fn`` raises ``UserError`` for a bad
    row; the error of the first bad row of the split is raised once every worker is done, whichever worker
    reached its row first.
    """

    def __init__(self, folder: Path, workers: int | None):
        self.folder = folder
        self.workers = workers
        self.files: dict[str, list[str]] = {}

    def map(self, split: datasets.Dataset, fn: Callable[[dict, list[int]], dict], name: str,
            features: dict[str, datasets.features.FeatureType]) -> datasets.Dataset:
        """``split`` tokenized by ``fn``, as a dataset backed by the cache's files.

        Raises:
            UserError: ``fn`` refused a row; the first such row's message.
        """
        errors = self.folder / f"{name}-errors"
        errors.mkdir()
        typed = datasets.Features({LENGTH: datasets.Value("int32"), LOSS_UNITS: datasets.Value("int32"), **features})
        with _workers_die_with_this_process():
            mapped = split.map(_Guarded(fn, list(typed), errors), batched=True, with_indices=True,
                               remove_columns=split.column_names, features=typed, load_from_cache_file=False,
                               num_proc=self.workers if self.workers and self.workers > 1 else None,
                               cache_file_name=str(self.folder / f"{name}.arrow"), new_fingerprint=f"finetune-{name}",
                               desc=f"tokenizing {name}")
        refused = sorted(errors.iterdir())
        if refused:
            raise UserError(refused[0].read_text())
        errors.rmdir()
        self.files[name] = [Path(f["filename"]).name for f in mapped.cache_files]
        return mapped


class _Guarded:
    """A task's batch function as ``datasets.map`` runs it: extra columns filled in, a refused batch noted in
    a file named by its first row (batches are contiguous, so the first file names the split's first bad row)
    and left out of the output, which is thrown away anyway."""

    def __init__(self, fn, columns: list[str], errors: Path):
        self.fn, self.columns, self.errors = fn, columns, errors

    def __call__(self, batch: dict, rows: list[int]) -> dict:
        try:
            out = self.fn(batch, rows)
        except UserError as err:
            (self.errors / f"{rows[0]:015d}").write_text(str(err))
            return {name: [] for name in self.columns}
        if LENGTH not in out:
            out[LENGTH] = [len(ids) for ids in out["input_ids"]]
        if LOSS_UNITS not in out:
            labels = out.get("labels")
            out[LOSS_UNITS] = ([sum(label != IGNORE for label in row) for row in labels]
                               if labels and isinstance(labels[0], list) else [1] * len(out["input_ids"]))
        return {name: out[name] for name in self.columns}


_forking_parent: int | None = None
"""While a split is tokenized in worker processes, the process that forks them."""
PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    """In a tokenizing worker, just forked: the kernel kills it when the process that forked it dies, however that
    dies (SIGKILL too). ``datasets``' pool gives its workers no initializer, and without this a killed build leaves
    them running, each holding its share of the data."""
    global _forking_parent
    parent, _forking_parent = _forking_parent, None  # the worker's own children are not tokenizing workers
    if parent is None:
        return
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent:  # it died before the line above
        os._exit(1)


if sys.platform == "linux":
    os.register_at_fork(after_in_child=_die_with_parent)


@contextlib.contextmanager
def _workers_die_with_this_process() -> Iterator[None]:
    """Processes forked while open die with this one (``_die_with_parent``)."""
    global _forking_parent
    _forking_parent = os.getpid()
    try:
        yield
    finally:
        _forking_parent = None


CHARS_PER_TOKEN = 16
"""More characters than a token of text takes: a text longer than this many for each token that can be kept is cut
before it is tokenized (``fitting_prefixes``)."""


def fitting_prefixes(texts: list[str], tokenizer, max_tokens: int) -> tuple[list[str], list[int | None]]:
    """``(texts, lengths)``: each text, or a prefix whose first ``max_tokens`` tokens are exactly the whole text's,
    and the prefix's number of tokens (None for a text kept whole), so that a row of megabytes is not tokenized whole
    to keep its start: tokenizing it whole took minutes and gigabytes for one 21 MB row.

    A text is cut at ``CHARS_PER_TOKEN x max_tokens`` characters, and kept so only when more than ``max_tokens`` of
    the prefix's tokens come before what the cut can change: its last word (pre-tokenizers split words apart, so
    earlier words tokenize alike) and the span an added token cut in half could take. Otherwise (long runs of
    white space, a tokenizer that reads the text as one word) it is tokenized whole. Specials are not counted.
    """
    limit = CHARS_PER_TOKEN * max_tokens
    long = [i for i, text in enumerate(texts) if len(text) > limit]
    texts, lengths = list(texts), [None] * len(texts)
    if not long:
        return texts, lengths
    margin = max(map(len, tokenizer.get_added_vocab()), default=0)
    encoded = tokenizer([texts[i][:limit] for i in long], add_special_tokens=False, return_offsets_mapping=True,
                        return_attention_mask=False)
    for row, i in enumerate(long):
        words, offsets = encoded.word_ids(row), encoded["offset_mapping"][row]
        unchanged = sum(word != words[-1] and end <= limit - margin for word, (_, end) in zip(words, offsets,
                                                                                              strict=True))
        if unchanged > max_tokens:
            texts[i], lengths[i] = texts[i][:limit], len(words)
    return texts, lengths


def cache_root(cfg) -> Path:
    """``--dataset_cache_dir``, else ``finetune/`` in the ``datasets`` cache (``HF_DATASETS_CACHE``)."""
    return Path(cfg.dataset_cache_dir).expanduser() if cfg.dataset_cache_dir else (
        Path(datasets.config.HF_DATASETS_CACHE) / "finetune")


def cache_folder(task, cfg, tokenizer) -> tuple[Path, dict, datasets.DatasetDict, str]:
    """``(folder, key parts, raw splits, source)``: where the task's tokenized data for ``cfg`` lives.

    Raises:
        UserError: the raw data cannot be had (see ``Task.load_data``).
    """
    raw, source = task.load_data(cfg)
    files = {"train": cfg.train_file, "validation": cfg.validation_file}
    parts = {
        "task": task.name,
        # A local file by its size and content; a Hub dataset or embedded default by datasets' fingerprint.
        "data": {split: {"size": os.path.getsize(path), "xxh3_128": file_digest(path)} if path else
                 raw[split]._fingerprint for split, path in files.items()},
        "tokenizer": _tokenizer_digest(tokenizer),
        "options": task.data_options(cfg),
        "code": _code_digest(task),
        "libraries": _library_versions(),
    }
    digest = hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:16]
    return cache_root(cfg) / f"{task.name}-{digest}", parts, raw, source


def load_or_build(task, cfg, tokenizer, runtime=None) -> PreparedData:
    """The task's tokenized data for ``cfg``: built by one process per node if missing (or if
    ``--overwrite_cache``), then opened, memory-mapped, by every process of ``runtime`` (None: this process alone,
    in a script or a test).

    Raises:
        UserError: bad raw data (the task's messages), or a cache folder that cannot be written.
    """
    env = LaunchEnvironment.read()
    started = time.perf_counter()
    built, refusal = False, None
    if env.local_rank == 0:
        try:
            folder, parts, raw, source = cache_folder(task, cfg, tokenizer)
            with _locked(folder):
                built = _build(task, cfg, tokenizer, folder, parts, raw, source)
                data = _open(folder)
        except UserError as err:
            if runtime is None:
                raise
            refusal = str(err)
    if runtime is not None:  # the others wait for the builders however long they take (not --ddp_timeout)
        runtime.wait_for_save()
        if (refusal := runtime.first_refusal(refusal)) is not None:
            raise UserError(refusal)
    if env.local_rank != 0:
        folder = cache_folder(task, cfg, tokenizer)[0]
        with _locked(folder):
            data = _open(folder)
    how = (f"built in {time.perf_counter() - started:.1f} s with {cfg.preprocessing_num_workers or 1} worker(s)"
           if built else "cached")
    if runtime is None or runtime.is_main_process:
        print(f"tokenized data: {folder} ({how}; {len(data.train)} training and {len(data.validation)} validation "
              "rows)", flush=True)
    return data


@contextlib.contextmanager
def _locked(folder: Path) -> Iterator[None]:
    """Hold the cache folder's lock (a file beside it), which builders and openers of the folder take.

    Raises:
        UserError: the folder's parent cannot be written.
    """
    try:
        folder.parent.mkdir(parents=True, exist_ok=True)
        lock = filelock.FileLock(str(folder) + ".lock")
        lock.acquire()
    except OSError as err:
        raise UserError(f"the data cache {folder.parent} cannot be written ({err.strerror}); choose another "
                        "--dataset_cache_dir") from None
    try:
        yield
    finally:
        lock.release()


def _build(task, cfg, tokenizer, folder: Path, parts: dict, raw: datasets.DatasetDict, source: str) -> bool:
    """Tokenize into ``folder`` unless it holds an intact build already; whether it was built. Call it holding
    the folder's lock (``_locked``).

    Raises:
        UserError: bad raw data (the task's messages), or a disk that cannot hold the build.
    """
    if folder.is_dir() and not cfg.overwrite_cache:
        damage = _damage(folder)
        if damage is None:
            return False
        print(f"warning: the data cache {folder} cannot be used ({damage}); building it again", file=sys.stderr,
              flush=True)
    partial = folder.with_name(folder.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)  # a build that was killed
    partial.mkdir()
    try:
        tokenizing = Tokenizing(partial, cfg.preprocessing_num_workers)
        info = task.tokenize(raw, tokenizer, cfg, tokenizing)
        checksums = {file: _checksum(partial / file, sync=True) for files in tokenizing.files.values()
                     for file in files}
        meta = {"key": parts, "source": source, "info": info, "files": tokenizing.files, "checksums": checksums}
        with open(partial / META_FILE, "w") as f:
            json.dump(meta, f, indent=2)
            f.flush()
            os.fsync(f.fileno())
    except BaseException as err:
        shutil.rmtree(partial, ignore_errors=True)
        if isinstance(err, OSError) and err.errno in DISK_FULL:
            raise UserError(f"cannot write the data cache {folder} ({err.strerror}); free disk space or choose "
                            "another --dataset_cache_dir") from None
        raise
    if folder.exists():  # --overwrite_cache, or a damaged build
        shutil.rmtree(folder)
    partial.rename(folder)
    fsync_directory(folder.parent)
    return True


def _checksum(path: Path, sync: bool = False) -> dict:
    """The file's size and xxh3-128 hash, as ``prepared.json`` records them; with ``sync``, once the file is
    flushed to disk."""
    digest = xxhash.xxh3_128()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 23), b""):
            digest.update(block)
        if sync:
            os.fsync(f.fileno())
    return {"size": path.stat().st_size, "xxh3_128": digest.hexdigest()}


def _damage(folder: Path) -> str | None:
    """What makes a built cache folder unusable (no readable ``prepared.json``, a file missing, cut short or
    changed since the build), or None."""
    try:
        meta = json.loads((folder / META_FILE).read_text())
        checksums = {file: meta["checksums"][file] for files in meta["files"].values() for file in files}
    except FileNotFoundError:
        return f"it has no {META_FILE}"
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return f"its {META_FILE} cannot be read"
    for file, expected in checksums.items():
        path = folder / file
        if not path.is_file():
            return f"{file} is missing"
        if path.stat().st_size != expected["size"]:
            return f"{file} holds {path.stat().st_size} bytes where the build wrote {expected['size']}"
        if _checksum(path) != expected:
            return f"{file} changed after the build (its checksum differs)"
    return None


def _open(folder: Path) -> PreparedData:
    meta = json.loads((folder / META_FILE).read_text())
    splits = {}
    for name, files in meta["files"].items():
        parts = [datasets.Dataset.from_file(str(folder / file)) for file in files]
        splits[name] = parts[0] if len(parts) == 1 else datasets.concatenate_datasets(parts)
    return PreparedData(splits["train"], splits["validation"], meta["info"], meta["source"], folder)


def _tokenizer_digest(tokenizer) -> str:
    """A hash of the tokenizer's files as it would save them: vocabulary, merges, special tokens, chat template."""
    digest = hashlib.sha256()
    with tempfile.TemporaryDirectory() as saved, _without_call_settings(tokenizer):
        tokenizer.save_pretrained(saved)
        for path in sorted(Path(saved).iterdir()):
            digest.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()


@contextlib.contextmanager
def _without_call_settings(tokenizer) -> Iterator[None]:
    """A fast tokenizer's ``tokenizer.json`` also holds the last call's truncation and padding, which are not the
    tokenizer: they are off while it is saved and set back after (rewriting the saved JSON took seconds for a
    262k vocabulary)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        yield
        return
    truncation, padding = backend.truncation, backend.padding
    backend.no_truncation()
    backend.no_padding()
    try:
        yield
    finally:
        if truncation:
            backend.enable_truncation(**truncation)
        if padding:
            backend.enable_padding(**padding)


TOKENIZING_LIBRARIES = ("transformers", "tokenizers", "jinja2", "datasets")
"""Whose release can change the tokens of the same text: a tokenizer's rules, a chat template's rendering."""


def _library_versions() -> dict[str, str]:
    return {name: importlib.metadata.version(name) for name in TOKENIZING_LIBRARIES}


def _code_digest(task) -> str:
    """A hash of the code that makes the tokens: the recipe's module, the modules it names, and this one."""
    recipe = type(task).tokenize.__code__.co_filename  # a recipe runs as __main__, or is loaded by path
    files = [recipe, *(importlib.import_module(name).__file__ for name in task.tokenizing_code), __file__]
    digest = hashlib.sha256()
    for file in files:
        digest.update(Path(file).read_bytes())
    return digest.hexdigest()
