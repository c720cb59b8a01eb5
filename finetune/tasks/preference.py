"""Preference pairs for DPO: reading TRL's formats, tokenizing both replies after the same prompt tokens, batching
pairs so that each prompt runs through the model once for both replies, the DPO losses, and the reference model.

A pair is a prompt (messages), a chosen reply and a rejected one (each one assistant turn). Both replies are found by
position, as ``finetune.tasks.chat`` finds a reply: the prompt rendered with the generation prompt, and the reply as the
stretch the rendering with it adds. The prompt text is tokenized once and each reply's text after it, so both rows
of a pair start with exactly the same prompt token ids, the ones a model reading the prompt with the generation
prompt sees when it replies.
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
import json
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import datasets
import torch
import torch.distributed as dist
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from finetune.checkpointing.checkpoint import tensors_digest
from finetune.checkpointing.files import replacing
from finetune.data.batching import LENGTH, LOSS_UNITS
from finetune.data.cache import TOKEN_IDS, Tokenizing, fitting_prefixes
from finetune.distributed.ddp import all_gather_padded, all_reduce_max, unwrap
from finetune.environment import LaunchEnvironment
from finetune.errors import UserError
from finetune.models.loading import default_chat_model_path
from finetune.tasks.causal_lm import (
    adapt_chat_model,
    is_adapter_folder,
    load_causal_lm,
    run_precision,
    shared_prompt_log_probs,
    summed_reply_log_probs,
)
from finetune.tasks.chat import check_conversation, render_last_reply, rows_tools, without_nulls

__all__ = ["LOSS_TYPES", "PAIR_FIGURES", "Precomputation", "PromptRepliesCollator", "Reference",
           "check_loss_options", "dpo_loss", "load_policy_and_reference", "pair_figures", "pair_log_probs",
           "pair_metrics", "policy_precision", "precomputed_reference", "preference_layout", "preview_pairs",
           "read_pairs", "reference_key", "tokenize_pairs", "write_pair_predictions"]

LOSS_TYPES = ("sigmoid", "ipo", "robust")


def check_loss_options(loss_type: str, beta: float, label_smoothing: float) -> None:
    """Raises ``UserError`` for options ``dpo_loss`` cannot take (as flags: --loss_type, --beta, --label_smoothing)."""
    if loss_type not in LOSS_TYPES:
        raise UserError(f"--loss_type {loss_type!r} is unknown; use one of {', '.join(LOSS_TYPES)}")
    if not 0 < beta < math.inf:
        raise UserError(f"--beta is {beta}; it must be a positive number")
    if not 0 <= label_smoothing < 0.5 or (label_smoothing and loss_type != "robust"):
        raise UserError(f"--label_smoothing is {label_smoothing}; give a share in [0, 0.5) with --loss_type robust, "
                        "or leave it at 0")


def preference_layout(split: datasets.Dataset, name: str) -> tuple[str, ...]:
    """``("prompt", "chosen", "rejected")``, or ``("chosen", "rejected")`` for whole conversations that share
    their leading turns.

    Raises:
        UserError: no ``chosen`` and ``rejected`` columns.
    """
    columns = split.column_names
    if "chosen" in columns and "rejected" in columns:
        return ("prompt", "chosen", "rejected") if "prompt" in columns else ("chosen", "rejected")
    raise UserError(f"{name} data has no 'chosen' and 'rejected' columns (columns: {', '.join(columns)}); give "
                    "preference pairs as prompt, chosen and rejected columns (text, or lists of {role, content} "
                    "messages), or as chosen and rejected conversations that share their earlier turns")


def read_pairs(batch: dict, rows: list[int], layout: tuple[str, ...], name: str
               ) -> list[tuple[list[dict], dict, dict]]:
    """A batch's rows as ``(prompt messages, chosen reply, rejected reply)``, each reply one assistant message.

    Without a ``prompt`` column the prompt is every turn but the last, which must be the same in both.

    Raises:
        UserError: a reply that is empty or not one assistant turn, prompts that differ, an empty prompt, or a
            message that is not a ``{role, content}`` object with a known role and text; the message names the row.
    """
    pairs = []
    for i, row in enumerate(rows):
        where = f"{name} row {row + 1}"
        if "prompt" in layout:
            prompt = _messages(batch["prompt"][i], "user", where, "prompt")
            chosen, rejected = (_reply(_messages(batch[column][i], "assistant", where, column), where, column)
                                for column in ("chosen", "rejected"))
        else:
            whole = {column: _messages(batch[column][i], "assistant", where, column)
                     for column in ("chosen", "rejected")}
            chosen, rejected = (_reply(whole[column][-1:], where, column) for column in ("chosen", "rejected"))
            prompt, other = whole["chosen"][:-1], whole["rejected"][:-1]
            if other != prompt:
                turn = next((t for t, (a, b) in enumerate(zip(prompt, other, strict=False)) if a != b),
                            min(len(prompt), len(other)))
                raise UserError(f"{where}: chosen and rejected differ at message {turn + 1}, before their last turn, "
                                "so they share no prompt; give both the same earlier turns, or use a prompt column")
        if not prompt:
            raise UserError(f"{where}: the prompt is empty; give at least the user's message before the replies")
        for reply in (chosen, rejected):
            check_conversation([*prompt, reply], where)
        pairs.append((prompt, chosen, rejected))
    return pairs


def _messages(value, role: str, where: str, column: str) -> list[dict]:
    """A column's value as messages: text is one message of ``role``."""
    if isinstance(value, str):
        return [{"role": role, "content": value}]
    if not isinstance(value, list):
        raise UserError(f"{where}: {column} is {type(value).__name__}; give text or a list of {{role, content}} "
                        "messages")
    for turn, message in enumerate(value, start=1):
        if not isinstance(message, dict) or "role" not in message:
            raise UserError(f"{where}, {column} message {turn}: not a {{role, content}} object")
    return [without_nulls(message) for message in value]


