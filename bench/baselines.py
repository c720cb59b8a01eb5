"""What the recipes are measured against: hand-written PyTorch loops, transformers' Trainer and TRL's SFTTrainer,
DPOTrainer and GRPOTrainer.

    python bench/baselines.py KIND DATA_FILE OUT_DIR [--seed N] [--per_device_train_batch_size N] [--eval_file F]
    (KIND: loop_random, loop_same_optimizer, trainer_default, trainer_grouped, trainer_ner, loop_sft,
    trl_padding_free, trl_default, trl_memory, trl_long, loop_dpo, trl_dpo, trl_dpo_default, trl_dpo_memory,
    trl_dpo_long, trl_grpo, trl_grpo_long, trl_agent, st_mnrl or st_cached_mnrl_large;
    the batch size is the chat and preference baselines' only, their recipe's by default; the memory kinds
    evaluate on --eval_file; trl_agent starts from --model_name_or_path and is held out on --eval_file)
    python bench/baselines.py agent_held_out PROMPTS_FILE OUT_DIR --model_name_or_path ADAPTER --eval_file F

The classification baselines train the same model on the same CSV for one epoch with the recipe's defaults:
per-device batch 32, learning rate 1e-4, sequences cut at 128 tokens, each batch padded to its own longest row.

- ``loop_random``: the loop everyone writes. A shuffled DataLoader, AdamW with torch's defaults, a
  linear schedule and gradient clipping at 1.0 (the recipe clips and schedules too).
- ``loop_same_optimizer``: a loop over the batches the recipe's sampler plans (grouped by length) with the
  recipe's optimizer (fused AdamW, its weight decay, none on biases and norms): exactly the recipe's work
  written by hand, so the ratio between the two is the package's own cost.
- ``trainer_default``: ``Trainer`` with default ``TrainingArguments`` (fused AdamW, no weight decay,
  linear schedule, clipping at 1.0), given the tokenizer, so it pads per batch.
- ``trainer_grouped``: the same with Trainer's length-grouped sampler.
- ``loop_sft``: the chat recipe's own batches (its tokenization, sampler and collator) in a hand-written loop
  with its optimizer, the loss from the model's ``labels``.
- ``loop_dpo``: the same for the preference recipe: its pairs, batches, LoRA model and optimizer, and DPO's loss
  written out in the loop (the reference is the model with its adapters switched off).

Run under ``bench/probe.py``'s hooks (installed here), like the recipe.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import datasets  # noqa: E402
import probe  # noqa: E402
import torch  # noqa: E402
from transformers import (  # noqa: E402
    AutoModelForSequenceClassification,
    AutoModelForTokenClassification,
    AutoTokenizer,
    DataCollatorForTokenClassification,
    DataCollatorWithPadding,
    Trainer,
    TrainerCallback,
    TrainingArguments,
    get_linear_schedule_with_warmup,
)

from finetune.config import TrainConfig  # noqa: E402
from finetune.data.batching import GlobalBatchSampler  # noqa: E402
from finetune.data.cache import Tokenizing, load_or_build  # noqa: E402
from finetune.data.embedded.tagged_tickets import make_tagged_tickets  # noqa: E402
from finetune.models.loading import default_model_path, optimizer_param_groups  # noqa: E402
from finetune.tasks.tagging import align_labels, encode_tags, entity_scores, first_pieces  # noqa: E402

RECIPE = TrainConfig()  # the recipes' shared defaults, which every configuration uses
BATCH_SIZE, LEARNING_RATE = RECIPE.per_device_train_batch_size, RECIPE.learning_rate
MAX_LENGTH, SEED = RECIPE.max_seq_length, RECIPE.seed


class CountingCollator:
    """Builds batches with ``collate`` and tells the probe what each batch held: ``rows_per_example`` is 2 for
    preference pairs (``probe.record_batch``)."""

    def __init__(self, collate, rows_per_example: int = 1):
        self.collate = collate
        self.rows_per_example = rows_per_example
        self.counting = True

    def __call__(self, features):
        batch = self.collate(features)
        if self.counting:
            probe.record_batch(batch, len(features), self.rows_per_example)
        return batch


class CountingTextsCollator:
    """sentence-transformers' collator (each text column tokenized and padded apart) telling the probe what each
    batch held; everything else the trainer asks of it is the collator's."""

    def __init__(self, collate):
        self.collate = collate

    def __getattr__(self, name):
        return getattr(self.collate, name)

    def __call__(self, features):
        batch = self.collate(features)
        masks = [value for key, value in batch.items() if key.endswith("attention_mask")]
        probe.record_counts(len(features), int(sum(m.sum() for m in masks)), sum(m.numel() for m in masks))
        return batch


