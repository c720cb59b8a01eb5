"""Tools a model calls in its episodes (GRPO with ``--tools``): plain Python functions with type hints and a
docstring, named ``module:function`` as reward functions are, run in the worker pool (``finetune.tasks.workers``)
under a timeout, so that a tool that hangs, raises or kills its process costs that call, not the run.

An environment (``--environment module:Class``, TRL's ``environment_factory``) is a class with one instance per
episode: ``reset(**row)`` starts it (and may return a first observation), its public methods are tools. Its state
travels with each call, pickled, and the trainer never unpickles it (it runs no user code): any worker serves any
episode's call, and a call that hangs or kills its worker leaves the state as it was before the call.

A tool call's result is text for the model: what the function returned, as ``str()`` makes it; a call that fails
(the tool raises, is unknown, gets arguments it does not take, passes its timeout, kills its worker) returns
``{'error': '...'}`` instead, as TRL's trainer does, so the model sees its mistake and learns from it. Each failure
is counted by kind.
"""

from __future__ import annotations

import inspect
import json
import os
import pickle
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from finetune.errors import UserError
from finetune.tasks.workers import Call, FunctionKind, WorkerPool, check_specs

__all__ = ["ENVIRONMENT", "ERROR_KINDS", "TOOL", "ToolCall", "ToolPool", "ToolResult", "check_tool_specs"]

TOOL = FunctionKind("tool", "tool", "with type hints and a docstring that describes each argument (transformers' "
                    "get_json_schema reads them)", "my_tools:lookup_order or tools.py:lookup_order")
ENVIRONMENT = FunctionKind("environment", "tool", "a class whose reset(**row) starts an episode and whose public "
                           "methods are its tools", "my_env:Shop or env.py:Shop")
ERROR_KINDS = ("raised", "unknown_tool", "bad_arguments", "unparsed", "timed_out", "worker_died")
"""How a tool call fails: the tool raised (wrong arguments included), no tool has the name, the arguments are not
an object, the call's text does not parse, it passed ``--tool_timeout``, its worker process died."""


def check_tool_specs(specs: Sequence[str], environment: str | None = None) -> None:
    """What can be wrong with ``specs`` and ``environment`` short of importing them, and two tools of one name (the
    model calls a tool by its name).

    Raises:
        UserError: as ``finetune.tasks.workers.check_specs``, or two specs ending in the same function name.
    """
    check_specs(specs, TOOL)
    if environment:
        check_specs([environment], ENVIRONMENT)
    names = [spec.rsplit(":", 1)[-1].rsplit(".", 1)[-1] for spec in specs]
    if len(set(names)) != len(names):
        twice = next(name for name in names if names.count(name) > 1)
        raise UserError(f"two --tools are named {twice!r}; the model calls a tool by its name, so give tools of "
                        "different names")


@dataclass(frozen=True)
class ToolCall:
    """A call the model made: the tool's name, its arguments (a dict, or its JSON text), and for an environment's
    method the episode's environment state (``episode`` keeps one episode's calls in order); or, ``unparsed``, why
    the call's text does not parse."""

    name: str
    arguments: Any
    episode: int = 0
    state: bytes | None = None
    unparsed: str | None = None


@dataclass(frozen=True)
class ToolResult:
    """A tool call's result as the model reads it, how the call failed (one of ``ERROR_KINDS``), if it did, and the
    episode's environment state after it."""

    text: str
    error: str | None = None
    state: bytes | None = None


def _error(message: str, kind: str, state: bytes | None = None) -> ToolResult:
    return ToolResult(str({"error": message}), kind, state)


