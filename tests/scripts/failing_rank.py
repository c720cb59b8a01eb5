"""Train a tiny model through a runtime; rank 1 raises at its third step."""

import sys
from dataclasses import dataclass

import torch

from finetune.config import parse_config
from finetune.runtimes.launcher import make_runtime


@dataclass
class NoOptions:
    pass


cfg, _ = parse_config(NoOptions, sys.argv[1:])
with make_runtime(cfg, tracking=None) as runtime:
    model = torch.nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    model, optimizer, scheduler = runtime.prepare(model, optimizer, scheduler)
    for step in range(1000):
        if step == 3 and runtime.rank == 1:
            raise RuntimeError("rank 1 failed on purpose at step 3")
        runtime.backward(model(torch.randn(8, 4)).pow(2).mean())
        optimizer.step()
        optimizer.zero_grad()
