"""Causal language models in the loop: packed or padded batches, label log-probabilities computed in chunks of
positions, evaluation and greedy replies within a token budget.

The output layer (``model.get_output_embeddings()``) is never applied to a whole batch at once: the model's
forward runs with it projecting no position, and the log-probabilities of the labels are computed from its input
(the last hidden states) a chunk of positions at a time, each chunk's logits recomputed in the backward pass
instead of kept. A batch of B rows of T tokens then holds one chunk's float32 logits, not B x T x vocabulary.
"""

from __future__ import annotations

import contextlib
import inspect
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import jinja2
import torch
import transformers
from torch.utils.checkpoint import checkpoint
from transformers.cache_utils import DynamicLayer

from finetune.checkpointing.checkpoint import save_model
from finetune.config import arg
from finetune.data.batching import pad_token_id
from finetune.distributed.ddp import all_reduce_max, unwrap
from finetune.distributed.fsdp import is_sharded
from finetune.environment import LaunchEnvironment
from finetune.errors import UserError
from finetune.models.estimate import note_logits
from finetune.models.loading import default_chat_model_path, from_pretrained, load_model
from finetune.models.lora import LoraArguments, add_lora, save_adapter
from finetune.models.memory import four_bit_loading, keep_four_bit_trainable, require_bitsandbytes
from finetune.task import ModelCardInfo
from finetune.tasks.chat import (
    IGNORE,
    end_of_turn_ids,
    require_chat_template,
    template_with_defaults,
    write_generations,
)

__all__ = ["CausalLMArguments", "ChatModelArguments", "ChatTask", "EvalReplies", "adapt_chat_model", "cache_keyword",
           "chat_model_card", "check_output_layer", "decode_replies", "greedy_replies", "is_adapter_folder",
           "label_log_probs", "language_model_collators", "load_causal_lm", "load_chat_tokenizer", "plain_cache",
           "reply_log_probs", "run_precision", "save_chat_model", "shared_prompt_log_probs", "split_by_tokens",
           "summed_log_probs", "summed_reply_log_probs"]

LOGITS_PER_CHUNK = 2**24
"""Logits computed at once (64 MiB in float32): a chunk holds ``LOGITS_PER_CHUNK // vocabulary`` positions."""


@dataclass
class CausalLMArguments:
    """Options of every causal-LM recipe (chat, preference tuning); a recipe's own dataclass inherits them."""

    per_device_eval_max_tokens: int = arg(
        16384, "Most tokens in one evaluation forward pass on each process: rows x their longest row (for replies "
               "with --eval_generate, rows x (longest prompt + --max_new_tokens)). An evaluation batch of "
               "--per_device_eval_batch_size rows runs in as many passes as that takes; a longer row runs alone. "
               "Results do not depend on it.")

    def __post_init__(self):
        if self.per_device_eval_max_tokens < 1:
            raise UserError(f"--per_device_eval_max_tokens is {self.per_device_eval_max_tokens}; it must be a "
                            "positive whole number")


