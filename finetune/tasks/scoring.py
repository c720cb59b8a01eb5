"""Scoring GRPO's replies with the reward functions: the call each function gets (TRL's), the check before training,
the evaluation's figures, and the judges of a run's scores: a function that fails too often over the newest
completions, rollouts that no function scored. The worker processes that run the functions are
``finetune.tasks.rewards``'."""

from __future__ import annotations

import json
import sys
from collections import deque

import datasets
import numpy as np
import torch

from finetune.errors import UserError
from finetune.tasks.rewards import RewardFailures, RewardPool, RewardScores, check_reward_signature

__all__ = ["FAILURE_WINDOW", "MIN_JUDGED", "UNSCORED_ROLLOUTS", "RewardJudge", "check_rewards_on",
           "failed_table", "reward_figures", "reward_names", "score_replies"]

FAILURE_WINDOW = 256
"""Completions (the newest rollouts', over every process) over which ``--max_reward_failures`` judges a function: a
function that starts failing late in a long run is stopped within a window, not after a share of the whole run."""
MIN_JUDGED = 64
"""The fewest completions a share is taken of: one failure among a first step's 16 is not 6% of the run."""
UNSCORED_ROLLOUTS = 3
"""Rollouts in a row with no completion scored (every function returned None) before the run stops: a warning at
each before that."""


def reward_names(specs: list[str]) -> list[str]:
    """How the logs name each reward function: its name (TRL's ``rewards/NAME/mean``), or its whole spec where two
    functions share a name."""
    names = [spec.rsplit(":", 1)[-1] for spec in specs]
    return [name if names.count(name) == 1 else spec for name, spec in zip(names, specs, strict=True)]


def score_replies(pool: RewardPool, rows: datasets.Dataset, texts: list[str] | list[list[dict]],
                  prompts: list | None = None, environments: list[bytes] | None = None) -> RewardScores:
    """The reward functions' scores of the replies ``texts`` to the prompts ``rows`` (of ``tokenize_prompts``), each
    function given what TRL gives it: the prompts as the data has them (or ``prompts``: an environment's first
    observation added), the completions (a conversation's as a list holding the assistant's message; an episode
    with tools as its messages, given as such), the rows' other columns, and ``environments`` (pickled states)."""
    prompts = prompts or [json.loads(p) for p in rows["prompt_messages"]]
    replies = [text if isinstance(prompt, str) or isinstance(text, list) else [{"role": "assistant", "content": text}]
               for prompt, text in zip(prompts, texts, strict=True)]
    columns = [json.loads(c) for c in rows["columns"]]
    columns = {key: [c[key] for c in columns] for key in (columns[0] if columns else ())}
    if environments is not None:
        columns["environments"] = environments
    return pool.score(prompts, replies, columns)


def check_rewards_on(pool: RewardPool, row: dict, environment: bytes | None = None) -> None:
    """Each of ``pool``'s reward functions called once, in its workers under ``--reward_timeout``, on the first row
    of ``tokenize_prompts`` with an empty reply (and ``environment``, a started one's state), as training calls it
    (``finetune.tasks.rewards.check_reward_signature``: a function that cannot take the call, or hangs, is refused
    before the model loads)."""
    prompt = json.loads(row["prompt_messages"])
    reply = "" if isinstance(prompt, str) else [{"role": "assistant", "content": ""}]
    columns = json.loads(row["columns"])
    if environment is not None:
        columns["environments"] = environment
    check_reward_signature(pool, prompt, reply, columns)


def failed_table(scores: RewardScores, pool: RewardPool) -> np.ndarray:
    """``[replies, functions]``: 1 where a function failed on a reply."""
    failed = np.zeros(scores.values.shape)
    for failure in scores.failures:
        failed[failure.row, pool.names.index(failure.name)] = 1
    return failed


