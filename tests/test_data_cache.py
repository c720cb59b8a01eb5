"""The tokenized-data cache: keyed by everything that changes a token, built once by one process, memory-mapped,
never half-made, and the same rows whatever the number of workers."""

from __future__ import annotations

import csv
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import datasets
import pytest
from helpers import (
    REPO,
    data_flags,
    launch_cmd,
    load_recipe,
    note_longest_texts,
    parity_flags,
    python_cmd,
    recipe_path,
    run,
    train_here,
    write_csv,
    write_jsonl,
)

from finetune.config import parse_config
from finetune.data.cache import cache_folder, load_or_build
from finetune.data.sources import file_digest
from finetune.errors import UserError


def recipe_task(name: str, task: str, arguments: str, flags: list[str]):
    module = load_recipe(name)
    cfg, args = parse_config(getattr(module, arguments), flags)
    made = getattr(module, task)(args)
    return made, cfg, made.load_tokenizer(cfg)


def classify(flags: list[str]):
    recipe = load_recipe()
    cfg, args = parse_config(recipe.ClassifyArguments, flags)
    task = recipe.ClassifyTask(args)
    return task, cfg, task.load_tokenizer(cfg)


def folder_of(task_cfg_tokenizer) -> Path:
    return cache_folder(*task_cfg_tokenizer)[0]


def rows_of(path: Path) -> list[dict]:
    with open(path, newline="", encoding="utf-8") as f:
        return list(csv.DictReader(f))


# -- the key: a change of any part builds a new cache, the same parts find the same one

def test_the_same_data_and_options_find_the_same_cache(small_data, tmp_path):
    first = folder_of(classify(data_flags(small_data)))
    assert first == folder_of(classify(data_flags(small_data)))
    assert first.parent == Path(os.environ["HF_DATASETS_CACHE"]) / "finetune"
    other_root = folder_of(classify([*data_flags(small_data), "--dataset_cache_dir", str(tmp_path / "cache")]))
    assert other_root == tmp_path / "cache" / first.name


def test_other_raw_data_builds_another_cache(small_data, tmp_path):
    train = tmp_path / "train.csv"
    train.write_bytes(small_data["train"].read_bytes())
    flags = ["--train_file", str(train), "--validation_file", str(small_data["validation"])]
    before = folder_of(classify(flags))
    text = train.read_text().splitlines()
    text[5] = "My parcel is late again,shipping"
    train.write_text("\n".join(text) + "\n")
    assert folder_of(classify(flags)) != before


def test_another_tokenizer_builds_another_cache(small_data, tiny_bert, tmp_path):
    from transformers import AutoTokenizer

    assert folder_of(classify(data_flags(small_data))) == folder_of(
        classify([*data_flags(small_data), "--model_name_or_path", str(tiny_bert)])), "the same tokenizer"
    tokenizer = AutoTokenizer.from_pretrained(tiny_bert)
    tokenizer.add_tokens(["refundable"])
    changed = tmp_path / "model"
    changed.mkdir()
    for file in tiny_bert.iterdir():
        (changed / file.name).symlink_to(file)
    for file in changed.glob("*token*"):
        file.unlink()
    (changed / "vocab.txt").unlink(missing_ok=True)
    tokenizer.save_pretrained(changed)
    assert folder_of(classify([*data_flags(small_data), "--model_name_or_path", str(changed)])) != folder_of(
        classify([*data_flags(small_data), "--model_name_or_path", str(tiny_bert)]))


def test_a_tokenizer_after_a_truncating_and_padding_call_finds_the_same_cache(tiny_bert):
    """A fast tokenizer's saved file holds its last call's truncation and padding: the key leaves them out, and
    the tokenizer keeps them."""
    from transformers import AutoTokenizer

    from finetune.data.cache import _tokenizer_digest

    fresh, called = (AutoTokenizer.from_pretrained(tiny_bert) for _ in range(2))
    called(["a ticket", "a longer ticket about a refund"], truncation=True, max_length=5, padding="max_length")
    settings = (called.backend_tokenizer.truncation, called.backend_tokenizer.padding)
    assert settings[0]["max_length"] == 5 and settings[1]["length"] == 5
    assert _tokenizer_digest(called) == _tokenizer_digest(fresh)
    assert (called.backend_tokenizer.truncation, called.backend_tokenizer.padding) == settings
    fresh.add_tokens(["refundable"])
    assert _tokenizer_digest(fresh) != _tokenizer_digest(called)