@dataclass
class ChatModelArguments(CausalLMArguments, LoraArguments):
    """Options of the recipes that tune a chat model with LoRA (chat, preference tuning)."""

    chat_template: str | None = arg(None, "A Jinja chat template file, or the name of one TRL ships (qwen2_5, "
                                          "llama3_1, ...), in place of the model's own (or for one that has none).")
    chat_template_kwargs: str | None = arg(None, "Options for the chat template at every rendering, as JSON: "
                                                 "'{\"enable_thinking\": false}' (the evaluation's prompts too).")
    use_lora: bool = arg(True, "Train LoRA adapters only; --no_use_lora fine-tunes every weight.")
    dtype: Literal["float32", "bfloat16", "float16"] = arg(
        "float32", "The dtype of the frozen base weights under LoRA (TRL's --dtype): bfloat16 halves their memory, "
                   "while the adapter trains in float32. Without LoRA every weight trains, in float32.")
    load_in_4bit: bool = arg(False, "QLoRA: hold the frozen base's linear layers in 4-bit NF4 with double "
                                    "quantization (bitsandbytes: pip install -e \".[qlora]\"), about an eighth of "
                                    "their float32 memory; the adapter trains in float32 on top. LoRA only.")
    bnb_4bit_compute_dtype: Literal["float32", "bfloat16", "float16"] | None = arg(
        None, "The dtype the 4-bit layers compute in (default: --mixed_precision's, float32 without).")
    merge_lora: bool = arg(False, "Also save OUTPUT/merged: the base model with the adapter folded in.")
    eval_generate: int | None = arg(None, "Greedy replies for the first N validation conversations at each "
                                          "evaluation (default: all of the default data's, else none).")
    max_new_tokens: int = arg(48, "Longest generated reply.")

    def __post_init__(self):
        super().__post_init__()
        self.check_lora()
        if self.dtype != "float32" and not self.use_lora:
            raise UserError(f"--dtype {self.dtype} with --no_use_lora would train every weight in {self.dtype}, where "
                            "small updates round away; train in float32 with --mixed_precision bf16, or with LoRA")
        if self.load_in_4bit and not self.use_lora:
            raise UserError("--load_in_4bit with --no_use_lora: 4-bit weights cannot train; train LoRA adapters on "
                            "the 4-bit base (leave out --no_use_lora), or leave out --load_in_4bit")
        if self.load_in_4bit:
            require_bitsandbytes()
        try:
            options = json.loads(self.chat_template_kwargs or "{}")
        except json.JSONDecodeError as err:
            raise UserError(f"--chat_template_kwargs is not JSON ({err}); give an object such as "
                            '\'{"enable_thinking": false}\'') from None
        if not isinstance(options, dict):
            raise UserError(f"--chat_template_kwargs is {type(options).__name__}; give a JSON object of options")
        unnamed = [repr(name) for name in options if not name.isidentifier()]
        if unnamed:
            raise UserError(f"--chat_template_kwargs names {', '.join(unnamed)}: give options by the names the "
                            "template reads (letters, digits and _)")
        try:  # Jinja's own words (true, none, not, ...) name no variable the saved template could set
            jinja2.Environment().parse(template_with_defaults("", options))
        except jinja2.TemplateSyntaxError:
            raise UserError(f"--chat_template_kwargs names one of Jinja's own words ({', '.join(options)}): give "
                            "options by the names the template reads") from None

    def loading_options(self, cfg) -> dict:
        """``from_pretrained``'s keyword arguments for the model: its dtype (``--dtype``), and under
        ``--load_in_4bit`` the 4-bit base computing in ``--bnb_4bit_compute_dtype`` (else the run's mixed
        precision).

        Raises:
            UserError: ``--load_in_4bit`` with ``--fsdp`` or under Accelerate's FSDP config.
        """
        if not self.load_in_4bit:
            return {"dtype": getattr(torch, self.dtype)}
        if cfg.fsdp or LaunchEnvironment.read().accelerate_fsdp:
            how = "--fsdp" if cfg.fsdp else "Accelerate's FSDP config"
            raise UserError(f"--load_in_4bit with {how}: FSDP cannot shard 4-bit weights here; launch without "
                            "sharding (each process holds the 4-bit base, a quarter of bfloat16's size)")
        half = {"bf16": "bfloat16", "fp16": "float16"}.get(run_precision(cfg), "float32")
        compute = getattr(torch, self.bnb_4bit_compute_dtype or half)
        return {"dtype": getattr(torch, self.dtype), **four_bit_loading(compute)}

    @property
    def template_options(self) -> dict:
        """``--chat_template_kwargs`` as the keyword arguments every rendering gets."""
        return json.loads(self.chat_template_kwargs or "{}")


def chat_model_card(what: str, use_lora: bool) -> ModelCardInfo:
    """The model card's part for a chat model fine-tuned for ``what`` from the default chat model: an adapter
    loaded with peft, or a model for transformers' pipeline."""
    return ModelCardInfo(
        pipeline_tag="text-generation", what=what, default_base_model="HuggingFaceTB/SmolLM2-135M-Instruct",
        library_name="peft" if use_lora else "transformers",
        usage=('from peft import AutoPeftModelForCausalLM\n'
               'model = AutoPeftModelForCausalLM.from_pretrained("{repo_id}")' if use_lora else
               'from transformers import pipeline\nchat = pipeline("text-generation", model="{repo_id}")'))


