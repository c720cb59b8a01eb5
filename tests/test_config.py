import subprocess
import sys
from dataclasses import dataclass

import pytest
from helpers import REPO, load_recipe

from finetune.config import SCHEDULERS, arg, parse_config
from finetune.errors import UserError


@dataclass
class TaskOptions:
    text_column: str = arg("text", "Column holding the text.")
    tags: list[str] = arg(["a"], "Some names.")


def parse(argv):
    return parse_config(TaskOptions, argv, defaults={"output_dir": "outputs/task"})


def test_defaults_match_the_documented_ones_and_a_recipe_sets_its_own():
    cfg, task = parse([])
    assert cfg.model_name_or_path is None and cfg.output_dir == "outputs/task"
    assert cfg.group_by_length is True and cfg.runtime == "auto"
    assert task.text_column == "text" and task.tags == ["a"]


def test_yaml_sets_values_and_the_command_line_overrides_it(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("learning_rate: 3.0e-5\nper_device_train_batch_size: 8\ngroup_by_length: false\n"
                    "checkpointing_steps: 100\ntext_column: sentence\ntags: [x, y]\nmax_train_steps: null\n")
    cfg, task = parse(["--config", str(path), "--per_device_train_batch_size", "16"])
    assert cfg.learning_rate == 3e-5
    assert cfg.per_device_train_batch_size == 16
    assert cfg.group_by_length is False
    assert cfg.checkpoint_every_steps == 100
    assert task.text_column == "sentence" and task.tags == ["x", "y"]


def test_no_group_by_length_flag_turns_grouping_off():
    assert parse(["--no_group_by_length"])[0].group_by_length is False


def test_the_schedulers_checked_are_transformers_own_that_run_on_warmup_and_steps_alone():
    import torch
    from transformers import SchedulerType, get_scheduler

    def two_steps(name):
        optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
        scheduler = get_scheduler(name, optimizer, num_warmup_steps=1, num_training_steps=10)
        for _ in range(2):
            optimizer.step()
            scheduler.step()  # as the loop calls it
        return optimizer.param_groups[0]["lr"]

    assert set(SCHEDULERS) < {s.value for s in SchedulerType}
    assert all(two_steps(name) > 0 for name in SCHEDULERS)
    for name in {s.value for s in SchedulerType} - set(SCHEDULERS):
        with pytest.raises((TypeError, ValueError)):
            two_steps(name)


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
        parse(["--config", str(path)])


# Each value is refused the same way from a YAML file as from the command line.
BAD_VALUES = [
    ("num_train_epochs", "2.5", "invalid int value: '2.5'"),
    ("hub_strategy", "checkpoints", "invalid choice: 'checkpoints'"),
    ("group_by_length", "3", "Truthy value expected"),
    ("per_device_train_batch_size", "0", "must be a positive whole number"),
    ("checkpointing_steps", "often", "positive number of steps or 'epoch'"),
    ("lr_scheduler_type", "triangle", "is unknown"),
    ("lr_scheduler_type", "reduce_lr_on_plateau", "needs a metric or options no flag passes; use one of linear, "),
    ("learning_rate", "fast", "invalid float value: 'fast'"),
]


@pytest.mark.parametrize(("key", "value", "message"), BAD_VALUES, ids=[f"{v[0]}-{v[1]}" for v in BAD_VALUES])
def test_a_bad_value_is_refused_alike_from_yaml_and_the_command_line(tmp_path, key, value, message):
    with pytest.raises(UserError, match=message):
        parse([f"--{key}", value])
    path = tmp_path / "run.yaml"
    path.write_text(f"{key}: {value}\n")
    with pytest.raises(UserError, match=message):
        parse(["--config", str(path)])


def test_a_polynomial_schedule_needs_a_learning_rate_above_where_it_ends():
    with pytest.raises(UserError, match="polynomial decays to 1e-07; give a --learning_rate above it"):
        parse(["--lr_scheduler_type", "polynomial", "--learning_rate", "1e-7"])
    assert parse(["--lr_scheduler_type", "polynomial", "--learning_rate", "2e-7"])[0].learning_rate == 2e-7


def test_a_type_error_names_where_the_value_came_from(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("num_train_epochs: 2.5\n")
    problem = "argument --num_train_epochs/--num-train-epochs: invalid int value"
    with pytest.raises(UserError, match=f"^--config {path}: {problem}"):
        parse(["--config", str(path)])
    with pytest.raises(UserError, match=f"^the command line: {problem}"):
        parse(["--num_train_epochs", "2.5"])


def test_yaml_lists_and_single_values_must_match_the_option(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("learning_rate: [1, 2]\n")
    with pytest.raises(UserError, match="learning_rate must be a single value"):
        parse(["--config", str(path)])
    path.write_text("output_dir: null\n")
    with pytest.raises(UserError, match="output_dir is empty"):
        parse(["--config", str(path)])


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--max_train_steps", "-3"], "must be a positive"),
        (["--train_file", "a.csv"], "go together"),
        (["--dataset_name", "glue", "--train_file", "a.csv", "--validation_file", "b.csv"], "pass one data source"),
        (["--no_such_flag", "1"], "unrecognized arguments: --no_such_flag"),
        (["--preview_rows", "3"], "--preview_rows shows the data --prepare_only prepares; add --prepare_only"),
        (["--preview_rows", "-1", "--prepare_only"], "--preview_rows is -1; give how many training rows to show"),
        (["--tiled_mlp", "--fsdp"], "--tiled_mlp with --fsdp is not supported"),
    ],
)
def test_invalid_values_are_refused(argv, message):
    with pytest.raises(UserError, match=message):
        parse(argv)


def test_a_mistake_in_the_flags_comes_back_before_the_loop_and_its_libraries_load():
    """A recipe imports torch, transformers and datasets (its task needs them); the loop, the runtimes and what only
    they need (accelerate, peft, evaluate with scikit-learn and scipy: seconds of imports) load once the flags
    are good."""
    deferred = ("accelerate", "peft", "evaluate", "sklearn", "scipy", "finetune.loop", "finetune.runtimes.base",
                "transformers.modeling_utils")
    probe = ("import runpy, sys\n"
             "sys.argv = ['recipes/classify.py', '--train_file', 'nope.csv']\n"
             "try:\n    runpy.run_path('recipes/classify.py', run_name='__main__')\n"
             "except SystemExit as exit:\n"
             f"    print(exit.code, [m for m in {deferred!r} if m in sys.modules], 'torch' in sys.modules)\n")
    result = subprocess.run([sys.executable, "-c", probe], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert result.stdout.strip() == "2 [] True", result.stdout + result.stderr
    assert result.stderr.strip() == "error: --train_file and --validation_file go together; pass both"


@pytest.mark.parametrize("value", ["nan", "inf", "-inf"])
@pytest.mark.parametrize("flag", ["learning_rate", "weight_decay", "max_grad_norm"])
def test_a_float_option_that_is_no_finite_number_is_refused_at_flag_time(flag, value):
    with pytest.raises(UserError, match=f"^--{flag} is {value}; give a finite number$"):
        parse([f"--{flag}={value}"])


@pytest.mark.parametrize(("flag", "value"), [("beta", "nan"), ("label_smoothing", "nan"), ("lora_dropout", "inf")])
def test_a_recipe_s_own_float_option_is_checked_finite_at_flag_time(flag, value):
    dpo = load_recipe("dpo")
    with pytest.raises(UserError, match=f"^--{flag} is {value}; give a finite number$"):
        parse_config(dpo.DPOArguments, [f"--{flag}", value])


def test_dpo_and_grpo_train_without_lora_dropout_unless_asked_as_trl_does():
    """TRL's DPOTrainer turns dropout off (``disable_dropout``), and GRPO's old log-probabilities are taken in eval
    mode, so dropout in training would make a rollout's first pass off-policy; the chat recipe keeps LoRA's 0.05."""
    dpo, grpo = load_recipe("dpo").DPOArguments, load_recipe("grpo")
    rewards = ["--reward_funcs", grpo.DEFAULT_REWARD]
    dropouts = [parse_config(options, argv)[1].lora_dropout for options, argv in
                ((dpo, []), (grpo.GRPOArguments, rewards), (load_recipe("sft").SFTArguments, []),
                 (dpo, ["--lora_dropout", "0.1"]), (grpo.GRPOArguments, [*rewards, "--lora_dropout", "0.1"]))]
    assert dropouts == [0.0, 0.0, 0.05, 0.1, 0.1]


OUT_OF_RANGE = [
    ("weight_decay", "-0.1", "--weight_decay is -0.1; it must be 0 or a positive number"),
    ("max_grad_norm", "-1", "--max_grad_norm is -1.0; give the norm to clip the gradient to, or 0 to turn clipping "
                            "off"),
    ("seed", "-1", "--seed is -1; give a whole number from 0 to 4294967295"),
    ("seed", "4294967296", "--seed is 4294967296; give a whole number from 0 to 4294967295"),
    ("lora_r", "0", "--lora_r is 0; the rank of an adapter is a positive whole number"),
    ("lora_alpha", "0", "--lora_alpha is 0; it scales the adapter's update by alpha / r"),
    ("lora_dropout", "1.5", "--lora_dropout is 1.5; give the share of inputs dropped, in [0, 1)"),
    ("lora_dropout", "-0.1", "--lora_dropout is -0.1; give the share of inputs dropped, in [0, 1)"),
]


@pytest.mark.parametrize(("flag", "value", "message"), OUT_OF_RANGE, ids=[f"{f} {v}" for f, v, _ in OUT_OF_RANGE])
def test_an_option_out_of_its_range_is_refused_at_flag_time_naming_it(flag, value, message):
    with pytest.raises(UserError) as refused:
        parse_config(load_recipe("sft").SFTArguments, [f"--{flag}", value])
    assert str(refused.value).startswith(message)
