"""Rewards a program checks, for online RL (GRPO): loading the user's reward functions, checking them once before
training, scoring completions in worker processes, and the failures counted over a run.

A reward function has TRL's ``GRPOTrainer`` signature, ``func(prompts, completions, **columns)``, called with
keywords: ``prompts`` and ``completions`` as the caller has them (text or messages) and the dataset's other columns
as lists aligned with the completions. It returns one reward per completion, a number or ``None`` where it does not
apply to that row. It is named ``module:function``, the module a dotted name or a ``.py`` file.

The functions run in worker processes so that one that hangs or kills its process costs that batch's rewards, not
the run: a worker that passes the timeout is killed, one that dies is replaced, and the rows it held fail. Workers
are ``python -m finetune.tasks.rewards`` started with ``subprocess`` and spoken to over pipes in pickled frames:
multiprocessing's spawn and forkserver would import the recipe's ``__main__`` again (torch and transformers, seconds
each), and forking copies a process that holds torch's threads. A worker imports this module and the reward
modules only, from the training process's ``sys.path``.
"""

from __future__ import annotations

import ctypes
import hashlib
import importlib
import importlib.util
import math
import os
import pickle
import re
import selectors
import signal
import struct
import subprocess
import sys
import threading
import time
import traceback
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

from finetune.errors import UserError

if TYPE_CHECKING:
    import numpy as np

__all__ = ["SIGNATURE", "FailureCount", "RewardFailure", "RewardFailures", "RewardFunc", "RewardPool",
           "RewardScores", "check_reward_signature", "check_reward_specs", "load_reward_funcs"]

SIGNATURE = "func(prompts, completions, **columns) -> list of floats or None"
WORKER_ENVIRONMENT = ("PATH", "LD_LIBRARY_PATH", "HOME", "USER", "LOGNAME", "SHELL", "LANG", "LANGUAGE", "TZ",
                      "TMPDIR", "TERM", "VIRTUAL_ENV", "CONDA_PREFIX", "OMP_NUM_THREADS", "MKL_NUM_THREADS")
"""What a reward worker gets of the trainer's environment (and ``LC_*``, ``PYTHON*``): no token (``HF_TOKEN``, a
tracker's key) reaches a function that may run model-written code, unless the pool is told to pass it."""
STARTUP_TIMEOUT = 120.0
"""Seconds a worker may take to import the reward modules (a verifier may load a computer algebra system)."""
IGNORED_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1, signal.SIGHUP)
"""The stop signals launchers and schedulers send every process of a job: the training process stops after its
step, and that step's rewards are still to be scored. A worker ends when the training process closes its pipe or
dies."""
_FRAME_HEADER = struct.Struct("<Q")
_IMPORT_ROOT = str(Path(__file__).resolve().parents[2])
"""The folder that holds the ``finetune`` package."""


@dataclass(frozen=True)
class RewardFunc:
    """A loaded reward function and the spec that named it."""

    name: str
    """The spec as given, ``module:function``."""
    func: Callable[..., Any]


def check_reward_specs(specs: Sequence[str]) -> None:
    """What can be wrong with ``specs`` short of importing them, which runs the user's code: only the workers do
    that (``load_reward_funcs``), where an import that hangs is timed out and no token is in the environment.

    Raises:
        UserError: a spec without a colon or given twice, a file that is not there, a module not found.
    """
    if len(set(specs)) != len(specs):
        twice = next(spec for spec in specs if specs.count(spec) > 1)
        raise UserError(f"reward function {twice} is given twice; give each reward function once")
    for spec in specs:
        module_name, _ = _split(spec)
        if _is_path(module_name):
            _existing_file(spec, module_name)
        elif importlib.util.find_spec(top := module_name.partition(".")[0]) is None:  # (a top level runs no code)
            raise UserError(f"reward function {spec}: cannot import {module_name}: ModuleNotFoundError: No module "
                            f"named {top!r}; {_IMPORTABLE}")


