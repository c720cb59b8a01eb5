"""Learning-rate schedules: transformers' seven that need nothing but the warmup and the number of steps.

Each is ``transformers.get_scheduler``'s formula with its defaults (tests/test_schedules.py holds them equal, step
for step). They are written here because ``transformers.optimization`` imports ``transformers.trainer_utils``, which
imports peft, which imports bitsandbytes where it is installed: about a second at the start of every process,
whether it trains an adapter or not.
"""

from __future__ import annotations

import functools
import math

import torch

from finetune.config import POLYNOMIAL_END, SCHEDULERS

__all__ = ["learning_rate_schedule"]


def learning_rate_schedule(name: str, optimizer: torch.optim.Optimizer, warmup_steps: int,
                           total_steps: int) -> torch.optim.lr_scheduler.LambdaLR:
    """The ``LambdaLR`` of schedule ``name`` (one of ``finetune.config.SCHEDULERS``) over ``total_steps``: a linear
    warmup from 0 over ``warmup_steps`` (none for ``constant``, as in transformers), then the schedule's shape."""
    assert name in SCHEDULERS, name
    shape, options = _SHAPES[name], {"warmup": 0 if name == "constant" else warmup_steps, "total": total_steps}
    if name == "polynomial":
        options["start"] = optimizer.defaults["lr"]
    if name == "inverse_sqrt":
        options["timescale"] = warmup_steps or 10_000
    return torch.optim.lr_scheduler.LambdaLR(optimizer, functools.partial(_warmed_up, shape, **options))


def _warmed_up(shape, step: int, *, warmup: int, **options) -> float:
    if step < warmup:
        return float(step) / float(max(1, warmup))
    return shape(step, warmup=warmup, **options)


def _progress(step: int, warmup: int, total: int) -> float:
    return float(step - warmup) / float(max(1, total - warmup))


def _linear(step: int, *, warmup: int, total: int) -> float:
    return max(0.0, float(total - step) / float(max(1, total - warmup)))


def _cosine(step: int, *, warmup: int, total: int) -> float:  # half a cycle: from 1 down to 0
    return max(0.0, 0.5 * (1.0 + math.cos(math.pi * _progress(step, warmup, total))))


def _cosine_with_restarts(step: int, *, warmup: int, total: int) -> float:  # one cycle, then 0
    progress = _progress(step, warmup, total)
    if progress >= 1.0:
        return 0.0
    return max(0.0, 0.5 * (1.0 + math.cos(math.pi * (progress % 1.0))))


def _polynomial(step: int, *, warmup: int, total: int, start: float) -> float:
    if step >= total:  # where transformers' formula would divide by zero when the warmup is every step
        return POLYNOMIAL_END / start
    return ((start - POLYNOMIAL_END) * (1 - _progress(step, warmup, total)) + POLYNOMIAL_END) / start


def _constant(step: int, *, warmup: int, total: int) -> float:
    return 1.0


def _inverse_sqrt(step: int, *, warmup: int, total: int, timescale: int) -> float:
    return 1.0 / math.sqrt((step + timescale - warmup) / timescale)


_SHAPES = {"linear": _linear, "cosine": _cosine, "cosine_with_restarts": _cosine_with_restarts,
           "polynomial": _polynomial, "constant": _constant, "constant_with_warmup": _constant,
           "inverse_sqrt": _inverse_sqrt}
"""Each schedule after its warmup."""
