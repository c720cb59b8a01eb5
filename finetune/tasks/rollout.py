"""GRPO's rollouts: the plan of an epoch's rollouts (``RolloutSampler``), sampling seeded per completion
(``sample_completions``), and ``Rollouts``, which turns each optimizer step's prompts into the micro-batches that
train on their completions: sampled (episodes of several turns with tools: ``finetune.tasks.episodes``), scored,
shared across processes, their advantages and loss units counted over the whole step.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import itertools
import json
import time
import warnings
from pathlib import Path

import datasets
import numpy as np
import torch

from finetune.checkpointing.files import replacing
from finetune.data.batching import LENGTH, GlobalBatchSampler, PlannedBatch, pad_token_id
from finetune.distributed.ddp import all_reduce_max, all_reduce_sum
from finetune.distributed.fsdp import is_sharded
from finetune.errors import UserError
from finetune.task import CountedBatch
from finetune.tasks.causal_lm import cache_keyword, decode_replies, forward_takes, plain_cache, reply_log_probs
from finetune.tasks.episodes import Episode, Episodes, score_episodes, tool_figures, tool_table
from finetune.tasks.grpo import (
    Advantages,
    check_whole_groups,
    completion_loss_units,
    group_advantages,
    nanstd,
    policy_loss,
)
from finetune.tasks.rewards import RewardFailures, RewardPool
from finetune.tasks.scoring import RewardJudge, failed_table, reward_figures, reward_names, score_replies

__all__ = ["EvalReplyRewards", "KeptCache", "RolloutSampler", "Rollouts", "greedy_sampling", "sample_completions"]


class RolloutSampler(GlobalBatchSampler):
    """The plan of an epoch of rollouts: its prompts shuffled by ``seed + epoch``, cut into windows of one
    optimizer step's completions (per-device batch x processes x accumulation, counted in completions), each prompt
    repeated ``num_generations`` times in a row, so a group's completions are consecutive in the global order
    (dealt round-robin to the processes, a group may span them). A window is trained ``num_iterations`` times
    over, its micro-batches planned again for each; the prompts left over after the last whole window sit the
    epoch out (the next epoch's shuffle draws from all of them again).

    Loss units and scales are the rollout's to set (``Rollouts``): they are known only once the completions are.
    """

    def __init__(self, prompt_lengths, per_device_batch_size: int, num_replicas: int, *, seed: int,
                 accumulation_steps: int, num_generations: int, num_iterations: int = 1, rank: int | None = None):
        super().__init__(prompt_lengths, per_device_batch_size, num_replicas, seed=seed, group_by_length=False,
                         accumulation_steps=accumulation_steps, rank=rank)
        self.num_generations, self.num_iterations = num_generations, num_iterations
        self.prompts_per_window = self.global_batch_size * accumulation_steps // num_generations

    @classmethod
    def for_run(cls, prompt_lengths, cfg, args, world_size: int) -> RolloutSampler:
        """The plan of a run of ``TrainConfig`` ``cfg`` and ``GRPOArguments`` ``args`` on ``world_size`` processes.

        Raises:
            UserError: a step's completions over every process do not hold whole groups, or the prompts are fewer
                than a step's.
        """
        check_whole_groups(cfg.per_device_train_batch_size * world_size * cfg.gradient_accumulation_steps,
                           args.num_generations)
        sampler = cls(prompt_lengths, cfg.per_device_train_batch_size, world_size, seed=cfg.seed,
                      accumulation_steps=cfg.gradient_accumulation_steps, num_generations=args.num_generations,
                      num_iterations=args.num_iterations)
        if not sampler.windows:
            raise UserError(f"{len(prompt_lengths)} training prompts are fewer than a step's "
                            f"{sampler.prompts_per_window}; lower --per_device_train_batch_size or "
                            "--gradient_accumulation_steps, or add prompts")
        return sampler

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


@dataclasses.dataclass
class KeptCache:
    """The keys and values of a ``sample_completions`` call's rows (``keep=True``), for the next turn of each:
    ``attention`` is 1 at the columns that hold a token of the row's context (its prompt, then its reply but the
    tokens sampled after it ended), in order, so a row's cache holds the first ``attention[row].sum()`` tokens of
    its context."""

    cache: object
    attention: torch.Tensor

    @staticmethod
    def of(cache, attention: torch.Tensor) -> KeptCache | None:
        """None where the cache is not plain (``plain_cache``): such a model's next turn runs its whole context
        again."""
        return KeptCache(cache, attention) if plain_cache(cache) else None

    def select(self, rows: list[int]) -> KeptCache:
        """These rows, in this order, each row's columns packed to the right (what went before dropped): the
        cache is as wide as the longest context it holds, however many turns and ended rows it has seen. (Each
        column's position was set when it ran, so moving it changes nothing.) The cache is changed in place."""
        kept = torch.tensor(rows, device=self.attention.device)
        attention = self.attention[kept]
        width = int(attention.sum(1).max())
        order = torch.argsort(attention, dim=1, stable=True)[:, -width:]  # dead columns first, then live, in order
        for layer in self.cache.layers:
            index = order[:, None, :, None].expand(-1, layer.keys.shape[1], -1, layer.keys.shape[-1])
            layer.keys = layer.keys[kept].gather(2, index)
            layer.values = layer.values[kept].gather(2, index)
        return KeptCache(self.cache, attention.gather(1, order))


def sample_completions(model, prompts: list[list[int]], counts: list[int], seeds: list[int], *, max_new_tokens: int,
                       temperature: float, top_p: float, pad_token_id: int, past: KeptCache | None = None,
                       keep: bool = False):
    """``counts[i]`` sampled completions of each prompt (token ids), in order: each completion through its first
    end-of-turn token (the model's ``generation_config.eos_token_id``), or ``max_new_tokens`` long.

    Each completion draws from a generator of its own, seeded with its entry of ``seeds``: a completion depends on
    its seed and prompt, not on which others share its batch or process, so a run samples the same completions on
    any number of processes, and a resumed run what the uninterrupted one did. Each prompt's KV cache is computed
    once and copied to its completions. ``model`` is unwrapped; it samples in eval mode (no dropout). At
    ``temperature`` 0 every completion is the greedy one.

    An episode's next turn runs only its new tokens: ``past`` (each prompt's row, counts all 1) holds the start of
    each prompt, the context of the row's last call, and ``keep=True`` returns ``(completions, KeptCache)`` (None
    for a model whose cache cannot be run on: ``KeptCache.of``).
    """
    device = next(model.parameters()).device
    held = past.attention.sum(1).tolist() if past is not None else [0] * len(prompts)
    news = [p[h:] for p, h in zip(prompts, held, strict=True)]
    # At least two columns: one prompt column at least is run before the loop, as every call does (a sharded
    # model's processes run their forwards together).
    longest = max(2, *map(len, news))
    ids = torch.tensor([[pad_token_id] * (longest - len(p)) + p for p in news], device=device)
    mask = torch.tensor([[0] * (longest - len(p)) + [1] * len(p) for p in news], device=device)
    rows = torch.repeat_interleave(torch.arange(len(prompts), device=device), torch.tensor(counts, device=device))
    generators = [torch.Generator(device).manual_seed(seed) for seed in seeds]
    stops = torch.tensor(model.generation_config.eos_token_id, device=device).view(-1)
    positions = torch.tensor(held, device=device)[:, None] + (mask.cumsum(1) - 1).clamp(min=0)
    keyword = cache_keyword(model)
    prefill = {} if past is None else {keyword: past.cache}
    if forward_takes(model, "logits_to_keep"):  # of each prompt token, none is sampled
        prefill["logits_to_keep"] = 1
    attention = mask if past is None else torch.cat([past.attention, mask], 1)
    sharded = is_sharded(model)
    training = model.training
    model.eval()
    try:
        with torch.no_grad():
            # The new tokens but the last, once for each prompt; the last token is the first input of the loop.
            cache = getattr(model(input_ids=ids[:, :-1], attention_mask=attention[:, :-1], use_cache=True,
                                  position_ids=positions[:, :-1], **prefill), keyword)
            if any(count != 1 for count in counts):
                cache.reorder_cache(rows)
            tokens, attention, positions = ids[rows, -1:], attention[rows], positions[rows, -1:]
            first = attention.shape[1]  # the column of the first sampled token
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
    completions = [row[:length].tolist() for row, length in zip(generated, lengths.tolist(), strict=True)]
    if not keep:
        return completions
    # The cache holds every input so far, not the last sampled token; what a row sampled after its end is masked.
    attention = attention[:, :cache.get_seq_length()].clone()
    sampled = torch.arange(attention.shape[1], device=device)[None] - first
    attention[sampled >= lengths[:, None]] = 0
    return completions, KeptCache.of(cache, attention)


def widest_micro_batch(positions: list[int], per_device_batch_size: int, num_generations: int) -> list[int]:
    """The prompt groups of the completions at ``positions`` (a process's, micro-batch after micro-batch) in the
    micro-batch that spans the most groups: each group's prompt runs in it."""
    micro_batches = [positions[start:start + per_device_batch_size]
                     for start in range(0, len(positions), per_device_batch_size)]
    return max(([position // num_generations for position in batch] for batch in micro_batches),
               key=lambda groups: len(set(groups)))


def greedy_sampling(pad_token_id: int):
    """``sample_completions`` at temperature 0, as ``finetune.tasks.episodes.Episodes.roll`` takes it."""
    return functools.partial(sample_completions, temperature=0.0, top_p=1.0, pad_token_id=pad_token_id)


def _right_padded(rows: list[list[int]], pad: int, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(ids, mask)``, each ``[len(rows), width]``: the token id lists, padded on the right."""
    ids = torch.tensor([row + [pad] * (width - len(row)) for row in rows])
    mask = torch.tensor([[1] * len(row) + [0] * (width - len(row)) for row in rows])
    return ids, mask


def _prompts_and_replies(runs: list[tuple[list[int], int]], replies: list[list[int]], pad: int, width: int) -> dict:
    """``reply_log_probs``'s batch: a row for each run of ``(prompt, how many replies in a row are its)``, and the
    ``replies`` right-padded to ``width``."""
    prompts = [prompt for prompt, _ in runs]
    prompt_ids, prompt_mask = _right_padded(prompts, pad, max(map(len, prompts)))
    reply_ids, reply_mask = _right_padded(replies, pad, width)
    return {"prompt_ids": prompt_ids, "prompt_mask": prompt_mask, "reply_ids": reply_ids, "reply_mask": reply_mask,
            "prompt_of": torch.arange(len(runs)).repeat_interleave(torch.tensor([count for _, count in runs]))}


def _nucleus(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """``probs`` with each row cut to its smallest set of tokens whose probability reaches ``top_p`` (at least the
    likeliest), renormalised by the sampling."""
    if top_p >= 1:
        return probs
    ordered, order = probs.sort(-1, descending=True)
    outside = ordered.cumsum(-1) - ordered >= top_p  # the tokens after the set reaches top_p
    return probs.scatter(-1, order, ordered.masked_fill(outside, 0.0))


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
        self.pad = pad_token_id(tokenizer)
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
        if self.episodes:
            self.episodes.take_tool_seconds()  # (an evaluation's since the last rollout)
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
        """The rollout a run resumed between two passes over it trains on, if every process kept its own; else None
        (the run had moved past the checkpoint it resumes from, on one process at least): it is sampled again, from
        the resumed weights, on every process, whose sampling and scoring take part in collectives together."""
        kept = torch.load(self.kept, weights_only=True) if self.kept and self.kept.is_file() else None
        missing = kept is None or kept["key"] != key
        if all_reduce_max(torch.tensor(int(missing), device=device)).item():
            warnings.warn("resumed between two passes over a rollout that is no longer kept (on this process or "
                          "another: the run went on past this checkpoint): sampling it again from the resumed weights",
                          stacklevel=2)
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
        return self.episodes.roll_rows(model, prompted, counts, seeds, sample, sharded=is_sharded(model))

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
            columns["tools"] = tool_table(episodes)
        local = np.column_stack(list(columns.values())).astype(np.float64)
        positions = self._positions()
        table = torch.zeros(len(positions) * self.world_size, local.shape[1], dtype=torch.float64)
        table[positions] = torch.from_numpy(local)
        table = all_reduce_sum(table.to(device)).cpu()  # each row is one process's; the others add zeros
        shared, start = {"positions": positions, "mask": mask, "width": width}, 0
        for name, values in columns.items():
            size = np.asarray(values, dtype=np.float64).reshape(len(episodes), -1).shape[1]
            block = table[:, start:start + size]
            shared[name] = block if name in ("rewards", "failed", "tools") else block[:, 0]
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
            where = [shared["positions"][i] for i in mine]  # the rows' places in the window's global order
            batch = {**_prompts_and_replies(runs, [episodes[i].ids for i in mine], self.pad, width),
                     "completion_mask": shared["mask"][list(mine)], "advantages": advantages[where].float()}
            tokens = (int(batch["prompt_mask"].sum() + batch["reply_mask"].sum()),
                      batch["prompt_ids"].numel() + batch["reply_ids"].numel())
            batch = {name: value.to(device) for name, value in batch.items()}
            self._add_log_probs(model, batch)
            units = int(shared["units"][where].sum())
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
        loss, figures = self._loss_and_figures(model, batch)
        no_kl = figures["clipped_low"].new_zeros(())  # on the loss's device: the figures are stacked there
        self._loss_figures += torch.stack([figures["clipped_low"], figures["clipped_high"], figures.get("kl", no_kl),
                                           figures["tokens"]]).double().cpu()
        return loss

    def _loss_and_figures(self, model, batch: dict) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        log_probs = reply_log_probs(model, batch, temperature=self.args.temperature)
        return policy_loss(log_probs, batch["advantages"], batch["completion_mask"].bool(),
                           loss_type=self.args.loss_type, epsilon=self.args.epsilon,
                           epsilon_high=self.args.epsilon_high, old_log_probs=batch.get("old_log_probs"),
                           ref_log_probs=batch.get("ref_log_probs"), beta=self.args.beta)

    def largest_micro_batch(self) -> CountedBatch:
        """The largest micro-batch this process can train on, for the memory prediction: its share of the
        micro-batch of a window that spans the most prompts, each completion ``max_completion_length`` tokens after
        the longest prompt (an episode's tool results come on top)."""
        longest = self.prompts[int(np.argmax(self.prompts[LENGTH]))]["prompt_ids"]
        groups = widest_micro_batch(self._positions(), self.per_device_batch_size, self.args.num_generations)
        rows = [{"prompt_ids": longest, "reply_ids": [self.pad] * self.args.max_completion_length, "group": group}
                for group in groups]
        return CountedBatch(rows, self._counted_batch, lambda model, batch: self._loss_and_figures(model, batch)[0],
                            tokens=f"{len(rows)} x {len(longest) + self.args.max_completion_length}")

    def _counted_batch(self, rows: list[dict]) -> dict:
        """``largest_micro_batch``'s rows as ``_micro_batches`` makes a batch (each prompt once)."""
        runs = [(rows[0]["prompt_ids"], len(list(members)))
                for _, members in itertools.groupby(row["group"] for row in rows)]
        batch = _prompts_and_replies(runs, [row["reply_ids"] for row in rows], self.pad, len(rows[0]["reply_ids"]))
        batch |= {"completion_mask": batch["reply_mask"], "advantages": torch.ones(len(rows))}
        for kept, needed in (("old_log_probs", self.args.num_iterations > 1), ("ref_log_probs", self.args.beta)):
            if needed:
                batch[kept] = torch.zeros(batch["reply_ids"].shape)
        return batch

    def _note_rollout(self, shared: dict, advantages: Advantages, generation_seconds: float,
                      reward_seconds: float, tool_seconds: float | None) -> None:
        rewards, lengths = shared["rewards"], shared["lengths"]
        figures = {"reward": float(advantages.rewards.nanmean()), "reward_std": float(nanstd(advantages.rewards, 0)),
                   "frac_reward_zero_std": float(advantages.zero_std.double().mean()),
                   "completions/mean_length": float(lengths.mean()), "completions/max_length": float(lengths.max()),
                   "completions/truncated_share": float(shared["truncated"].mean()),
                   "generation_seconds": generation_seconds, "reward_seconds": reward_seconds}
        for k, name in enumerate(self.names):
            figures[f"rewards/{name}/mean"] = float(rewards[:, k].nanmean())
            figures[f"rewards/{name}/std"] = float(nanstd(rewards[:, k], 0))
        if tool_seconds is not None:  # sampling's time without the tools'
            figures.update({"generation_seconds": generation_seconds - tool_seconds, "tool_seconds": tool_seconds,
                            **tool_figures(shared["tools"].numpy())})
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


class EvalReplyRewards:
    """The evaluation without tools (``finetune.tasks.episodes.EvalEpisodes``' twin): the greedy replies of
    ``replies`` (``finetune.tasks.causal_lm.EvalReplies``) scored by the reward functions of ``rewards`` where they
    were generated, a batch at a time (each call under ``--reward_timeout``, as in training), and by the data's own
    check where it has one."""

    def __init__(self, replies, rewards: RewardPool, weights: np.ndarray):
        self.replies, self.rewards, self.weights = replies, rewards, weights

    def outputs(self, model, index: torch.Tensor) -> tuple[torch.Tensor, ...]:
        replies = self.replies.generate(model, index)
        values = np.full((len(index), len(self.rewards.names)), np.nan)
        failed = np.zeros_like(values)
        replied = [row for row, i in enumerate(index.tolist()) if i < len(self.replies.prompts)]  # (--eval_generate)
        if replied:
            scores = score_replies(self.rewards, self.replies.prompted.select(index[replied].tolist()),
                                   decode_replies(replies[replied], len(replied), self.replies.tokenizer))
            values[replied], failed[replied] = scores.values, failed_table(scores, self.rewards)
        return replies, torch.from_numpy(values).to(index.device), torch.from_numpy(failed).to(index.device)

    def metrics(self, outputs: tuple[torch.Tensor, ...]) -> dict[str, float]:
        replies, values, failed = outputs
        count = len(self.replies.prompts)
        return {**reward_figures(values[:count].cpu().numpy(), failed[:count].cpu().numpy(),
                                 reward_names(self.rewards.names), self.weights),
                **self.replies.metrics(replies)}

    def write(self, tokens: torch.Tensor, output_dir: str) -> None:
        self.replies.write(tokens, output_dir)
