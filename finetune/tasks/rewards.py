"""Rewards a program checks, for online RL (GRPO): the reward functions' calls in the worker pool
(``finetune.tasks.workers``), checking them once before training, and the failures counted over a run.

A reward function has TRL's ``GRPOTrainer`` signature, ``func(prompts, completions, **columns)``, called with
keywords: ``prompts`` and ``completions`` as the caller has them (text or messages) and the dataset's other columns
as lists aligned with the completions. It returns one reward per completion, a number or ``None`` where it does not
apply to that row. It is named ``module:function``, the module a dotted name or a ``.py`` file, and runs in a worker
process: one that hangs or kills its process costs that batch's rewards, not the run.
"""

from __future__ import annotations

import math
import pickle
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from finetune.errors import UserError
from finetune.tasks.workers import Call, FunctionKind, WorkerPool, check_specs, load_funcs, raised

if TYPE_CHECKING:
    import numpy as np

__all__ = ["REWARD_FUNCTION", "SIGNATURE", "FailureCount", "RewardFailure", "RewardFailures", "RewardFunc",
           "RewardPool", "RewardScores", "check_reward_signature", "check_reward_specs", "load_reward_funcs"]

SIGNATURE = "func(prompts, completions, **columns) -> list of floats or None"
REWARD_FUNCTION = FunctionKind("reward function", "reward", SIGNATURE, "my_rewards:accuracy or rewards.py:accuracy")


@dataclass(frozen=True)
class RewardFunc:
    """A loaded reward function and the spec that named it."""

    name: str
    """The spec as given, ``module:function``."""
    func: Callable[..., Any]


def check_reward_specs(specs: Sequence[str]) -> None:
    """What can be wrong with ``specs`` short of importing them (``finetune.tasks.workers.check_specs``).

    Raises:
        UserError: a spec without a colon or given twice, a file that is not there, a module not found.
    """
    check_specs(specs, REWARD_FUNCTION)


def load_reward_funcs(specs: Sequence[str]) -> list[RewardFunc]:
    """The reward functions ``specs`` name, each ``module:function``: a dotted module importable here, or the path
    to a ``.py`` file (relative to the working directory, or absolute).

    Raises:
        UserError: what ``check_reward_specs`` refuses, a module that cannot be imported (with what it raised), no
            such function in it, or something that is not callable.
    """
    return [RewardFunc(spec, func) for spec, func in zip(specs, load_funcs(specs, REWARD_FUNCTION), strict=True)]


def _plural(count: int, word: str) -> str:
    return f"{count} {word}{'' if count == 1 else 's'}"


def _outcome(value: Any) -> float | None | str:
    """A returned reward as a float, None, or the reason it is not one."""
    if value is None:
        return None
    if not isinstance(value, (str, bytes)) and hasattr(type(value), "__float__"):  # numpy and torch scalars too
        try:
            number = float(value)
        except Exception:  # a tensor of several values
            number = None
        if number is not None:
            if math.isfinite(number):
                return number
            return f"returned {number}, not a finite number (return None for a row the function does not apply to)"
    text = repr(value)
    return f"returned {text if len(text) <= 60 else text[:57] + '...'} ({type(value).__name__}), not a number or None"


def _outcomes(result: Any, count: int) -> list[float | None | str] | str:
    """Each of ``count`` rows' reward (float, None, or why it is not one), or why ``result`` is not ``count``
    rewards."""
    if not isinstance(result, (list, tuple)) and hasattr(result, "tolist"):  # a numpy array or a tensor
        result = result.tolist()
    if not isinstance(result, (list, tuple)):
        return f"returned a {type(result).__name__}, not a list of {_plural(count, 'reward')}"
    if len(result) != count:
        return f"returned {_plural(len(result), 'reward')} for {_plural(count, 'completion')}"
    return [_outcome(value) for value in result]