class EvaluationIsNotTraining(TrainerCallback):
    """Trainer pads evaluation batches with the training collator: those are not training batches."""

    def __init__(self, collate: CountingCollator):
        self.collate = collate

    def on_epoch_end(self, args, state, control, **kwargs):
        self.collate.counting = False  # the epoch's evaluation comes next

    def on_evaluate(self, args, state, control, **kwargs):
        self.collate.counting = True


def hand_written_loop(model, train, collate, batch_sampler, device, bf16, recipe_optimizer: bool,
                      learning_rate: float = LEARNING_RATE, loss_of=lambda model, batch: model(**batch).loss) -> None:
    model.to(device).train()
    loader = torch.utils.data.DataLoader(train, batch_sampler=batch_sampler, collate_fn=collate)
    if recipe_optimizer:
        optimizer = torch.optim.AdamW(optimizer_param_groups(model, RECIPE.weight_decay), lr=learning_rate,
                                      fused=True)
    else:
        optimizer = torch.optim.AdamW(model.parameters(), lr=learning_rate)
    scheduler = get_linear_schedule_with_warmup(optimizer, 0, len(loader))
    for batch in loader:
        batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
            loss = loss_of(model, batch)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()


def recipe_module(name: str):
    """``recipes/NAME.py`` as a module: its defaults and its task."""
    return module_from(Path(__file__).parent.parent / "recipes" / f"{name}.py", f"{name}_recipe")


def module_from(path: Path | str, name: str | None = None):
    """The Python file at ``path`` as a module."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(name or Path(path).stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def recipe_setup(recipe, arguments, task_class, flags: list[str], batch_size: int | None):
    """``(task, setup, shared options)``: the recipe's task set up with ``flags`` as its run sets it up (tokenized
    data, model, collator)."""
    from finetune.config import parse_config

    if batch_size:
        flags = [*flags, "--per_device_train_batch_size", str(batch_size)]
    cfg, args = parse_config(arguments, flags, defaults=recipe.DEFAULTS)
    task = task_class(args)
    tokenizer = task.load_tokenizer(cfg)
    return task, task.setup(cfg, tokenizer, load_or_build(task, cfg, tokenizer)), cfg


def recipe_batches(setup, cfg) -> GlobalBatchSampler:
    """The batches the recipe's sampler plans for one process: length-grouped, with the recipe's seed."""
    return GlobalBatchSampler(setup.train_set.lengths, cfg.per_device_train_batch_size, 1, seed=SEED,
                              group_by_length=True)


def loop_sft(train_jsonl: str, batch_size: int | None, device, bf16) -> None:
    """The chat recipe's tokenized conversations, length-grouped batches, padding collator and LoRA model, trained
    by a hand-written loop with the recipe's optimizer and learning rate."""
    recipe = recipe_module("sft")
    _, setup, cfg = recipe_setup(recipe, recipe.SFTArguments, recipe.SFTTask,
                                 ["--train_file", train_jsonl, "--validation_file", train_jsonl, "--no_packing"],
                                 batch_size)
    hand_written_loop(setup.model, setup.train_set, CountingCollator(setup.collate), recipe_batches(setup, cfg),
                      device, bf16, recipe_optimizer=True, learning_rate=cfg.learning_rate)


