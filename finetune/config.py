"""Configuration: the options every recipe shares, a recipe's own, from defaults, a YAML file and the command line.

Flag names follow transformers' example scripts (``--model_name_or_path``, ``--per_device_train_batch_size``,
``--output_dir``, ...). A YAML file's values are turned into the command-line words they stand for and parsed
by the same parser, so a file is checked exactly like the command line; the command line wins over the file.

This module imports no torch, accelerate or datasets: a recipe checks its flags before it loads the loop,
the runtimes and their libraries (accelerate, peft, evaluate), let alone a model or data.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import math
import os
import sys
import typing
from dataclasses import dataclass, field
from typing import Literal

import yaml
from transformers import HfArgumentParser
from transformers.hf_argparser import string_to_bool

from finetune.errors import UserError

__all__ = ["TrainConfig", "arg", "parse_config"]

SCHEDULERS = ("linear", "cosine", "cosine_with_restarts", "polynomial", "constant", "constant_with_warmup",
              "inverse_sqrt")
"""The ``transformers.SchedulerType`` values that need nothing but the warmup and the number of steps (the others
need a metric or options no flag passes), spelled out so that checking a flag does not import torch."""

POLYNOMIAL_END = 1e-7
"""Where the ``polynomial`` schedule ends (transformers' ``lr_end``; its power is 1)."""

TRACKERS = ("tensorboard", "mlflow", "wandb")
"""What ``--report_to`` may name, each also the package that must be installed for it."""


def arg(default, help: str, **extra):
    """A dataclass field whose ``help`` becomes the flag's help text."""
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata={"help": help, **extra})
    return field(default=default, metadata={"help": help, **extra})