class ToolPool(WorkerPool):
    """Worker processes that run the tools ``specs`` and the methods of the ``environment`` class; ``schemas`` are
    their JSON schemas (transformers' ``get_json_schema``, made in a worker: the trainer never imports the user's
    modules), the functions' in the order given, then the environment's methods.

    Raises:
        UserError: a tool cannot be loaded, has no type hint or docstring description for an argument, an
            environment has no ``reset``, or a worker does not start within
            ``finetune.tasks.workers.STARTUP_TIMEOUT`` seconds.
    """

    def __init__(self, specs: Sequence[str], environment: str | None = None, workers: int | None = None,
                 timeout: float = 30.0):
        check_tool_specs(specs, environment)
        # Episodes call at once: a worker per core (at least one per function), not one per function alone.
        workers = workers or max(len(specs), min(4, os.cpu_count() or 1))
        super().__init__([*specs, *filter(None, [environment])], kind=TOOL, handler=__name__, workers=workers,
                         timeout=timeout)
        self.environment_index = len(specs) if environment else None
        """The environment's place among the pool's functions."""
        self.schemas: list[dict] = [schema for schema, _ in self.described]
        self._index = {schema["function"]["name"]: (k if method is None else self.environment_index, method)
                       for k, (schema, method) in enumerate(self.described)}
        if len(self._index) != len(self.schemas):
            self.close()
            raise UserError("two of the --tools and --environment's methods share a name; the model calls a tool by "
                            "its name, so give them different names")

    def reset(self, rows: Sequence[dict]) -> list[tuple[str | None, bytes]]:
        """A new environment per row, started by ``reset(**row)``: its first observation (None where it returns
        none) and its state.

        Raises:
            UserError: the environment cannot start on a row (it raises, hangs, or its state does not pickle):
                naming the row's place and the reason.
        """
        started: list[tuple[str | None, bytes] | None] = [None] * len(rows)

        def settle(call: Call, reply: tuple) -> list[Call]:
            kind, body = reply
            if kind != "state":
                reason = body if kind == "lost" else f"raised {body}"
                raise UserError(f"environment {self.names[self.environment_index]}: reset(**row) {reason} on row "
                                f"{call.tag + 1} of a rollout ({sorted(rows[call.tag])} given); make it start on "
                                "every row of the data")
            started[call.tag] = body
            return []

        self.run([Call(self.environment_index, "reset", pickle.dumps(row), tag=k) for k, row in enumerate(rows)],
                 settle)
        return started

    def call(self, calls: Sequence[ToolCall]) -> list[ToolResult]:
        """The results of ``calls``, in order: each under the pool's timeout, different episodes' at once in the
        workers, one episode's one after another (an environment's method sees the state the last one left)."""
        results: list[ToolResult | None] = [None] * len(calls)
        queues: dict[int, list[int]] = {}
        for k, call in enumerate(calls):
            queues.setdefault(call.episode, []).append(k)
        states = {call.episode: call.state for call in calls}

        def next_of(episode: int) -> list[Call]:
            while queues[episode]:
                k = queues[episode].pop(0)
                made = self._request(calls[k], states[episode], k)
                if isinstance(made, Call):
                    return [made]
                results[k] = made
            return []

        def settle(call: Call, reply: tuple) -> list[Call]:
            kind, body = reply
            episode, state = calls[call.tag].episode, states[calls[call.tag].episode]
            if kind == "result":
                text, state = body if call.mode == "method" else (body, state)
                results[call.tag] = ToolResult(text, None, state)
            elif kind == "raised":
                message, state = body if call.mode == "method" else (body, state)
                results[call.tag] = _error(message, "raised", state)
            else:  # lost: timed out, or the worker died; an environment keeps its state from before the call
                results[call.tag] = _error(body, "timed_out" if body.startswith("timed out") else "worker_died",
                                           state)
            states[episode] = state
            return next_of(episode)

        self.run([made for episode in queues for made in next_of(episode)], settle)
        return results

    def _request(self, call: ToolCall, state: bytes | None, tag: int) -> Call | ToolResult:
        """The worker call for ``call``, or its result where it fails before any worker runs it."""
        if call.unparsed:
            return _error(f"the tool call does not parse: {call.unparsed}", "unparsed", state)
        arguments = call.arguments
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments) if arguments.strip() else {}
            except json.JSONDecodeError as err:
                return _error(f"the arguments of {call.name} are not JSON: {err}", "bad_arguments", state)
        if call.name not in self._index:
            return _error(f"Tool {call.name} not found. The tools are: {', '.join(self._index)}.", "unknown_tool",
                          state)
        if not isinstance(arguments, dict):
            return _error(f"the arguments of {call.name} are {type(arguments).__name__}, not an object of named "
                          "arguments", "bad_arguments", state)
        func, method = self._index[call.name]
        if method is None:
            return Call(func, "call", pickle.dumps(arguments), tag=tag)
        return Call(func, "method", pickle.dumps((state, method, arguments)), tag=tag)