def loop_dpo(train_jsonl: str, batch_size: int | None, device, bf16) -> None:
    """The preference recipe's tokenized pairs, length-grouped batches, pair collator and LoRA model (dropout off),
    trained by a hand-written loop with the recipe's optimizer and learning rate on DPO's loss: the replies'
    log-probabilities summed by the recipe's library (``pair_log_probs``, each prompt run once for both replies),
    the reference's with the adapters switched off, the mean over the batch's pairs of -log sigmoid(beta x
    (policy - reference) margin)."""
    from finetune.tasks.preference import pair_log_probs

    recipe = recipe_module("dpo")
    task, setup, cfg = recipe_setup(recipe, recipe.DPOArguments, recipe.DPOTask,
                                    ["--train_file", train_jsonl, "--validation_file", train_jsonl, "--lora_dropout",
                                     "0"], batch_size)
    beta = task.args.beta

    def dpo_loss(model, batch):
        del batch["index"]
        with torch.no_grad(), model.disable_adapter():
            reference, _ = pair_log_probs(model, batch)
        policy, _ = pair_log_probs(model, batch)
        ratios = policy - reference
        return -torch.nn.functional.logsigmoid(beta * (ratios[:, 0] - ratios[:, 1])).mean()

    hand_written_loop(setup.model, setup.train_set, CountingCollator(setup.collate, rows_per_example=2),
                      recipe_batches(setup, cfg), device, bf16, recipe_optimizer=True,
                      learning_rate=cfg.learning_rate, loss_of=dpo_loss)


def trainer_ner(output_dir: str, seed: int) -> None:
    """Trainer as run_ner.py uses it, on the tagging recipe's embedded default: the same words and tags, the same
    sub-token labels (each word's first piece, the default of both), batch, learning rate, weight decay and
    epochs, and an evaluation at the end of each epoch as the recipe makes; Trainer's defaults otherwise.
    Writes ``all_results.json`` with the entity F1 read per word, as the recipe reads it."""
    data = make_tagged_tickets()
    tokenizer = AutoTokenizer.from_pretrained(default_model_path())
    names, train, validation = encode_tags(data["train"], data["validation"], "tokens", "ner_tags")
    tokenizing = Tokenizing(Path(tempfile.mkdtemp(dir=output_dir)), workers=None)
    train_set = align_labels(train, tokenizer, MAX_LENGTH, False, names, "train", tokenizing)
    eval_set = align_labels(validation, tokenizer, MAX_LENGTH, False, names, "validation", tokenizing, keep_words=True)
    eval_word_ids = eval_set["word_ids"]
    train_set, eval_set = (rows.select_columns(["input_ids", "labels"]) for rows in (train_set, eval_set))
    model = AutoModelForTokenClassification.from_pretrained(
        default_model_path(), num_labels=len(names), id2label=dict(enumerate(names)),
        label2id={n: i for i, n in enumerate(names)})
    args = TrainingArguments(output_dir=output_dir, per_device_train_batch_size=BATCH_SIZE,
                             per_device_eval_batch_size=64, learning_rate=LEARNING_RATE, num_train_epochs=3,
                             weight_decay=RECIPE.weight_decay, seed=seed, bf16=torch.cuda.is_available(),
                             save_strategy="no", report_to="none", eval_strategy="epoch")
    collate = CountingCollator(DataCollatorForTokenClassification(tokenizer, return_tensors="pt"))
    trainer = Trainer(model=model, args=args, train_dataset=train_set, eval_dataset=eval_set,
                      processing_class=tokenizer, data_collator=collate, callbacks=[EvaluationIsNotTraining(collate)])
    trainer.train()
    collate.counting = False
    logits = trainer.predict(eval_set).predictions
    predicted, references = [], []
    for row, word_ids in enumerate(eval_word_ids):
        firsts = first_pieces(word_ids)
        predicted.append([names[int(logits[row][p].argmax())] for p in firsts])
        references.append([names[eval_set[row]["labels"][p]] for p in firsts])
    scores = entity_scores(references, predicted)
    with open(os.path.join(output_dir, "all_results.json"), "w") as f:
        json.dump({"eval_f1": scores["overall_f1"]}, f)