@dataclass
class TrainConfig:
    """Options every recipe shares: model and data sources, optimisation, outputs, logging, Hub, runtime."""

    # Model and data
    model_name_or_path: str | None = arg(None, "Hub id or local folder of a pretrained model; default: the "
                                               "recipe's embedded model.")
    dataset_name: str | None = arg(None, "Dataset on the Hub (or a local dataset folder).")
    dataset_config_name: str | None = arg(None, "Configuration name of --dataset_name.")
    train_file: str | None = arg(None, "Training data file (the recipe lists the formats it reads).")
    validation_file: str | None = arg(None, "Evaluation data, same formats as --train_file.")
    max_seq_length: int = arg(128, "Longer inputs are cut to this many tokens (and counted at start-up).")
    trust_remote_code: bool = arg(False, "Allow model or dataset code from the Hub to run on this machine.")
    preprocessing_num_workers: int | None = arg(None, "Processes that tokenize the data when its cache is built.")
    overwrite_cache: bool = arg(False, "Tokenize the data again even if a cache of it exists.")
    dataset_cache_dir: str | None = arg(None, "Where tokenized data is cached; default: finetune/ in the datasets "
                                              "cache (HF_DATASETS_CACHE).")
    prepare_only: bool = arg(False, "Tokenize the data into its cache, print each process's predicted memory "
                                    "(counted on the model's first two layers, on this machine) and exit (a CPU job "
                                    "before a GPU job).")
    preview_rows: int = arg(0, "With --prepare_only, in the chat recipes: print the first N training rows with what "
                               "trains in them marked, and write them to OUTPUT/data_preview.jsonl.")

    # Optimisation
    per_device_train_batch_size: int = arg(32, "Training examples per process per micro-step.")
    per_device_eval_batch_size: int = arg(64, "Evaluation examples per process per step.")
    learning_rate: float = arg(1e-4, "Peak learning rate of AdamW.")
    weight_decay: float = arg(0.01, "AdamW weight decay (not applied to biases and normalisation weights).")
    num_train_epochs: int = arg(2, "Passes over the training data.")
    max_train_steps: int | None = arg(None, "Optimizer steps in total; overrides --num_train_epochs when set.")
    gradient_accumulation_steps: int = arg(1, "Micro-steps per optimizer step.")
    lr_scheduler_type: str = arg("linear", f"One of transformers' schedules: {', '.join(SCHEDULERS)}.")
    num_warmup_steps: int = arg(0, "Optimizer steps of linear warm-up.")
    max_grad_norm: float = arg(1.0, "Clip the global gradient norm to this; 0 turns clipping off.")
    seed: int = arg(42, "Seed for shuffling, dropout and newly initialised weights.")
    group_by_length: bool = arg(True, "Batch training examples of similar length together to spend little "
                                      "compute on padding.")
    mixed_precision: Literal["no", "fp16", "bf16"] | None = arg(
        None, "Overrides the launcher's choice (accelerate config); raw DDP supports no and bf16.")
    bf16: bool = arg(False, "Same as --mixed_precision bf16 (the flag of transformers' and TRL's scripts).")
    gradient_checkpointing: bool | None = arg(
        None, "Keep only each transformer layer's input for the backward pass and recompute the layer there "
              "(activation checkpointing): far less memory for long rows, for a second forward pass; exact. "
              "Default: on where keeping every activation of the longest micro-batch would need more than half the "
              "memory the rest of the predicted peak leaves (docs/memory.md).")
    tiled_mlp: bool = arg(False, "Run each layer's MLP a tile of positions at a time, keeping only its input for "
                                 "the backward pass (Arctic Long Sequence Training's tiled MLP): far less memory for "
                                 "rows of many thousand tokens, for a third forward pass of the MLP.")

    # Outputs, checkpoints, logging
    output_dir: str = arg("outputs", "Where the trained model, checkpoints and results go.")
    overwrite_output_dir: bool = arg(False, "Replace a model already saved in --output_dir, and remove another "
                                            "run's checkpoints there and the later steps a resume abandons.")
    checkpointing_steps: str | None = arg(None, "Save full training state every N optimizer steps, or 'epoch'.")
    checkpoints_total_limit: int | None = arg(None, "Keep at most this many checkpoints (oldest deleted first).")
    resume_from_checkpoint: str | None = arg(None, "A checkpoint folder to continue from, 'latest', or "
                                                   "hub:ORG/NAME.")
    eval_steps: int | None = arg(None, "Also evaluate every N optimizer steps (always at each epoch's end).")
    logging_steps: int = arg(10, "Log loss, learning rate and throughput every N optimizer steps.")
    with_tracking: bool = arg(False, "Send metrics to every installed experiment tracker (--report_to all).")
    report_to: str | None = arg(None, "Experiment trackers, comma-separated: tensorboard, mlflow, wandb; 'all' "
                                      "(those installed) or 'none'. Default: none, or all with --with_tracking.")
    run_name: str | None = arg(None, "The run's name in the trackers; default: the output folder's name.")

    # Hugging Face Hub
    push_to_hub: bool = arg(False, "Push the final model (and, per --hub_strategy, checkpoints) to the Hub.")
    hub_model_id: str | None = arg(None, "Repository to push to; default: the output folder's name under your "
                                         "namespace.")
    hub_token: str | None = arg(None, "Hub token; default: HF_TOKEN or the cached login. Never written anywhere.")
    hub_private_repo: bool = arg(False, "Create the repository as private.")
    hub_revision: str | None = arg(None, "Branch to push to (created if missing).")
    hub_strategy: Literal["end", "every_save", "checkpoint"] = arg(
        "every_save",
        "end: the final model only; every_save: also the model at each checkpoint; checkpoint: also the full "
        "newest training state under last-checkpoint/ (resume with --resume_from_checkpoint hub:ORG/NAME).")
    hub_timeout: int = arg(600, "Seconds to wait at the end for the last pushes before giving up on them.")
    hub_strict: bool = arg(False, "Exit non-zero if a push failed (by default training results stand).")

    # Runtime
    runtime: Literal["auto", "accelerate", "ddp"] = arg("auto", "auto: raw DDP when started by torchrun, "
                                                                "Accelerate otherwise.")
    ddp_backend: str | None = arg(None, "torch.distributed backend; default nccl with CUDA, gloo without.")
    ddp_timeout: int = arg(1800, "Seconds a collective may wait for the other processes before the job fails.")
    fsdp: bool = arg(False, "Shard weights, gradients and optimizer state across the processes (PyTorch FSDP2) "
                            "instead of copying them to each (DDP); under torchrun or plain python. Under "
                            "accelerate launch, use --config_file accelerate_configs/fsdp.yaml (GPUs only).")

    def __post_init__(self):
        for name in ("per_device_train_batch_size", "per_device_eval_batch_size", "num_train_epochs",
                     "gradient_accumulation_steps", "max_seq_length", "logging_steps", "ddp_timeout", "hub_timeout"):
            if getattr(self, name) < 1:
                raise UserError(f"--{name} is {getattr(self, name)}; it must be a positive whole number")
        for name in ("max_train_steps", "checkpoints_total_limit", "eval_steps", "preprocessing_num_workers"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise UserError(f"--{name} is {value}; it must be a positive whole number (or left unset)")
        if self.tiled_mlp and self.fsdp:
            raise UserError("--tiled_mlp with --fsdp is not supported (a tile's backward pass takes its weights' "
                            "gradients whole); leave one of them out")
        if self.preview_rows < 0:
            raise UserError(f"--preview_rows is {self.preview_rows}; give how many training rows to show")
        if self.preview_rows and not self.prepare_only:
            raise UserError("--preview_rows shows the data --prepare_only prepares; add --prepare_only")
        if self.num_warmup_steps < 0:
            raise UserError(f"--num_warmup_steps is {self.num_warmup_steps}; it must be 0 or more")
        if not 0 < self.learning_rate < math.inf:
            raise UserError(f"--learning_rate is {self.learning_rate}; it must be a positive number")
        if not 0 <= self.weight_decay < math.inf:
            raise UserError(f"--weight_decay is {self.weight_decay}; it must be 0 or a positive number")
        if not 0 <= self.max_grad_norm < math.inf:
            raise UserError(f"--max_grad_norm is {self.max_grad_norm}; give the norm to clip the gradient to, or 0 "
                            "to turn clipping off")
        if not 0 <= self.seed < 2**32:  # what numpy's seeding takes
            raise UserError(f"--seed is {self.seed}; give a whole number from 0 to {2**32 - 1}")
        if self.lr_scheduler_type not in SCHEDULERS:
            raise UserError(f"--lr_scheduler_type {self.lr_scheduler_type!r} is unknown, or needs a metric or options "
                            f"no flag passes; use one of {', '.join(SCHEDULERS)}")
        if self.lr_scheduler_type == "polynomial" and not self.learning_rate > POLYNOMIAL_END:
            raise UserError(f"--lr_scheduler_type polynomial decays to {POLYNOMIAL_END}; give a --learning_rate "
                            "above it")
        if self.checkpointing_steps is not None and self.checkpointing_steps != "epoch" and not (
            self.checkpointing_steps.isdigit() and int(self.checkpointing_steps) > 0
        ):
            raise UserError(
                f"--checkpointing_steps is {self.checkpointing_steps!r}; give a positive number of steps or 'epoch'")
        if self.bf16:
            if self.mixed_precision not in (None, "bf16"):
                raise UserError(f"--bf16 and --mixed_precision {self.mixed_precision} disagree; pass one of them")
            self.mixed_precision = "bf16"
        if self.dataset_name and (self.train_file or self.validation_file):
            raise UserError("--dataset_name and --train_file/--validation_file both given; pass one data source")
        if bool(self.train_file) != bool(self.validation_file):
            raise UserError("--train_file and --validation_file go together; pass both")
        _chosen_trackers(self.report_to, self.with_tracking)

    @property
    def trackers(self) -> tuple[str, ...]:
        """The trackers this run reports to, from ``--report_to`` and ``--with_tracking``."""
        return _chosen_trackers(self.report_to, self.with_tracking)

    @property
    def checkpoint_every_steps(self) -> int | None:
        if self.checkpointing_steps is None or self.checkpointing_steps == "epoch":
            return None
        return int(self.checkpointing_steps)


def _chosen_trackers(report_to: str | None, with_tracking: bool) -> tuple[str, ...]:
    """The trackers ``--report_to`` (a comma list, all or none) names; all installed with ``--with_tracking`` alone.

    Raises:
        UserError: an unknown name, a tracker whose package is not installed, or 'all' with none installed.
    """
    spec = report_to or ("all" if with_tracking else "none")
    names = [name.strip().lower() for name in spec.split(",") if name.strip()]
    installed = tuple(name for name in TRACKERS if importlib.util.find_spec(name) is not None)
    if names == ["none"]:
        return ()
    if names == ["all"]:
        if not installed:
            raise UserError(f"--report_to all: none of {', '.join(TRACKERS)} is installed; "
                            "pip install -e '.[trackers]', or leave tracking off")
        return installed
    if {"all", "none"} & set(names) or not names:
        raise UserError(f"--report_to {spec!r}: give tracker names, or all or none alone")
    if unknown := [name for name in names if name not in TRACKERS]:
        raise UserError(f"--report_to {spec}: {unknown[0]!r} is not a tracker here; name some of "
                        f"{', '.join(TRACKERS)} (comma-separated), or all or none")
    if missing := [name for name in names if name not in installed]:
        raise UserError(f"--report_to {missing[0]} needs the {missing[0]} package, which is not installed; "
                        f"pip install -e '.[trackers]' (or pip install {missing[0]})")
    return tuple(dict.fromkeys(names))


class _Parser(HfArgumentParser):
    """Argparse's mistakes become one ``UserError`` line instead of a usage screen."""

    source = "the command line"

    def error(self, message: str):
        raise UserError(f"{self.source}: {message}; see --help")


def parse_config(task_class: type, argv: list[str] | None = None, *, defaults: dict | None = None,
                 description: str | None = None) -> tuple:
    """``(TrainConfig, task options)`` from ``defaults``, ``--config FILE.yaml`` and ``argv``, in that order.

    ``task_class`` is the recipe's own dataclass; ``defaults`` are the recipe's values for shared options
    (its output folder, learning rate, ...).

    Raises:
        UserError: an unreadable or non-mapping YAML file, an unknown key, a value of the wrong type or out
            of range, from the file or the command line.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = _Parser((TrainConfig, task_class), description=description)
    parser.add_argument("--config", metavar="FILE.yaml", help="YAML file whose keys are these flags' names.")
    for cls in (TrainConfig, task_class):
        for name, kind in typing.get_type_hints(cls).items():
            if kind == bool | None:  # a switch whose default is chosen at run time: --X, --no_X, or neither
                switch = next(action for action in parser._actions if action.dest == name)
                switch.nargs, switch.const, switch.type = "?", True, string_to_bool  # --X alone means on
                parser.add_argument(f"--no_{name}", dest=name, action="store_const", const=False,
                                    help=f"Turn {name} off.")
    if defaults:
        parser.set_defaults(**defaults)
    config_path = parser.parse_known_args(argv)[0].config
    file_words: list[str] = []
    if config_path:
        file_words = _yaml_words(parser, config_path)
        parser.source = f"--config {config_path}"
        parser.parse_args(file_words)  # the file alone, so that a mistake in it is reported as the file's
        parser.source = _Parser.source
    values = vars(parser.parse_args(file_words + argv))
    values.pop("config")
    for cls in (TrainConfig, task_class):  # argparse reads nan and inf as floats; no option means either
        for name, kind in typing.get_type_hints(cls).items():
            if kind in (float, float | None) and values[name] is not None and not math.isfinite(values[name]):
                raise UserError(f"--{name} is {values[name]}; give a finite number")
    shared = {f.name for f in dataclasses.fields(TrainConfig)}
    return (TrainConfig(**{k: v for k, v in values.items() if k in shared}),
            task_class(**{k: v for k, v in values.items() if k not in shared}))


def _yaml_words(parser: _Parser, path: str) -> list[str]:
    """The command-line words a YAML file's keys and values stand for."""
    if not os.path.isfile(path):
        raise UserError(f"--config {path}: no such file; check the path")
    try:
        with open(path, encoding="utf-8") as f:
            values = yaml.safe_load(f)
    except (yaml.YAMLError, UnicodeDecodeError) as err:
        first_line = str(err).splitlines()[0]
        raise UserError(f"--config {path} is not valid YAML ({first_line}); fix the file") from None
    if values is None:
        return []
    if not isinstance(values, dict):
        raise UserError(f"--config {path} must be a mapping of flag names to values, not a {type(values).__name__}")
    actions = {}
    for action in parser._actions:  # a boolean's --no_X shares X's dest: keep X itself
        actions.setdefault(action.dest, action)
    unknown = sorted(str(key) for key in values if key not in actions or key in ("config", "help"))
    if unknown:
        raise UserError(
            f"--config {path} has unknown key(s) {', '.join(unknown)}; use flag names such as learning_rate")
    words = []
    for key, value in values.items():
        if value is None:  # "unset": only options that may be unset take it
            if actions[key].default is not None:
                raise UserError(f"--config {path}: {key} is empty; give it a value or remove the line")
            parser.set_defaults(**{key: None})
            continue
        many = actions[key].nargs in ("+", "*")
        if isinstance(value, list) != many or isinstance(value, dict):
            kind = "a list" if many else "a single value"
            raise UserError(f"--config {path}: {key} must be {kind}, not {value!r}; fix the file")
        words += [f"--{key}", *(_word(v) for v in (value if many else [value]))]
    return words


def _word(value) -> str:
    """How a YAML scalar is written on a command line (YAML's true/false are the parser's booleans)."""
    return str(value).lower() if isinstance(value, bool) else str(value)