def load_chat_tokenizer(cfg, chat_template: str | None, template_options: dict | None = None):
    """The tokenizer of ``--model_name_or_path`` (default: the default chat model) with a chat template, which
    takes ``template_options`` (``--chat_template_kwargs``) wherever its caller gives none: every save of the run
    (the model, a checkpoint pushed to the Hub, a merged folder) then prompts the model as it trained, for
    transformers, vLLM, llama.cpp and Ollama alike.

    Raises:
        UserError: it cannot be loaded, or has no chat template and ``chat_template`` (a file) gives none.
    """
    model_path = cfg.model_name_or_path or default_chat_model_path()
    tokenizer = from_pretrained(transformers.AutoTokenizer, model_path, trust_remote_code=cfg.trust_remote_code)
    require_chat_template(tokenizer, chat_template, model_path)
    if template_options:
        tokenizer.chat_template = template_with_defaults(tokenizer.chat_template, template_options)
    if tokenizer.pad_token is None:  # Llama 3.x, Mistral v0.3: pad batches and generation with the end of text, as TRL
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def load_causal_lm(name_or_path: str, **kwargs):
    """The causal LM at ``name_or_path`` in float32 (``finetune.models.loading.load_model``); a peft adapter folder
    (a chat run's output) gives its base model with the adapter folded into the weights.

    Raises:
        UserError: the model, or an adapter's base model, cannot be loaded.
    """
    if not is_adapter_folder(name_or_path):
        return load_model(transformers.AutoModelForCausalLM, name_or_path, **kwargs)
    from peft import PeftConfig, PeftModel

    folder = os.path.expanduser(name_or_path)
    base_path = PeftConfig.from_pretrained(folder).base_model_name_or_path
    try:
        base = load_model(transformers.AutoModelForCausalLM, base_path, **kwargs)
    except UserError as err:
        raise UserError(f"--model_name_or_path {name_or_path} is an adapter for {base_path}, which cannot be loaded "
                        f"({err}); give the base model's folder as base_model_name_or_path in adapter_config.json"
                        ) from None
    return PeftModel.from_pretrained(base, folder).merge_and_unload()


def is_adapter_folder(name_or_path: str) -> bool:
    """Whether ``name_or_path`` is a local folder holding a peft adapter (``adapter_config.json``)."""
    return (Path(os.path.expanduser(name_or_path)) / "adapter_config.json").is_file()


class ChatTask:
    """What the chat recipes' tasks share: the tokenizer with its chat template, the data cache's options, the
    model card, and the save (the adapter, or without LoRA the whole model). A subclass names ``what`` it tunes for."""

    what: str

    def __init__(self, args: ChatModelArguments):
        self.args = args
        self.card = chat_model_card(self.what, args.use_lora)

    def load_tokenizer(self, cfg):
        return load_chat_tokenizer(cfg, self.args.chat_template, self.args.template_options)

    def data_options(self, cfg):  # the chat template is the tokenizer's, which the key hashes
        return {"max_seq_length": cfg.max_seq_length, "chat_template_kwargs": self.args.template_options}

    def save(self, model, state_dict, tokenizer, output_dir):
        save_chat_model(model, state_dict, tokenizer, output_dir, self.args)


def adapt_chat_model(model, args: ChatModelArguments, tokenizer) -> tuple[torch.nn.Module, str]:
    """``model`` with LoRA adapters unless ``--no_use_lora``, its output layer checked, and its generation stopping
    where the chat template ends a reply (the saved ``generation_config.json`` too); and how the start-up line names
    the adapters ("" without)."""
    model.generation_config.eos_token_id = end_of_turn_ids(tokenizer, args.template_options)
    if args.load_in_4bit:
        keep_four_bit_trainable(model)
    if args.use_lora:
        model = add_lora(model, args.lora_r, args.lora_alpha, args.lora_dropout, args.lora_target_modules)
    check_output_layer(model)
    if not args.use_lora:
        return model, ""
    described = f"LoRA r={args.lora_r} on {args.lora_target_modules}"
    if args.load_in_4bit:
        compute = str(model.config.quantization_config.bnb_4bit_compute_dtype).removeprefix("torch.")
        described += f" over the base's linear layers in 4-bit NF4, computing in {compute}"
    return model, described