def test_another_chat_template_builds_another_cache(tmp_path):
    template = tmp_path / "template.jinja"
    template.write_text("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}</s>{% endfor %}"
                        "{% if add_generation_prompt %}<assistant>{% endif %}")
    plain = recipe_task("sft", "SFTTask", "SFTArguments", [])
    templated = recipe_task("sft", "SFTTask", "SFTArguments", ["--chat_template", str(template)])
    assert folder_of(plain) != folder_of(templated)


@pytest.mark.parametrize("option", [["--max_seq_length", "64"], ["--text_column", "body"],
                                    ["--label_column", "team"]])
def test_an_option_that_changes_tokens_builds_another_cache(small_data, tmp_path, option):
    flags = []
    for split in ("train", "validation"):  # the same columns under other names too
        rows = [{**row, "body": row["text"], "team": row["label"]} for row in rows_of(small_data[split])]
        flags += [f"--{split}_file", str(write_csv(tmp_path / f"{split}.csv", rows))]
    assert folder_of(classify([*flags, *option])) != folder_of(classify(flags))


def test_label_all_tokens_builds_another_cache():
    first = recipe_task("token_classify", "TokenClassifyTask", "TokenClassifyArguments", [])
    every = recipe_task("token_classify", "TokenClassifyTask", "TokenClassifyArguments", ["--label_all_tokens"])
    assert folder_of(first) != folder_of(every)


