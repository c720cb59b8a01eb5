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

from finetune.config import arg, parse_config
from finetune.data.batching import TokenizedDataset
from finetune.data.embedded.preference_pairs import make_preference_pairs
from finetune.data.embedded.support_chats import routing_accuracy
from finetune.data.sources import load_splits
from finetune.errors import run_main
from finetune.models.loading import default_chat_model_path
from finetune.models.lora import add_lora
from finetune.task import TaskSetup
from finetune.tasks import causal_lm, preference
from finetune.tasks.chat import write_generations

DEFAULT_DATA = "support preference pairs (embedded default)"
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
    precompute_ref_log_probs: bool = arg(False, "Compute the reference's log-probabilities of every training pair "
                                                "once, before the first step (each pair once over all processes), and "
                                                f"keep them in OUTPUT/{REFERENCE_FILE} for a resumed run.")

    def __post_init__(self):
        super().__post_init__()
        preference.check_loss_options(self.loss_type, self.beta, self.label_smoothing)


class DPOTask:
    name = "dpo"
    tokenizing_code = ("finetune.tasks.preference", "finetune.tasks.chat", "finetune.data.sources",
                       "finetune.data.embedded.preference_pairs", "finetune.data.embedded.support_chats",
                       "finetune.data.embedded.support_tickets")
    logged_figures = ("rewards_chosen", "rewards_rejected", "rewards_margin", "rewards_accuracy", "logps_chosen",
                      "logps_rejected")
    run_files = (REFERENCE_FILE,)

    def __init__(self, args: DPOArguments):
        self.args = args
        self.card = causal_lm.chat_model_card("preference tuning (DPO)", args.use_lora)

    def load_tokenizer(self, cfg):
        return causal_lm.load_chat_tokenizer(cfg, self.args.chat_template)

    def load_data(self, cfg):
        return load_splits(cfg.train_file, cfg.validation_file, cfg.dataset_name, cfg.dataset_config_name,
                           cfg.trust_remote_code, make_preference_pairs, DEFAULT_DATA, reread=cfg.overwrite_cache)

    def data_options(self, cfg):
        return {"max_seq_length": cfg.max_seq_length}

    def tokenize(self, raw, tokenizer, cfg, tokenizing):
        train = preference.tokenize_pairs(raw["train"], tokenizer, cfg.max_seq_length, "train", tokenizing)
        preference.tokenize_pairs(raw["validation"], tokenizer, cfg.max_seq_length, "validation", tokenizing,
                       generation_prompts=True)
        embedded = not (cfg.train_file or cfg.dataset_name)  # its replies name a team: routing accuracy is scored
        return {"teams": list(raw["validation"]["team"]) if embedded else None, "cut": sum(train["cut"]),
                "same": sum(train["same"])}

    def setup(self, cfg, tokenizer, data):
        args = self.args
        self.tokenizer, self.teams = tokenizer, data.info["teams"]
        self.prompted = data.validation.select(range(min(args.eval_generate, len(data.validation))))
        self.prompts = [row["prompt_ids"] for row in self.prompted]
        model = preference.load_causal_lm(cfg.model_name_or_path or default_chat_model_path(),
                                          trust_remote_code=cfg.trust_remote_code)
        # The precision as the runtimes take it: the flag, else accelerate launch's configuration.
        precision = cfg.mixed_precision or os.environ.get("ACCELERATE_MIXED_PRECISION", "no")
        reference_key = preference.reference_key(model, precision, data.folder) if args.precompute_ref_log_probs else ""
        if args.use_lora:
            model = add_lora(model, args.lora_r, args.lora_alpha, args.lora_dropout, args.lora_target_modules)
        causal_lm.check_output_layer(model)
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        train_set, eval_collate = TokenizedDataset(data.train, COLUMNS), preference.PromptRepliesCollator(pad)
        self.reference = preference.Reference(model, preference.Precomputation(
            train_set, eval_collate, cfg.per_device_eval_batch_size, args.per_device_eval_max_tokens,
            Path(cfg.output_dir) / REFERENCE_FILE, key=reference_key,
        ) if args.precompute_ref_log_probs else None)
        adapter_start = cfg.model_name_or_path and preference.is_adapter_folder(cfg.model_name_or_path)
        return TaskSetup(train_set, TokenizedDataset(data.validation, COLUMNS), preference.PairCollator(pad), model,
                         eval_collate=eval_collate, truncated=data.info["cut"],
                         summary=f"a pair per example, --loss_type {args.loss_type} --beta {args.beta}, "
                                 f"{'precomputed' if args.precompute_ref_log_probs else 'live'} reference"
                                 + (f", LoRA r={args.lora_r} on {args.lora_target_modules}" if args.use_lora else "")
                                 + (f", {data.info['same']} pair(s) whose chosen and rejected replies are the same "
                                    "tokens (they train nothing)" if data.info["same"] else "")
                                 + (f", from {cfg.model_name_or_path} folded into its base model (the saved adapter "
                                    "applies to that model; --merge_lora also saves one that stands alone)"
                                    if adapter_start else ""))

    def loss(self, model, batch):
        reference = self.reference.training_log_probs(model, batch, batch.pop("index"))
        policy, counts = preference.pair_log_probs(model, batch)
        losses, rewards = preference.dpo_loss(policy, reference, counts, self.args.loss_type, self.args.beta,
                                              self.args.label_smoothing)
        return {"loss": losses.sum(), **preference.pair_figures(policy, rewards)}

    def eval_outputs(self, model, batch):  # each prompt runs once for both replies
        index, budget = batch.pop("index"), self.args.per_device_eval_max_tokens
        policy = causal_lm.shared_prompt_log_probs(model, batch, budget)
        reference = self.reference.shared_prompt_log_probs(model, batch, budget)
        replies = causal_lm.greedy_replies(model, index, self.prompts, self.tokenizer, self.args.max_new_tokens,
                                           budget)
        return policy, reference, batch["reply_mask"].sum(1).view(-1, 2), replies

    def metrics(self, outputs):
        policy, reference, counts, replies = outputs
        metrics = preference.pair_metrics(policy, reference, counts, self.args.loss_type, self.args.beta,
                                          self.args.label_smoothing)
        self.generations = causal_lm.decode_replies(replies, len(self.prompts), self.tokenizer)
        if self.teams and self.generations:
            metrics["routing_accuracy"] = routing_accuracy(self.generations, self.teams)
        return metrics

    def write_predictions(self, outputs, output_dir):
        policy, reference, _, _ = outputs
        preference.write_pair_predictions(os.path.join(output_dir, "eval_predictions.jsonl"), policy, reference,
                                          self.args.beta)
        if self.generations:
            write_generations(os.path.join(output_dir, "eval_generations.jsonl"), self.prompted, self.generations)

    def save(self, model, state_dict, tokenizer, output_dir):
        causal_lm.save_chat_model(model, state_dict, tokenizer, output_dir, self.args)


def main(argv=None):
    cfg, args = parse_config(DPOArguments, argv, description="Align a chat model on preference pairs (DPO).",
                             defaults=DEFAULTS)
    from finetune.loop import train  # the training libraries load once the flags are known to be good

    train(DPOTask(args), cfg, args)


if __name__ == "__main__":
    run_main(main)