def trl_sft(kind: str, train_jsonl: str, output_dir: str, batch_size: int | None, eval_jsonl: str | None) -> None:
    """TRL's SFTTrainer on the chat recipe's work: the same model, conversations (prompt = system and user
    turns, completion = the reply, so only the reply trains), LoRA settings, batch, learning rate, weight decay,
    length limit and logging interval, one epoch, no evaluation. ``trl_padding_free`` concatenates each batch as
    the recipe's packing does, with activation checkpointing off as in the recipe; ``trl_default`` keeps TRL's
    defaults (padded batches, activation checkpointing on). ``trl_memory`` is the recipe's memory comparison:
    padded batches cut at 512 tokens, activation checkpointing off, and one evaluation of ``eval_jsonl`` at the
    epoch's end in batches of 8, as the recipe's ``--per_device_eval_batch_size 8``. ``trl_long`` is
    ``bench/long.py``'s: TRL's defaults (activation checkpointing on), padding-free batches, no length limit."""
    from peft import LoraConfig
    from trl import SFTConfig, SFTTrainer

    from finetune.models.loading import default_chat_model_path

    recipe = recipe_module("sft")
    defaults, lora_defaults = recipe.DEFAULTS, recipe.SFTArguments()

    def prompt_and_completion(path: str) -> datasets.Dataset:
        rows = datasets.load_dataset("json", data_files=path, split="train")
        return rows.map(lambda row: {"prompt": row["messages"][:-1], "completion": row["messages"][-1:]},
                        remove_columns=rows.column_names)

    settings = {"max_length": defaults["max_seq_length"]}
    if kind == "trl_padding_free":  # without packing TRL enforces no length limit here; these are far shorter
        settings = {"padding_free": True, "gradient_checkpointing": False, "max_length": None}
    if kind == "trl_memory":
        settings = {"max_length": 512, "gradient_checkpointing": False, "per_device_eval_batch_size": 8,
                    "eval_strategy": "epoch"}
    if kind == "trl_long":  # bench/long.py: its defaults for long rows, activation checkpointing on, no padding
        settings = {"padding_free": True, "max_length": None}
    args = SFTConfig(output_dir=output_dir,
                     per_device_train_batch_size=batch_size or defaults["per_device_train_batch_size"],
                     learning_rate=defaults["learning_rate"], weight_decay=RECIPE.weight_decay, num_train_epochs=1,
                     seed=SEED, bf16=torch.cuda.is_available(),
                     save_strategy="no", report_to="none", logging_steps=RECIPE.logging_steps,
                     **settings)
    lora = LoraConfig(r=lora_defaults.lora_r, lora_alpha=lora_defaults.lora_alpha,
                      lora_dropout=lora_defaults.lora_dropout, target_modules=lora_defaults.lora_target_modules,
                      task_type="CAUSAL_LM")
    model, full = default_chat_model_path(), False
    if kind == "trl_long":  # bench/long.py's GPU part: another model, and every weight trained
        model, full = os.environ.get("BENCH_LONG_MODEL") or model, bool(os.environ.get("BENCH_LONG_FULL"))
    trainer = SFTTrainer(model=model, args=args, train_dataset=prompt_and_completion(train_jsonl),
                         eval_dataset=prompt_and_completion(eval_jsonl) if eval_jsonl else None,
                         peft_config=None if full else lora)
    trainer.data_collator = CountingCollator(trainer.data_collator)
    trainer.add_callback(EvaluationIsNotTraining(trainer.data_collator))
    trainer.train()