def load_reward_funcs(specs: Sequence[str]) -> list[RewardFunc]:
    """The reward functions ``specs`` name, each ``module:function``: a dotted module importable here, or the path
    to a ``.py`` file (relative to the working directory, or absolute).

    Raises:
        UserError: what ``check_reward_specs`` refuses, a module that cannot be imported (with what it raised), no
            such function in it, or something that is not callable.
    """
    check_reward_specs(specs)
    return [RewardFunc(spec, _load(spec)) for spec in specs]


def _split(spec: str) -> tuple[str, str]:
    module, _, attribute = spec.rpartition(":")
    if not module or not attribute:
        raise UserError(f"reward function {spec!r} is not module:function; give a dotted module or a path to a .py "
                        "file, a colon, and the function's name, e.g. my_rewards:accuracy or rewards.py:accuracy")
    return module, attribute


def _is_path(module: str) -> bool:
    return module.endswith(".py") or "/" in module or os.sep in module


def _resolved(spec: str) -> str:
    """``spec`` with a relative file path made absolute, so that a worker finds the same file."""
    module, attribute = _split(spec)
    return f"{Path(module).expanduser().resolve()}:{attribute}" if _is_path(module) else spec


def _load(spec: str) -> Callable[..., Any]:
    module_name, attribute = _split(spec)
    module = _load_file(spec, module_name) if _is_path(module_name) else _import(spec, module_name)
    found: Any = module
    for part in attribute.split("."):
        if not hasattr(found, part):
            defined = sorted(name for name, value in vars(module).items()
                             if callable(value) and not name.startswith("_")
                             and getattr(value, "__module__", None) == module.__name__)
            listing = f" (it defines {', '.join(defined)})" if defined else ""
            raise UserError(f"reward function {spec}: {module_name} has no {attribute!r}{listing}; give the name of a "
                            "function defined there after the colon")
        found = getattr(found, part)
    if not callable(found):
        raise UserError(f"reward function {spec}: {attribute} is a {type(found).__name__}, not a function; give a "
                        f"function {SIGNATURE}")
    return found


def _import(spec: str, module_name: str):
    try:
        return importlib.import_module(module_name)
    except (Exception, SystemExit) as err:
        missing = isinstance(err, ModuleNotFoundError) and f"{module_name}.".startswith(f"{err.name}.")
        fix = _IMPORTABLE if missing else f"fix what importing {module_name} raised"
        raise UserError(f"reward function {spec}: cannot import {module_name}: {_summary(err)}; {fix}") from None


_IMPORTABLE = "give a module importable from here (on sys.path or installed) or a path to a .py file"


def _existing_file(spec: str, module_name: str) -> Path:
    path = Path(module_name).expanduser()
    if path.suffix != ".py" or not path.is_file():
        what = "no such file" if not path.exists() else "not a .py file"
        raise UserError(f"reward function {spec}: {path} is {what}; give the path to a .py file, absolute or relative "
                        f"to {os.getcwd()}, or a dotted module name")
    return path.resolve()


def _load_file(spec: str, module_name: str):
    path = _existing_file(spec, module_name)
    # One module per file, under a name no other file gets; in sys.modules so that dataclasses and pickle find it.
    stem = re.sub(r"\W", "_", path.stem)
    name = f"_reward_{stem}_{hashlib.sha1(str(path).encode()).hexdigest()[:10]}"
    if name in sys.modules:
        return sys.modules[name]
    module = importlib.util.module_from_spec(importlib.util.spec_from_file_location(name, path))
    sys.modules[name] = module
    try:
        module.__spec__.loader.exec_module(module)
    except (Exception, SystemExit) as err:
        del sys.modules[name]
        raise UserError(f"reward function {spec}: cannot import {path}: {_summary(err)}; fix what it raised") from None
    return module


def _summary(err: BaseException) -> str:
    """``Type: first line of the message``, on one line."""
    lines = str(err).strip().splitlines()
    return f"{type(err).__name__}: {lines[0][:300]}" if lines else type(err).__name__


def _raised(err: BaseException) -> str:
    """A failure's reason: what ``err`` is and the line that raised it, unless that is the call here (a call that
    does not fit the function's signature)."""
    frames = traceback.extract_tb(err.__traceback__)
    inside = frames and frames[-1].filename != __file__
    where = f" ({Path(frames[-1].filename).name}, line {frames[-1].lineno})" if inside else ""
    return f"raised {_summary(err)}{where}"


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