def check_reward_signature(pool: RewardPool, prompt: Any, completion: Any, row: Mapping[str, Any] | None = None
                           ) -> None:
    """Call each of ``pool``'s functions once on one example row (``prompt``, ``completion`` and the row's other
    columns ``row``), as training will call it on a batch, so that a function that cannot run fails before training
    starts. The call runs in the pool's workers under its timeout: a function that hangs fails too.

    Raises:
        UserError: naming the first function that failed, and how (it raised, hung, killed its worker, or did not
            return one number or None).
    """
    columns = {name: [value] for name, value in (row or {}).items()}
    failures = pool.score([prompt], [completion], columns).failures
    if not failures:
        return
    failure = failures[0]
    if failure.reason.startswith(("raised TypeError", "returned")):
        called = f"called as func(prompts=[...], completions=[...]{''.join(f', {n}=[...]' for n in columns)})"
        hint = f"expected TRL's signature {SIGNATURE}, {called}"
    elif failure.reason.startswith("timed out"):
        hint = "make it score one row within --reward_timeout, or give a longer --reward_timeout"
    else:
        hint = "fix the function so that it scores this row"
    raise UserError(f"reward function {failure.name} {failure.reason} on an example row; {hint}")


@dataclass(frozen=True)
class RewardFailure:
    """One function's failure on one row of a batch."""

    name: str
    """The function's spec."""
    row: int
    """The row's position in the batch."""
    reason: str
    """What went wrong, one line: ``raised ...``, ``returned ...``, ``timed out ...``, ``the worker ... died ...``."""


@dataclass
class RewardScores:
    """A batch's rewards from every function, and where they failed."""

    values: np.ndarray
    """``[completions, functions]`` float64 rewards, NaN where a function returned None or failed."""
    failures: list[RewardFailure]
    """Each function's failed rows, in the order of the functions, then of the rows."""


class RewardPool(WorkerPool):
    """Worker processes that score completions with the reward functions ``specs``; use it as a context manager.

    Each worker imports every function, so ``workers`` of them (one per function by default) run different
    functions on the same batch at once; ``timeout`` and ``passed_environment`` as ``WorkerPool``'s. With an
    ``environment`` class (``finetune.tasks.tools``), a column ``environments`` of pickled instances reaches the
    functions unpickled, TRL's ``environments=``.

    Raises:
        UserError: a worker cannot load the functions (see ``load_reward_funcs``) or does not start within
            ``finetune.tasks.workers.STARTUP_TIMEOUT`` seconds.
    """

    def __init__(self, specs: Sequence[str], workers: int | None = None, timeout: float = 60.0,
                 passed_environment: Sequence[str] = (), environment: str | None = None):
        super().__init__(specs, kind=REWARD_FUNCTION, handler=__name__, workers=workers, timeout=timeout,
                         passed_environment=passed_environment, preload=[environment] if environment else [])

    def score(self, prompts: Sequence, completions: Sequence, columns: Mapping[str, Sequence] | None = None
              ) -> RewardScores:
        """Every function's rewards for the batch, and the rows where a function failed.

        A function that raises or returns the wrong number of rewards for the batch is called again row by row, so
        that only the rows it fails on fail (within one more ``timeout``). A timeout or a dead worker fails every
        row of the call with the same reason. A reward that is not a finite number fails its row.
        """
        import numpy as np  # here, not at the top: workers run this module and need no numpy

        columns = dict(columns or {})
        count = len(completions)
        for name, values in [("prompts", prompts), *columns.items()]:
            if len(values) != count:
                raise ValueError(f"{name} has {len(values)} rows for {count} completions")
        if not count:
            return RewardScores(np.zeros((0, len(self.names))), [])
        payload = pickle.dumps((prompts, completions, columns), protocol=pickle.HIGHEST_PROTOCOL)
        rewards = np.full((count, len(self.names)), np.nan, dtype=np.float64)
        failed: dict[tuple[int, int], str] = {}

        def settle(call: Call, reply: tuple) -> list[Call]:
            kind, body = reply
            if kind == "values":
                for row, outcome in enumerate(body):
                    if isinstance(outcome, str):
                        failed[call.func, row] = outcome
                    elif outcome is not None:
                        rewards[row, call.func] = outcome
            elif kind == "failed" and call.mode == "batch" and count > 1:
                return [Call(call.func, "rows", payload, tag=body)]
            else:
                after = f", calling it row by row after the batch call {call.tag}" if call.mode == "rows" else ""
                reason = f"{body}{after}"
                failed.update(((call.func, row), reason) for row in range(count))
            return []

        self.run([Call(func, "batch", payload) for func in range(len(self.names))], settle)
        failures = [RewardFailure(self.names[func], row, failed[func, row]) for func, row in sorted(failed)]
        return RewardScores(rewards, failures)