def trl_dpo(kind: str, train_jsonl: str, output_dir: str, batch_size: int | None, eval_jsonl: str | None) -> None:
    """TRL's DPOTrainer on the preference recipe's work: the same model, pairs (prompt, chosen and rejected
    messages), LoRA settings with dropout off, batch, learning rate, weight decay, beta, length limit and logging
    interval, one epoch, a live reference (the adapters switched off), no evaluation, float32 on a CPU (where TRL's
    default would be bf16). ``trl_dpo`` turns activation checkpointing off as the recipe runs; ``trl_dpo_default``
    keeps TRL's defaults otherwise (activation checkpointing on). ``trl_dpo_memory`` is the recipe's memory
    comparison: rows cut at 512 tokens, activation checkpointing off, and one evaluation of ``eval_jsonl`` at the
    epoch's end in batches as large as the training batch, as the recipe's ``--per_device_eval_batch_size``.
    ``trl_dpo_long`` is ``bench/long.py --recipe dpo``'s: TRL's defaults (activation checkpointing on), no length
    limit."""
    from peft import LoraConfig
    from trl import DPOConfig, DPOTrainer

    from finetune.models.loading import default_chat_model_path

    recipe = recipe_module("dpo")
    defaults, options = recipe.DEFAULTS, recipe.DPOArguments()
    batch_size = batch_size or defaults["per_device_train_batch_size"]
    settings = {"max_length": defaults["max_seq_length"]}
    if kind == "trl_dpo":
        settings["gradient_checkpointing"] = False
    if kind == "trl_dpo_memory":
        settings = {"max_length": 512, "gradient_checkpointing": False,
                    "per_device_eval_batch_size": batch_size, "eval_strategy": "epoch"}
    if kind == "trl_dpo_long":
        settings = {"max_length": None}
    args = DPOConfig(output_dir=output_dir, per_device_train_batch_size=batch_size,
                     learning_rate=defaults["learning_rate"], weight_decay=RECIPE.weight_decay, num_train_epochs=1,
                     seed=SEED, bf16=torch.cuda.is_available(), save_strategy="no", report_to="none",
                     logging_steps=RECIPE.logging_steps, beta=options.beta, precompute_ref_log_probs=False,
                     **settings)
    lora = LoraConfig(r=options.lora_r, lora_alpha=options.lora_alpha, lora_dropout=0.0,
                      target_modules=options.lora_target_modules, task_type="CAUSAL_LM")

    def pairs(path: str) -> datasets.Dataset:
        return datasets.load_dataset("json", data_files=path, split="train")

    trainer = DPOTrainer(model=default_chat_model_path(), args=args, train_dataset=pairs(train_jsonl),
                         eval_dataset=pairs(eval_jsonl) if eval_jsonl else None, peft_config=lora)
    trainer.data_collator = CountingCollator(trainer.data_collator, rows_per_example=2)
    trainer.add_callback(EvaluationIsNotTraining(trainer.data_collator))
    trainer.train()


def trl_grpo(kind: str, train_jsonl: str, output_dir: str, batch_size: int | None) -> None:
    """TRL's GRPOTrainer on the GRPO recipe's work: the same model, prompts, routing reward (TRL passes the
    ``team`` column to it), completions per step and per prompt, completion length, sampling temperature and
    top_p, loss type, reward scaling, clipping, LoRA settings with dropout off, learning rate, weight decay and
    logging interval, beta 0, one epoch, generation by transformers (``use_vllm=False``), float32 on a CPU,
    activation checkpointing off as the recipe runs, no evaluation. Its sampling (``_generate``) and scoring
    (``_calculate_rewards``) are timed as the recipe's are. ``trl_grpo_long`` is ``bench/long.py --recipe grpo``'s:
    the model, reward (a .py file's ``varied``) and completion length in ``BENCH_LONG_MODEL``, ``BENCH_LONG_REWARD``
    and ``BENCH_LONG_COMPLETION``, activation checkpointing on (TRL's default)."""
    from peft import LoraConfig
    from trl import GRPOConfig, GRPOTrainer

    from finetune.data.embedded.support_chats import routing_reward
    from finetune.models.loading import default_chat_model_path

    recipe = recipe_module("grpo")
    defaults, options = recipe.DEFAULTS, recipe.GRPOArguments(reward_funcs=[recipe.DEFAULT_REWARD])
    model, reward = default_chat_model_path(), routing_reward
    settings = {"gradient_checkpointing": False, "max_completion_length": defaults["max_completion_length"]}
    if kind == "trl_grpo_long":
        model, settings = os.environ["BENCH_LONG_MODEL"], {"max_completion_length": int(os.environ[
            "BENCH_LONG_COMPLETION"])}
        reward = module_from(os.environ["BENCH_LONG_REWARD"]).varied
    args = GRPOConfig(output_dir=output_dir,
                      per_device_train_batch_size=batch_size or defaults["per_device_train_batch_size"],
                      num_generations=defaults["num_generations"], temperature=options.temperature,
                      top_p=options.top_p, loss_type=options.loss_type, scale_rewards=options.scale_rewards,
                      epsilon=options.epsilon, beta=0.0, learning_rate=defaults["learning_rate"],
                      weight_decay=RECIPE.weight_decay, num_train_epochs=1, seed=SEED, bf16=torch.cuda.is_available(),
                      save_strategy="no", report_to="none", logging_steps=defaults["logging_steps"], **settings)
    lora = LoraConfig(r=options.lora_r, lora_alpha=options.lora_alpha, lora_dropout=0.0,
                      target_modules=options.lora_target_modules, task_type="CAUSAL_LM")
    trainer = GRPOTrainer(model=model, reward_funcs=reward, args=args,
                          train_dataset=datasets.load_dataset("json", data_files=train_jsonl, split="train"),
                          peft_config=lora)
    probe.time_phase(GRPOTrainer, "_generate", "generation",
                     lambda args, result: result[1] if args[0].model.training else None)
    probe.time_phase(GRPOTrainer, "_calculate_rewards", "scoring")
    trainer.train()


