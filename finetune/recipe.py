"""A recipe's command line: its flags read and checked, then the training loop and its libraries loaded and run.

Apart from ``loop`` so that a bad flag or YAML file is refused in a second, before accelerate, peft and the
runtimes load (``tests/test_config.py`` checks what has loaded by then).
"""

from __future__ import annotations

from collections.abc import Callable

from finetune.config import parse_config

__all__ = ["run_recipe"]


def run_recipe(make_task: Callable, options_class: type, argv: list[str] | None = None, *, description: str,
               defaults: dict | None = None) -> dict:
    """Parse ``argv`` into the shared ``TrainConfig`` and the recipe's ``options_class`` (over the recipe's
    ``defaults``), then train ``make_task(options)``; returns ``all_results``.

    Raises:
        UserError: a bad flag, before anything heavy loads; then whatever ``finetune.loop.train`` raises.
    """
    cfg, options = parse_config(options_class, argv, defaults=defaults, description=description)
    from finetune.loop import train

    return train(make_task(options), cfg, options)
