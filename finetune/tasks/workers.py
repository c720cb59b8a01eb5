"""The worker pool that runs the user's functions (reward functions, tools) out of the training process: naming
them ``module:function``, loading them, and calling them in worker processes under a timeout.

A function is named ``module:function``, the module a dotted name or a ``.py`` file. The trainer checks the names
without importing them (importing runs the user's code); only the workers import the modules.

Functions run in worker processes so that one that hangs or kills its process costs that call, not the run: a
worker that passes the timeout is killed, one that dies is replaced, and the call fails with the reason. Workers
are ``python -m finetune.tasks.workers`` started with ``subprocess`` and spoken to over pipes in pickled frames:
multiprocessing's spawn and forkserver would import the recipe's ``__main__`` again (torch and transformers, seconds
each), and forking copies a process that holds torch's threads. A worker imports this module, the module that says
what a call does (a pool's *handler*: ``serve(func, mode, payload)`` and ``ready(funcs, specs)``) and the user's
modules, from the training process's ``sys.path``.
"""

from __future__ import annotations

import ctypes
import dataclasses
import hashlib
import importlib
import importlib.util
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
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from finetune.errors import UserError

__all__ = ["IGNORED_SIGNALS", "STARTUP_TIMEOUT", "WORKER_ENVIRONMENT", "Call", "FunctionKind", "WorkerPool",
           "check_specs", "load_funcs", "raised", "summary"]

WORKER_ENVIRONMENT = ("PATH", "LD_LIBRARY_PATH", "HOME", "USER", "LOGNAME", "SHELL", "LANG", "LANGUAGE", "TZ",
                      "TMPDIR", "TERM", "VIRTUAL_ENV", "CONDA_PREFIX", "OMP_NUM_THREADS", "MKL_NUM_THREADS")
"""What a worker gets of the trainer's environment (and ``LC_*``, ``PYTHON*``): no token (``HF_TOKEN``, a
tracker's key) reaches a function that may run model-written code, unless the pool is told to pass it."""
STARTUP_TIMEOUT = 120.0
"""Seconds a worker may take to import the user's modules (a verifier may load a computer algebra system)."""
IGNORED_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1, signal.SIGHUP)
"""The stop signals launchers and schedulers send every process of a job: the training process stops after its
step, and that step's calls are still to be made. A worker ends when the training process closes its pipe or
dies."""
_FRAME_HEADER = struct.Struct("<Q")
_IMPORT_ROOT = str(Path(__file__).resolve().parents[2])
"""The folder that holds the ``finetune`` package."""
_IMPORTABLE = "give a module importable from here (on sys.path or installed) or a path to a .py file"


@dataclass(frozen=True)
class FunctionKind:
    """What a pool's functions are, for its messages."""

    noun: str
    """``reward function``, ``tool``."""
    short: str
    """``reward``, ``tool``: what its workers are, ``a reward worker process``."""
    expected: str
    """What a function must be, after "give a function"."""
    example: str
    """Two specs, by module and by file."""


# -- naming and loading the functions


def check_specs(specs: Sequence[str], kind: FunctionKind) -> None:
    """What can be wrong with ``specs`` short of importing them, which runs the user's code: only the workers do
    that (``load_funcs``), where an import that hangs is timed out and no token is in the environment.

    Raises:
        UserError: a spec without a colon or given twice, a file that is not there, a module not found.
    """
    if len(set(specs)) != len(specs):
        twice = next(spec for spec in specs if specs.count(spec) > 1)
        raise UserError(f"{kind.noun} {twice} is given twice; give each {kind.noun} once")
    for spec in specs:
        module_name, _ = _split(spec, kind)
        if _is_path(module_name):
            _existing_file(spec, module_name, kind)
        elif importlib.util.find_spec(top := module_name.partition(".")[0]) is None:  # (a top level runs no code)
            raise UserError(f"{kind.noun} {spec}: cannot import {module_name}: ModuleNotFoundError: No module "
                            f"named {top!r}; {_IMPORTABLE}")