def test_a_change_to_the_tokenizing_code_builds_another_cache(small_data, tmp_path, monkeypatch):
    module = tmp_path / "ticket_words.py"
    module.write_text("SEPARATOR = ' '\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    __import__("ticket_words")
    task, cfg, tokenizer = classify(data_flags(small_data))
    monkeypatch.setattr(task, "tokenizing_code", (*task.tokenizing_code, "ticket_words"))
    before = folder_of((task, cfg, tokenizer))
    module.write_text("SEPARATOR = '  '\n")
    assert folder_of((task, cfg, tokenizer)) != before


@pytest.mark.parametrize("library", ["transformers", "tokenizers", "jinja2", "datasets"])
def test_another_release_of_a_tokenizing_library_builds_another_cache(small_data, library, monkeypatch):
    """A release can render a chat template or split a text otherwise: the same inputs, other tokens."""
    import importlib.metadata

    task_cfg_tokenizer = classify(data_flags(small_data))
    before = folder_of(task_cfg_tokenizer)
    installed = importlib.metadata.version
    monkeypatch.setattr(importlib.metadata, "version", lambda name: "99.0" if name == library else installed(name))
    assert folder_of(task_cfg_tokenizer) != before


# -- building and opening

def test_a_cache_is_built_once_then_opened_memory_mapped(small_data, tmp_path, monkeypatch):
    task, cfg, tokenizer = classify([*data_flags(small_data), "--dataset_cache_dir", str(tmp_path / "cache")])
    calls = []
    original = task.tokenize
    monkeypatch.setattr(task, "tokenize", lambda *args: calls.append(1) or original(*args))
    built = load_or_build(task, cfg, tokenizer)
    opened = load_or_build(task, cfg, tokenizer)
    assert calls == [1], "the second run tokenized nothing"
    assert built.folder == opened.folder and built.info == opened.info == {"label_names": ["account", "billing",
                                                                                            "shipping", "technical"]}
    assert opened.train.to_dict() == built.train.to_dict() and len(opened.train) == 42
    assert opened.train.features["input_ids"].feature.dtype == "int32"
    assert all(Path(f["filename"]).parent == opened.folder for f in opened.train.cache_files), "memory-mapped"
    assert isinstance(opened.train.data, datasets.table.MemoryMappedTable)
    assert sorted(p.name for p in opened.folder.parent.iterdir()) == [opened.folder.name, opened.folder.name + ".lock"]
    rebuilt = load_or_build(task, type(cfg)(**{**vars(cfg), "overwrite_cache": True}), tokenizer)
    assert calls == [1, 1] and rebuilt.train.to_dict() == built.train.to_dict()


def test_workers_tokenize_the_same_rows(small_data, tmp_path):
    one = load_or_build(*classify([*data_flags(small_data), "--dataset_cache_dir", str(tmp_path / "one")]))
    two = load_or_build(*classify([*data_flags(small_data), "--dataset_cache_dir", str(tmp_path / "two"),
                                   "--preprocessing_num_workers", "2"]))
    assert len(two.train.cache_files) == 2, "each worker wrote its part"
    assert two.train.to_dict() == one.train.to_dict() and two.validation.to_dict() == one.validation.to_dict()


def test_bad_rows_name_the_first_one_whichever_worker_finds_its_row_first(small_data, tmp_path):
    teams = ["account", "billing", "shipping", "technical"]
    rows = [{"text": f"please look at ticket {i}", "label": teams[i % 4]} for i in range(1000)]
    rows[300]["text"] = rows[800]["text"] = " "  # one in each worker's half
    many = write_csv(tmp_path / "many.csv", rows)
    cache = tmp_path / "cache"
    flags = ["--train_file", str(many), "--validation_file", str(small_data["validation"]),
             "--dataset_cache_dir", str(cache), "--preprocessing_num_workers", "2"]
    with pytest.raises(UserError, match=r"^train data row 301: column 'text' is empty"):
        load_or_build(*classify(flags))
    assert [p.name for p in cache.iterdir() if not p.name.endswith(".lock")] == [], "nothing cached"


def test_a_build_killed_half_way_is_never_read(small_data, tmp_path):
    cache = tmp_path / "cache"
    flags = [*data_flags(small_data), "--dataset_cache_dir", str(cache)]
    child = subprocess.Popen([sys.executable, "-c", f"""
import sys, time
sys.path.insert(0, {str(REPO / 'tests')!r})
from helpers import load_recipe
from finetune.config import parse_config
from finetune.data.cache import Tokenizing, load_or_build
original = Tokenizing.map
def map_then_hang(self, split, fn, name, features):
    mapped = original(self, split, fn, name, features)
    print("mapped", name, flush=True)
    time.sleep(600)
Tokenizing.map = map_then_hang
recipe = load_recipe()
cfg, args = parse_config(recipe.ClassifyArguments, {flags!r})
task = recipe.ClassifyTask(args)
load_or_build(task, cfg, task.load_tokenizer(cfg))
"""], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "mapped train"
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait()
    partial = [p for p in cache.iterdir() if p.name.endswith(".partial")]
    assert len(partial) == 1 and any(partial[0].glob("train*.arrow")), "the killed build left its partial files"
    data = load_or_build(*classify(flags))
    assert len(data.train) == 42 and not partial[0].exists()


# -- runs

@pytest.mark.parametrize("precision", ["no", "bf16"])
def test_prepare_only_builds_the_cache_and_touches_no_output_folder(small_data, tiny_bert, tmp_path, precision):
    cache = tmp_path / "cache"
    flags = [*data_flags(small_data), "--model_name_or_path", str(tiny_bert), "--dataset_cache_dir", str(cache),
             "--output_dir", str(tmp_path / "out"), "--mixed_precision", precision]
    def classify(*more: str):  # bf16 in a process of its own: this one's Accelerator state is float32
        return train_here("classify", *flags, *more) if precision == "no" else run(python_cmd(*flags, *more))
    result = classify("--prepare_only")
    assert "built in" in result.stdout and not (tmp_path / "out").exists()
    folder = next(p for p in cache.iterdir() if p.is_dir())
    assert json.loads((folder / "prepared.json").read_text())["info"]["label_names"][0] == "account"
    predicted = predicted_memory(result.stdout)
    result = classify("--max_train_steps", "1", "--per_device_eval_batch_size", "64")
    assert f"tokenized data: {folder} (cached;" in result.stdout
    # the prediction before the model loads is the run's, but for what is in use at the start (measured there)
    assert predicted == predicted_memory(result.stdout) and "activations of the longest micro-batch" in predicted


def predicted_memory(stdout: str) -> str:
    line = next(line for line in stdout.splitlines() if line.startswith("memory per process, predicted peak"))
    return line.split("(libraries, data, weights), ")[1]


def watched(launcher: str, out: Path, *flags) -> list[str]:
    return launch_cmd(launcher, str(out), recipe_path(), *flags, script="tests/scripts/watch_data.py")


@pytest.mark.multiprocess
@pytest.mark.slow
def test_one_process_builds_while_the_others_wait_past_the_collective_timeout(small_data, tiny_bert_without_dropout,
                                                                              parity_runs, tmp_path):
    """The build takes longer than --ddp_timeout; the other process waits, then reads the same cache. The run
    also resumes mid-epoch: the batches before the checkpoint's position are never fetched."""
    checkpoint = parity_runs("torchrun", 2, 4) / "checkpoints" / "step_4"
    records = tmp_path / "records"
    records.mkdir()
    flags = [*parity_flags(small_data, tiny_bert_without_dropout, 4), "--output_dir", str(tmp_path / "out"),
             "--dataset_cache_dir", str(tmp_path / "cache"), "--ddp_timeout", "4",
             "--resume_from_checkpoint", str(checkpoint)]
    started = time.monotonic()
    run(watched("torchrun", records, *flags), env={"WATCH_DATA_BUILD_SECONDS": "8"})
    assert time.monotonic() - started > 8
    ranks = [json.loads((records / f"rank_{rank}.json").read_text()) for rank in range(2)]
    assert [r["builds"] for r in ranks] == [1, 0], "one build, by the main process"
    assert_fetches_start_at_the_checkpoint(ranks, checkpoint)


@pytest.mark.multiprocess
@pytest.mark.slow
def test_accelerate_resumes_mid_epoch_without_fetching_the_skipped_batches(small_data, tiny_bert_without_dropout,
                                                                          parity_runs, tmp_path):
    checkpoint = parity_runs("accelerate", 2, 4) / "checkpoints" / "step_4"
    records = tmp_path / "records"
    records.mkdir()
    run(watched("accelerate", records, *parity_flags(small_data, tiny_bert_without_dropout, 4),
                "--output_dir", str(tmp_path / "out"), "--resume_from_checkpoint", str(checkpoint)))
    assert_fetches_start_at_the_checkpoint([json.loads((records / f"rank_{r}.json").read_text()) for r in range(2)],
                                           checkpoint)


def assert_fetches_start_at_the_checkpoint(ranks: list[dict], checkpoint: Path) -> None:
    from finetune.data.batching import GlobalBatchSampler

    progress = json.loads((checkpoint / "progress.json").read_text())
    assert progress["batches_in_epoch"] > 0, "the checkpoint is mid-epoch"
    for rank, record in enumerate(ranks):
        sampler = GlobalBatchSampler(record["lengths"], 4, 2, seed=42, group_by_length=True, accumulation_steps=2)
        expected = [list(b) for epoch in range(progress["epoch"], 3)
                    for b in sampler.plan(epoch, rank)[progress["batches_in_epoch"] if epoch == progress["epoch"]
                                                       else 0:]]
        assert record["fetched"] == expected


# -- a local file is known by its content; a cache that cannot be used is built again

def tickets(path: Path, labels: str) -> Path:
    write_jsonl(path, [{"text": f"ticket number {i}", "label": label} for i, label in enumerate(labels)])
    return path


def edit_keeping_the_modification_time(path: Path, labels: str) -> None:
    """The rows' labels changed in place (the same size), the modification time put back as ``touch -r`` does."""
    stat = path.stat()
    tickets(path, labels)
    assert path.stat().st_size == stat.st_size
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))