def _reply(messages: list[dict], where: str, column: str) -> dict:
    if len(messages) != 1 or messages[0]["role"] != "assistant":
        roles = ", ".join(m["role"] for m in messages) or "nothing"
        raise UserError(f"{where}: the {column} reply must be one assistant turn, not {roles}; give it as text or "
                        "as one {role: assistant, content} message")
    content = messages[0].get("content")
    if not messages[0].get("tool_calls") and (not isinstance(content, str) or not content.strip()):
        raise UserError(f"{where}: the {column} reply is empty; give it some text or drop the row")
    return messages[0]


def tokenize_pairs(split: datasets.Dataset, tokenizer, max_length: int, name: str, tokenizing: Tokenizing,
                   generation_prompts: bool = False, template_options: dict | None = None) -> datasets.Dataset:
    """``prompt_ids``, ``chosen_ids`` and ``rejected_ids`` (the replies' tokens, after the prompt's), ``index`` (the
    row), ``cut`` (whether a reply was cut) and ``same`` (whether both replies are the same tokens, after the cut: a
    pair that trains nothing, its loss ln 2 and its gradient zero); one loss unit per pair; ``length`` is the tokens
    the pair puts through the model: its prompt once and both replies.

    A pair with a row longer than ``max_length`` keeps its whole prompt and the start of each reply: both replies
    are cut to the ``max_length - prompt`` tokens left, so each keeps at least one. Each reply is what the model
    would generate after the prompt (``finetune.tasks.chat.render_last_reply``); a row's ``tools`` and the
    ``template_options`` go to the template. With ``generation_prompts`` each row also keeps ``prompt_messages``
    (JSON) and ``reference`` (the chosen reply), for ``write_generations``.

    Raises:
        UserError: a bad row (see ``read_pairs``), a reply the template renders otherwise than it prompts for it, or
            a prompt that leaves no room for a reply within ``max_length``.
    """
    layout = preference_layout(split, name)

    def encode(batch, rows):
        pairs = read_pairs(batch, rows, layout, name)
        tools = rows_tools(batch, rows, name)
        rendered = render_last_reply([[*prompt, reply] for prompt, chosen, rejected in pairs
                                      for reply in (chosen, rejected)],
                                     tokenizer, [f"{name} row {row + 1}" for row in rows for _ in range(2)],
                                     [listed for listed in tools for _ in range(2)], template_options)
        texts = []  # each pair's prompt, chosen reply and rejected reply (both replies follow the same prompt)
        for (prompt, chosen), (_, rejected) in zip(rendered[0::2], rendered[1::2], strict=True):
            texts += [prompt, chosen, rejected]
        texts, cut_lengths = fitting_prefixes(texts, tokenizer, max_length)
        ids = tokenizer(texts, add_special_tokens=False, return_attention_mask=False)["input_ids"]
        out = {"prompt_ids": ids[0::3], "chosen_ids": [], "rejected_ids": [], LENGTH: [], "index": rows, "cut": [],
               "same": []}
        for row, prompt_ids, chosen_ids, rejected_ids, prompt_cut in zip(rows, ids[0::3], ids[1::3], ids[2::3],
                                                                         cut_lengths[0::3], strict=True):
            room = max_length - len(prompt_ids)
            if room < 1:
                takes = f"more than {max_length}" if prompt_cut else len(prompt_ids)
                raise UserError(f"{name} row {row + 1}: the prompt takes {takes} tokens, which leaves no room for a "
                                f"reply within --max_seq_length {max_length}; raise --max_seq_length or shorten the "
                                "prompt")
            out["chosen_ids"].append(chosen_ids[:room])
            out["rejected_ids"].append(rejected_ids[:room])
            out["cut"].append(max(len(chosen_ids), len(rejected_ids)) > room)
            out["same"].append(out["chosen_ids"][-1] == out["rejected_ids"][-1])
            # Batches are grouped by, and padding efficiency counts, what a pair puts through the model.
            out[LENGTH].append(len(prompt_ids) + len(out["chosen_ids"][-1]) + len(out["rejected_ids"][-1]))
        out[LOSS_UNITS] = [1] * len(rows)
        if generation_prompts:
            out["prompt_messages"] = [json.dumps(prompt) for prompt, _, _ in pairs]
            out["reference"] = [chosen.get("content") or "" for _, chosen, _ in pairs]
        return out

    features = {"prompt_ids": TOKEN_IDS, "chosen_ids": TOKEN_IDS, "rejected_ids": TOKEN_IDS,
                "index": datasets.Value("int32"), "cut": datasets.Value("bool"), "same": datasets.Value("bool")}
    if generation_prompts:
        features.update(prompt_messages=datasets.Value("string"), reference=datasets.Value("string"))
    return tokenizing.map(split, encode, name, features)


