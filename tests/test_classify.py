"""The classify recipe end to end, launched as a user launches it."""

from __future__ import annotations

import csv
import json
import sys
from pathlib import Path

import psutil
import pytest
import torch
from helpers import (
    assert_same_steps,
    classify_flags,
    launch_cmd,
    load_recipe,
    log_history,
    max_weight_diff,
    read_jsonl,
    read_results,
    read_weights,
    run,
    tensorboard_scalars,
    train_here,
    write_csv,
)
from transformers import AutoModelForSequenceClassification, AutoTokenizer

from finetune.data.embedded.support_tickets import LABEL_NAMES, make_support_tickets

RESULT_KEYS = {"eval_accuracy", "eval_f1", "eval_loss", "train_loss", "train_runtime", "train_samples_per_second",
               "epoch", "global_step", "runtime", "world_size"}


def predict(folder: Path, texts: list[str], max_length: int) -> list[str]:
    """What plain transformers predicts with the saved folder, one example at a time."""
    model, info = AutoModelForSequenceClassification.from_pretrained(folder, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    tokenizer = AutoTokenizer.from_pretrained(folder)
    model.eval()
    labels = []
    with torch.no_grad():
        for text in texts:
            logits = model(**tokenizer(text, truncation=True, max_length=max_length, return_tensors="pt")).logits
            labels.append(model.config.id2label[int(logits.argmax(-1))])
    return labels


def read_predictions(folder: Path) -> list[str]:
    return [json.loads(line)["prediction"] for line in (folder / "eval_predictions.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_default_run_trains_offline_and_saves_a_plain_model(tmp_path):
    out = tmp_path / "out"
    result = run([sys.executable, "-m", "accelerate.commands.launch", "--num_processes", "1",
                  "recipes/classify.py", "--max_train_steps", "6", "--output_dir", str(out)])

    results = read_results(out)
    assert RESULT_KEYS <= results.keys()
    assert results["runtime"] == "accelerate" and results["world_size"] == 1 and results["global_step"] == 6
    assert f"saved the model to {out}" in result.stdout and "eval_accuracy" in result.stdout
    # accelerate launch pins a lone process to 1 thread unless told otherwise; the run uses every core.
    assert f"1 process(es) on cpu, {psutil.cpu_count(logical=False)} CPU thread(s) each" in result.stdout

    weights = read_weights(out)
    config = json.loads((out / "config.json").read_text())
    assert list(config["id2label"].values()) == LABEL_NAMES
    assert not any(k.startswith(("module.", "_orig_mod.")) for k in weights)

    validation = make_support_tickets()["validation"]
    predicted = predict(out, validation["text"], max_length=128)
    assert predicted == read_predictions(out)
    accuracy = sum(p == LABEL_NAMES[y] for p, y in zip(predicted, validation["label"], strict=True)) / len(validation)
    assert accuracy == pytest.approx(results["eval_accuracy"], abs=1e-12)


def test_a_thread_count_the_user_chose_is_kept(small_data, tiny_bert, tmp_path):
    result = run([sys.executable, "-m", "accelerate.commands.launch", "--num_processes", "1",
                  "--num_cpu_threads_per_process", "1", "recipes/classify.py",
                  *classify_flags(small_data, tiny_bert, "--max_train_steps", "1",
                                  "--output_dir", str(tmp_path / "out"))])
    assert "1 process(es) on cpu, 1 CPU thread(s) each" in result.stdout


@pytest.mark.multiprocess
def test_two_processes_evaluate_exactly_like_one(parity_runs, small_data):
    out = parity_runs("accelerate", 2, 4)
    results = read_results(out)
    assert results["world_size"] == 2 and results["runtime"] == "accelerate"
    # 42 examples, global batch 8, accumulation 2: 6 micro-batches, 3 optimizer steps per epoch.
    assert results["global_step"] == 9 and results["epoch"] == 3.0

    with open(small_data["validation"], encoding="utf-8") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 23
    predicted = predict(out, [r["text"] for r in rows], max_length=48)
    assert predicted == read_predictions(out)
    accuracy = sum(p == r["label"] for p, r in zip(predicted, rows, strict=True)) / len(rows)
    assert accuracy == pytest.approx(results["eval_accuracy"], abs=1e-12)


@pytest.mark.multiprocess
@pytest.mark.slow
# Each launcher once, each sampler once: the sampler is the same code under both launchers.
@pytest.mark.parametrize(("launcher", "group_by_length"), [("accelerate", True), ("torchrun", False)])
def test_each_process_gets_a_disjoint_shard_covering_every_example(tmp_path, launcher, group_by_length):
    flags = [str(tmp_path), "--per_device_train_batch_size", "4"]
    flags += [] if group_by_length else ["--no_group_by_length"]
    run(launch_cmd(launcher, *flags, script="tests/scripts/record_batches.py"))
    ranks = [json.loads((tmp_path / f"rank_{r}.json").read_text()) for r in range(2)]
    assert [r["world_size"] for r in ranks] == [2, 2]
    for epoch in range(2):
        shards = [[i for batch in r["epochs"][epoch] for i in batch] for r in ranks]
        assert not set(shards[0]) & set(shards[1])
        assert sorted(shards[0] + shards[1]) == list(range(45))
    assert ranks[0]["epochs"][0] != ranks[0]["epochs"][1], "each epoch has its own shuffle"


def test_resume_mid_epoch_two_gives_the_uninterrupted_weights(small_data, tiny_bert, tmp_path):
    common = classify_flags(small_data, tiny_bert, "--per_device_train_batch_size", "4",
                            "--gradient_accumulation_steps", "2", "--num_train_epochs", "3", "--seed", "7")
    full = tmp_path / "full"
    # Dropout stays on: resuming must restore the RNG state too.
    train_here("classify", *common, "--output_dir", str(full), "--checkpointing_steps", "4",
               "--checkpoints_total_limit", "2", "--with_tracking", "--report_to", "tensorboard")
    checkpoints = sorted(p.name for p in (full / "checkpoints").iterdir())
    assert checkpoints == ["step_12", "step_16"], "the limit keeps the newest two"
    history = log_history(full)
    logged = tensorboard_scalars(full)
    for key in ("loss", "learning_rate", "grad_norm"):  # each step's values, as TensorBoard reads them back
        assert [(e.step, e.value) for e in logged[key]] == [
            (row["step"], pytest.approx(row[key], rel=1e-6)) for row in history], key
    assert [e.step for e in logged["loss"]] == list(range(1, 19))

    progress = json.loads((full / "checkpoints" / "step_16" / "progress.json").read_text())
    # 6 optimizer steps per epoch: step 16 is 4 steps (8 micro-batches) into the third epoch.
    assert progress["epoch"] == 2 and progress["batches_in_epoch"] == 8

    resumed = tmp_path / "resumed"
    result = train_here("classify", *common, "--output_dir", str(resumed),
                        "--resume_from_checkpoint", str(full / "checkpoints" / "step_16"))
    assert "resumed from" in result.stdout
    assert max_weight_diff(full, resumed) == 0.0
    assert read_results(resumed)["eval_accuracy"] == read_results(full)["eval_accuracy"]
    assert log_history(resumed)[0]["loss"] == history[16]["loss"], "dropout drew the uninterrupted run's masks"


@pytest.mark.parametrize(("flags", "steps", "epoch"), [
    (["--checkpointing_steps", "epoch"], 6, 1),  # 42 examples in batches of 8: 6 steps, the epoch's end
    (["--checkpointing_steps", "2", "--max_train_steps", "4"], 4, 0),  # the last step within the epoch
], ids=["epoch-end", "mid-epoch"])
def test_resuming_from_the_final_checkpoint_saves_the_same_model(small_data, tiny_bert, tmp_path, flags, steps,
                                                                 epoch):
    """A run resumed from the checkpoint of its last step (its final save cut short) trains no step more."""
    common = classify_flags(small_data, tiny_bert, "--per_device_train_batch_size", "8", "--num_train_epochs", "1")
    first = tmp_path / "first"
    train_here("classify", *common, "--output_dir", str(first), *flags)
    final_checkpoint = first / "checkpoints" / f"step_{steps}"
    assert json.loads((final_checkpoint / "progress.json").read_text())["epoch"] == epoch

    again = tmp_path / "again"
    train_here("classify", *common, "--output_dir", str(again), *flags[2:], "--resume_from_checkpoint",
               str(final_checkpoint))
    assert max_weight_diff(first, again) == 0.0
    assert read_predictions(again) == read_predictions(first)
    assert read_results(again)["global_step"] == steps


def test_gradient_checkpointing_trains_exactly_as_keeping_the_activations(small_data, tiny_bert, tmp_path):
    """A full fine-tune of an encoder with dropout on: the recompute draws the masks the forward pass drew."""
    flags = ["--max_train_steps", "3", "--per_device_train_batch_size", "8", "--learning_rate", "1e-3"]
    train_here("classify", *classify_flags(small_data, tiny_bert, *flags, "--output_dir", str(tmp_path / "kept")))
    train_here("classify", *classify_flags(small_data, tiny_bert, *flags, "--output_dir", str(tmp_path / "recomputed"),
                                           "--gradient_checkpointing"))
    assert_same_steps(log_history(tmp_path / "recomputed"), log_history(tmp_path / "kept"), rel=1e-6)
    assert max_weight_diff(tmp_path / "recomputed", tmp_path / "kept") <= 1e-6


def test_predict_reads_the_columns_the_run_read_and_cuts_texts_where_it_cut_them(small_data, tiny_bert, tmp_path):
    """A sentence-pair run (``--text_column question --text_pair_column answer``, cut at 12 tokens): predict on the
    validation file, given no columns, labels each row as the run's evaluation did; a file without the answers is
    refused naming the column."""
    from finetune.errors import run_main
    from finetune.predict.__main__ import main as predict_main

    for split in ("train", "validation"):
        rows = list(csv.DictReader(open(small_data[split])))
        write_csv(tmp_path / f"{split}.csv", [{"question": row["text"], "answer": rows[-1 - i]["text"],
                                               "label": row["label"]} for i, row in enumerate(rows)])
    out = tmp_path / "out"
    train_here("classify", "--train_file", str(tmp_path / "train.csv"), "--validation_file",
               str(tmp_path / "validation.csv"), "--text_column", "question", "--text_pair_column", "answer",
               "--max_seq_length", "12", "--max_train_steps", "4", "--learning_rate", "1e-2",
               "--model_name_or_path", str(tiny_bert), "--output_dir", str(out))
    run_main(predict_main, [str(out), "--input", str(tmp_path / "validation.csv")])
    rows = read_jsonl(out / "predictions.jsonl")
    assert [row["predicted_label"] for row in rows] == read_predictions(out)
    model = AutoModelForSequenceClassification.from_pretrained(out).eval()
    tokenizer = AutoTokenizer.from_pretrained(out)

    def probabilities(*texts, **cut):
        with torch.no_grad():
            return model(**tokenizer(*texts, return_tensors="pt", **cut)).logits.softmax(-1)[0].tolist()

    row = rows[0]
    expected = probabilities(row["question"], row["answer"], truncation=True, max_length=12)
    assert list(row["probabilities"].values()) == pytest.approx(expected, abs=1e-6)
    for other in (probabilities(row["question"], row["answer"]), probabilities(row["question"], truncation=True,
                                                                                max_length=12)):
        assert max(abs(a - b) for a, b in zip(other, expected, strict=True)) > 1e-4
    with pytest.raises(SystemExit):
        run_main(predict_main, [str(out), "--input", str(small_data["validation"]), "--output", str(tmp_path / "x")])
    # A --max_seq_length past the tokenizer's own length (MiniLM's position embeddings hold 512) saves its own
    run_main(load_recipe("classify").main, [*classify_flags(small_data, tiny_bert, "--max_seq_length", "1024",
                                                            "--max_train_steps", "1", "--output_dir",
                                                            str(tmp_path / "long"))])
    assert AutoTokenizer.from_pretrained(tmp_path / "long").model_max_length == 512