def load_funcs(specs: Sequence[str], kind: FunctionKind) -> list[Callable[..., Any]]:
    """The functions ``specs`` name, each ``module:function``: a dotted module importable here, or the path to a
    ``.py`` file (relative to the working directory, or absolute).

    Raises:
        UserError: what ``check_specs`` refuses, a module that cannot be imported (with what it raised), no such
            function in it, or something that is not callable.
    """
    check_specs(specs, kind)
    return [_load(spec, kind) for spec in specs]


def _split(spec: str, kind: FunctionKind) -> tuple[str, str]:
    module, _, attribute = spec.rpartition(":")
    if not module or not attribute:
        raise UserError(f"{kind.noun} {spec!r} is not module:function; give a dotted module or a path to a .py "
                        f"file, a colon, and the function's name, e.g. {kind.example}")
    return module, attribute


def _is_path(module: str) -> bool:
    return module.endswith(".py") or "/" in module or os.sep in module


def _resolved(spec: str, kind: FunctionKind) -> str:
    """``spec`` with a relative file path made absolute, so that a worker finds the same file."""
    module, attribute = _split(spec, kind)
    return f"{Path(module).expanduser().resolve()}:{attribute}" if _is_path(module) else spec


def _load(spec: str, kind: FunctionKind) -> Callable[..., Any]:
    module_name, attribute = _split(spec, kind)
    module = _load_file(spec, module_name, kind) if _is_path(module_name) else _import(spec, module_name, kind)
    found: Any = module
    for part in attribute.split("."):
        if not hasattr(found, part):
            defined = sorted(name for name, value in vars(module).items()
                             if callable(value) and not name.startswith("_")
                             and getattr(value, "__module__", None) == module.__name__)
            listing = f" (it defines {', '.join(defined)})" if defined else ""
            raise UserError(f"{kind.noun} {spec}: {module_name} has no {attribute!r}{listing}; give the name of a "
                            "function defined there after the colon")
        found = getattr(found, part)
    if not callable(found):
        raise UserError(f"{kind.noun} {spec}: {attribute} is a {type(found).__name__}, not a function; give a "
                        f"function {kind.expected}")
    return found


def _import(spec: str, module_name: str, kind: FunctionKind):
    try:
        return importlib.import_module(module_name)
    except (Exception, SystemExit) as err:
        missing = isinstance(err, ModuleNotFoundError) and f"{module_name}.".startswith(f"{err.name}.")
        fix = _IMPORTABLE if missing else f"fix what importing {module_name} raised"
        raise UserError(f"{kind.noun} {spec}: cannot import {module_name}: {summary(err)}; {fix}") from None


def _existing_file(spec: str, module_name: str, kind: FunctionKind) -> Path:
    path = Path(module_name).expanduser()
    if path.suffix != ".py" or not path.is_file():
        what = "no such file" if not path.exists() else "not a .py file"
        raise UserError(f"{kind.noun} {spec}: {path} is {what}; give the path to a .py file, absolute or relative "
                        f"to {os.getcwd()}, or a dotted module name")
    return path.resolve()


def _load_file(spec: str, module_name: str, kind: FunctionKind):
    path = _existing_file(spec, module_name, kind)
    # One module per file, under a name no other file gets; in sys.modules so that dataclasses and pickle find it.
    stem = re.sub(r"\W", "_", path.stem)
    name = f"_user_{stem}_{hashlib.sha1(str(path).encode()).hexdigest()[:10]}"
    if name in sys.modules:
        return sys.modules[name]
    module = importlib.util.module_from_spec(importlib.util.spec_from_file_location(name, path))
    sys.modules[name] = module
    try:
        module.__spec__.loader.exec_module(module)
    except (Exception, SystemExit) as err:
        del sys.modules[name]
        raise UserError(f"{kind.noun} {spec}: cannot import {path}: {summary(err)}; fix what it raised") from None
    return module


