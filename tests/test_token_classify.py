"""The token-classification recipe end to end, launched as a user launches it."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import datasets
import pytest
import torch
from helpers import (
    assert_refused,
    assert_same_steps,
    assert_weights_match_a_parity_run,
    launch_cmd,
    load_recipe,
    log_history,
    read_jsonl,
    read_results,
    recipe_path,
    run,
    train_here,
    write_jsonl,
)
from transformers import AutoModelForTokenClassification, AutoTokenizer, pipeline

from finetune.config import parse_config
from finetune.data.cache import load_or_build
from finetune.data.embedded.tagged_tickets import TAG_NAMES, make_tagged_tickets
from finetune.errors import run_main
from finetune.predict.__main__ import main as predict
from finetune.tasks.tagging import IGNORE, entities, entity_scores

RECIPE = recipe_path("token_classify")
RESULT_KEYS = {"eval_precision", "eval_recall", "eval_f1", "eval_accuracy", "eval_loss", "train_loss",
               "train_runtime", "train_samples_per_second", "epoch", "global_step", "runtime", "world_size"}


def write_tagged(path: Path, split: datasets.Dataset) -> Path:
    path.write_text("".join(json.dumps({"tokens": row["tokens"], "ner_tags": [TAG_NAMES[t] for t in row["ner_tags"]]})
                            + "\n" for row in split))
    return path


@pytest.fixture(scope="session")
def tagged_data(tmp_path_factory) -> list[str]:
    """42 tagged sentences for training, 23 for evaluation, with string tags, as data flags."""
    folder = tmp_path_factory.mktemp("tagged")
    data = make_tagged_tickets()
    train = write_tagged(folder / "train.jsonl", data["train"].select(range(42)))
    validation = write_tagged(folder / "validation.jsonl", data["validation"].select(range(23)))
    return ["--train_file", str(train), "--validation_file", str(validation), "--max_seq_length", "48",
            "--per_device_eval_batch_size", "4", "--logging_steps", "1"]


def read_predictions(folder: Path) -> list[dict]:
    return [json.loads(line) for line in (folder / "eval_predictions.jsonl").read_text().splitlines()]


def launch_default(out: Path, *flags: str) -> str:
    """The default run (3 epochs, 114 steps, under a minute), as the README launches it."""
    return run([sys.executable, "-m", "accelerate.commands.launch", "--num_processes", "1", RECIPE, *flags,
                "--output_dir", str(out)], timeout=600).stdout


@pytest.fixture(scope="module")
def default_run(tmp_path_factory) -> tuple[Path, str]:
    out = tmp_path_factory.mktemp("token_classify") / "out"
    return out, launch_default(out)


@pytest.mark.slow
def test_the_default_run_saves_a_plain_tagging_model_and_its_predictions(default_run):
    out, stdout = default_run
    results = read_results(out)
    assert RESULT_KEYS <= results.keys() and results["global_step"] == 114
    assert "training token_classify on tagged support tickets" in stdout
    # Tagging each word with its most frequent training tag scores F1 0.356 on this validation set.
    assert results["eval_f1"] > 0.9

    model, info = AutoModelForTokenClassification.from_pretrained(out, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    assert list(model.config.id2label.values()) == TAG_NAMES

    validation = make_tagged_tickets()["validation"]
    predictions = read_predictions(out)
    assert [p["tokens"] for p in predictions] == list(validation["tokens"])
    assert all(len(p["predicted"]) == len(p["tokens"]) for p in predictions)
    # The predictions file scores to the reported F1 (every word here fits in --max_seq_length).
    references = [[TAG_NAMES[t] for t in tags] for tags in validation["ner_tags"]]
    scores = entity_scores(references, [p["predicted"] for p in predictions])
    assert scores["overall_f1"] == pytest.approx(results["eval_f1"], abs=1e-12)


@pytest.mark.slow
def test_trained_on_every_piece_the_pipeline_groups_whole_words_into_the_predicted_entities(tmp_path):
    """With --label_all_tokens a word's later pieces train as I-X, so "simple" grouping keeps a word whole even
    where the tokenizer splits it at punctuation ("7,942", "anna@example.com"): the pipeline finds exactly the
    entities of the per-word predictions. (Trained on first pieces only, the default, it splits most such
    words: bench/results/default-runs.json.) Two epochs of the default model and data (three by default), in this
    process: the point is the labels, not the launcher."""
    out = tmp_path / "out"
    train_here("token_classify", "--label_all_tokens", "--num_train_epochs", "2", "--output_dir", str(out))
    assert read_results(out)["eval_f1"] > 0.9
    tag = pipeline("token-classification", model=str(out), aggregation_strategy="simple")
    predictions = [p for p in read_predictions(out) if any(t != "O" for t in p["predicted"])][:40]
    differ = []
    for prediction in predictions:
        words, tags = prediction["tokens"], prediction["predicted"]
        grouped = [(g["entity_group"], g["word"].replace(" ", "")) for g in tag(" ".join(words))]
        expected = [(kind, "".join(words[start:end + 1]).lower()) for kind, start, end in
                    sorted(entities(tags), key=lambda e: e[1])]
        if [(kind, word.lower()) for kind, word in grouped] != expected:
            differ.append((grouped, expected))
    assert len(predictions) == 40 and not differ, differ


@pytest.mark.multiprocess
@pytest.mark.slow
def test_one_process_and_two_train_alike_under_both_launchers(tagged_data, tiny_bert_without_dropout, tmp_path):
    """Loss units are tokens here: 1 x batch 8 and 2 x batch 4, Accelerate and raw DDP, all the same."""
    common = [*tagged_data, "--model_name_or_path", str(tiny_bert_without_dropout), "--gradient_accumulation_steps",
              "2", "--num_train_epochs", "3", "--checkpointing_steps", "4"]
    outs = {name: tmp_path / name for name in ("one", "accelerate_2", "torchrun_2")}
    train_here("token_classify", *common, "--per_device_train_batch_size", "8", "--output_dir", str(outs["one"]))
    for launcher in ("accelerate", "torchrun"):
        run(launch_cmd(launcher, *common, "--per_device_train_batch_size", "4", "--output_dir",
                       str(outs[f"{launcher}_2"]), script=RECIPE))
    reference = log_history(outs["one"])
    assert [read_results(out)["world_size"] for out in outs.values()] == [1, 2, 2]
    assert [h["step"] for h in reference] == list(range(1, 10))
    for name in ("accelerate_2", "torchrun_2"):
        assert_same_steps(log_history(outs[name]), reference)
        assert_weights_match_a_parity_run(outs["one"], outs[name])
        results, expected = read_results(outs[name]), read_results(outs["one"])
        for key in ("eval_precision", "eval_recall", "eval_f1", "eval_accuracy"):
            assert results[key] == expected[key]
        assert results["eval_loss"] == pytest.approx(expected["eval_loss"], rel=1e-5)
        assert read_predictions(outs[name]) == read_predictions(outs["one"])


def test_conll_files_train_and_cut_words_are_predicted_o(tiny_bert, tmp_path):
    data = make_tagged_tickets()
    splits = {"train": data["train"].select(range(16)), "validation": data["validation"].select(range(5))}
    for name, split in splits.items():
        lines = ["-DOCSTART- -X- O", ""]
        for row in split:
            lines += [f"{word} X {TAG_NAMES[tag]}" for word, tag in zip(row["tokens"], row["ner_tags"], strict=True)]
            lines.append("")
        (tmp_path / f"{name}.conll").write_text("\n".join(lines))
    out = tmp_path / "out"
    result = train_here("token_classify", "--train_file", str(tmp_path / "train.conll"), "--validation_file",
                        str(tmp_path / "validation.conll"), "--max_seq_length", "8", "--max_train_steps", "1",
                        "--model_name_or_path", str(tiny_bert), "--output_dir", str(out))
    tokenizer = AutoTokenizer.from_pretrained(tiny_bert)
    pieces = [len(tokenizer(row["tokens"], is_split_into_words=True)["input_ids"]) - 2 for row in splits["validation"]]
    cut = sum(count > 6 for count in pieces)  # 8 tokens hold [CLS], 6 pieces and [SEP]
    assert cut and f"{cut} validation sentence(s) cut" in result.stdout
    for prediction, row in zip(read_predictions(out), splits["validation"], strict=True):
        assert prediction["tokens"] == row["tokens"]
        assert set(prediction["predicted"][6:]) <= {"O"}, "words past --max_seq_length are predicted O"
    # predict cuts sentences where the run did: its tags are the evaluation's.
    run_main(predict, [str(out), "--input", str(tmp_path / "validation.conll")])
    assert [row["predicted_tags"] for row in read_jsonl(out / "predictions.jsonl")] == \
        [prediction["predicted"] for prediction in read_predictions(out)]


GOOD = [{"tokens": ["refund", "$5", "now"], "ner_tags": ["O", "B-AMOUNT", "O"]},
        {"tokens": ["order", "A1", "late"], "ner_tags": ["O", "B-ORDER", "O"]}]


def unlabelled_parquet(path: Path) -> str:
    features = datasets.Features({"tokens": datasets.Sequence(datasets.Value("string")),
                                  "ner_tags": datasets.Sequence(datasets.ClassLabel(names=["O", "B-X"]))})
    datasets.Dataset.from_dict({"tokens": [["a", "b"], ["c"]], "ner_tags": [[0, 1], [-1]]},
                               features=features).to_parquet(path)
    return str(path)


BAD = {
    "words and tags of different lengths": (
        lambda d: write_jsonl(d / "t.jsonl", [*GOOD, {"tokens": ["a", "b"], "ner_tags": ["O"]}]), None,
        "train data row 3 has 2 words and 1 tags"),
    "a validation tag training never saw": (
        None, lambda d: write_jsonl(d / "v.jsonl", [{"tokens": ["bo@x.io"], "ner_tags": ["B-EMAIL"]}]),
        "tag(s) B-EMAIL that training data never has"),
    "I- right after O": (
        lambda d: write_jsonl(d / "t.jsonl", [*GOOD, {"tokens": ["a", "b"], "ner_tags": ["O", "I-ORDER"]}]), None,
        "I-ORDER follows O, which BIO does not allow"),
    "an empty sentence": (lambda d: write_jsonl(d / "t.jsonl", [*GOOD, {"tokens": [], "ner_tags": []}]), None,
                          "train data row 3 is an empty sentence"),
    "words that are not strings": (
        lambda d: write_jsonl(d / "t.jsonl", [*GOOD, {"tokens": [4, 5], "ner_tags": ["O", "O"]}]), None,
        "holds 4, not a word"),
    "a CoNLL file whose columns change": (
        lambda d: str((d / "t.conll").write_text("a X O\nb B-ORDER\n") and d / "t.conll"), None,
        "line 2 has 2 column(s) where the file has 3"),
    "unlabelled rows (-1)": (lambda d: unlabelled_parquet(d / "t.parquet"),
                             lambda d: unlabelled_parquet(d / "v.parquet"), "is unlabelled (tag -1)"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_input_is_one_error_line_and_changes_nothing(tmp_path, case):
    make_train, make_validation, expected = BAD[case]
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "notes.txt").write_text("kept")
    train = make_train(tmp_path) if make_train else write_jsonl(tmp_path / "good_t.jsonl", GOOD)
    validation = make_validation(tmp_path) if make_validation else write_jsonl(tmp_path / "good_v.jsonl", GOOD)
    flags = ["--train_file", train, "--validation_file", validation, "--output_dir", str(tmp_path / "out")]
    assert_refused("token_classify", flags, tmp_path, expected)


def test_the_loss_is_the_mean_over_labelled_sub_tokens(tagged_data, tiny_bert, tmp_path):
    """The task's sum over a batch, divided by the loss units the loop divides by, is cross-entropy's own mean over
    the sub-tokens that carry a label: padding and untrained pieces (-100) count for nothing."""
    recipe = load_recipe("token_classify")
    cfg, args = parse_config(recipe.TokenClassifyArguments, [*tagged_data, "--model_name_or_path",
                                                                    str(tiny_bert), "--output_dir", str(tmp_path)])
    task = recipe.TokenClassifyTask(args)
    tokenizer = task.load_tokenizer(cfg)
    setup = task.setup(cfg, tokenizer, load_or_build(task, cfg, tokenizer))
    rows = list(range(8))
    batch = setup.collate(setup.train_set.__getitems__(rows))
    labels = batch["labels"].clone()
    assert (labels == IGNORE).any() and (labels != IGNORE).any()
    with torch.no_grad():
        loss = task.loss(setup.model, dict(batch))
        logits = setup.model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    units = setup.train_set.loss_units[rows].sum()
    assert units == (labels != IGNORE).sum()
    expected = torch.nn.functional.cross_entropy(logits[labels != IGNORE], labels[labels != IGNORE])
    torch.testing.assert_close(loss / units, expected, rtol=1e-6, atol=0)


@pytest.mark.parametrize("label_all_tokens", [False, True])
def test_the_recipe_trains_first_pieces_only_unless_label_all_tokens(tagged_data, tmp_path, label_all_tokens):
    recipe = load_recipe("token_classify")
    flags = [*tagged_data, "--output_dir", str(tmp_path / "out")] + ["--label_all_tokens"] * label_all_tokens
    cfg, args = parse_config(recipe.TokenClassifyArguments, flags)
    task = recipe.TokenClassifyTask(args)
    tokenizer = task.load_tokenizer(cfg)
    train_set = load_or_build(task, cfg, tokenizer).train
    words = [json.loads(line)["tokens"] for line in Path(tagged_data[1]).read_text().splitlines()]
    encoded = tokenizer(words, is_split_into_words=True, truncation=True, max_length=cfg.max_seq_length)
    later_pieces = trained_later_pieces = 0
    for row in range(len(words)):
        word_ids, labels = encoded.word_ids(row), train_set[row]["labels"]
        for position in range(1, len(word_ids)):
            if word_ids[position] is not None and word_ids[position] == word_ids[position - 1]:
                later_pieces += 1
                trained_later_pieces += labels[position] != IGNORE
    assert later_pieces > 50 and trained_later_pieces == (later_pieces if label_all_tokens else 0)
