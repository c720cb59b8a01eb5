"""Tools a model calls in its episodes (GRPO with ``--tools``): plain Python functions with type hints and a
docstring, named ``module:function`` as reward functions are, run in the worker pool (``finetune.tasks.workers``)
under a timeout, so that a tool that hangs, raises or kills its process costs that call, not the run.

A tool call's result is text for the model: what the function returned, as ``str()`` makes it; a call that fails
(the tool raises, is unknown, gets arguments it does not take, passes its timeout, kills its worker) returns
``{'error': '...'}`` instead, as TRL's trainer does, so the model sees its mistake and learns from it. Each failure
is counted by kind.
"""

from __future__ import annotations

import json
import pickle
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from finetune.errors import UserError
from finetune.tasks.workers import Call, FunctionKind, WorkerPool, check_specs

__all__ = ["ERROR_KINDS", "TOOL", "ToolPool", "ToolResult", "check_tool_specs"]

TOOL = FunctionKind("tool", "tool", "with type hints and a docstring that describes each argument (transformers' "
                    "get_json_schema reads them)", "my_tools:lookup_order or tools.py:lookup_order")
ERROR_KINDS = ("raised", "unknown_tool", "bad_arguments", "unparsed", "timed_out", "worker_died")
"""How a tool call fails: the tool raised (wrong arguments included), no tool has the name, the arguments are not
an object, the call's text does not parse, it passed ``--tool_timeout``, its worker process died."""


def check_tool_specs(specs: Sequence[str]) -> None:
    """What can be wrong with ``specs`` short of importing them, and two tools of one name (the model calls a tool
    by its name).

    Raises:
        UserError: as ``finetune.tasks.workers.check_specs``, or two specs ending in the same function name.
    """
    check_specs(specs, TOOL)
    names = [spec.rsplit(":", 1)[-1].rsplit(".", 1)[-1] for spec in specs]
    if len(set(names)) != len(names):
        twice = next(name for name in names if names.count(name) > 1)
        raise UserError(f"two --tools are named {twice!r}; the model calls a tool by its name, so give tools of "
                        "different names")


@dataclass(frozen=True)
class ToolResult:
    """A tool call's result as the model reads it, and how the call failed (one of ``ERROR_KINDS``), if it did."""

    text: str
    error: str | None = None


def _error(message: str, kind: str) -> ToolResult:
    return ToolResult(str({"error": message}), kind)


class ToolPool(WorkerPool):
    """Worker processes that run the tools ``specs``; ``schemas`` are their JSON schemas (transformers'
    ``get_json_schema``, made in a worker: the trainer never imports the tools' modules), in the order given.

    Raises:
        UserError: a tool cannot be loaded, has no type hint or docstring description for an argument, or a worker
            does not start within ``finetune.tasks.workers.STARTUP_TIMEOUT`` seconds.
    """

    def __init__(self, specs: Sequence[str], workers: int | None = None, timeout: float = 30.0):
        check_tool_specs(specs)
        super().__init__(specs, kind=TOOL, handler=__name__, workers=workers, timeout=timeout)
        self.schemas: list[dict] = self.described
        self._index = {schema["function"]["name"]: k for k, schema in enumerate(self.schemas)}

    def call(self, calls: Sequence[tuple[str, Any]]) -> list[ToolResult]:
        """The results of ``calls``, each ``(name, arguments)`` (a dict, or its JSON text), in order; made in the
        workers at once, each under the pool's timeout."""
        results: list[ToolResult | None] = [None] * len(calls)
        made = []
        for k, (name, arguments) in enumerate(calls):
            if isinstance(arguments, str):
                try:
                    arguments = json.loads(arguments) if arguments.strip() else {}
                except json.JSONDecodeError as err:
                    results[k] = _error(f"the arguments of {name} are not JSON: {err}", "bad_arguments")
                    continue
            if name not in self._index:
                known = ", ".join(self._index)
                results[k] = _error(f"Tool {name} not found. The tools are: {known}.", "unknown_tool")
            elif not isinstance(arguments, dict):
                results[k] = _error(f"the arguments of {name} are {type(arguments).__name__}, not an object of "
                                    "named arguments", "bad_arguments")
            else:
                made.append(Call(self._index[name], "call", pickle.dumps(arguments), tag=k))

        def settle(call: Call, reply: tuple) -> list[Call]:
            kind, body = reply
            if kind == "result":
                results[call.tag] = ToolResult(body)
            elif kind == "raised":
                results[call.tag] = _error(body, "raised")
            else:  # lost: timed out, or the worker died
                results[call.tag] = _error(body, "timed_out" if body.startswith("timed out") else "worker_died")
            return []

        self.run(made, settle)
        return results


# -- in the worker process

def ready(funcs: list[Callable[..., Any]], specs: list[str]) -> list[dict]:
    """The tools' JSON schemas (``finetune.tasks.workers``' handler, once the tools load).

    Raises:
        UserError: a tool transformers cannot describe (no type hint, no docstring, an argument the docstring
            does not describe).
    """
    from transformers.utils import get_json_schema
    from transformers.utils.chat_template_utils import DocstringParsingException, TypeHintParsingException

    schemas = []
    for func, spec in zip(funcs, specs, strict=True):
        try:
            schemas.append(get_json_schema(func))
        except (DocstringParsingException, TypeHintParsingException) as err:
            raise UserError(f"tool {spec}: {err}; give every argument a type hint, and the function a docstring "
                            "with a line per argument under Args: (as transformers' get_json_schema reads them)"
                            ) from None
    return schemas


def serve(func: Callable[..., Any], mode: str, payload: bytes) -> tuple[str, str]:
    """A tool call in a worker: ``("result", text)``, or ``("raised", message)``."""
    try:
        return "result", str(func(**pickle.loads(payload)))
    except BaseException as err:  # SystemExit too: it would end the worker
        return "raised", str(err) or type(err).__name__