TOOL_TURNS_ALLOWANCE = 96
"""TRL counts the tool turns' tokens (a result with the template's markup about it, 30 to 40 tokens here) in an
episode's ``max_completion_length`` and ends an episode whose next result would not fit; the recipe counts only
sampled tokens. TRL's budget is the recipe's plus room for two tool turns and more, so that its episodes are cut
no sooner than the recipe's."""


def trl_agent(train_jsonl: str, output_dir: str, model: str, eval_jsonl: str) -> None:
    """TRL's GRPOTrainer with ``tools=`` on the agent suite's work (``suites.AGENT_FLAGS``): the same start model
    (its tokenizer carries the qwen2_5 template, for which TRL sets the response template that parses calls),
    tickets, tool, reward, episodes per step and per ticket, completion budget over all turns, no limit on turns,
    sampling, loss, LoRA settings with dropout off, learning rate 1e-4 and beta 0, as ``trl_grpo`` sets them. Its
    ``_generate`` (sampling and the tool loop) and scoring are timed as the recipe's are. Then the trained adapter's
    held-out success in another process (``agent_held_out``), not counted in this one's memory."""
    import subprocess

    from peft import LoraConfig
    from trl import GRPOConfig, GRPOTrainer

    from finetune.data.embedded.order_tickets import lookup_order, resolved

    recipe = recipe_module("grpo")
    options = recipe.GRPOArguments(reward_funcs=[recipe.DEFAULT_REWARD])
    flags = suite_flags()
    args = GRPOConfig(output_dir=output_dir, per_device_train_batch_size=int(flags["--per_device_train_batch_size"]),
                      num_generations=int(flags["--num_generations"]),
                      max_completion_length=int(flags["--max_completion_length"]) + TOOL_TURNS_ALLOWANCE,
                      max_tool_calling_iterations=None, temperature=options.temperature,
                      top_p=options.top_p, loss_type=options.loss_type, scale_rewards=options.scale_rewards,
                      epsilon=options.epsilon, beta=0.0, learning_rate=float(flags["--learning_rate"]),
                      weight_decay=RECIPE.weight_decay, num_train_epochs=1, seed=SEED, bf16=torch.cuda.is_available(),
                      gradient_checkpointing=False, save_strategy="no", report_to="none",
                      logging_steps=int(flags["--logging_steps"]))
    lora = LoraConfig(r=options.lora_r, lora_alpha=options.lora_alpha, lora_dropout=0.0,
                      target_modules=options.lora_target_modules, task_type="CAUSAL_LM")
    trainer = GRPOTrainer(model=model, reward_funcs=resolved, args=args, tools=[lookup_order],
                          train_dataset=datasets.load_dataset("json", data_files=train_jsonl, split="train"),
                          processing_class=AutoTokenizer.from_pretrained(model), peft_config=lora)
    probe.time_phase(GRPOTrainer, "_generate", "generation",
                     lambda args, result: result[1] if args[0].model.training else None)
    probe.time_phase(GRPOTrainer, "_calculate_rewards", "scoring")
    trainer.train()
    adapter = Path(output_dir, "adapter")
    trainer.model.save_pretrained(adapter)
    AutoTokenizer.from_pretrained(model).save_pretrained(adapter)  # as it was: TRL sets a response template on its own
    subprocess.run([sys.executable, __file__, "agent_held_out", train_jsonl, output_dir, "--model_name_or_path",
                    str(adapter), "--eval_file", eval_jsonl], check=True)


