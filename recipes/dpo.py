"""Align a chat model on preference pairs (DPO with LoRA), on one process or many.

With no flags it trains SmolLM2-135M-Instruct (the chat recipe's converted folder) on embedded pairs of replies to
support tickets, offline: the chosen reply names the team that owns the ticket, the rejected one a wrong team or
none. It saves the LoRA adapter with the tokenizer to outputs/dpo.

    accelerate launch recipes/dpo.py                                                   # 1 process
    accelerate launch --config_file accelerate_configs/cpu_ddp.yaml recipes/dpo.py    # 2 CPU processes
    torchrun --nproc_per_node=2 recipes/dpo.py --model_name_or_path outputs/sft        # after the chat recipe

Data: jsonl, json or parquet with `prompt`, `chosen` and `rejected` columns (text, or lists of {role, content}
messages), or only `chosen` and `rejected` conversations that share every turn but the last; or `--dataset_name`.
`--model_name_or_path` may be a chat run's adapter folder: its base model with the adapter folded in is both the
model trained and the reference. Flags follow TRL's DPO script; `--config FILE.yaml` sets any of them.
"""

import os
from dataclasses import dataclass
from pathlib import Path

from finetune.config import arg
from finetune.data.batching import TokenizedDataset, pad_token_id
from finetune.data.embedded.preference_pairs import PREFERENCE_PAIRS
from finetune.data.sources import load_splits
from finetune.errors import run_main
from finetune.recipe import run_recipe
from finetune.task import TaskSetup
from finetune.tasks import causal_lm, preference

DEFAULTS = {"output_dir": "outputs/dpo", "num_train_epochs": 1, "learning_rate": 1e-3, "per_device_train_batch_size": 8,
            "per_device_eval_batch_size": 16, "max_seq_length": 1024}
"""The shared options' defaults for this recipe (LoRA trains well at a higher learning rate; one epoch of the
embedded pairs already ranks every held-out pair right)."""
COLUMNS = ["prompt_ids", "chosen_ids", "rejected_ids", "index"]
REFERENCE_FILE = "ref_log_probs.safetensors"


@dataclass
class DPOArguments(causal_lm.ChatModelArguments):
    loss_type: str = arg("sigmoid", "sigmoid (DPO), ipo (on the replies' mean log-probabilities) or robust "
                                    "(DPO for labels flipped at a rate --label_smoothing).")
    beta: float = arg(0.1, "How far the policy may move from the reference: DPO's beta, IPO's tau.")
    label_smoothing: float = arg(0.0, "--loss_type robust: the share of pairs whose labels are taken to be flipped, "
                                      "in [0, 0.5).")
    eval_generate: int = arg(0, "Greedy replies to the first N validation prompts at each evaluation (default none, "
                                "which keeps the default run short).")
    lora_dropout: float = arg(0.0, "Dropout on the LoRA input: off by default, as TRL's DPO turns dropout off (the "
                                   "model's own always), so that the policy's log-probabilities compare with the "
                                   "reference's, taken without.")
    precompute_ref_log_probs: bool = arg(False, "Compute the reference's log-probabilities of every training pair "
                                                "once, before the first step (each pair once over all processes), and "
                                                f"keep them in OUTPUT/{REFERENCE_FILE} for a resumed run.")

    def __post_init__(self):
        super().__post_init__()
        preference.check_loss_options(self.loss_type, self.beta, self.label_smoothing)


class DPOTask(causal_lm.ChatTask):
    name, what = "dpo", "preference tuning (DPO)"
    tokenizing_code = ("finetune.tasks.preference", "finetune.tasks.chat", "finetune.data.sources",
                       "finetune.data.embedded", "finetune.data.embedded.preference_pairs",
                       "finetune.data.embedded.support_chats", "finetune.data.embedded.support_tickets")
    logged_figures = preference.PAIR_FIGURES
    run_files = (REFERENCE_FILE,)

    def load_data(self, cfg):
        return load_splits(cfg, PREFERENCE_PAIRS)

    def tokenize(self, raw, tokenizer, cfg, tokenizing):
        options = self.args.template_options
        train = preference.tokenize_pairs(raw["train"], tokenizer, cfg.max_seq_length, "train", tokenizing,
                                          template_options=options)
        preference.tokenize_pairs(raw["validation"], tokenizer, cfg.max_seq_length, "validation", tokenizing,
                                  generation_prompts=True, template_options=options)
        return {"answers": PREFERENCE_PAIRS.answers(raw, cfg), "cut": sum(train["cut"]), "same": sum(train["same"])}

    def setup(self, cfg, tokenizer, data):
        args = self.args
        self.replies = causal_lm.EvalReplies(data.validation, tokenizer, args, data.info["answers"],
                                             PREFERENCE_PAIRS.score_replies)
        pad = pad_token_id(tokenizer)
        train_set, collate = TokenizedDataset(data.train, COLUMNS), preference.PromptRepliesCollator(pad)
        model, self.reference, described = preference.load_policy_and_reference(
            cfg, args, tokenizer, data.folder, train_set, collate, Path(cfg.output_dir) / REFERENCE_FILE)
        same = data.info["same"] and (f"{data.info['same']} pair(s) whose chosen and rejected replies are the same "
                                      "tokens (they train nothing)")
        summary = ", ".join(filter(None, [f"a pair per example, --loss_type {args.loss_type} --beta {args.beta}",
                                          described, same]))
        return TaskSetup(train_set, TokenizedDataset(data.validation, COLUMNS), collate, model,
                         truncated=data.info["cut"], summary=summary)

    def preview(self, data, tokenizer, count):
        return preference.preview_pairs(data.train, tokenizer, count)

    def loss(self, model, batch):  # each prompt runs once for both replies
        reference = self.reference.training_log_probs(model, batch, batch.pop("index"))
        policy, counts = preference.pair_log_probs(model, batch)
        losses, rewards = preference.dpo_loss(policy, reference, counts, self.args.loss_type, self.args.beta,
                                              self.args.label_smoothing)
        return {"loss": losses.sum(), **preference.pair_figures(policy, rewards)}

    def eval_outputs(self, model, batch):  # each prompt runs once for both replies
        index, budget = batch.pop("index"), self.args.per_device_eval_max_tokens
        policy = causal_lm.shared_prompt_log_probs(model, batch, budget)
        reference = self.reference.shared_prompt_log_probs(model, batch, budget)
        return policy, reference, batch["reply_mask"].sum(1).view(-1, 2), self.replies.generate(model, index)

    def metrics(self, outputs):
        policy, reference, counts, replies = outputs
        metrics = preference.pair_metrics(policy, reference, counts, self.args.loss_type, self.args.beta,
                                          self.args.label_smoothing)
        return {**metrics, **self.replies.metrics(replies)}

    def write_predictions(self, outputs, output_dir):
        policy, reference, _, replies = outputs
        preference.write_pair_predictions(os.path.join(output_dir, "eval_predictions.jsonl"), policy, reference,
                                          self.args.beta)
        self.replies.write(replies, output_dir)


def main(argv=None):
    run_recipe(DPOTask, DPOArguments, argv, description="Align a chat model on preference pairs (DPO).",
               defaults=DEFAULTS)


if __name__ == "__main__":
    run_main(main)