def test_a_file_edited_with_its_modification_time_kept_is_read_again(tmp_path):
    train = tickets(tmp_path / "t.jsonl", "abab")
    validation = write_jsonl(tmp_path / "v.jsonl", [{"text": "ticket", "label": label} for label in "ab"])
    flags = ["--train_file", str(train), "--validation_file", validation, "--dataset_cache_dir",
             str(tmp_path / "cache")]
    assert list(load_or_build(*classify(flags)).train["labels"]) == [0, 1, 0, 1]
    edit_keeping_the_modification_time(train, "bbaa")
    assert list(load_or_build(*classify(flags)).train["labels"]) == [1, 1, 0, 0]
    edit_keeping_the_modification_time(train, "abba")
    assert list(load_or_build(*classify([*flags, "--overwrite_cache"])).train["labels"]) == [0, 1, 1, 0]


def test_overwrite_cache_reads_the_raw_files_again_not_datasets_copy_of_them(tmp_path):
    from datasets.arrow_writer import ArrowWriter

    train = write_jsonl(tmp_path / "t.jsonl", [{"text": f"note {i}", "label": label} for i, label in enumerate("abab")])
    validation = tickets(tmp_path / "v.jsonl", "ab")
    flags = ["--train_file", train, "--validation_file", str(validation), "--dataset_cache_dir",
             str(tmp_path / "cache")]
    load_or_build(*classify(flags))
    (copy,) = (Path(os.environ["HF_DATASETS_CACHE"]) / "finetune-files" / file_digest(train)).rglob("*.arrow")
    with ArrowWriter(path=str(copy)) as writer:  # datasets' copy no longer says what the file says
        writer.write_batch({"text": [f"note {i}" for i in range(4)], "label": list("bbab")})
    assert list(load_or_build(*classify([*flags, "--max_seq_length", "40"])).train["labels"]) == [1, 1, 0, 1]
    assert list(load_or_build(*classify([*flags, "--overwrite_cache"])).train["labels"]) == [0, 1, 0, 1]


