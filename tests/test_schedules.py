"""The learning-rate schedules are transformers' own, step for step, and the loop starts without importing peft."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from helpers import REPO
from transformers import get_scheduler

from finetune.config import SCHEDULERS
from finetune.schedules import learning_rate_schedule


def optimizer(lr: float = 3e-4) -> torch.optim.Optimizer:
    return torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))], lr=lr)


def rates(scheduler, steps: int) -> list[float]:
    seen = []
    for _ in range(steps):
        seen.append(scheduler.get_last_lr()[0])
        scheduler.optimizer.step()
        scheduler.step()
    return seen


@pytest.mark.parametrize("warmup", [0, 1, 4])
@pytest.mark.parametrize("name", SCHEDULERS)
def test_each_schedule_gives_transformers_rates_step_for_step_and_resumes_from_its_state(name, warmup):
    total = 12
    theirs = get_scheduler(name, optimizer(), num_warmup_steps=warmup, num_training_steps=total)
    ours = learning_rate_schedule(name, optimizer(), warmup, total)
    expected = rates(theirs, total + 3)  # polynomial's rate past the end too
    assert rates(ours, total + 3) == expected  # equal floats, not close ones
    flat = name == "constant" or (name == "constant_with_warmup" and warmup == 0)
    assert (len(set(expected)) == 1) == flat
    # a checkpoint of transformers' schedule, taken at step 5, resumes in ours
    saved = get_scheduler(name, optimizer(), num_warmup_steps=warmup, num_training_steps=total)
    rates(saved, 5)
    resumed = learning_rate_schedule(name, optimizer(), warmup, total)
    resumed.load_state_dict(saved.state_dict())
    assert rates(resumed, total - 2) == expected[5:]


def test_a_polynomial_schedule_warming_up_over_every_step_ends_at_its_end_rate():
    """Where transformers' formula divides by zero (the warmup as long as the run)."""
    seen = rates(learning_rate_schedule("polynomial", optimizer(3e-4), 3, 3), 5)
    assert seen == pytest.approx([0.0, 1e-4, 2e-4, 1e-7, 1e-7], rel=1e-12)


def test_the_training_loop_imports_neither_peft_nor_bitsandbytes():
    """transformers.optimization would (through transformers.trainer_utils): a second at every process's start."""
    import peft  # noqa: F401  installed, so that transformers would import it

    code = ("import sys, finetune.loop; "
            "print(sorted({'peft', 'bitsandbytes', 'transformers.trainer_utils'} & set(sys.modules)))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120,
                            cwd=REPO)
    assert result.stdout.strip() == "[]"
