"""GRPO: prompts through the chat template, the plan of rollouts, sampling seeded per completion, and the
rollouts that turn a step's prompts into training batches (``Rollouts``); the arithmetic: a group's advantages from
its completions' rewards, and the clipped policy loss of each loss type as a sum over loss units, so that the shared
loop's normalisation (``world_size / units in the global batch``) makes it exact at any world size and accumulation.

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

import dataclasses
import functools
import hashlib
import itertools
import json
import math
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

import datasets
import numpy as np
import torch

from finetune.checkpointing.files import replacing
from finetune.config import arg
from finetune.data.batching import LENGTH, LOSS_UNITS, GlobalBatchSampler, PlannedBatch
from finetune.data.cache import TOKEN_IDS, Tokenizing
from finetune.distributed.ddp import all_reduce_max, all_reduce_sum
from finetune.distributed.fsdp import is_sharded
from finetune.errors import UserError
from finetune.tasks.causal_lm import ChatModelArguments, cache_keyword, reply_log_probs
from finetune.tasks.chat import check_conversation, render_prompts, rows_tools
from finetune.tasks.episodes import Episode, Episodes, prompt_messages, row_columns, score_episodes
from finetune.tasks.rewards import RewardFailures, RewardPool, check_reward_specs
from finetune.tasks.scoring import RewardJudge, failed_table, reward_names, score_replies
from finetune.tasks.tools import ERROR_KINDS, check_tool_specs

__all__ = ["LOSS_TYPES", "SCALE_REWARDS", "Advantages", "GRPOArguments", "RolloutSampler", "Rollouts",
           "check_grpo_options", "check_whole_groups", "completion_loss_units", "greedy_sampling", "group_advantages",
           "policy_loss", "sample_completions", "tokenize_prompts"]

LOSS_TYPES = ("dapo", "grpo", "dr_grpo")
SCALE_REWARDS = ("group", "batch", "none")
STD_EPSILON = 1e-4
"""Added to the standard deviation a group's advantages are divided by, as TRL does, so a group whose rewards
barely differ does not get huge advantages."""


@dataclass
class GRPOArguments(ChatModelArguments):
    """The GRPO recipe's options (TRL's names), checked before anything heavy loads: the reward functions' specs
    (their modules are imported only in the reward workers), with their ``weights``."""

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
    lora_dropout: float = arg(0.0, "Dropout on the LoRA input: off by default, as TRL turns dropout off, so that a "
                                   "rollout's first pass trains at the log-probabilities it was sampled with.")
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
    group_std = _nanstd(grouped, dim=1)
    advantages = (grouped - group_mean).flatten()
    if scale != "none":
        std = group_std.repeat_interleave(num_generations) if scale == "group" else _nanstd(total, dim=0)
        advantages = advantages / (std + STD_EPSILON)
    zero_std = torch.isclose(group_std, torch.zeros_like(group_std)) | group_std.isnan()
    return Advantages(advantages.nan_to_num(0.0), total, zero_std)


def _nanstd(values: torch.Tensor, dim: int) -> torch.Tensor:
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


# -- prompts, the plan of rollouts, and sampling


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
        columns = [json.dumps({column: batch[column][i] for column in others}) for i in range(len(rows))]
        return {"prompt_ids": ids, "prompt_messages": [json.dumps(p) for p in batch["prompt"]], "columns": columns,
                "reference": [""] * len(rows), "index": rows, LENGTH: [len(i) for i in ids],
                LOSS_UNITS: [1] * len(rows)}

    features = {"prompt_ids": TOKEN_IDS, "prompt_messages": datasets.Value("string"),
                "columns": datasets.Value("string"), "reference": datasets.Value("string"),
                "index": datasets.Value("int32")}
    return tokenizing.map(split, encode, name, features)


class RolloutSampler(GlobalBatchSampler):
    """The plan of an epoch of rollouts: its prompts shuffled by ``seed + epoch``, cut into windows of one
    optimizer step's completions (per-device batch x processes x accumulation, counted in completions), each prompt
    repeated ``num_generations`` times in a row, so a group's completions are consecutive in the global order
    (dealt round-robin to the processes, a group may span them). A window is trained ``num_iterations`` times
    over, its micro-batches planned again for each; the prompts left over at an epoch's end wait for the next.

    Loss units and scales are the rollout's to set (``Rollouts``): they are known only once the completions are.
    """

    def __init__(self, prompt_lengths, per_device_batch_size: int, num_replicas: int, *, seed: int,
                 accumulation_steps: int, num_generations: int, num_iterations: int = 1, rank: int | None = None):
        super().__init__(prompt_lengths, per_device_batch_size, num_replicas, seed=seed, group_by_length=False,
                         accumulation_steps=accumulation_steps, rank=rank)
        self.num_generations, self.num_iterations = num_generations, num_iterations
        self.prompts_per_window = self.global_batch_size * accumulation_steps // num_generations

    def for_rank(self, rank: int) -> RolloutSampler:
        return RolloutSampler(self.lengths, self.per_device_batch_size, self.num_replicas, seed=self.seed,
                              accumulation_steps=self.accumulation_steps, num_generations=self.num_generations,
                              num_iterations=self.num_iterations, rank=rank)

    @property
    def windows(self) -> int:
        return len(self.lengths) // self.prompts_per_window

    @property
    def batches_per_rank(self) -> int:
        return self.windows * self.accumulation_steps * self.num_iterations

    def _micro_batches(self, epoch: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        generator = torch.Generator().manual_seed(self.seed + epoch)
        prompts = torch.randperm(len(self.lengths), generator=generator).numpy()
        windows = prompts[:self.windows * self.prompts_per_window].reshape(self.windows, 1, -1)
        order = np.repeat(np.repeat(windows, self.num_iterations, axis=1).reshape(-1), self.num_generations)
        starts = np.arange(0, len(order), self.global_batch_size)
        return order, starts, np.arange(len(starts)) // (self.accumulation_steps * self.num_iterations)


def sample_completions(model, prompts: list[list[int]], counts: list[int], seeds: list[int], *, max_new_tokens: int,
                       temperature: float, top_p: float, pad_token_id: int) -> list[list[int]]:
    """``counts[i]`` sampled completions of each prompt (token ids), in order: each completion through its first
    end-of-turn token (the model's ``generation_config.eos_token_id``), or ``max_new_tokens`` long.

    Each completion draws from a generator of its own, seeded with its entry of ``seeds``: a completion depends on
    its seed and prompt, not on which others share its batch or process, so a run samples the same completions on
    any number of processes, and a resumed run what the uninterrupted one did. Each prompt's KV cache is computed
    once and copied to its completions. ``model`` is unwrapped; it samples in eval mode (no dropout). At
    ``temperature`` 0 every completion is the greedy one.
    """
    device = next(model.parameters()).device
    longest = max(len(p) for p in prompts)
    ids = torch.tensor([[pad_token_id] * (longest - len(p)) + p for p in prompts], device=device)
    mask = torch.tensor([[0] * (longest - len(p)) + [1] * len(p) for p in prompts], device=device)
    rows = torch.repeat_interleave(torch.arange(len(prompts), device=device), torch.tensor(counts, device=device))
    generators = [torch.Generator(device).manual_seed(seed) for seed in seeds]
    stops = torch.tensor(model.generation_config.eos_token_id, device=device).view(-1)
    sharded = is_sharded(model)
    training = model.training
    model.eval()
    try:
        with torch.no_grad():
            # The prompts but their last token, once each; the last token is the first input of the loop.
            keyword = cache_keyword(model)
            cache = getattr(model(input_ids=ids[:, :-1], attention_mask=mask[:, :-1], use_cache=True,
                                  position_ids=(mask[:, :-1].cumsum(1) - 1).clamp(min=0)), keyword)
            cache.reorder_cache(rows)
            tokens, attention = ids[rows, -1:], mask[rows]
            positions = attention.sum(1, keepdim=True) - 1
            done = torch.zeros(len(rows), dtype=torch.bool, device=device)
            generated = []
            for _ in range(max_new_tokens):
                logits = model(input_ids=tokens, attention_mask=attention, position_ids=positions, use_cache=True,
                               **{keyword: cache}).logits[:, -1].float()
                if temperature:
                    probs = _nucleus(torch.softmax(logits / temperature, -1), top_p)
                    tokens = torch.cat([torch.multinomial(p, 1, generator=g) for p, g in zip(probs, generators,
                                                                                             strict=True)])
                else:  # greedy (evaluation)
                    tokens = logits.argmax(-1)
                tokens = tokens.masked_fill(done, pad_token_id)[:, None]
                generated.append(tokens)
                done |= torch.isin(tokens[:, 0], stops)
                # A sharded model's every forward gathers weights from all processes: they stop together.
                if int(all_reduce_max((~done).any().int()) if sharded else (~done).any()) == 0:
                    break
                attention = torch.cat([attention, torch.ones_like(tokens)], 1)
                positions = positions + 1
    finally:
        model.train(training)
    generated = torch.cat(generated, 1)
    ended = torch.isin(generated, stops)
    lengths = torch.where(ended.any(1), ended.int().argmax(1) + 1, generated.shape[1])
    return [row[:length].tolist() for row, length in zip(generated, lengths.tolist(), strict=True)]


def greedy_sampling(pad_token_id: int):
    """``sample_completions`` at temperature 0, as ``finetune.tasks.episodes.Episodes.roll`` takes it."""
    return functools.partial(sample_completions, temperature=0.0, top_p=1.0, pad_token_id=pad_token_id)


def _right_padded(rows: list[list[int]], pad: int, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(ids, mask)``, each ``[len(rows), width]``: the token id lists, padded on the right."""
    ids = torch.tensor([row + [pad] * (width - len(row)) for row in rows])
    mask = torch.tensor([[1] * len(row) + [0] * (width - len(row)) for row in rows])
    return ids, mask


def _nucleus(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """``probs`` with each row cut to its smallest set of tokens whose probability reaches ``top_p`` (at least the
    likeliest), renormalised by the sampling."""
    if top_p >= 1:
        return probs
    ordered, order = probs.sort(-1, descending=True)
    outside = ordered.cumsum(-1) - ordered >= top_p  # the tokens after the set reaches top_p
    return probs.scatter(-1, order, ordered.masked_fill(outside, 0.0))


# -- rollouts: a window's prompts to the micro-batches that train on their completions


class Rollouts:
    """Turns a window's prompts into training micro-batches (``Task.rollout``): every process samples its
    completions, scores them with the reward functions, and shares the scores, so that each group's advantages come
    from all its completions wherever they were sampled; the loss units (``completion_loss_units``) are counted over
    the whole window, which makes the loss each micro-batch adds exact at any world size and accumulation.

    ``args`` holds the GRPO options (``num_generations``, ``max_completion_length``, ``temperature``, ``top_p``,
    ``loss_type``, ``scale_rewards``, ``mask_truncated_completions``, ``num_iterations``, ``beta``,
    ``max_reward_failures``); ``prompts`` is the training split of ``tokenize_prompts``; ``pool`` a
    ``finetune.tasks.rewards.RewardPool``; ``stop_ids`` end a completion; ``reference`` (with ``beta``) a
    ``finetune.tasks.preference.Reference``; ``kept`` the file where this process keeps its rollout while a later
    pass over it may still be resumed into (``num_iterations`` > 1).
    """

    def __init__(self, args, prompts: datasets.Dataset, tokenizer, pool: RewardPool, weights: list[float],
                 stop_ids: list[int], *, world_size: int, rank: int, per_device_batch_size: int,
                 accumulation_steps: int, seed: int, reference=None, kept: Path | None = None,
                 episodes: Episodes | None = None):
        self.args, self.prompts, self.tokenizer, self.pool, self.reference = args, prompts, tokenizer, pool, reference
        self.episodes = episodes
        self.kept = kept
        self.weights, self.stop_ids = torch.tensor(weights, dtype=torch.float64), set(stop_ids)
        self.world_size, self.rank, self.seed = world_size, rank, seed
        self.per_device_batch_size, self.accumulation_steps = per_device_batch_size, accumulation_steps
        self.pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        self.failures = RewardFailures(pool.names)
        self.judge = RewardJudge(self.failures, args.max_reward_failures, rank)
        self.names = reward_names(pool.names)
        self._rollout_figures: list[dict[str, float]] = []
        self._loss_figures = torch.zeros(4, dtype=torch.float64)
        self._training_since: float | None = None  # when the last rollout was handed to training
        # Every option that shapes a rollout or its loss (rewards, sampling, loss type, beta): a run resumed with
        # other ones samples again rather than train on a rollout kept under these.
        options = {field.name: getattr(args, field.name) for field in dataclasses.fields(args) if field.init}
        self._options_digest = hashlib.sha256(json.dumps(options, sort_keys=True, default=str).encode()).hexdigest()

    def __call__(self, model, window: list[tuple[dict, PlannedBatch]], epoch: int) -> list[tuple[dict, PlannedBatch]]:
        """The window's micro-batches, for each of its ``num_iterations`` passes (or those a resumed run has left),
        made from one rollout."""
        one_pass = window[:self.accumulation_steps]
        passes = len(window) // self.accumulation_steps
        key = [epoch, one_pass[0][1].window, self.world_size, self.seed, self._options_digest]
        device = next(model.parameters()).device
        self._stop_training_clock()
        micro_batches = self._kept_rollout(key, device) if passes < self.args.num_iterations else None
        if micro_batches is None:
            micro_batches = self._roll_out(model, one_pass, epoch, device)
            if self.args.num_iterations > 1:
                self._keep(key, micro_batches)
            self._training_since = time.perf_counter()
        return [(batch, planned) for _ in range(passes) for batch, planned in micro_batches]

    def _stop_training_clock(self) -> None:
        """The last rollout's ``training_seconds``: from its scoring to now (the next rollout, or its log)."""
        if self._training_since is not None:
            self._rollout_figures[-1]["training_seconds"] = time.perf_counter() - self._training_since
            self._training_since = None

    def _roll_out(self, model, one_pass: list[tuple[dict, PlannedBatch]], epoch: int, device: torch.device
                  ) -> list[tuple[dict, PlannedBatch]]:
        rows = [row for batch, _ in one_pass for row in batch["index"].tolist()]
        started = time.perf_counter()
        episodes = self._sample(model, rows, epoch, one_pass[0][1].window)
        sampled = time.perf_counter()
        rewards, failed = self._score(rows, episodes)
        scored = time.perf_counter()
        shared = self._shared(rewards, failed, episodes, device)
        advantages = group_advantages(shared["rewards"], self.weights, self.args.num_generations,
                                      self.args.scale_rewards, shared["failed"])
        self.judge.judge_scored(advantages.rewards)
        micro_batches = self._micro_batches(model, episodes, shared, advantages.advantages, device,
                                            [planned for _, planned in one_pass])
        tool_seconds = self.episodes.take_tool_seconds() if self.episodes else None
        self._note_rollout(shared, advantages, sampled - started, scored - sampled, tool_seconds)
        return micro_batches

    def _keep(self, key: list, micro_batches: list[tuple[dict, PlannedBatch]]) -> None:
        """Keep the rollout until its last pass: a run resumed between two passes trains on it, not on a new one."""
        kept = [({name: value.cpu() for name, value in batch.items()}, list(planned), vars(planned))
                for batch, planned in micro_batches]
        with replacing(self.kept, durable=True) as partial:  # on disk before the checkpoint that relies on it
            torch.save({"key": key, "micro_batches": kept}, partial)

    def _kept_rollout(self, key: list, device: torch.device) -> list[tuple[dict, PlannedBatch]] | None:
        """The rollout a run resumed between two passes over it trains on, if this process kept it; else None (the
        run had moved past the checkpoint it resumes from): it is sampled again, from the resumed weights."""
        kept = torch.load(self.kept, weights_only=True) if self.kept and self.kept.is_file() else None
        if kept is None or kept["key"] != key:
            warnings.warn("resumed between two passes over a rollout that is no longer kept (the run went on past "
                          "this checkpoint): sampling it again from the resumed weights", stacklevel=2)
            return None
        return [({name: value.to(device) for name, value in batch.items()},
                 PlannedBatch(indices, attributes["num_real"], attributes["units"], attributes["loss_scale"],
                              attributes["window"], tuple(attributes["tokens"])))
                for batch, indices, attributes in kept["micro_batches"]]

    def _sample(self, model, rows: list[int], epoch: int, window: int) -> list[Episode]:
        runs = [(row, len(list(group))) for row, group in itertools.groupby(rows)]
        prompted = self.prompts.select([row for row, _ in runs])
        counts = [count for _, count in runs]

        def seeds(turn: int) -> list[int]:
            # A completion's seed is the run's, the epoch's, the window's, its place in the window's global order and
            # its turn (the first turn's as a run without tools has it).
            entropy = [self.seed, epoch, window] + ([turn] if turn else [])
            everyone = np.random.SeedSequence(entropy).generate_state(len(rows) * self.world_size)
            return everyone[self._positions()].tolist()

        sample = functools.partial(sample_completions, temperature=self.args.temperature, top_p=self.args.top_p,
                                   pad_token_id=self.pad)
        prompts = prompted["prompt_ids"]
        if self.episodes is None:
            completions = sample(model, prompts, counts, seeds(0), max_new_tokens=self.args.max_completion_length)
            return [Episode(prompts[i], [], ids=c, trained=[1] * len(c), truncated=not c or c[-1] not in self.stop_ids)
                    for c, i in zip(completions, (i for i, count in enumerate(counts) for _ in range(count)),
                                    strict=True)]
        messages = [prompt_messages(json.loads(prompt)) for prompt in prompted["prompt_messages"]]
        return self.episodes.roll(model, prompts, counts, messages, seeds, sample, rows=row_columns(prompted),
                                  sharded=is_sharded(model))

    def _positions(self) -> list[int]:
        """Where this process's completions sit in the window's global order: micro-batch after micro-batch, each
        one's dealt round-robin to the processes."""
        world, batch = self.world_size, self.per_device_batch_size
        return [m * world * batch + self.rank + j * world for m in range(self.accumulation_steps) for j in range(batch)]

    def _score(self, rows: list[int], episodes: list[Episode]) -> tuple[np.ndarray, np.ndarray]:
        """``(rewards, failed)``, each ``[completions, functions]``: NaN where a function did not score a completion,
        1 where it failed. An episode with tools is scored as its messages, TRL's completion of a tool run."""
        if self.episodes is None:
            texts = self.tokenizer.batch_decode([e.ids for e in episodes], skip_special_tokens=True)
            scores = score_replies(self.pool, self.prompts.select(rows), texts)
        else:
            scores = score_episodes(self.pool, self.prompts.select(rows), episodes)
        self.failures.add(scores, rows=[row + 1 for row in rows])
        return scores.values, failed_table(scores, self.pool)

    def _shared(self, rewards: np.ndarray, failed: np.ndarray, episodes: list[Episode], device: torch.device
                ) -> dict:
        """Every process's completions' rewards, failures, sampled lengths, truncation and loss units (with tools:
        calls, turns and errors by kind), in the window's global order (micro-batch after micro-batch, each one's
        completions dealt round-robin to the processes); a function that failed too often stops the run here, on
        every process at once."""
        truncated = [e.truncated for e in episodes]
        width = self.args.max_completion_length
        if self.episodes is not None:  # sampled tokens and the tool turns between them
            width = max(width, int(all_reduce_max(torch.tensor(max(len(e.ids) for e in episodes), device=device))))
        mask = torch.tensor([e.trained + [0] * (width - len(e.ids)) for e in episodes])
        if self.args.mask_truncated_completions:
            mask[torch.tensor(truncated)] = 0
        units = completion_loss_units(mask, self.args.loss_type, self.args.max_completion_length)
        columns = {"rewards": rewards, "failed": failed, "lengths": [e.sampled for e in episodes],
                   "truncated": truncated, "units": units.numpy()}
        if self.episodes is not None:
            columns.update({"tool_calls": [e.tool_calls for e in episodes], "turns": [e.turns for e in episodes],
                            "tool_errors": [[e.errors[kind] for kind in ERROR_KINDS] for e in episodes]})
        local = np.column_stack(list(columns.values())).astype(np.float64)
        positions = self._positions()
        table = torch.zeros(len(positions) * self.world_size, local.shape[1], dtype=torch.float64)
        table[positions] = torch.from_numpy(local)
        table = all_reduce_sum(table.to(device)).cpu()  # each row is one process's; the others add zeros
        shared, start = {"positions": positions, "mask": mask, "width": width}, 0
        for name, values in columns.items():
            size = np.asarray(values, dtype=np.float64).reshape(len(episodes), -1).shape[1]
            block = table[:, start:start + size]
            shared[name] = block if name in ("rewards", "failed", "tool_errors") else block[:, 0]
            start += size
        self.judge.judge_failures(shared["failed"].sum(0), len(table))
        return shared

    def _micro_batches(self, model, episodes: list[Episode], shared: dict,
                       advantages: torch.Tensor, device: torch.device, planned: list[PlannedBatch]
                       ) -> list[tuple[dict, PlannedBatch]]:
        """Each micro-batch's prompts (each once) and completions (``finetune.tasks.causal_lm.reply_log_probs``'s
        batch; the tokens that train in ``completion_mask``), advantages and loss scale, with the log-probabilities
        a later pass over the rollout and the KL term need."""
        units_everywhere = float(shared["units"].sum())
        scale = self.world_size / units_everywhere if units_everywhere else 0.0
        width = shared["width"]
        made = []
        for m, share in enumerate(planned):
            mine = range(m * self.per_device_batch_size, (m + 1) * self.per_device_batch_size)
            # A prompt's completions sit together (its group, or this process's part of it): one row each run.
            runs = [(prompt, len(list(group))) for prompt, group in itertools.groupby(episodes[i].prompt for i in mine)]
            prompts = [prompt for prompt, _ in runs]
            prompt_ids, prompt_mask = _right_padded(prompts, self.pad, max(map(len, prompts)))
            reply_ids, reply_mask = _right_padded([episodes[i].ids for i in mine], self.pad, width)
            where = [shared["positions"][i] for i in mine]  # the rows' places in the window's global order
            batch = {"prompt_ids": prompt_ids, "prompt_mask": prompt_mask, "reply_ids": reply_ids,
                     "reply_mask": reply_mask, "prompt_of": torch.arange(len(runs)).repeat_interleave(
                         torch.tensor([count for _, count in runs])),
                     "completion_mask": shared["mask"][list(mine)], "advantages": advantages[where].float()}
            batch = {name: value.to(device) for name, value in batch.items()}
            self._add_log_probs(model, batch)
            units = int(shared["units"][where].sum())
            tokens = (int(prompt_mask.sum() + reply_mask.sum()), prompt_ids.numel() + reply_ids.numel())
            made.append((batch, PlannedBatch(list(share), len(mine), units, scale, share.window, tokens=tokens)))
        return made

    def _add_log_probs(self, model, batch: dict) -> None:
        """The log-probabilities the completions were sampled with, for passes after the first (``num_iterations``),
        and the reference's, for the KL term (``beta``)."""
        if self.args.num_iterations > 1:
            training = model.training
            model.eval()
            with torch.no_grad():
                batch["old_log_probs"] = reply_log_probs(model, batch, temperature=self.args.temperature)
            model.train(training)
        if self.args.beta:
            with torch.no_grad(), self.reference.model(model, batch["reply_ids"].device) as reference:
                batch["ref_log_probs"] = reply_log_probs(reference, batch, temperature=self.args.temperature)

    def loss(self, model, batch: dict) -> torch.Tensor:
        """A rollout micro-batch's policy loss, summed over its loss units; notes its clipping and KL figures."""
        log_probs = reply_log_probs(model, batch, temperature=self.args.temperature)
        loss, figures = policy_loss(log_probs, batch["advantages"], batch["completion_mask"].bool(),
                                    loss_type=self.args.loss_type,
                                    epsilon=self.args.epsilon, epsilon_high=self.args.epsilon_high,
                                    old_log_probs=batch.get("old_log_probs"), ref_log_probs=batch.get("ref_log_probs"),
                                    beta=self.args.beta)
        no_kl = figures["clipped_low"].new_zeros(())  # on the loss's device: the figures are stacked there
        self._loss_figures += torch.stack([figures["clipped_low"], figures["clipped_high"], figures.get("kl", no_kl),
                                           figures["tokens"]]).double().cpu()
        return loss

    def _note_rollout(self, shared: dict, advantages: Advantages, generation_seconds: float,
                      reward_seconds: float, tool_seconds: float | None) -> None:
        rewards, lengths = shared["rewards"], shared["lengths"]
        figures = {"reward": float(advantages.rewards.nanmean()), "reward_std": float(_nanstd(advantages.rewards, 0)),
                   "frac_reward_zero_std": float(advantages.zero_std.double().mean()),
                   "completions/mean_length": float(lengths.mean()), "completions/max_length": float(lengths.max()),
                   "completions/truncated_share": float(shared["truncated"].mean()),
                   "generation_seconds": generation_seconds, "reward_seconds": reward_seconds}
        for k, name in enumerate(self.names):
            figures[f"rewards/{name}/mean"] = float(rewards[:, k].nanmean())
            figures[f"rewards/{name}/std"] = float(_nanstd(rewards[:, k], 0))
        if tool_seconds is not None:  # sampling's time without the tools'
            calls = shared["tool_calls"]
            figures.update({"generation_seconds": generation_seconds - tool_seconds, "tool_seconds": tool_seconds,
                            "tools/calls/mean": float(calls.mean()), "tools/calls/max": float(calls.max()),
                            "tools/turns/mean": float(shared["turns"].mean())})
            errors = shared["tool_errors"].sum(0)
            figures.update({f"tools/errors/{kind}": float(count) for kind, count in zip(ERROR_KINDS, errors,
                                                                                        strict=True)})
        self._rollout_figures.append(figures)

    def interval_logs(self) -> dict[str, float]:
        """The rollouts' figures since the last call, averaged (``completions/max_length``: the longest), the share
        of completion tokens whose ratio was clipped, the KL term with ``beta``, and each function's failures so
        far. Every process must call it (the clipping is summed over them)."""
        self._stop_training_clock()
        logs = {}
        for name in self._rollout_figures[0] if self._rollout_figures else ():
            values = [f[name] for f in self._rollout_figures]
            logs[name] = max(values) if name.endswith(("max_length", "/max")) else sum(values) / len(values)
        low, high, kl, tokens = all_reduce_sum(self._loss_figures).tolist()
        tokens = max(tokens, 1.0)
        logs.update({"clip_ratio/low": low / tokens, "clip_ratio/high": high / tokens,
                     "clip_ratio/region": (low + high) / tokens})
        if self.args.beta:
            logs["kl"] = kl / tokens
        logs.update({f"reward_failures/{name}": float(self.judge.failed[k]) for k, name in enumerate(self.names)})
        self._rollout_figures, self._loss_figures = [], torch.zeros(4, dtype=torch.float64)
        return logs