# -- in the worker process

def ready(funcs: list[Callable[..., Any]], specs: list[str]) -> list[tuple[dict, str | None]]:
    """Each tool's JSON schema, with the name of the environment's method it is (None for a function):
    ``finetune.tasks.workers``' handler, once the tools load, in the pool's first worker. The environment (a
    class) gives its public methods but ``reset``, as TRL takes them.

    Raises:
        UserError: a tool transformers cannot describe (no type hint, no docstring, an argument the docstring
            does not describe), an environment without ``reset`` or without a method.
    """
    described = []
    for func, spec in zip(funcs, specs, strict=True):
        if not inspect.isclass(func):
            described.append((_schema(func, f"tool {spec}"), None))
            continue
        if not callable(getattr(func, "reset", None)):
            raise UserError(f"environment {spec} has no reset method; give it reset(self, **row), which starts an "
                            "episode from the row's columns (and may return a first observation)")
        methods = [name for name, _ in inspect.getmembers(func, inspect.isfunction)
                   if not name.startswith("_") and name != "reset"]
        if not methods:
            raise UserError(f"environment {spec} has no public method besides reset; its methods are the tools the "
                            "model calls")
        described += [(_schema(getattr(func, name), f"environment {spec}, method {name}"), name) for name in methods]
    return described


def _schema(func: Callable[..., Any], what: str) -> dict:
    from transformers.utils import get_json_schema
    from transformers.utils.chat_template_utils import DocstringParsingException, TypeHintParsingException

    try:
        return get_json_schema(func)
    except (DocstringParsingException, TypeHintParsingException) as err:
        raise UserError(f"{what}: {err}; give every argument a type hint, and the function a docstring with a line "
                        "per argument under Args: (as transformers' get_json_schema reads them)") from None


def serve(func: Callable[..., Any], mode: str, payload: bytes) -> tuple[str, Any]:
    """A call in a worker. ``call``: a function's ``("result", text)`` or ``("raised", message)``; ``method``: an
    environment's method on the state given, the same with the state after it; ``reset``: a new environment's
    ``("state", (first observation or None, state))``, or ``("raised", message)``."""
    if mode == "reset":
        try:
            environment = func()
            observation = environment.reset(**pickle.loads(payload))
            return "state", (None if observation is None else str(observation), pickle.dumps(environment))
        except BaseException as err:
            return "raised", f"{type(err).__name__}: {err}"
    if mode == "method":
        state, method, arguments = pickle.loads(payload)
        try:
            environment = pickle.loads(state)
        except BaseException as err:
            return "raised", (f"the environment's state does not load: {type(err).__name__}: {err}", state)
        try:
            result = ("result", str(getattr(environment, method)(**arguments)))
        except BaseException as err:  # SystemExit too: it would end the worker
            result = ("raised", str(err) or type(err).__name__)
        try:
            return result[0], (result[1], pickle.dumps(environment))
        except BaseException as err:  # an attribute that does not pickle: the state before the call stands
            return "raised", (f"the environment's state does not pickle after {method}: {type(err).__name__}: "
                              f"{err}; keep its state in plain attributes", state)
    try:
        return "result", str(func(**pickle.loads(payload)))
    except BaseException as err:  # SystemExit too: it would end the worker
        return "raised", str(err) or type(err).__name__