class PromptRepliesCollator:
    """Pairs to one batch whose prompts each run once for both replies (``pair_log_probs`` in training,
    ``finetune.tasks.causal_lm.shared_prompt_log_probs`` in evaluation and for the precomputed reference):
    ``prompt_ids`` and ``prompt_mask``, one row per pair, and ``reply_ids`` and ``reply_mask``, each pair's chosen
    then rejected reply, all right-padded. ``index`` (one per pair) comes along."""

    def __init__(self, pad_token_id: int):
        self.pad_token_id = pad_token_id

    def __call__(self, pairs: list[dict]) -> dict:
        prompt_ids, prompt_mask = self._padded([p["prompt_ids"] for p in pairs])
        reply_ids, reply_mask = self._padded([p[side] for p in pairs for side in ("chosen_ids", "rejected_ids")])
        return {"prompt_ids": prompt_ids, "prompt_mask": prompt_mask, "reply_ids": reply_ids, "reply_mask": reply_mask,
                "index": torch.tensor([p["index"] for p in pairs], dtype=torch.long)}

    def _padded(self, rows: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
        width = max(map(len, rows))
        ids = torch.tensor([row + [self.pad_token_id] * (width - len(row)) for row in rows], dtype=torch.long)
        return ids, (torch.arange(width) < torch.tensor([len(row) for row in rows])[:, None]).long()


def pair_log_probs(model, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """``(log_probs, counts)``, each ``[pairs, 2]`` (chosen, rejected): the replies' float32 log-probabilities
    summed over their tokens and their token counts, of a ``PromptRepliesCollator`` batch without its ``index``.
    Each prompt runs once and its KV cache serves both replies
    (``finetune.tasks.causal_lm.summed_reply_log_probs``); ``model`` may be wrapped (DDP) and train."""
    return summed_reply_log_probs(model, batch, 2), batch["reply_mask"].sum(1).view(-1, 2)


def dpo_loss(policy: torch.Tensor, reference: torch.Tensor, counts: torch.Tensor, loss_type: str, beta: float,
             label_smoothing: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """``(losses [pairs], rewards [pairs, 2])`` from summed log-probabilities ``[pairs, 2]`` (chosen, rejected)
    of the policy and the reference and the replies' token counts. A reward is ``beta x (policy - reference)``.

    ``sigmoid``: DPO's ``-log sigmoid(beta x margin)``; ``robust``: the same, unbiased for a share
    ``label_smoothing`` of flipped labels (Chowdhury et al. 2024); ``ipo``: ``(margin - 1 / (2 beta))^2`` on the
    log-probabilities' means over each reply's tokens, as the IPO paper defines it.
    """
    ratios = policy - reference
    rewards = beta * ratios.detach()
    if loss_type == "ipo":
        means = ratios / counts
        return (means[:, 0] - means[:, 1] - 1 / (2 * beta)) ** 2, rewards
    logits = beta * (ratios[:, 0] - ratios[:, 1])
    if loss_type == "sigmoid":
        return -F.logsigmoid(logits), rewards
    if loss_type == "robust":
        return ((1 - label_smoothing) * -F.logsigmoid(logits) + label_smoothing * F.logsigmoid(-logits)) / (
            1 - 2 * label_smoothing), rewards
    raise ValueError(f"unknown loss type {loss_type!r}")


PAIR_FIGURES = ("rewards_chosen", "rewards_rejected", "rewards_margin", "rewards_accuracy", "logps_chosen",
                "logps_rejected")
"""What ``pair_figures`` reports, each logged per pair (a recipe's ``logged_figures``)."""


def pair_figures(policy: torch.Tensor, rewards: torch.Tensor) -> dict[str, torch.Tensor]:
    """What a run reports of its pairs, each summed over them: the rewards (``dpo_loss``) of both replies, their
    margin, how many pairs reward the chosen reply strictly higher, and the policy's summed log-probabilities."""
    policy = policy.detach()
    return {"rewards_chosen": rewards[:, 0].sum(), "rewards_rejected": rewards[:, 1].sum(),
            "rewards_margin": (rewards[:, 0] - rewards[:, 1]).sum(),
            "rewards_accuracy": (rewards[:, 0] > rewards[:, 1]).sum().float(),
            "logps_chosen": policy[:, 0].sum(), "logps_rejected": policy[:, 1].sum()}


def pair_metrics(policy: torch.Tensor, reference: torch.Tensor, counts: torch.Tensor, loss_type: str, beta: float,
                 label_smoothing: float = 0.0) -> dict[str, float]:
    """The mean loss (``dpo_loss``) and the mean of each of ``pair_figures`` over every pair."""
    losses, rewards = dpo_loss(policy, reference, counts, loss_type, beta, label_smoothing)
    figures = pair_figures(policy, rewards)
    return {"loss": losses.mean().item(), **{name: value.item() / len(losses) for name, value in figures.items()}}


def write_pair_predictions(path: str, policy: torch.Tensor, reference: torch.Tensor, beta: float) -> None:
    """``eval_predictions.jsonl``: for each pair in order, the policy's and the reference's summed log-probabilities
    of both replies, and the margin of the chosen reply's reward over the rejected one's."""
    with open(path, "w") as f:
        for index, (mine, theirs) in enumerate(zip(policy.tolist(), reference.tolist(), strict=True)):
            margin = beta * ((mine[0] - theirs[0]) - (mine[1] - theirs[1]))
            f.write(json.dumps({"index": index, "policy_logps_chosen": mine[0], "policy_logps_rejected": mine[1],
                                "reference_logps_chosen": theirs[0], "reference_logps_rejected": theirs[1],
                                "rewards_margin": margin}) + "\n")


@dataclass
class Precomputation:
    """What computing every training pair's reference log-probabilities once takes (``precomputed_reference``)."""

    pairs: Any
    collate: Callable[[list[dict]], dict]
    batch_size: int
    max_tokens: int
    path: Path
    key: str


AUTOCAST_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


class Reference:
    """The reference model: with LoRA, the policy itself with its adapters switched off; without, a frozen copy
    of the policy as it was given, run as the runtime runs the policy (else the two differ at step 0): under
    ``autocast_dtype``'s autocast, with its weights (not its buffers) in ``weights_dtype`` where FSDP's
    mixed-precision policy gathers the policy's so. Either runs in eval mode (no dropout), under ``no_grad``. With a
    ``precomputation``, training batches read their reference from a table computed once."""

    def __init__(self, model, precomputation: Precomputation | None = None, autocast_dtype: torch.dtype | None = None,
                 weights_dtype: torch.dtype | None = None):
        self.frozen = None if hasattr(model, "disable_adapter") else copy.deepcopy(model).eval().requires_grad_(False)
        if self.frozen is not None and weights_dtype is not None:
            for weight in self.frozen.parameters():
                weight.data = weight.data.to(weights_dtype)
        self.precomputation, self.table = precomputation, None
        self.autocast_dtype = autocast_dtype

    def training_log_probs(self, policy, batch: dict, index: torch.Tensor) -> torch.Tensor:
        """``[pairs, 2]``: the reference of a training batch whose pairs are ``index``, live or from the
        precomputed table (made at the first call, before the policy has moved: every process must make it)."""
        if self.precomputation is None:
            return self.pair_log_probs(policy, batch)
        if self.table is None:
            self.table = precomputed_reference(self, policy, **vars(self.precomputation))
        return self.table[index.to(self.table.device)]

    def pair_log_probs(self, policy, batch: dict) -> torch.Tensor:
        """``[pairs, 2]`` summed reply log-probabilities of a ``PromptRepliesCollator`` batch (as
        ``pair_log_probs``); ``policy`` may be wrapped (DDP)."""
        with torch.no_grad(), self.model(policy, batch["prompt_ids"].device) as model:
            return pair_log_probs(model, batch)[0]

    def shared_prompt_log_probs(self, policy, batch: dict, max_tokens: int) -> torch.Tensor:
        """``[pairs, 2]`` as ``pair_log_probs``, of a ``PromptRepliesCollator`` batch, each prompt run once for both
        replies in passes of at most ``max_tokens`` tokens (``finetune.tasks.causal_lm.shared_prompt_log_probs``);
        ``policy`` may be wrapped (DDP)."""
        with torch.no_grad(), self.model(policy, batch["prompt_ids"].device) as model:
            return shared_prompt_log_probs(model, batch, max_tokens)

    @contextlib.contextmanager
    def model(self, policy, device: torch.device) -> Iterator[torch.nn.Module]:
        """The reference, in eval mode, while the block runs: ``policy`` (may be wrapped) with its adapters off, or
        the frozen copy on ``device``."""
        if self.frozen is not None:
            with torch.autocast(device.type, dtype=self.autocast_dtype, enabled=self.autocast_dtype is not None):
                yield self.frozen.to(device)
            return
        # On the unwrapped model: a DDP wrapper would hide peft's switch (and need no gradient hooks here).
        inner = unwrap(policy)
        training = inner.training
        inner.eval()
        try:
            with inner.disable_adapter():
                yield inner
        finally:
            inner.train(training)


def preview_pairs(pairs: datasets.Dataset, tokenizer, count: int) -> list[dict]:
    """The first ``count`` pairs of ``tokenize_pairs`` as ``Task.preview`` gives rows: each pair twice, the prompt
    with its chosen reply, then with its rejected one (``reply`` says which); the reply is what trains."""
    previews = []
    for pair in pairs.select(range(min(count, len(pairs)))):
        for side in ("chosen", "rejected"):
            reply = pair[f"{side}_ids"]
            text = tokenizer.decode(pair["prompt_ids"] + reply)
            previews.append({"example": pair["index"] + 1, "reply": side, "text": text,
                             "trained": [tokenizer.decode(reply)]})
    return previews


def policy_precision(cfg) -> dict:
    """``Reference``'s ``autocast_dtype`` and ``weights_dtype`` for a run, as its runtime runs the policy:
    Accelerate under autocast (with FSDP's bf16 weights too), torchrun --fsdp with its weights gathered in bf16
    and no autocast, raw DDP under autocast."""
    precision = run_precision(cfg)
    sharded_bf16 = precision == "bf16" and (cfg.fsdp or LaunchEnvironment.read().accelerate_fsdp)
    return {"autocast_dtype": None if cfg.fsdp else AUTOCAST_DTYPES.get(precision),
            "weights_dtype": torch.bfloat16 if sharded_bf16 else None}


def load_policy_and_reference(cfg, args, tokenizer, data_folder: Path, train_set, collate, table_path: Path
                              ) -> tuple[torch.nn.Module, Reference, str]:
    """The model preference tuning trains (``--model_name_or_path``, by default the default chat model; an adapter
    folder is folded into its base), its dropout off (LoRA's is ``--lora_dropout``), with LoRA unless
    ``--no_use_lora``; its ``Reference``, whose log-probabilities
    of ``train_set`` are computed once into ``table_path`` under ``--precompute_ref_log_probs``; and how the
    start-up line names both.

    Raises:
        UserError: the model cannot be loaded.
    """
    name = cfg.model_name_or_path or default_chat_model_path()
    model = load_causal_lm(name, trust_remote_code=cfg.trust_remote_code, **args.loading_options(cfg))
    for module in model.modules():  # as TRL's DPO: the policy's log-probabilities, as the reference's, without
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
    precomputation = None
    precision = policy_precision(cfg)
    # --prepare_only counts the memory with the live reference: the same for the backward pass, and no table made
    if args.precompute_ref_log_probs and not cfg.prepare_only:
        precomputation = Precomputation(train_set, collate, cfg.per_device_eval_batch_size,
                                        args.per_device_eval_max_tokens, table_path,
                                        key=reference_key(model, str(precision), data_folder))
    model, adapters = adapt_chat_model(model, args, tokenizer)
    folded = is_adapter_folder(name) and (
        f"from {name} folded into its base model (the saved adapter applies to that model; --merge_lora also saves "
        "one that stands alone)")
    summary = [f"{'precomputed' if precomputation else 'live'} reference", adapters, folded]
    return model, Reference(model, precomputation, **precision), ", ".join(filter(None, summary))


def reference_key(model, precision: str, data_folder: Path) -> str:
    """What the precomputed reference of ``model`` (the reference itself: before adapters are added) depends on:
    its weights and configuration, wherever they came from (a folder retrained in place, an adapter folded in),
    the precision it runs in and the tokenized data (``data_folder``, the cache folder named by its key)."""
    return " ".join([tensors_digest(model.state_dict().items()),
                     hashlib.sha256(model.config.to_json_string().encode()).hexdigest(), precision, data_folder.name])


def precomputed_reference(reference: Reference, policy, pairs, collate, batch_size: int, max_tokens: int, path: Path,
                          key: str) -> torch.Tensor:
    """``[len(pairs), 2]``: every pair's reference log-probabilities (``Reference.shared_prompt_log_probs`` of
    ``collate``'s batches, a ``PromptRepliesCollator``), on every process.

    Read from ``path`` when it holds them for ``key`` on every process; else computed with each pair once over
    all processes (process r takes pairs r, r + world size, ...), gathered, and written to ``path`` by the main
    process, so that a resumed run reads them. Every process must call it at the same point.
    """
    device = next(unwrap(policy).parameters()).device
    table = None
    if path.is_file():
        stored = load_file(str(path))
        if stored.get("key") is not None and bytes(stored["key"].tolist()) == key.encode():
            table = stored["log_probs"].to(device)
    missing = all_reduce_max(torch.tensor(int(table is None), device=device))
    if not missing:
        return table
    world, rank = (dist.get_world_size(), dist.get_rank()) if dist.is_initialized() else (1, 0)
    # Process r's k-th row is pair r + k x world. Every process takes as many rows (a short share repeats its last
    # pair), so all run as many forward passes, as a sharded model needs; the repeats land past the last pair.
    share = -(-len(pairs) // world)
    mine = list(range(rank, len(pairs), world)) or [0]
    mine += mine[-1:] * (share - len(mine))
    # Longest pairs first: passes of like lengths carry little padding. The table is put back in pair order.
    order = sorted(range(share), key=lambda k: -pairs.lengths[mine[k]])
    parts = []
    for start in range(0, share, batch_size):
        batch = collate(pairs.__getitems__([mine[k] for k in order[start:start + batch_size]]))
        batch.pop("index")
        parts.append(reference.shared_prompt_log_probs(policy, {k: v.to(device) for k, v in batch.items()},
                                                       max_tokens))
    computed = torch.cat(parts)
    in_order = torch.empty_like(computed).index_copy_(0, torch.tensor(order, device=device), computed)
    gathered = torch.stack(all_gather_padded(in_order))
    table = gathered.transpose(0, 1).reshape(-1, 2)[:len(pairs)]
    if rank == 0:
        with replacing(path) as partial:
            save_file({"log_probs": table.cpu().contiguous(),
                       "key": torch.tensor(list(key.encode()), dtype=torch.uint8)}, str(partial))
    return table