def suite_flags() -> dict[str, str]:
    """The agent suite's recipe flags that take a value, by name."""
    from suites import AGENT_FLAGS

    return dict(zip(AGENT_FLAGS[::2], AGENT_FLAGS[1::2], strict=True))


def agent_held_out(train_jsonl: str, output_dir: str, adapter: str, eval_jsonl: str) -> None:
    """``all_results.json`` in ``output_dir`` with the held-out success (``eval_reward``) and tool calls of
    ``adapter`` (folded into its base) on ``eval_jsonl``: the GRPO recipe's evaluation, greedy episodes with the
    live tool, as the recipe's side gets it."""
    from sft_default import recipe_metrics
    from suites import AGENT_FLAGS

    metrics = recipe_metrics("grpo", "GRPOArguments", "GRPOTask",
                             ["--train_file", train_jsonl, "--validation_file", eval_jsonl, *AGENT_FLAGS,
                              "--model_name_or_path", adapter])
    Path(output_dir, "all_results.json").write_text(json.dumps(metrics))


def sentence_transformers_embed(kind: str, train_jsonl: str, output_dir: str, eval_jsonl: str, seed: int) -> None:
    """sentence-transformers' trainer on the embedding recipe's work: the same model, pairs, loss (scale 20),
    learning rate, weight decay, clipping, linear schedule, sequence limit and global batch, one epoch, its own
    batch sampler and collator (which tokenizes each batch); ``st_cached_mnrl_large`` at the recipe's large batch
    in mini-batches of the recipe's micro-batch. Then the held-out retrieval of the recipe's metric, from its
    ``encode``, into ``all_results.json``."""
    from embed_default import held_out_retrieval
    from sentence_transformers import (
        SentenceTransformer,
        SentenceTransformerTrainer,
        SentenceTransformerTrainingArguments,
        losses,
    )
    from suites import EMBED_BATCH, EMBED_LARGE_BATCH

    recipe = recipe_module("embed")
    model = SentenceTransformer(default_model_path(), device="cuda" if torch.cuda.is_available() else "cpu")
    model.max_seq_length = MAX_LENGTH
    cached = kind == "st_cached_mnrl_large"
    loss = (losses.CachedMultipleNegativesRankingLoss(model, mini_batch_size=EMBED_BATCH) if cached
            else losses.MultipleNegativesRankingLoss(model))
    args = SentenceTransformerTrainingArguments(
        output_dir=output_dir, per_device_train_batch_size=EMBED_LARGE_BATCH if cached else EMBED_BATCH,
        learning_rate=recipe.DEFAULTS["learning_rate"], weight_decay=RECIPE.weight_decay,
        max_grad_norm=RECIPE.max_grad_norm, lr_scheduler_type="linear", num_train_epochs=1, seed=seed,
        bf16=torch.cuda.is_available(), save_strategy="no", report_to="none", logging_steps=10)
    trainer = SentenceTransformerTrainer(model=model, args=args, loss=loss,
                                         train_dataset=datasets.load_dataset("json", data_files=train_jsonl,
                                                                             split="train"))
    trainer.data_collator = CountingTextsCollator(trainer.data_collator)
    trainer.train()
    held_out = datasets.load_dataset("json", data_files=eval_jsonl, split="train")
    scores = held_out_retrieval(model, held_out["anchor"], held_out["positive"])
    Path(output_dir, "all_results.json").write_text(json.dumps({f"eval_{k}": v for k, v in scores.items()}))


