"""Broken and hostile input to the classify recipe, run in this process through ``run_main`` (what its command
line calls) to keep the catalogue fast; ``test_bad_input.py`` checks the same contract on real processes.

Each of the catalogue's cases (broken CSV rows, wrong encodings, missing or fractional labels, numbers where
text belongs, empty texts, files that are not what their extension says, bad YAML, sizes and counts out of
range, conflicting flags, a read-only output folder) must end with exactly one ``error:`` line naming the
problem, exit status 2 and every file in the test's folder unchanged. Then: a full disk at save time is one
clear error, and texts far over ``--max_seq_length`` are cut and counted rather than refused.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers import assert_refused, train_here, write_csv, write_jsonl


def write(path: Path, data: str | bytes) -> str:
    path.write_bytes(data if isinstance(data, bytes) else data.encode())
    return str(path)


GOOD_ROWS = [{"text": f"message number {i}", "label": "ab"[i % 2]} for i in range(8)]


@pytest.fixture
def folder(tmp_path):
    write_csv(tmp_path / "train.csv", GOOD_ROWS)
    write_csv(tmp_path / "validation.csv", GOOD_ROWS[:4])
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "notes.txt").write_text("kept")
    return tmp_path


def files(folder, train=None, validation=None) -> list[str]:
    return ["--train_file", train or str(folder / "train.csv"),
            "--validation_file", validation or str(folder / "validation.csv"), "--output_dir", str(folder / "out")]


CASES = {
    "broken csv row": (lambda d: files(d, train=write(d / "t.csv", 'text,label\n"a",x\n"b",y,extra,more\n')),
                       "could not be read as csv"),
    "wrong encoding": (lambda d: files(d, train=write(d / "t.csv", "text,label\ncaf\xe9,x\n".encode("latin-1"))),
                       "could not be read as csv"),
    "missing label in csv": (lambda d: files(d, train=write(d / "t.csv", "text,label\na,x\nb,\nc,y\n")),
                             "row 2 has no label"),
    "null label in jsonl": (lambda d: files(d, train=write_jsonl(d / "t.jsonl", [{"text": "a", "label": "x"},
                                                                                {"text": "b", "label": None}])),
                            "row 2 has no label"),
    "fractional label": (lambda d: files(d, train=write(d / "t.csv", "text,label\na,0.5\nb,1\n")),
                         "labels must be class names or ids"),
    "numbers as text": (lambda d: files(d, train=write(d / "t.csv", "text,label\n5,a\n7,b\n")),
                        "holds 5, not text"),
    "empty text": (lambda d: files(d, train=write_jsonl(d / "t.jsonl", [{"text": "a", "label": "a"},
                                                                       {"text": "  ", "label": "b"}])),
                   "row 2: column 'text' is empty"),
    "a single class": (lambda d: files(d, train=write(d / "t.csv", "text,label\na,x\nb,x\n")), "single class"),
    "json that is not json": (lambda d: files(d, train=write(d / "t.json", "this is not json")),
                              "could not be read as json"),
    "parquet that is not parquet": (lambda d: files(d, train=write(d / "t.parquet", "text,label\na,x\n")),
                                    "could not be read as parquet"),
    "yaml that is not a mapping": (lambda d: [*files(d), "--config", write(d / "c.yaml", "- 1\n- 2\n")],
                                   "must be a mapping"),
    "yaml that does not parse": (lambda d: [*files(d), "--config", write(d / "c.yaml", "learning_rate: [\n")],
                                 "is not valid YAML"),
    "zero train batch": (lambda d: [*files(d), "--per_device_train_batch_size", "0"], "must be a positive"),
    "negative eval batch": (lambda d: [*files(d), "--per_device_eval_batch_size", "-4"], "must be a positive"),
    "zero steps": (lambda d: [*files(d), "--max_train_steps", "0"], "must be a positive"),
    "negative accumulation": (lambda d: [*files(d), "--gradient_accumulation_steps", "-2"], "must be a positive"),
    "zero epochs": (lambda d: [*files(d), "--num_train_epochs", "0"], "must be a positive"),
    "negative warm-up": (lambda d: [*files(d), "--num_warmup_steps", "-1"], "must be 0 or more"),
    "dataset and files together": (lambda d: [*files(d), "--dataset_name", "imdb"], "pass one data source"),
    "train file alone": (lambda d: ["--train_file", str(d / "train.csv"), "--output_dir", str(d / "out")],
                         "go together"),
    "checkpointing every 'often'": (lambda d: [*files(d), "--checkpointing_steps", "often"],
                                    "positive number of steps or 'epoch'"),
    "unknown scheduler": (lambda d: [*files(d), "--lr_scheduler_type", "zigzag"], "is unknown"),
    "output folder on a read-only filesystem": (lambda d: [*files(d)[:4], "--output_dir", "/sys/finetune-out"],
                                                "cannot be written"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_hostile_input_is_refused_cleanly(folder, case):
    make_argv, expected = CASES[case]
    assert_refused("classify", make_argv(folder), folder, expected)


def test_texts_far_over_max_seq_length_are_truncated_and_counted(folder, tiny_bert):
    long_rows = [{"text": "word " * 500, "label": "a"}, {"text": "short", "label": "b"}] + GOOD_ROWS
    write_csv(folder / "long.csv", long_rows)
    result = train_here("classify", *files(folder, train=str(folder / "long.csv")), "--max_train_steps", "1",
                        "--max_seq_length", "16", "--model_name_or_path", str(tiny_bert))
    assert "10 examples (1 cut to --max_seq_length 16)" in result.stdout


MORE_CASES = {
    "labels mixing ids and names": (
        lambda d: files(d, train=write_jsonl(d / "t.jsonl", [{"text": "a", "label": 1}, {"text": "b", "label": "x"},
                                                             {"text": "c", "label": 2}])),
        "error: train data mixes class names and ids in column 'label' (row 2: 'x', row 1: 1); give every label the "
        "same way"),
    "an empty jsonl file": (lambda d: files(d, train=write(d / "t.jsonl", "")), "t.jsonl holds no rows"),
    "a line that is not json": (
        lambda d: files(d, train=write(d / "t.jsonl", "".join(
            (json.dumps(row) if number != 8 else "hello") + "\n" for number, row in enumerate(GOOD_ROWS, 1)))),
        "t.jsonl line 8 is not a JSON object (Expecting value); fix the line"),
    "a line that is a list": (
        lambda d: files(d, validation=write(d / "v.jsonl", "".join(
            (json.dumps(row) if number != 3 else "[1, 2]") + "\n" for number, row in enumerate(GOOD_ROWS, 1)))),
        "--validation_file " + "{d}/v.jsonl line 3 is not a JSON object (a list); fix the line"),
    "a seed numpy cannot take": (lambda d: [*files(d), "--seed", "-1"], "--seed is -1; give a whole number from 0"),
    "no room for text": (lambda d: [*files(d), "--max_seq_length", "1"],
                         "--max_seq_length 1 leaves no room for the text: the tokenizer adds 2 special tokens to each "
                         "example; give at least 3"),
    "only room for the special tokens": (lambda d: [*files(d), "--max_seq_length", "2"], "give at least 3"),
}


@pytest.mark.parametrize("case", sorted(MORE_CASES))
def test_more_hostile_input_is_refused_cleanly_and_names_rows_as_counted_from_1(folder, case):
    make_argv, expected = MORE_CASES[case]
    assert_refused("classify", make_argv(folder), folder, expected.format(d=folder))