def summary(err: BaseException) -> str:
    """``Type: first line of the message``, on one line."""
    lines = str(err).strip().splitlines()
    return f"{type(err).__name__}: {lines[0][:300]}" if lines else type(err).__name__


def raised(err: BaseException, caller: str) -> str:
    """A failure's reason: what ``err`` is and the line that raised it, unless that is in the file ``caller`` (the
    handler's call: a call that does not fit the function's signature)."""
    frames = traceback.extract_tb(err.__traceback__)
    inside = frames and frames[-1].filename != caller
    where = f" ({Path(frames[-1].filename).name}, line {frames[-1].lineno})" if inside else ""
    return f"raised {summary(err)}{where}"


# -- the pool


@dataclass
class Call:
    """A call for a pool's worker: which function, how (the handler's ``mode``) and on what (pickled)."""

    func: int
    mode: str
    payload: bytes
    tag: Any = None
    """The caller's, to know the call again when it ends."""


@dataclass(eq=False)
class _Worker:
    process: subprocess.Popen
    describes: bool
    """Whether it reports the handler's ``ready`` (the pool's first worker)."""
    ready: bool = False
    call: Call | None = None
    deadline: float | None = None
    """When the call (or, before ``ready``, the start) is given up."""
    received: bytearray = field(default_factory=bytearray)