def reward_figures(values: np.ndarray, failed: np.ndarray, names: list[str], weights: np.ndarray) -> dict[str, float]:
    """An evaluation's ``reward`` (the weighted sum) and ``rewards/NAME/mean`` of the replies, each over the replies
    its functions scored, and ``reward_failures/NAME``, the replies each function failed on: a reply any function
    failed on has no sum (as in training), and a failure counts in no mean, as 0 would. From the rewards ``values``
    and ``failed`` (each ``[replies, functions]``) of functions ``names``."""
    totals = np.where(np.isnan(values).all(1) | failed.any(1), np.nan, (np.nan_to_num(values) * weights).sum(1))
    figures = {"reward": totals, **{f"rewards/{name}/mean": values[:, k] for k, name in enumerate(names)}}
    means = {name: float(np.nanmean(v)) for name, v in figures.items() if not np.isnan(v).all()}
    return {**means, **{f"reward_failures/{name}": int(failed[:, k].sum()) for k, name in enumerate(names)}}


class RewardJudge:
    """Stops a run whose rewards cannot train it, on every process at once (it is given every process's figures):
    a function that failed on more than ``max_share`` of the newest ``FAILURE_WINDOW`` completions (counted over at
    least ``MIN_JUDGED``), or ``UNSCORED_ROLLOUTS`` rollouts in a row that no function scored. ``failures`` are this
    process's, which name the row and exception a stop is for."""

    def __init__(self, failures: RewardFailures, max_share: float, rank: int = 0):
        self.failures, self.max_share, self.rank = failures, max_share, rank
        self.failed = torch.zeros(len(failures.counts), dtype=torch.float64)
        """Each function's failures over the run, for the logs."""
        self.recent: deque[tuple[torch.Tensor, int]] = deque()
        self.unscored_in_a_row = 0

    def judge_failures(self, failed: torch.Tensor, scored: int) -> None:
        """Add a rollout's failures of each function (``failed``) among its ``scored`` completions.

        Raises:
            UserError: a function failed on more than ``max_share`` of the newest completions.
        """
        self.failed += failed
        self.recent.append((failed, scored))
        while sum(count for _, count in self.recent) - self.recent[0][1] >= FAILURE_WINDOW:
            self.recent.popleft()
        failed_recently = sum(f for f, _ in self.recent)
        counted = sum(count for _, count in self.recent)
        over = torch.nonzero(failed_recently > self.max_share * max(counted, MIN_JUDGED)).flatten().tolist()
        if not over:
            return
        self.failures.check(0.0)  # this process's own failures, named
        name = list(self.failures.counts)[over[0]]
        raise UserError(f"reward function {name} failed on {int(failed_recently[over[0]])} of the last {counted} "
                        f"completions over all processes, more than --max_reward_failures {self.max_share:g}; the "
                        "error line of the process that saw it names the row")

    def state_dict(self) -> dict:
        """The counters, for a checkpoint: a resumed run judges the same window as the uninterrupted one."""
        return {"failed": self.failed.tolist(), "recent": [[failed.tolist(), scored] for failed, scored in self.recent],
                "unscored_in_a_row": self.unscored_in_a_row}

    def load_state_dict(self, state: dict) -> None:
        self.failed = torch.tensor(state["failed"], dtype=torch.float64)
        self.recent = deque((torch.tensor(failed, dtype=torch.float64), scored) for failed, scored in state["recent"])
        self.unscored_in_a_row = state["unscored_in_a_row"]

    def judge_scored(self, rewards: torch.Tensor) -> None:
        """Say when no function scored any of a rollout's completions (``rewards``, NaN where none did: every one
        returned None, as a function that reads a misnamed column with ``columns.get`` does), which trains nothing.

        Raises:
            UserError: the ``UNSCORED_ROLLOUTS``-th such rollout in a row.
        """
        if not rewards.isnan().all():
            self.unscored_in_a_row = 0
            return
        self.unscored_in_a_row += 1
        what = (f"no reward function scored any of this step's {len(rewards)} completions (each returned None or "
                "failed), so it trains nothing")
        if self.unscored_in_a_row >= UNSCORED_ROLLOUTS:
            raise UserError(f"{what}, {UNSCORED_ROLLOUTS} rollouts in a row; check that the functions read columns "
                            "the data has (None means 'not mine')")
        if self.rank == 0:
            print(f"warning: {what}", file=sys.stderr, flush=True)