class EvalReplies:
    """Greedy replies to the first validation prompts at each evaluation (``count``, else ``--eval_generate``; by
    default all of them where the data has a check of its replies, else none): generated in token budgets, decoded,
    scored by the data's ``score_replies`` against ``answers`` where it has one (the embedded data), and written with
    their prompts and reference replies to ``eval_generations.jsonl``.

    ``validation`` is the split tokenized with generation prompts (``prompt_ids``, ``prompt_messages``,
    ``reference``).
    """

    def __init__(self, validation, tokenizer, args: ChatModelArguments, answers: list | None = None,
                 score_replies=None, count: int | None = None):
        if count is None:
            count = args.eval_generate if args.eval_generate is not None else len(validation) if answers else 0
        self.prompted = validation.select(range(min(count, len(validation))))
        self.prompts = list(self.prompted["prompt_ids"])
        self.tokenizer, self.args, self.answers, self.score_replies = tokenizer, args, answers, score_replies

    def generate(self, model, index: torch.Tensor) -> torch.Tensor:
        """The replies of an evaluation batch's rows ``index`` (``greedy_replies``), to gather with its outputs."""
        return greedy_replies(model, index, self.prompts, self.tokenizer, self.args.max_new_tokens,
                              self.args.per_device_eval_max_tokens)

    def texts(self, replies: torch.Tensor) -> list[str]:
        """The gathered ``replies`` of the prompted rows, as text."""
        return decode_replies(replies, len(self.prompts), self.tokenizer)

    def metrics(self, replies: torch.Tensor) -> dict[str, float]:
        texts = self.texts(replies)
        return self.score_replies(texts, self.answers) if self.answers and texts else {}

    def write(self, replies: torch.Tensor, output_dir: str) -> None:
        if self.prompts:
            write_generations(os.path.join(output_dir, "eval_generations.jsonl"), self.prompted, self.texts(replies))


def save_chat_model(model, state_dict: dict, tokenizer, output_dir: str, args: ChatModelArguments) -> None:
    """The adapter (with ``--merge_lora`` the merged model too) or, without LoRA, the whole model; each with the
    ``generation_config.json`` that stops at the template's end of turn."""
    if args.use_lora:
        save_adapter(model, state_dict, tokenizer, output_dir, merge=args.merge_lora)
        # Loaders take the base model's generation config, which may not stop there: this copy is for generate()
        model.generation_config.save_pretrained(output_dir)
    else:
        save_model(model, state_dict, tokenizer, output_dir)


def run_precision(cfg) -> str:
    """The run's mixed precision as the runtimes take it: the flag, else accelerate launch's configuration."""
    return cfg.mixed_precision or os.environ.get("ACCELERATE_MIXED_PRECISION", "no")


def language_model_collators(tokenizer, packing: bool | None, half_precision: bool = False) -> tuple:
    """``(train collate, eval collate, packed, flash)`` for tokenized rows with labels.

    ``packing=None`` takes the faster batches for the device: packed where flash-attention's variable-length
    kernels run (a GPU with flash-attn installed, and ``half_precision``: they take no float32, in which the
    weights load), else padded. Without those kernels a packed row's
    attention spans the whole row under a block mask (SDPA's math path on a CPU), slower than padded batches
    grouped by length (``bench/results/sft.md``). ``flash`` says the model should load with
    ``attn_implementation="flash_attention_2"``. Evaluation batches are always padded, one row per example.
    """
    flash_available = (half_precision and torch.cuda.is_available()
                       and transformers.utils.is_flash_attn_2_available())
    packed = flash_available if packing is None else packing
    flash = packed and flash_available
    padded = transformers.DataCollatorForSeq2Seq(tokenizer, label_pad_token_id=IGNORE)
    # Packed rows restart position ids at each example; transformers masks attention from them (with
    # flash-attention, from the sequence lengths the collator adds).
    train = transformers.DataCollatorWithFlattening(return_flash_attn_kwargs=flash) if packed else padded
    return train, padded, packed, flash