@dataclass
class _Call:
    func: int
    row_by_row: bool = False
    after: str = ""
    """Why the batch call failed, for a call row by row."""


@dataclass(eq=False)
class _Worker:
    process: subprocess.Popen
    ready: bool = False
    call: _Call | None = None
    deadline: float | None = None
    """When the call (or, before ``ready``, the start) is given up."""
    received: bytearray = field(default_factory=bytearray)


class RewardPool:
    """Worker processes that score completions with the reward functions ``specs``; use it as a context manager.

    Each worker imports every function, so ``workers`` of them (one per function by default) run different
    functions on the same batch at once. A worker gets ``WORKER_ENVIRONMENT``'s part of this process's environment
    and the variables named in ``passed_environment``. A call that takes more than ``timeout`` seconds fails and its
    worker is killed and replaced; so is one whose worker dies. Workers die with the thread that started them (Linux's
    parent-death signal), so start and use the pool from one thread that lives as long as it.

    Raises:
        UserError: a worker cannot load the functions (see ``load_reward_funcs``) or does not start within
            ``STARTUP_TIMEOUT`` seconds.
    """

    def __init__(self, specs: Sequence[str], workers: int | None = None, timeout: float = 60.0,
                 passed_environment: Sequence[str] = ()):
        if not specs:
            raise ValueError("RewardPool needs at least one reward function")
        if (workers is not None and workers < 1) or not timeout > 0:
            raise ValueError(f"RewardPool needs workers >= 1 and a timeout > 0, not {workers} and {timeout}")
        self.names = list(specs)
        self.timeout = timeout
        passed = (*WORKER_ENVIRONMENT, *passed_environment)
        self._environment = {name: value for name, value in os.environ.items()
                             if name in passed or name.startswith(("LC_", "PYTHON"))}
        self._init = {"specs": [_resolved(spec) for spec in specs], "sys_path": list(sys.path),
                      "pythonpath": os.environ.get("PYTHONPATH"), "parent": os.getpid()}
        self._selector = selectors.DefaultSelector()
        self._workers: list[_Worker] = []
        try:
            for _ in range(workers or len(specs)):
                self._workers.append(self._start())
            while not all(worker.ready for worker in self._workers):
                self._poll()
        except BaseException:
            self.close()
            raise

    def __enter__(self) -> RewardPool:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

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
        for worker in self._workers:
            if worker.call is not None:  # left running by a call to score that raised
                worker.process.kill()
                self._replace(worker)
        payload = pickle.dumps((prompts, completions, columns), protocol=pickle.HIGHEST_PROTOCOL)
        rewards = np.full((count, len(self.names)), np.nan, dtype=np.float64)
        failed: dict[tuple[int, int], str] = {}
        pending = deque(_Call(func) for func in range(len(self.names)))

        def settle(call: _Call, reply: tuple) -> None:
            kind, body = reply
            if kind == "values":
                for row, outcome in enumerate(body):
                    if isinstance(outcome, str):
                        failed[call.func, row] = outcome
                    elif outcome is not None:
                        rewards[row, call.func] = outcome
            elif kind == "failed" and not call.row_by_row and count > 1:
                pending.append(_Call(call.func, row_by_row=True, after=body))
            else:
                reason = f"{body}, calling it row by row after the batch call {call.after}" if call.row_by_row else body
                failed.update(((call.func, row), reason) for row in range(count))

        while pending or any(worker.call is not None for worker in self._workers):
            for worker in self._workers:
                if pending and worker.ready and worker.call is None:
                    call = pending.popleft()
                    lost = self._send(worker, call, payload)
                    if lost:
                        settle(call, ("lost", lost))
            for call, reply in self._poll():
                settle(call, reply)
        failures = [RewardFailure(self.names[func], row, failed[func, row]) for func, row in sorted(failed)]
        return RewardScores(rewards, failures)

    def close(self) -> None:
        """End the workers: an idle one as its pipe closes, a busy or starting one killed; each one waited for."""
        for worker in self._workers:
            if worker.call is not None or not worker.ready:
                worker.process.kill()
            try:
                worker.process.stdin.close()
            except OSError:  # it died with the pipe full
                pass
        deadline = time.monotonic() + 5
        for worker in self._workers:
            try:
                worker.process.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                worker.process.kill()
                worker.process.wait()
            worker.process.stdout.close()
        self._workers = []
        self._selector.close()

    # -- workers

    def _start(self) -> _Worker:
        # -m finds this package by the PYTHONPATH given here; the worker then takes this process's sys.path and
        # PYTHONPATH, so that it imports the reward modules as this process did.
        env = {**self._environment,
               "PYTHONPATH": os.pathsep.join(filter(None, [_IMPORT_ROOT, os.environ.get("PYTHONPATH")]))}
        process = subprocess.Popen([sys.executable, "-m", "finetune.tasks.rewards"], stdin=subprocess.PIPE,
                                   stdout=subprocess.PIPE, env=env)
        worker = _Worker(process, deadline=time.monotonic() + STARTUP_TIMEOUT)
        try:
            _write_frame(process.stdin, self._init)
        except OSError:  # it ended at once; _poll says how
            pass
        os.set_blocking(process.stdout.fileno(), False)
        self._selector.register(process.stdout, selectors.EVENT_READ, worker)
        return worker

    def _replace(self, worker: _Worker) -> str:
        """Kill ``worker`` (if it still runs) and start another in its place; returns how it ended."""
        if worker.process.poll() is None:
            try:
                worker.process.wait(2)  # its pipe closed as it exits
            except subprocess.TimeoutExpired:
                worker.process.kill()
                worker.process.wait()
        code = worker.process.returncode
        self._selector.unregister(worker.process.stdout)
        worker.process.stdout.close()
        try:
            worker.process.stdin.close()
        except OSError:
            pass
        self._workers[self._workers.index(worker)] = self._start()
        return f"killed by {signal.Signals(-code).name}" if code < 0 else f"exit status {code}"

    def _send(self, worker: _Worker, call: _Call, payload: bytes) -> str | None:
        """Give ``worker`` the call; returns why the call failed at once, if it did."""
        try:
            _write_frame(worker.process.stdin, ("rows" if call.row_by_row else "batch", call.func, payload))
        except OSError:
            return f"the worker process running it died ({self._replace(worker)})"
        worker.call, worker.deadline = call, time.monotonic() + self.timeout
        return None

    def _poll(self) -> list[tuple[_Call, tuple]]:
        """Wait for replies until the next deadline; returns the calls that ended, each with the worker's reply,
        or ``("lost", reason)`` for one that timed out or whose worker died (the worker replaced)."""
        deadlines = [worker.deadline for worker in self._workers if worker.deadline is not None]
        wait = max(0.0, min(deadlines) - time.monotonic()) if deadlines else None
        ended = []
        for key, _ in self._selector.select(wait):
            worker: _Worker = key.data
            try:
                chunk = os.read(key.fd, 1 << 20)
            except BlockingIOError:
                continue
            worker.received += chunk
            reply = _take_frame(worker.received)
            if chunk and reply is None:
                continue
            if not worker.ready:
                self._started(worker, reply)
            elif worker.call is None:  # an idle worker ended (its pipe closed): replace it before it gets a call
                self._replace(worker)
            elif reply is None:
                ended.append((worker.call, ("lost", f"the worker process running it died ({self._replace(worker)})")))
            else:
                ended.append((worker.call, reply))
                worker.call = worker.deadline = None
        now = time.monotonic()
        for worker in self._workers:
            if worker.deadline is None or now < worker.deadline:
                continue
            if not worker.ready:
                raise UserError(f"a reward worker process did not load {', '.join(self.names)} within "
                                f"{STARTUP_TIMEOUT:g} s; make importing the reward modules quicker")
            worker.process.kill()
            self._replace(worker)
            ended.append((worker.call, ("lost", f"timed out after {self.timeout:g} s; its worker process was killed "
                                                "and replaced")))
        return ended

    def _started(self, worker: _Worker, reply: tuple | None) -> None:
        if reply is None:
            raise UserError(f"a reward worker process ended while loading {', '.join(self.names)} "
                            f"({self._replace(worker)}); check that the reward modules import in a fresh process")
        if reply[0] == "error":
            raise UserError(reply[1])
        worker.ready, worker.deadline = True, None