@dataclass
class FailureCount:
    """One function's failures so far."""

    scored: int = 0
    """Rows the function was called on."""
    failed: int = 0
    first_row: int | None = None
    first_reason: str | None = None

    @property
    def share(self) -> float:
        return self.failed / self.scored if self.scored else 0.0


class RewardFailures:
    """Each reward function's failed rows over a run: ``add`` a step's scores, ``check`` the share, log
    ``figures``."""

    def __init__(self, names: Sequence[str]):
        self.counts = {name: FailureCount() for name in names}
        self._rows_seen = 0

    def add(self, scores: RewardScores, rows: Sequence[int] | None = None) -> None:
        """Count a batch's scores; ``rows`` names each completion's row in messages (the dataset's row number, say),
        by default its position among the completions added so far, from 0."""
        count = len(scores.values)
        rows = list(rows) if rows is not None else list(range(self._rows_seen, self._rows_seen + count))
        if len(rows) != count:
            raise ValueError(f"{len(rows)} row numbers for {count} completions")
        self._rows_seen += count
        for tally in self.counts.values():
            tally.scored += count
        for failure in scores.failures:
            tally = self.counts[failure.name]
            tally.failed += 1
            if tally.first_row is None:
                tally.first_row, tally.first_reason = rows[failure.row], failure.reason

    def check(self, max_share: float) -> None:
        """Raises ``UserError`` once a function has failed on more than ``max_share`` of its rows so far (the
        ``--max_reward_failures`` flag)."""
        if not 0 <= max_share <= 1:
            raise UserError(f"--max_reward_failures is {max_share}; give a share of rows from 0 to 1")
        for name, tally in self.counts.items():
            if tally.share > max_share:
                raise UserError(
                    f"reward function {name} failed on {tally.failed} of {tally.scored} rows ({tally.share:.1%}), more "
                    f"than --max_reward_failures {max_share:g} allows; first on row {tally.first_row}: "
                    f"{tally.first_reason}; fix the function, or raise --max_reward_failures, the share of its rows a "
                    "reward function may fail on")

    def figures(self) -> dict[str, float]:
        """``reward_failures/NAME`` (failed rows so far) and ``reward_failures/NAME/share`` (of the rows scored)."""
        figures = {}
        for name, tally in self.counts.items():
            figures[f"reward_failures/{name}"] = tally.failed
            figures[f"reward_failures/{name}/share"] = tally.share
        return figures


# -- in the worker process

def ready(funcs: list[Callable[..., Any]], specs: list[str]) -> None:
    """Nothing to say of reward functions once loaded (``finetune.tasks.workers``' handler)."""


def serve(func: Callable[..., Any], mode: str, payload: bytes) -> tuple[str, Any]:
    """A reward call in a worker: ``("values", [float, None or reason per row])``, or ``("failed", reason)`` for
    a ``batch`` call that raised or returned the wrong number of rewards; ``rows`` calls it row by row."""
    prompts, completions, columns = pickle.loads(payload)
    if "environments" in columns:
        columns["environments"] = [pickle.loads(state) for state in columns["environments"]]
    if mode == "batch":
        try:
            outcomes = _outcomes(func(prompts=prompts, completions=completions, **columns), len(completions))
        except BaseException as err:  # SystemExit too: it would end the worker
            return "failed", raised(err, __file__)
        return ("failed", outcomes) if isinstance(outcomes, str) else ("values", outcomes)
    rows = []
    for row in range(len(completions)):
        try:
            outcome = _outcomes(func(prompts=[prompts[row]], completions=[completions[row]],
                                     **{name: [values[row]] for name, values in columns.items()}), 1)
        except BaseException as err:
            outcome = raised(err, __file__)
        rows.append(outcome if isinstance(outcome, str) else outcome[0])
    return "values", rows