class WorkerPool:
    """Worker processes that load the functions ``specs`` and make calls of them as the module ``handler`` says;
    use it as a context manager.

    Each worker imports every function, so ``workers`` of them (one per function by default) make different calls
    at once. A worker gets ``WORKER_ENVIRONMENT``'s part of this process's environment and the variables named in
    ``passed_environment``. A call that takes more than ``timeout`` seconds fails and its worker is killed and
    replaced; so is one whose worker dies. Workers die with the thread that started them (Linux's parent-death
    signal), so start and use the pool from one thread that lives as long as it. ``described`` is what the
    handler's ``ready`` said of the functions in the first worker the pool starts, the only one that asks it (a
    description can take seconds: transformers' tool schemas import torch). ``preload`` names more that the
    workers load but do not call: the classes of objects that calls unpickle.

    Raises:
        UserError: a worker cannot load the functions (see ``load_funcs``), the handler's ``ready`` refuses them, or
            a worker does not start within ``STARTUP_TIMEOUT`` seconds.
    """

    def __init__(self, specs: Sequence[str], *, kind: FunctionKind, handler: str, workers: int | None = None,
                 timeout: float = 60.0, passed_environment: Sequence[str] = (), preload: Sequence[str] = ()):
        if not specs:
            raise ValueError(f"a pool of {kind.noun}s needs at least one")
        if (workers is not None and workers < 1) or not timeout > 0:
            raise ValueError(f"a worker pool needs workers >= 1 and a timeout > 0, not {workers} and {timeout}")
        self.names, self.kind, self.timeout = list(specs), kind, timeout
        self.described: Any = None
        passed = (*WORKER_ENVIRONMENT, *passed_environment)
        self._environment = {name: value for name, value in os.environ.items()
                             if name in passed or name.startswith(("LC_", "PYTHON"))}
        self._init = {"specs": [_resolved(spec, kind) for spec in specs], "kind": dataclasses.astuple(kind),
                      "preload": [_resolved(spec, kind) for spec in preload],
                      "handler": handler,
                      "sys_path": list(sys.path), "pythonpath": os.environ.get("PYTHONPATH"), "parent": os.getpid()}
        self._selector = selectors.DefaultSelector()
        self._workers: list[_Worker] = []
        try:
            for k in range(workers or len(specs)):
                self._workers.append(self._start(describe=k == 0))
            while not all(worker.ready for worker in self._workers):
                self._poll()
        except BaseException:
            self.close()
            raise

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def run(self, calls: Sequence[Call], settle: Callable[[Call, tuple], Sequence[Call]]) -> None:
        """Make ``calls``, each in the first idle worker, until none is left: ``settle`` gets each call as it ends
        with the worker's reply, or ``("lost", reason)`` for one that timed out or whose worker died, and returns
        the calls to make after it (none, or a call again another way)."""
        for worker in self._workers:
            if worker.call is not None:  # left running by a run that raised
                worker.process.kill()
                self._replace(worker)
        pending = deque(calls)
        while pending or any(worker.call is not None for worker in self._workers):
            for worker in self._workers:
                if pending and worker.ready and worker.call is None:
                    call = pending.popleft()
                    lost = self._send(worker, call)
                    if lost:
                        pending.extend(settle(call, ("lost", lost)))
            for call, reply in self._poll():
                pending.extend(settle(call, reply))

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

    def _start(self, describe: bool = False) -> _Worker:
        # -m finds this package by the PYTHONPATH given here; the worker then takes this process's sys.path and
        # PYTHONPATH, so that it imports the user's modules as this process did.
        env = {**self._environment,
               "PYTHONPATH": os.pathsep.join(filter(None, [_IMPORT_ROOT, os.environ.get("PYTHONPATH")]))}
        process = subprocess.Popen([sys.executable, "-m", "finetune.tasks.workers"], stdin=subprocess.PIPE,
                                   stdout=subprocess.PIPE, env=env)
        worker = _Worker(process, describe, deadline=time.monotonic() + STARTUP_TIMEOUT)
        try:
            _write_frame(process.stdin, {**self._init, "describe": describe})
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

    def _send(self, worker: _Worker, call: Call) -> str | None:
        """Give ``worker`` the call; returns why the call failed at once, if it did."""
        try:
            _write_frame(worker.process.stdin, (call.mode, call.func, call.payload))
        except OSError:
            return f"the worker process running it died ({self._replace(worker)})"
        worker.call, worker.deadline = call, time.monotonic() + self.timeout
        return None

    def _poll(self) -> list[tuple[Call, tuple]]:
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
                raise UserError(f"a {self.kind.short} worker process did not load {', '.join(self.names)} within "
                                f"{STARTUP_TIMEOUT:g} s; make importing the modules quicker")
            worker.process.kill()
            self._replace(worker)
            ended.append((worker.call, ("lost", f"timed out after {self.timeout:g} s; its worker process was killed "
                                                "and replaced")))
        return ended

    def _started(self, worker: _Worker, reply: tuple | None) -> None:
        if reply is None:
            raise UserError(f"a {self.kind.short} worker process ended while loading {', '.join(self.names)} "
                            f"({self._replace(worker)}); check that the modules import in a fresh process")
        if reply[0] == "error":
            raise UserError(reply[1])
        if worker.describes:
            self.described = reply[1]
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


# -- the worker process

def _worker() -> None:
    """Load the functions the first frame names, then answer each call frame with the handler until stdin closes."""

    def ignore(number, frame):
        pass  # a handler, not SIG_IGN, which the functions' own child processes would inherit

    for number in IGNORED_SIGNALS:
        signal.signal(number, ignore)
    # The frames get pipes of their own; what the functions print goes to stderr, the run's log.
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
    handler = importlib.import_module(init["handler"])
    try:
        funcs = load_funcs(init["specs"], FunctionKind(*init["kind"]))
        load_funcs(init["preload"], FunctionKind(*init["kind"]))
        described = handler.ready(funcs, init["specs"]) if init["describe"] else None
    except UserError as err:
        _write_frame(replies, ("error", f"in a {init['kind'][1]} worker process: {err}"))
        return
    _write_frame(replies, ("ready", described))
    while (request := _read_frame(requests)) is not None:
        mode, func, payload = request
        _write_frame(replies, handler.serve(funcs[func], mode, payload))


def _exit_with_parent(parent: int) -> None:
    while os.getppid() == parent:
        time.sleep(1)
    os._exit(1)


if __name__ == "__main__":
    _worker()
