"""Each bad input ends in one line naming the problem and the fix, a non-zero exit, and no change on disk."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from helpers import (
    CPU_DDP_CONFIG,
    FAST_FLAGS,
    assert_refused,
    free_port,
    one_error_line,
    python_cmd,
    recipe_path,
    run,
    snapshot,
    train_here,
    write_csv,
)


@pytest.fixture
def refused(tmp_path):
    """Run the recipe on bad input and check the contract; in this process unless ``env`` is given."""

    def check(args: list[str], *expected: str, env: dict | None = None) -> str:
        if env is None:
            return assert_refused("classify", [*args, *FAST_FLAGS], tmp_path, *expected)
        before = snapshot(tmp_path)
        result = run(python_cmd(*args, *FAST_FLAGS), check=False, env=env)
        line = one_error_line(result.returncode, result.stderr, *expected)
        assert result.stderr.strip().splitlines()[-1] == line, "the error is the last word"
        assert snapshot(tmp_path) == before, "nothing already on disk changed"
        return line

    return check


@pytest.fixture
def files(tmp_path):
    train = write_csv(tmp_path / "train.csv", [{"text": f"text {i}", "label": "ab"[i % 2]} for i in range(8)])
    validation = write_csv(tmp_path / "validation.csv", [{"text": "t", "label": "a"}, {"text": "u", "label": "b"}])
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "notes.txt").write_text("the user's own file")
    return {"train": str(train), "validation": str(validation), "out": str(tmp_path / "out")}


def data(files, train=None, validation=None):
    return ["--train_file", train or files["train"], "--validation_file", validation or files["validation"],
            "--output_dir", files["out"]]


def test_a_preview_of_rows_is_the_chat_recipes_and_is_refused_before_any_build(tmp_path, files, refused):
    refused([*data(files), "--prepare_only", "--preview_rows", "2", "--dataset_cache_dir", str(tmp_path / "cache")],
            "--preview_rows: the classify recipe has no preview of its rows; the chat recipes do")
    assert not (tmp_path / "cache").exists()


def test_missing_data_file(tmp_path, files, refused):
    refused(data(files, train=str(tmp_path / "nope.csv")), "nope.csv: no such file")


def test_unsupported_file_type(tmp_path, files, refused):
    (tmp_path / "train.xlsx").write_text("x")
    refused(data(files, train=str(tmp_path / "train.xlsx")), "unsupported file type .xlsx",
                   ".csv")


def test_text_column_missing(tmp_path, files, refused):
    refused([*data(files), "--text_column", "sentence"], "no column 'sentence'", "--text_column")


def test_label_column_missing(tmp_path, files, refused):
    refused([*data(files), "--label_column", "target"], "no column 'target'", "--label_column")


def test_empty_dataset(tmp_path, files, refused):
    (tmp_path / "empty.csv").write_text("text,label\n")
    refused(data(files, train=str(tmp_path / "empty.csv")), "holds no rows")


def test_eval_label_never_seen_in_training(tmp_path, files, refused):
    write_csv(tmp_path / "validation_c.csv", [{"text": "t", "label": "a"}, {"text": "u", "label": "c"}])
    refused(data(files, validation=str(tmp_path / "validation_c.csv")),
                   "label(s) c that training data never has")


def test_output_dir_already_holds_a_model(tmp_path, files, refused):
    (Path(files["out"]) / "config.json").write_text("{}")
    (Path(files["out"]) / "model.safetensors").write_bytes(b"weights")
    refused(data(files), "already holds a model", "--overwrite_output_dir")


def test_unknown_key_in_config(tmp_path, files, refused):
    (tmp_path / "run.yaml").write_text("learning_rate: 1.0e-4\nlearnig_rate: 3\n")
    refused([*data(files), "--config", str(tmp_path / "run.yaml")], "unknown key(s) learnig_rate")


def test_resume_from_incomplete_checkpoint(tmp_path, files, refused):
    partial = tmp_path / "out" / "checkpoints" / "step_4.partial"
    partial.mkdir(parents=True)
    (partial / "optimizer.bin").write_bytes(b"half")
    refused([*data(files), "--resume_from_checkpoint", str(partial)],
                   "is not a complete checkpoint", "'latest'")


def test_model_path_that_does_not_exist(tmp_path, files, refused):
    refused([*data(files), "--model_name_or_path", str(tmp_path / "no-model")], "no such folder")


def test_hub_id_while_offline(tmp_path, files, refused):
    refused([*data(files), "--model_name_or_path", "someone/not-cached-model"],
                   "not in the local cache and HF_HUB_OFFLINE is set", env={"HF_HUB_OFFLINE": "1"})


def test_refused_runs_leave_a_prior_model_untouched_and_overwrite_replaces_it(tmp_path, files, tiny_bert):
    out = Path(files["out"])
    train_one_step = [*data(files), *FAST_FLAGS, "--model_name_or_path", str(tiny_bert), "--max_train_steps", "1"]
    train_here("classify", *train_one_step)
    saved = snapshot(out)
    assert "model.safetensors" in saved and "config.json" in saved

    # A second run into the same folder, with another seed: refused, and the model on disk is the same bytes.
    assert_refused("classify", [*train_one_step, "--seed", "3"], out, "already holds a model")

    train_here("classify", *train_one_step, "--seed", "3", "--overwrite_output_dir")
    replaced = snapshot(out)
    assert replaced["model.safetensors"] != saved["model.safetensors"], "the new run's model replaced the old one"
    assert (out / "notes.txt").read_text() == "the user's own file"


FINETUNE = [sys.executable, "-m", "finetune.cli"]  # the `finetune` command


@pytest.mark.multiprocess
@pytest.mark.parametrize(("launcher", "processes"), [("launch", 1), ("launch", 2), ("torchrun", 2)])
def test_under_finetune_launch_and_torchrun_a_refusal_is_one_line_and_status_2_from_every_process(
        tmp_path, files, launcher, processes):
    """Plain ``accelerate launch`` and ``torchrun`` follow the line with their traceback and report of the failed
    processes, and exit 1; their ``finetune`` forms run them in-process and show what the processes reported."""
    options = (["--config_file", CPU_DDP_CONFIG, "--num_processes", str(processes)] if launcher == "launch" else
               ["--nproc_per_node", str(processes)])
    options += [f"--{'main_process' if launcher == 'launch' else 'master'}_port", str(free_port())]
    before = snapshot(tmp_path)
    result = run([*FINETUNE, launcher, *options, recipe_path(), *data(files, train=str(tmp_path / "nope.csv")),
                  *FAST_FLAGS], check=False)
    line = one_error_line(result.returncode, result.stderr, "nope.csv: no such file")
    assert result.stderr.strip().splitlines()[-1] == line and "[rank" not in result.stderr
    assert "ChildFailedError" not in result.stderr and "exitcode" not in result.stderr
    assert snapshot(tmp_path) == before, "nothing already on disk changed"


def test_any_other_failure_under_finetune_torchrun_shows_the_launchers_report_and_its_status(tmp_path):
    script = tmp_path / "crash.py"
    script.write_text("raise RuntimeError('not a refusal')\n")
    result = run([*FINETUNE, "torchrun", "--nproc_per_node", "1", "--master_port", str(free_port()), str(script)],
                 check=False)
    assert result.returncode == 1 and "RuntimeError: not a refusal" in result.stderr
    assert "ChildFailedError" in result.stderr and "exitcode  : 1" in result.stderr, result.stderr[-3000:]


def test_the_finetune_command_names_its_commands():
    result = run([*FINETUNE, "train"], check=False)
    assert result.returncode == 2 and result.stderr.splitlines()[-1] == "error: name a command, launch or torchrun"