def main(kind: str, train_csv: str, output_dir: str, seed: int, chat_batch_size: int | None,
         eval_file: str | None, model: str | None) -> None:
    if kind == "agent_held_out":
        agent_held_out(train_csv, output_dir, model, eval_file)
        return
    probe.install()
    if kind == "trl_agent":
        trl_agent(train_csv, output_dir, model, eval_file)
        return
    if kind.startswith("st_"):
        sentence_transformers_embed(kind, train_csv, output_dir, eval_file, seed)
        return
    if kind == "trainer_ner":
        trainer_ner(output_dir, seed)
        return
    if kind.startswith("trl_grpo"):
        trl_grpo(kind, train_csv, output_dir, chat_batch_size)
        return
    if kind.startswith("trl_dpo"):
        trl_dpo(kind, train_csv, output_dir, chat_batch_size, eval_file)
        return
    if kind.startswith("trl_"):
        trl_sft(kind, train_csv, output_dir, chat_batch_size, eval_file)
        return
    torch.manual_seed(SEED)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    bf16 = device.type == "cuda"
    if kind in ("loop_sft", "loop_dpo"):
        (loop_sft if kind == "loop_sft" else loop_dpo)(train_csv, chat_batch_size, device, bf16)
        return
    tokenizer = AutoTokenizer.from_pretrained(default_model_path())
    raw = datasets.load_dataset("csv", data_files=train_csv, split="train")
    train = raw.map(lambda batch: tokenizer(batch["text"], truncation=True, max_length=MAX_LENGTH),
                    batched=True, remove_columns=["text"]).rename_column("label", "labels")
    model = AutoModelForSequenceClassification.from_pretrained(
        default_model_path(), num_labels=len(set(train["labels"]))
    )
    collate = CountingCollator(DataCollatorWithPadding(tokenizer, return_tensors="pt"))

    if kind.startswith("loop"):
        train = train.with_format(None).to_list()  # plain rows: what a hand-written loop indexes
        if kind == "loop_same_optimizer":
            batches = GlobalBatchSampler([len(row["input_ids"]) for row in train], BATCH_SIZE, 1, seed=SEED,
                                         group_by_length=True)
        else:
            generator = torch.Generator().manual_seed(SEED)
            batches = torch.utils.data.BatchSampler(
                torch.utils.data.RandomSampler(train, generator=generator), BATCH_SIZE, drop_last=False
            )
        hand_written_loop(model, train, collate, batches, device, bf16, recipe_optimizer=kind == "loop_same_optimizer")
        return

    # transformers 5 names the sampler with train_sampling_strategy; 4.x had group_by_length.
    if kind == "trainer_grouped":
        fields = TrainingArguments.__dataclass_fields__
        grouped = ({"train_sampling_strategy": "group_by_length"} if "train_sampling_strategy" in fields
                   else {"group_by_length": True})
    else:
        grouped = {}
    args = TrainingArguments(
        output_dir=output_dir,
        per_device_train_batch_size=BATCH_SIZE,
        learning_rate=LEARNING_RATE,
        num_train_epochs=1,
        seed=SEED,
        bf16=bf16,
        save_strategy="no",
        report_to="none",
        **grouped,
    )
    Trainer(model=model, args=args, train_dataset=train, processing_class=tokenizer, data_collator=collate).train()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("kind")
    parser.add_argument("data_file")
    parser.add_argument("output_dir")
    parser.add_argument("--seed", type=int, default=SEED)
    parser.add_argument("--per_device_train_batch_size", type=int, default=None)
    parser.add_argument("--eval_file", default=None)
    parser.add_argument("--model_name_or_path", default=None)
    cli = parser.parse_args()
    main(cli.kind, cli.data_file, cli.output_dir, cli.seed, cli.per_device_train_batch_size, cli.eval_file,
         cli.model_name_or_path)