def damage_cache(folder: Path, damage: str) -> None:
    arrow = folder / "train.arrow"
    if damage == "truncated":
        arrow.write_bytes(arrow.read_bytes()[:len(arrow.read_bytes()) // 2])
    elif damage == "changed":
        data = bytearray(arrow.read_bytes())
        data[len(data) // 2] ^= 0x01
        arrow.write_bytes(bytes(data))
    else:
        (folder / "prepared.json").unlink()


@pytest.mark.parametrize(("damage", "reason"), [
    ("truncated", r"train\.arrow holds \d+ bytes where the build wrote \d+"),
    ("changed", r"train\.arrow changed after the build \(its checksum differs\)"),
    ("no prepared.json", r"it has no prepared\.json"),
])
def test_a_cache_folder_that_cannot_be_used_is_said_in_one_line_and_built_again(small_data, tmp_path, capsys,
                                                                                damage, reason):
    import re

    flags = [*data_flags(small_data), "--dataset_cache_dir", str(tmp_path / "cache")]
    built = load_or_build(*classify(flags))
    rows, folder = built.train.to_dict(), built.folder
    del built  # its memory map of the file damaged next
    damage_cache(folder, damage)
    capsys.readouterr()
    again = load_or_build(*classify(flags))
    warnings = [line for line in capsys.readouterr().err.splitlines() if line.startswith("warning: ")]
    assert len(warnings) == 1 and re.fullmatch(
        f"warning: the data cache {re.escape(str(folder))} cannot be used \\({reason}\\); building it again",
        warnings[0]), warnings
    assert again.folder == folder and again.train.to_dict() == rows
    assert sorted(p.name for p in folder.parent.iterdir()) == [folder.name, folder.name + ".lock"]


@pytest.mark.parametrize("local_rank", ["0", "1"])
def test_every_process_opens_the_cache_holding_its_lock(small_data, tmp_path, monkeypatch, local_rank):
    """So that an --overwrite_cache build on another node cannot remove the folder while a process opens it."""
    import filelock

    flags = [*data_flags(small_data), "--dataset_cache_dir", str(tmp_path / "cache")]
    folder = load_or_build(*classify(flags)).folder
    held = []
    original = datasets.Dataset.from_file

    def from_file(*args, **kwargs):
        probe = filelock.FileLock(str(folder) + ".lock", timeout=0)
        try:
            probe.acquire()
            probe.release()
            held.append(False)
        except filelock.Timeout:
            held.append(True)
        return original(*args, **kwargs)

    monkeypatch.setattr(datasets.Dataset, "from_file", from_file)
    monkeypatch.setenv("LOCAL_RANK", local_rank)
    assert len(load_or_build(*classify(flags)).train) == 42
    assert held == [True, True], "both splits' files were opened under the lock"


def test_a_disk_that_fills_during_a_build_is_one_clear_error_and_leaves_nothing(tmp_path, monkeypatch):
    """Files stop growing at 64 kB while the train split is written (RLIMIT_FSIZE: EFBIG, as a full disk's ENOSPC)."""
    import resource

    from finetune.data.cache import Tokenizing

    rows = [{"text": f"please look at ticket number {i} " * 3, "label": "ab"[i % 2]} for i in range(3000)]
    flags = ["--train_file", write_jsonl(tmp_path / "t.jsonl", rows), "--validation_file",
             str(tickets(tmp_path / "v.jsonl", "ab")), "--dataset_cache_dir", str(tmp_path / "cache"),
             "--max_seq_length", "64"]
    task, cfg, tokenizer = classify(flags)
    original = Tokenizing.map

    def map_on_a_small_disk(self, *args, **kwargs):
        soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
        resource.setrlimit(resource.RLIMIT_FSIZE, (64 << 10, hard))
        try:
            return original(self, *args, **kwargs)
        finally:
            resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))

    monkeypatch.setattr(Tokenizing, "map", map_on_a_small_disk)
    previous = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # the write fails instead of killing the process
    try:
        with pytest.raises(UserError, match=r"^cannot write the data cache .*classify-\w+ \(File too large\); free "
                                            "disk space or choose another --dataset_cache_dir$"):
            load_or_build(task, cfg, tokenizer)
    finally:
        signal.signal(signal.SIGXFSZ, previous)
    assert [p.name for p in (tmp_path / "cache").iterdir() if not p.name.endswith(".lock")] == []


def test_tokenizing_workers_die_with_a_build_that_is_killed(small_data, tmp_path):
    import psutil

    flags = [*data_flags(small_data), "--dataset_cache_dir", str(tmp_path / "cache"), "--preprocessing_num_workers",
             "2"]
    child = subprocess.Popen([sys.executable, "-c", f"""
import os, sys, time
sys.path.insert(0, {str(REPO / 'tests')!r})
from helpers import load_recipe
from finetune.config import parse_config
from finetune.data import cache
def hang(self, batch, rows):
    print("worker", os.getpid(), flush=True)
    time.sleep(600)
cache._Guarded.__call__ = hang
recipe = load_recipe()
cfg, args = parse_config(recipe.ClassifyArguments, {flags!r})
task = recipe.ClassifyTask(args)
cache.load_or_build(task, cfg, task.load_tokenizer(cfg))
"""], stdout=subprocess.PIPE, text=True)
    try:
        started = [child.stdout.readline() for _ in range(2)]
        assert all(line.startswith("worker ") for line in started), started
        processes = psutil.Process(child.pid).children(recursive=True)  # the pool's, the tokenizing ones among them
        assert {int(line.split()[1]) for line in started} <= {p.pid for p in processes}
    finally:
        child.kill()
        child.wait()
    gone, alive = psutil.wait_procs(processes, timeout=60)
    for process in alive:
        process.kill()
    assert not alive, "every process the build started died with it"


# -- what can never fit is cut before it is tokenized, keeping exactly the tokens kept

def long_texts(count: int, special: str) -> list[str]:
    """Texts of 1,000 to 3,000 characters: words, numbers, accents, CJK, emoji, runs of white space, an added token
    (``special``) just before the cut at 16 x 32 characters; a word of 600 letters across the cut, white space
    alone, one word alone."""
    import random

    generator = random.Random(0)
    pieces = ["ticket", "refund", "42", "café", "日本語", "👋", ",", "!!", "   ", "\n\n", "don't", "e-mail"]
    texts = []
    for number in range(count):
        text = ""
        while len(text) < generator.randrange(1000, 3000):
            text += generator.choice(pieces) + " " * generator.randrange(0, 3)
        at = 512 - generator.randrange(0, 24)
        texts.append(text[:at] + special + text[at:] if number % 3 == 0 else text)
    return texts + ["word " * 90 + "x" * 600 + " word" * 90, " " * 5000 + "end", "x" * 5000]


@pytest.mark.parametrize("model", ["minilm", "smollm2"])
def test_a_text_cut_before_tokenizing_keeps_exactly_the_tokens_kept(model):
    from transformers import AutoTokenizer

    from finetune.data.cache import fitting_prefixes
    from finetune.models.loading import default_chat_model_path, default_model_path

    tokenizer = AutoTokenizer.from_pretrained(default_model_path() if model == "minilm" else default_chat_model_path())
    texts = long_texts(60, "[SEP]" if model == "minilm" else "<|im_start|>")
    cut, lengths = fitting_prefixes(texts, tokenizer, 32)
    assert sum(length is not None for length in lengths) > 50, "most long texts are cut"
    assert cut[-2:] == texts[-2:], "white space, or one word, is tokenized whole"

    def kept(rows):
        return tokenizer(rows, truncation=True, max_length=32)["input_ids"]

    assert kept(cut) == kept(texts)


def test_a_pair_is_cut_only_where_the_order_of_its_lengths_stays(tmp_path):
    """Truncating the longest first gives the longer text of a pair the odd token (--max_seq_length 33)."""
    from helpers import tokenizing
    from transformers import AutoTokenizer

    from finetune.models.loading import default_model_path
    from finetune.tasks.classification import tokenize_texts

    tokenizer = AutoTokenizer.from_pretrained(default_model_path())
    texts = long_texts(30, "")
    pairs = {"text": texts, "other": texts[::-1], "labels": [0] * len(texts)}
    pairs["other"][:5] = ["short one"] * 5
    rows = tokenize_texts(datasets.Dataset.from_dict(pairs), tokenizer, ["text", "other"], 33, "train",
                          tokenizing(tmp_path))
    assert rows["input_ids"] == tokenizer(pairs["text"], pairs["other"], truncation=True, max_length=33)["input_ids"]


def test_a_row_of_megabytes_is_not_tokenized_whole(tmp_path, monkeypatch):
    """Before, the whole text was tokenized and then cut: one 21 MB row took 607 s and 3.25 GB."""
    rows = [{"text": "please refund my order " * 100_000, "label": "billing"},
            *({"text": f"ticket {i}", "label": "ab"[i % 2]} for i in range(7))]
    flags = ["--train_file", write_jsonl(tmp_path / "t.jsonl", rows), "--validation_file",
             str(tickets(tmp_path / "v.jsonl", "ab")), "--dataset_cache_dir", str(tmp_path / "cache"),
             "--max_seq_length", "32"]
    task, cfg, tokenizer = classify(flags)
    longest = note_longest_texts(monkeypatch)
    data = load_or_build(task, cfg, tokenizer)
    assert max(longest) <= 16 * 32, "no text longer than 16 characters a kept token reached the tokenizer"
    assert data.train[0]["input_ids"] == tokenizer("please refund my order " * 30, truncation=True,
                                                   max_length=32)["input_ids"]