def label_log_probs(model, batch: dict, chunk_size: int | None = None, temperature: float = 1.0
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(log_probs, labels)``, both ``[batch, length - 1]``: each position's float32 log-probability of the next
    token's label (from logits divided by ``temperature``, as sampling at it draws), and that label; positions
    labelled ``IGNORE`` have log-probability 0. ``batch`` loses its labels.

    ``model`` may be wrapped (DDP): its own forward runs, so that DDP's gradient hooks work; its output layer is
    then applied to the labelled positions only, ``chunk_size`` of them at a time (default: as many as hold
    ``LOGITS_PER_CHUNK`` logits), each chunk's logits recomputed in the backward pass instead of kept.
    """
    next_labels = batch.pop("labels")[:, 1:]
    inner = unwrap(model)
    head = inner.get_output_embeddings()
    with _output_layer_input(head) as seen:
        # No KV cache: with one, transformers skips the mask that keeps packed examples apart.
        model(**batch, use_cache=False)
    if "hidden" not in seen:
        raise UserError(f"{type(inner).__name__} never calls its output layer (get_output_embeddings()) in its "
                        "forward; the chat recipes need a model that does")
    labelled = next_labels != IGNORE
    log_probs = _head_log_probs(inner, seen, seen["hidden"][:, :-1][labelled], next_labels[labelled], chunk_size,
                                temperature)
    return torch.zeros(next_labels.shape, device=log_probs.device).masked_scatter(labelled, log_probs), next_labels


def _head_log_probs(model, seen: dict, hidden: torch.Tensor, targets: torch.Tensor, chunk_size: int | None = None,
                    temperature: float = 1.0) -> torch.Tensor:
    """``[positions]``: the float32 log-probability of each target from the hidden state before it, ``model``'s
    output layer applied under the autocast state ``seen`` noted (``_output_layer_input``), ``chunk_size``
    positions at a time, each chunk's logits recomputed in the backward pass instead of kept."""
    head = model.get_output_embeddings()
    device_type, dtype, autocast = seen["autocast"]
    transform = _logit_transform(model.config.get_text_config())

    def log_probs_of(positions: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        with torch.autocast(device_type, dtype=dtype, enabled=autocast):  # as the model's forward applies its head
            logits = head(positions)
        return -torch.nn.functional.cross_entropy(transform(logits.float()) / temperature, labels, reduction="none")

    size = chunk_size or max(1, LOGITS_PER_CHUNK // head.weight.shape[0])
    chunks = zip(hidden.split(size), targets.split(size), strict=True)
    if torch.is_grad_enabled():
        recast = autocast and head.weight.dtype != dtype  # in each chunk's recompute, outside the forward's cast cache
        note_logits(len(hidden), size, head.weight.shape[0], head.weight.numel() * dtype.itemsize if recast else 0)
        pieces = [checkpoint(log_probs_of, h, y, use_reentrant=False) for h, y in chunks]
    else:
        pieces = [log_probs_of(h, y) for h, y in chunks]
    # With no position labelled, one empty chunk still connects the result to the model (backward works).
    return torch.cat(pieces)


def shared_prompt_log_probs(model, batch: dict, max_tokens: int) -> torch.Tensor:
    """``[prompts, k]``: the summed float32 log-probabilities of each prompt's ``k`` replies, what
    ``summed_log_probs`` gives for the rows prompt + reply, with each prompt run once. For evaluation, under
    ``no_grad``; ``model`` unwrapped.

    ``batch``: right-padded ``prompt_ids`` and ``prompt_mask`` ``[prompts, P]``, and ``reply_ids`` and ``reply_mask``
    ``[prompts x k, R]``, each prompt's replies in turn. A prompt's KV cache, repeated, serves its replies, which
    read on from the prompt's positions; a reply's first token is scored from the prompt's last hidden state. The
    prompts run in groups whose rows x ``k`` x (prompt + longest reply) stays within ``max_tokens`` (or alone).
    """
    prompt_mask, reply_mask = batch["prompt_mask"], batch["reply_mask"]
    k = len(reply_mask) // len(prompt_mask)
    widths = prompt_mask.sum(1) + reply_mask.sum(1).view(-1, k).amax(1)
    groups = _token_budget_groups(widths.tolist(), max(1, max_tokens // k))
    passes_behind = _passes_behind(model, len(groups), prompt_mask.device)
    sums = [_shared_prompt_pass(model, batch, group, k) for group in groups + groups[:1] * passes_behind]
    return torch.cat(sums[:len(groups)])


def _shared_prompt_pass(model, batch: dict, rows: slice, k: int) -> torch.Tensor:
    """``shared_prompt_log_probs`` of the prompts ``rows``."""
    reply_rows = slice(rows.start * k, rows.stop * k)
    part = {"prompt_ids": batch["prompt_ids"][rows], "prompt_mask": batch["prompt_mask"][rows],
            "reply_ids": batch["reply_ids"][reply_rows], "reply_mask": batch["reply_mask"][reply_rows]}
    return summed_reply_log_probs(model, part, k)


def summed_reply_log_probs(model, batch: dict, k: int) -> torch.Tensor:
    """``[prompts, k]``: the summed float32 log-probabilities of each prompt's ``k`` replies (``batch`` as
    ``shared_prompt_log_probs`` takes it), in one forward pass over the prompts and one over their replies
    (``reply_log_probs``); ``model`` may be wrapped (DDP) and train."""
    prompt_of = torch.arange(len(batch["prompt_ids"]), device=batch["prompt_ids"].device).repeat_interleave(k)
    return reply_log_probs(model, {**batch, "prompt_of": prompt_of}).sum(1).view(-1, k)


def reply_log_probs(model, batch: dict, temperature: float = 1.0) -> torch.Tensor:
    """``[replies, R]``: the float32 log-probability of each reply token given its prompt and the reply before it
    (0 at padding), what ``label_log_probs`` gives for the rows prompt + reply, with each prompt run through the
    model once and its KV cache copied to its replies: GRPO's completions share their prompt G times.

    ``batch``: right-padded ``prompt_ids`` and ``prompt_mask`` ``[prompts, P]``, right-padded ``reply_ids`` and
    ``reply_mask`` ``[replies, R]``, and ``prompt_of`` ``[replies]``, the row of each reply's prompt. A reply reads
    on from its prompt's positions; its first token is scored from the prompt's last hidden state. ``model`` may
    be wrapped (DDP) and train: its forward runs twice, and the gradient reaches the prompt's pass through the
    copied cache. Where its layers are recomputed in the backward pass (activation checkpointing), they keep no
    cache, and where its cache is not plain (``plain_cache``: a sliding window), the padding after a short prompt
    would count as context: each reply then runs as one row with its prompt.
    """
    inner = unwrap(model)
    prompt_ids, prompt_mask = _unpadded(batch["prompt_ids"], batch["prompt_mask"])
    reply_ids, reply_mask, prompt_of = *_unpadded(batch["reply_ids"], batch["reply_mask"]), batch["prompt_of"]
    if getattr(inner, "is_activation_checkpointing", False) and inner.training and torch.is_grad_enabled():
        log_probs = _reply_rows_log_probs(model, inner, prompt_ids[prompt_of], prompt_mask[prompt_of], reply_ids,
                                          reply_mask, temperature)
    else:
        log_probs = _shared_prompt_log_probs(model, inner, prompt_ids, prompt_mask, reply_ids, reply_mask, prompt_of,
                                             temperature)
    return torch.nn.functional.pad(log_probs, (0, batch["reply_ids"].shape[1] - reply_ids.shape[1]))


def _shared_prompt_log_probs(model, inner, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor,
                             reply_ids: torch.Tensor, reply_mask: torch.Tensor, prompt_of: torch.Tensor,
                             temperature: float) -> torch.Tensor:
    """``reply_log_probs`` with each prompt run once and its KV cache copied to its replies."""
    head, keyword = inner.get_output_embeddings(), cache_keyword(inner)
    lengths = prompt_mask.sum(1)
    with _output_layer_input(head) as seen:
        outputs = model(input_ids=prompt_ids, attention_mask=prompt_mask, use_cache=True)
    last = seen["hidden"][prompt_of, lengths[prompt_of] - 1]
    cache = getattr(outputs, keyword)
    if not plain_cache(cache):
        del outputs, cache, last
        return _reply_rows_log_probs(model, inner, prompt_ids[prompt_of], prompt_mask[prompt_of], reply_ids,
                                     reply_mask, temperature)
    cache.reorder_cache(prompt_of)
    positions = lengths[prompt_of, None] + torch.arange(reply_ids.shape[1], device=lengths.device)
    with _output_layer_input(head) as seen:
        model(input_ids=reply_ids, attention_mask=torch.cat([prompt_mask[prompt_of], reply_mask], 1),
              position_ids=positions, use_cache=True, **{keyword: cache})
    labelled = reply_mask.bool()
    hidden = torch.cat([last[:, None], seen["hidden"][:, :-1]], 1)[labelled]
    log_probs = _head_log_probs(inner, seen, hidden, reply_ids[labelled], temperature=temperature)
    return torch.zeros(reply_ids.shape, device=log_probs.device).masked_scatter(labelled, log_probs)


def _reply_rows_log_probs(model, inner, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, reply_ids: torch.Tensor,
                          reply_mask: torch.Tensor, temperature: float) -> torch.Tensor:
    """``reply_log_probs`` of replies each given the (right-padded) rows of its prompt, in one forward pass over
    the rows prompt + reply, each reply placed right after its prompt."""
    lengths = prompt_mask.sum(1, keepdim=True)
    reply_columns = lengths + torch.arange(reply_ids.shape[1], device=lengths.device)
    ids = torch.nn.functional.pad(prompt_ids, (0, reply_ids.shape[1])).scatter(1, reply_columns, reply_ids)
    mask = torch.nn.functional.pad(prompt_mask, (0, reply_ids.shape[1])).scatter(1, reply_columns, reply_mask)
    with _output_layer_input(inner.get_output_embeddings()) as seen:
        model(input_ids=ids, attention_mask=mask)
    labelled = reply_mask.bool()
    before = seen["hidden"].gather(1, (reply_columns - 1)[..., None].expand(-1, -1, seen["hidden"].shape[-1]))
    log_probs = _head_log_probs(inner, seen, before[labelled], reply_ids[labelled], temperature=temperature)
    return torch.zeros(reply_ids.shape, device=log_probs.device).masked_scatter(labelled, log_probs)


def _unpadded(ids: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded rows without the padding columns no row needs."""
    width = int(mask.sum(1).max())
    return ids[:, :width], mask[:, :width]


def plain_cache(cache) -> bool:
    """Whether each layer of a KV cache holds one plain tensor of every column it has seen, so that columns may be
    padding: a sliding window counts its columns, padding ones too, and a recurrent state has read the padding."""
    layers = getattr(cache, "layers", None)
    return bool(layers) and all(type(layer) is DynamicLayer for layer in layers)


def cache_keyword(model) -> str:
    """The name of the KV cache in the model's forward and its output: ``cache`` from transformers 5.24 on (where
    ``past_key_values`` still works, with a warning), ``past_key_values`` before."""
    return "cache" if forward_takes(model, "cache") else "past_key_values"


def forward_takes(model, keyword: str) -> bool:
    """Whether the forward of ``model`` (under its adapters, where it has them) names ``keyword``."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return keyword in inspect.signature(base.forward).parameters


@contextlib.contextmanager
def _output_layer_input(head: torch.nn.Module) -> Iterator[dict]:
    """While open, ``head`` projects no position: what it is given (the last hidden states) and the autocast
    state it runs under are noted in the dict yielded instead."""
    seen = {}

    def note_and_skip(module, args):
        hidden, *rest = args
        device_type = hidden.device.type
        seen["hidden"] = hidden
        seen["autocast"] = (device_type, torch.get_autocast_dtype(device_type), torch.is_autocast_enabled(device_type))
        return hidden[..., :0, :], *rest

    handle = head.register_forward_pre_hook(note_and_skip)
    try:
        yield seen
    finally:
        handle.remove()


UNREPRODUCED_LOGIT_FACTORS = ("logits_scaling", "lm_head_multiplier", "output_multiplier")
"""Configuration fields by which some models (Granite, Falcon-H1, ...) scale their logits in their forward."""


def _logit_transform(config):
    """What the model's forward does to its output layer's logits: Cohere's scale, Gemma's soft cap.

    Raises ``UserError`` for a model that scales them otherwise (``UNREPRODUCED_LOGIT_FACTORS``)."""
    factors = [name for name in UNREPRODUCED_LOGIT_FACTORS if getattr(config, name, None) not in (None, 1, 1.0)]
    if factors:
        raise UserError(f"{config.model_type} models scale their logits by {', '.join(factors)}, which the chat "
                        "recipes' chunked log-probabilities do not reproduce; use another model")
    scale = getattr(config, "logit_scale", None)
    cap = getattr(config, "final_logit_softcapping", None)

    def transform(logits: torch.Tensor) -> torch.Tensor:
        if scale is not None:
            logits = logits * scale
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits

    return transform


def check_output_layer(model) -> None:
    """Raise ``UserError`` for a model whose log-probabilities ``label_log_probs`` cannot compute: one without an
    output layer, or one that scales its logits in a way ``_logit_transform`` does not know."""
    if model.get_output_embeddings() is None:
        raise UserError(f"{type(model).__name__} has no output layer (get_output_embeddings()); the chat recipes "
                        "need a causal language model")
    _logit_transform(model.config.get_text_config())


def split_by_tokens(batch: dict, max_tokens: int) -> Iterator[dict]:
    """Consecutive rows of a padded ``batch`` in groups whose rows x longest row stays within ``max_tokens`` (a
    longer row alone), each without the padding columns no row of the group needs."""
    mask = batch["attention_mask"]
    for rows in _token_budget_groups(mask.sum(1).tolist(), max_tokens):
        used = mask[rows].any(0)
        yield {key: values[rows][:, used] if values.dim() == 2 else values[rows] for key, values in batch.items()}


def _token_budget_groups(lengths: list[int], max_tokens: int) -> list[slice]:
    """Consecutive index ranges whose size x longest length stays within ``max_tokens``, or single indices."""
    groups, start, longest = [], 0, 0
    for end, length in enumerate(lengths):
        if end > start and (end + 1 - start) * max(longest, length) > max_tokens:
            groups.append(slice(start, end))
            start, longest = end, 0
        longest = max(longest, length)
    return [*groups, slice(start, len(lengths))] if lengths else groups


def summed_log_probs(model, batch: dict, max_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(sums, counts)``: each row's label log-probabilities summed (float32) and how many labels it has, over
    forward passes of at most ``max_tokens`` tokens (``split_by_tokens``). For evaluation, under ``no_grad``."""
    parts = list(split_by_tokens(batch, max_tokens))
    sums, counts = [], []
    for part in parts:
        log_probs, labels = label_log_probs(model, dict(part))
        sums.append(log_probs.sum(1))
        counts.append((labels != IGNORE).sum(1))
    for _ in range(_passes_behind(model, len(parts), batch["input_ids"].device)):
        label_log_probs(model, dict(parts[0]))
    return torch.cat(sums), torch.cat(counts)


def greedy_replies(model, index: torch.Tensor, prompts: list[list[int]], tokenizer, max_new_tokens: int,
                   max_tokens: int) -> torch.Tensor:
    """Greedy replies for an evaluation batch whose rows are dataset examples ``index``: ``[len(index), L]``.

    Example ``i`` gets a reply when ``i < len(prompts)`` (``prompts[i]``, token ids); every other row, and each
    reply from its end-of-turn token on (the model's ``generation_config.eos_token_id``), is ``IGNORE``. The prompts
    are left-padded into batches of at most ``max_tokens`` tokens, counting each row's ``max_new_tokens`` (a longer
    row alone).
    """
    wanted = [(row, i) for row, i in enumerate(index.tolist()) if i < len(prompts)]
    groups = [wanted[group] for group in
              _token_budget_groups([len(prompts[i]) + max_new_tokens for _, i in wanted], max_tokens)]
    if prompts:  # a process with fewer groups than another decodes a stand-in prompt (generate keeps each in step)
        groups += [[(None, 0)]] * _passes_behind(model, len(groups), index.device)
    pad = pad_token_id(tokenizer)
    stops = torch.tensor(model.generation_config.eos_token_id, device=index.device).view(-1)
    replies = torch.full((len(index), max_new_tokens), IGNORE, device=index.device)
    for group in groups:
        rows, examples = zip(*group, strict=True)
        longest = max(len(prompts[i]) for i in examples)
        ids = torch.tensor([[pad] * (longest - len(prompts[i])) + prompts[i] for i in examples], device=index.device)
        mask = torch.tensor([[0] * (longest - len(prompts[i])) + [1] * len(prompts[i]) for i in examples],
                            device=index.device)
        generated = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_new_tokens,
                                   do_sample=False, pad_token_id=pad)[:, longest:]
        if rows[0] is not None:
            replies[list(rows), :generated.shape[1]] = generated.masked_fill(
                torch.isin(generated, stops).cumsum(1) > 0, IGNORE)
    return replies


def decode_replies(replies: torch.Tensor, count: int, tokenizer) -> list[str]:
    """The text of the first ``count`` rows of ``greedy_replies``' (gathered) output, special tokens left out."""
    return [tokenizer.decode([t for t in row if t != IGNORE], skip_special_tokens=True)
            for row in replies[:count].tolist()]


def _passes_behind(model, passes: int, device: torch.device) -> int:
    """How many forward passes this process must add to run as many as the process with the most: each forward
    of a sharded model gathers weights from every process, so all must run the same number. 0 unsharded."""
    if not is_sharded(model):
        return 0
    return int(all_reduce_max(torch.tensor(passes, device=device))) - passes
