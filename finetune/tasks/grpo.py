"""GRPO: its options, prompts through the chat template, and the arithmetic: a group's advantages from its
completions' rewards, and the clipped policy loss of each loss type as a sum over loss units, so that the shared
loop's normalisation (``world_size / units in the global batch``) makes it exact at any world size and accumulation.
The rollouts that sample the completions and turn them into training batches are ``finetune.tasks.rollout``'s.

A rollout is G completions per prompt (a *group*), scored by reward functions; every completion's advantage is its
reward against its group's. The loss types differ only in what a loss unit is:

- ``dapo``: a completion token. The loss is the mean per-token loss over every completion token of the global batch.
- ``grpo``: a completion. Each completion's per-token losses are averaged first, then the completions are.
- ``dr_grpo``: ``max_completion_length`` tokens per completion (Dr. GRPO's constant normaliser), so neither a
  completion's length nor the batch's shifts a token's weight.

TRL's trainer divides each micro-batch's loss by its own normaliser, which makes ``grpo`` and ``dr_grpo`` depend on
how completions fall into micro-batches and ``dapo`` on a per-process token count; here every unit weighs the same
in the global batch.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass

import datasets
import numpy as np
import torch

from finetune.config import arg
from finetune.data.batching import LENGTH, LOSS_UNITS
from finetune.data.cache import TOKEN_IDS, Tokenizing
from finetune.errors import UserError
from finetune.tasks.causal_lm import ChatModelArguments
from finetune.tasks.chat import check_conversation, render_prompts, rows_tools
from finetune.tasks.episodes import prompt_messages
from finetune.tasks.rewards import check_reward_specs
from finetune.tasks.tools import check_tool_specs

__all__ = ["LOSS_TYPES", "SCALE_REWARDS", "Advantages", "GRPOArguments", "check_grpo_options", "check_whole_groups",
           "completion_loss_units", "group_advantages", "nanstd", "policy_loss", "tokenize_prompts"]

LOSS_TYPES = ("dapo", "grpo", "dr_grpo")
SCALE_REWARDS = ("group", "batch", "none")
STD_EPSILON = 1e-4
"""Added to the standard deviation a group's advantages are divided by, as TRL does, so a group whose rewards
barely differ does not get huge advantages."""


@dataclass
class GRPOArguments(ChatModelArguments):
    """The GRPO recipe's options (TRL's names), checked before anything heavy loads: the reward functions' specs
    (their modules are imported only in the reward workers), with their ``weights``."""

    eval_generate: int | None = arg(None, "The chat recipe's; GRPO's evaluation samples a completion for every "
                                          "validation prompt.")
    max_new_tokens: int | None = arg(None, "The chat recipe's; GRPO's evaluation samples completions of up to "
                                           "--max_completion_length tokens.")
    reward_funcs: list[str] = arg([], "Reward functions, each module:function (a module name or a .py file), with "
                                      "TRL's signature.")
    reward_weights: list[float] = arg([], "A weight per reward function (default 1 each); a completion's reward is "
                                          "the weighted sum of those that score it.")
    reward_timeout: float = arg(60.0, "Seconds a reward function may take on a step's completions before the call "
                                      "fails (its worker is replaced).")
    reward_env: list[str] = arg([], "Environment variables the reward functions' worker processes get besides the "
                                    "basic ones (PATH, HOME, locale): an API key a judge needs. No other token "
                                    "(HF_TOKEN, a tracker's) reaches them.")
    max_reward_failures: float = arg(0.05, "The share of the newest 256 completions (taken of at least 64) a "
                                           "reward function may fail on (raise, hang, return a wrong or non-finite "
                                           "value) before the run stops; failed ones have no reward, never 0.")
    num_generations: int = arg(8, "Completions sampled per prompt: a group, whose rewards set each other's "
                                  "advantages.")
    max_completion_length: int = arg(256, "Longest completion, in tokens.")
    temperature: float = arg(1.0, "Sampling temperature (the log-probabilities trained are at it too).")
    top_p: float = arg(1.0, "Nucleus sampling: the smallest set of tokens whose probability reaches it.")
    loss_type: str = arg("dapo", "dapo (the mean over every completion token of a step), grpo (each completion's "
                                 "mean, then the completions'), dr_grpo (sums over max_completion_length).")
    scale_rewards: str = arg("group", "Divide advantages by the group's reward std (group), the step's (batch), "
                                      "or not at all (none).")
    epsilon: float = arg(0.2, "Clip the importance ratio below at 1 - epsilon.")
    epsilon_high: float | None = arg(None, "Clip it above at 1 + epsilon_high (DAPO's clip-higher); default epsilon.")
    num_iterations: int = arg(1, "Optimizer steps on each rollout (the ratio is against the log-probabilities it "
                                 "was sampled with).")
    beta: float = arg(0.0, "Weight of the KL term against the reference (the model with its adapters off); 0: "
                           "none, and no reference pass.")
    mask_truncated_completions: bool = arg(False, "Leave completions cut at max_completion_length out of the loss.")
    lora_dropout: float = arg(0.0, "Dropout on the LoRA input: off by default (TRL's GRPOConfig leaves it on), so "
                                   "that a rollout's first pass trains at the log-probabilities it was sampled with.")
    tools: list[str] = arg([], "Tools the model may call, each module:function (a module name or a .py file): "
                               "functions with type hints and a docstring, run in worker processes. A reply's calls "
                               "run and their results come back as tool messages: episodes of several turns.")
    environment: str | None = arg(None, "A class, module:Class, with one instance per episode (TRL's "
                                        "environment_factory): reset(**row) starts it and may return a first "
                                        "observation (added to the prompt's last message); its public methods are "
                                        "tools; reward functions get the instances as environments=.")
    max_turns: int | None = arg(None, "With --tools: the most replies in an episode (default: as many as "
                                      "--max_completion_length's sampled tokens allow).")
    tool_timeout: float = arg(30.0, "Seconds a tool call may take before it fails (its worker process is replaced); "
                                    "the model reads the error as the call's result.")

    def __post_init__(self):
        super().__post_init__()
        # Checked now, so that a bad spec is refused before anything heavy loads; imported only in the workers.
        if not self.reward_funcs:
            raise UserError("no --reward_funcs: give reward functions as module:function (TRL's signature, "
                            "func(prompts, completions, **columns) -> a list of floats or None)")
        check_reward_specs(self.reward_funcs)
        check_grpo_options(num_generations=self.num_generations, loss_type=self.loss_type,
                           scale_rewards=self.scale_rewards, epsilon=self.epsilon, epsilon_high=self.epsilon_high,
                           beta=self.beta, num_iterations=self.num_iterations)
        if not self.temperature > 0 or not 0 < self.top_p <= 1:
            raise UserError(f"--temperature {self.temperature} --top_p {self.top_p}: sample at a temperature above 0 "
                            "with top_p in (0, 1]")
        if self.reward_weights and len(self.reward_weights) != len(self.reward_funcs):
            raise UserError(f"{len(self.reward_weights)} --reward_weights for {len(self.reward_funcs)} --reward_funcs; "
                            "give one weight each")
        self.weights = np.array(self.reward_weights or [1.0] * len(self.reward_funcs))
        if self.eval_generate is not None or self.max_new_tokens is not None:
            given = "--eval_generate" if self.eval_generate is not None else "--max_new_tokens"
            raise UserError(f"{given} is the chat recipe's: GRPO's evaluation samples a completion of up to "
                            "--max_completion_length tokens for every validation prompt and scores it; leave it out")
        self.max_new_tokens = self.max_completion_length  # the evaluation's replies are as long as the completions
        if self.tools or self.environment:
            check_tool_specs(self.tools, self.environment)
        if self.max_turns is not None and self.max_turns < 1:
            raise UserError(f"--max_turns is {self.max_turns}; an episode has at least 1 reply (leave it unset for "
                            "as many as --max_completion_length allows)")
        if not self.tool_timeout > 0:
            raise UserError(f"--tool_timeout is {self.tool_timeout}; give a positive number of seconds")
        if not 0 <= self.max_reward_failures <= 1 or not self.reward_timeout > 0:
            raise UserError(f"--max_reward_failures {self.max_reward_failures} --reward_timeout "
                            f"{self.reward_timeout}: give a share from 0 to 1 and a positive number of seconds")



def check_grpo_options(*, num_generations: int, loss_type: str, scale_rewards: str, epsilon: float,
                       epsilon_high: float | None, beta: float, num_iterations: int) -> None:
    """Raises ``UserError`` for GRPO options that cannot work together (named as flags)."""
    if num_generations < 2:
        raise UserError(f"--num_generations is {num_generations}; a group needs at least 2 completions to compare "
                        "(GRPO's advantage is a completion's reward against its group's)")
    if loss_type not in LOSS_TYPES:
        raise UserError(f"--loss_type {loss_type!r} is unknown; use one of {', '.join(LOSS_TYPES)}")
    if scale_rewards not in SCALE_REWARDS:
        raise UserError(f"--scale_rewards {scale_rewards!r} is unknown; use one of {', '.join(SCALE_REWARDS)}")
    if not 0 < epsilon < 1:
        raise UserError(f"--epsilon is {epsilon}; the clipping range [1 - epsilon, 1 + epsilon] needs 0 < epsilon < 1")
    if epsilon_high is not None and not epsilon <= epsilon_high < math.inf:
        raise UserError(f"--epsilon_high {epsilon_high} is below --epsilon {epsilon}; the upper clip is at least the "
                        "lower one (DAPO's clip-higher), or leave it unset to use --epsilon")
    if not 0 <= beta < math.inf:
        raise UserError(f"--beta is {beta}; give 0 (no KL term) or a positive weight")
    if num_iterations < 1:
        raise UserError(f"--num_iterations is {num_iterations}; each rollout trains at least once")


def check_whole_groups(completions_per_step: int, num_generations: int) -> None:
    """Raises ``UserError`` unless a step's completions over every process (per-device batch x world size x
    accumulation) hold whole groups."""
    if completions_per_step % num_generations:
        raise UserError(f"a step's {completions_per_step} completions (--per_device_train_batch_size x processes x "
                        f"--gradient_accumulation_steps) do not hold whole groups of --num_generations "
                        f"{num_generations}; make the product a multiple of {num_generations}")


@dataclass
class Advantages:
    """``group_advantages``' result, each ``[completions]`` in the rollout's order unless said."""

    advantages: torch.Tensor
    rewards: torch.Tensor
    """The weighted sum over reward functions; NaN where no function scored the completion."""
    zero_std: torch.Tensor
    """``[groups]``: groups whose rewards are all equal, which give no gradient."""


def group_advantages(rewards: torch.Tensor, weights: torch.Tensor, num_generations: int, scale: str,
                     failed: torch.Tensor | None = None) -> Advantages:
    """Advantages of a rollout's completions from ``rewards`` ``[completions, functions]``, each group's
    ``num_generations`` completions consecutive; NaN marks a function that did not score a completion (it returned
    None, or failed: ``failed``, of the same shape, nonzero where it raised, timed out or lost its worker).

    A completion's reward is the weighted sum of the functions that scored it; its advantage is that less its
    group's mean, divided by the standard deviation of its group's rewards (``scale="group"``), of the whole
    rollout's (``"batch"``), or not at all (``"none"``). A completion no function scored, or any function failed
    on, has advantage 0 and counts in no mean: a failure's share of the sum is unknown, and 0 in its place would
    train on it. Give every completion of the global batch, whichever process generated it: a group's completions
    may sit on different processes.
    """
    unscored = rewards.isnan().all(1)
    if failed is not None:
        unscored |= failed.bool().any(1)
    total = (rewards.nan_to_num() * weights).sum(1).masked_fill(unscored, math.nan)
    grouped = total.view(-1, num_generations)
    group_mean = grouped.nanmean(1, keepdim=True)
    group_std = nanstd(grouped, dim=1)
    advantages = (grouped - group_mean).flatten()
    if scale != "none":
        std = group_std.repeat_interleave(num_generations) if scale == "group" else nanstd(total, dim=0)
        advantages = advantages / (std + STD_EPSILON)
    zero_std = torch.isclose(group_std, torch.zeros_like(group_std)) | group_std.isnan()
    return Advantages(advantages.nan_to_num(0.0), total, zero_std)


def nanstd(values: torch.Tensor, dim: int) -> torch.Tensor:
    """The sample standard deviation (Bessel-corrected, as TRL's) along ``dim`` of the non-NaN values; NaN where
    fewer than two."""
    count = (~values.isnan()).sum(dim)
    mean = values.nanmean(dim, keepdim=True)
    variance = ((values - mean) ** 2).nansum(dim) / (count - 1).clamp(min=1)
    return variance.sqrt().masked_fill(count < 2, math.nan)


def completion_loss_units(completion_mask: torch.Tensor, loss_type: str, max_completion_length: int) -> torch.Tensor:
    """``[completions]``: what each completion adds to the global batch's loss units (``completion_mask``
    ``[completions, length]`` marks the tokens that train)."""
    if loss_type == "dapo":
        return completion_mask.sum(1)
    per_completion = 1 if loss_type == "grpo" else max_completion_length
    return torch.full((len(completion_mask),), per_completion, device=completion_mask.device)


def policy_loss(log_probs: torch.Tensor, advantages: torch.Tensor, completion_mask: torch.Tensor, *, loss_type: str,
                epsilon: float, epsilon_high: float | None = None, old_log_probs: torch.Tensor | None = None,
                ref_log_probs: torch.Tensor | None = None, beta: float = 0.0) -> tuple[torch.Tensor, dict]:
    """The clipped surrogate loss of a batch of completions, summed over its completions in ``loss_type``'s units
    (divide by ``completion_loss_units`` summed over the global batch for the mean), and figures summed over its
    completion tokens: ``{"tokens", "clipped_low", "clipped_high", "kl"}`` (``kl`` only with ``beta``).

    ``log_probs``, ``old_log_probs`` (those the completions were sampled with; default: ``log_probs`` detached, the
    first pass over a rollout) and ``ref_log_probs`` are ``[completions, length]`` per token; ``advantages``
    ``[completions]``. The importance ratio is clipped to ``[1 - epsilon, 1 + epsilon_high]``; with ``beta`` > 0 a
    k3 estimate of the KL divergence from the reference is added per token.
    """
    mask = completion_mask.to(log_probs.dtype)
    old = log_probs.detach() if old_log_probs is None else old_log_probs
    ratio = torch.exp(log_probs - old)
    high = epsilon if epsilon_high is None else epsilon_high
    advantage = advantages[:, None]
    per_token = -torch.min(ratio * advantage, ratio.clamp(1 - epsilon, 1 + high) * advantage)
    figures = {"tokens": mask.sum(),
               "clipped_low": (((ratio < 1 - epsilon) & (advantage < 0)) * mask).sum(),
               "clipped_high": (((ratio > 1 + high) & (advantage > 0)) * mask).sum()}
    if beta:
        to_reference = ref_log_probs - log_probs
        kl = torch.exp(to_reference) - to_reference - 1
        per_token = per_token + beta * kl
        figures["kl"] = (kl.detach() * mask).sum()
    per_completion = (per_token * mask).sum(1)
    if loss_type == "grpo":
        per_completion = per_completion / mask.sum(1).clamp(min=1)
    return per_completion.sum(), figures


# -- prompts


def _columns_json(values: dict, place: str) -> str:
    """A row's other columns as the JSON the reward functions get them in.

    Raises:
        UserError: a column holds a value JSON cannot carry (a date, bytes, an image).
    """
    try:
        return json.dumps(values)
    except TypeError:
        for column, value in values.items():
            try:
                json.dumps(value)
            except TypeError:
                raise UserError(f"{place}: column {column!r} holds a {type(value).__name__}, which cannot reach the "
                                "reward functions (they get a row's columns as JSON); make it text or numbers, or "
                                "drop the column") from None
        raise


def tokenize_prompts(split: datasets.Dataset, tokenizer, max_length: int, name: str, tokenizing: Tokenizing,
                     template_options: dict | None = None, tools: list[dict] | None = None) -> datasets.Dataset:
    """A ``prompt`` column (text, or a list of messages before the reply, TRL's format) rendered with the generation
    prompt into ``prompt_ids``, with ``tools`` (JSON schemas) where given, else the row's ``tools`` column;
    ``prompt_messages`` keeps each prompt as given (JSON) and ``columns`` the row's other columns (JSON), both for
    the reward functions; ``index`` is the row; ``reference`` is empty (no reply to compare with).

    Raises:
        UserError: no ``prompt`` column, a bad message, a template that refuses a prompt, or a prompt longer than
            ``max_length`` tokens.
    """
    if "prompt" not in split.column_names:
        raise UserError(f"{name} data has no 'prompt' column (columns: {', '.join(split.column_names)}); give each "
                        "row's prompt as text or as a list of {role, content} messages, with the columns the reward "
                        "functions read beside it")
    others = [column for column in split.column_names if column not in ("prompt", "tools")]

    def encode(batch, rows):
        where = [f"{name} row {row + 1}" for row in rows]
        prompts = [prompt_messages(p) for p in batch["prompt"]]
        for messages, place in zip(prompts, where, strict=True):
            check_conversation(messages + [{"role": "assistant", "content": ""}], place)
        listed = [json.dumps(tools)] * len(rows) if tools else rows_tools(batch, rows, name)
        texts = render_prompts(prompts, tokenizer, where, listed, template_options)
        ids = tokenizer(texts, add_special_tokens=False, return_attention_mask=False)["input_ids"]
        for prompt_ids, place in zip(ids, where, strict=True):
            if len(prompt_ids) > max_length:
                raise UserError(f"{place}: the prompt is {len(prompt_ids)} tokens, over --max_seq_length {max_length}; "
                                "raise --max_seq_length or shorten the prompt")
        columns = [_columns_json({column: batch[column][i] for column in others}, place)
                   for i, place in enumerate(where)]
        return {"prompt_ids": ids, "prompt_messages": [json.dumps(p) for p in batch["prompt"]], "columns": columns,
                "reference": [""] * len(rows), "index": rows, LENGTH: [len(i) for i in ids],
                LOSS_UNITS: [1] * len(rows)}

    features = {"prompt_ids": TOKEN_IDS, "prompt_messages": datasets.Value("string"),
                "columns": datasets.Value("string"), "reference": datasets.Value("string"),
                "index": datasets.Value("int32")}
    return tokenizing.map(split, encode, name, features)
