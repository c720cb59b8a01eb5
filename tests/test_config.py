import pytest

from finetune.config import parse_config
from finetune.errors import UserError


def test_defaults_match_the_documented_ones():
    cfg = parse_config([])
    assert cfg.model_name_or_path is None and cfg.output_dir == "outputs/classify"
    assert cfg.group_by_length is True and cfg.runtime == "auto"


def test_yaml_sets_values_and_the_command_line_overrides_it(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("learning_rate: 3.0e-5\nper_device_train_batch_size: 8\ngroup_by_length: false\n"
                    "checkpointing_steps: 100\n")
    cfg = parse_config(["--config", str(path), "--per_device_train_batch_size", "16"])
    assert cfg.learning_rate == 3e-5
    assert cfg.per_device_train_batch_size == 16
    assert cfg.group_by_length is False
    assert cfg.checkpoint_every_steps == 100


def test_no_group_by_length_flag_turns_grouping_off():
    assert parse_config(["--no_group_by_length"]).group_by_length is False


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("- a\n- b\n", "must be a mapping"),
        ("lr: 1\n", "unknown key(s) lr"),
        ("learning_rate: [\n", "is not valid YAML"),
    ],
)
def test_bad_yaml_files_are_refused(tmp_path, text, message):
    path = tmp_path / "run.yaml"
    path.write_text(text)
    with pytest.raises(UserError, match=message.replace("(", r"\(").replace(")", r"\)")):
        parse_config(["--config", str(path)])


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--per_device_train_batch_size", "0"], "must be a positive"),
        (["--max_train_steps", "-3"], "must be a positive"),
        (["--checkpointing_steps", "often"], "positive number of steps or 'epoch'"),
        (["--lr_scheduler_type", "triangle"], "is unknown"),
        (["--train_file", "a.csv"], "go together"),
        (["--dataset_name", "glue", "--train_file", "a.csv", "--validation_file", "b.csv"], "pass one data source"),
    ],
)
def test_invalid_values_are_refused(argv, message):
    with pytest.raises(UserError, match=message):
        parse_config(argv)