def _write_frame(stream: IO[bytes], message: Any) -> None:
    data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    stream.write(_FRAME_HEADER.pack(len(data)) + data)
    stream.flush()


def _take_frame(received: bytearray) -> Any:
    """The first whole frame in ``received`` (removed from it), or None."""
    if len(received) < _FRAME_HEADER.size:
        return None
    (size,) = _FRAME_HEADER.unpack_from(received)
    if len(received) < _FRAME_HEADER.size + size:
        return None
    data = bytes(received[_FRAME_HEADER.size:_FRAME_HEADER.size + size])
    del received[:_FRAME_HEADER.size + size]
    return pickle.loads(data)


def _read_frame(stream: IO[bytes]) -> Any:
    """The next frame, or None at the end of the stream."""
    header = stream.read(_FRAME_HEADER.size)
    if len(header) < _FRAME_HEADER.size:
        return None
    return pickle.loads(stream.read(_FRAME_HEADER.unpack(header)[0]))


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


# -- the worker process

def _worker() -> None:
    """Load the reward functions the first frame names, then answer each call frame until stdin closes."""

    def ignore(number, frame):
        pass  # a handler, not SIG_IGN, which the reward functions' own child processes would inherit

    for number in IGNORED_SIGNALS:
        signal.signal(number, ignore)
    # The frames get pipes of their own; what reward functions print goes to stderr, the run's log.
    requests, replies = os.fdopen(os.dup(0), "rb"), os.fdopen(os.dup(1), "wb")
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)
    os.dup2(2, 1)
    sys.stdout.reconfigure(line_buffering=True)
    init = _read_frame(requests)
    if init is None:
        return
    if sys.platform == "linux":
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG: die with the parent
    else:
        threading.Thread(target=_exit_with_parent, args=(init["parent"],), daemon=True).start()
    if os.getppid() != init["parent"]:
        return
    sys.path[:] = init["sys_path"]
    if init["pythonpath"] is None:
        os.environ.pop("PYTHONPATH", None)
    else:
        os.environ["PYTHONPATH"] = init["pythonpath"]
    try:
        funcs = [reward.func for reward in load_reward_funcs(init["specs"])]
    except UserError as err:
        _write_frame(replies, ("error", f"in a reward worker process: {err}"))
        return
    _write_frame(replies, ("ready", None))
    while (request := _read_frame(requests)) is not None:
        mode, func, payload = request
        _write_frame(replies, _call(funcs[func], mode == "rows", *pickle.loads(payload)))


def _exit_with_parent(parent: int) -> None:
    while os.getppid() == parent:
        time.sleep(1)
    os._exit(1)


def _call(func: Callable[..., Any], row_by_row: bool, prompts: Sequence, completions: Sequence,
          columns: dict[str, Sequence]) -> tuple[str, Any]:
    """``("values", [float, None or reason per row])``, or ``("failed", reason)`` for a batch call that raised or
    returned the wrong number of rewards."""
    if not row_by_row:
        try:
            outcomes = _outcomes(func(prompts=prompts, completions=completions, **columns), len(completions))
        except BaseException as err:  # SystemExit too: it would end the worker
            return "failed", _raised(err)
        return ("failed", outcomes) if isinstance(outcomes, str) else ("values", outcomes)
    rows = []
    for row in range(len(completions)):
        try:
            outcome = _outcomes(func(prompts=[prompts[row]], completions=[completions[row]],
                                     **{name: [values[row]] for name, values in columns.items()}), 1)
        except BaseException as err:
            outcome = _raised(err)
        rows.append(outcome if isinstance(outcome, str) else outcome[0])
    return "values", rows


if __name__ == "__main__":
    _worker()
