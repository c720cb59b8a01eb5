"""Train a tiny model through the raw-DDP runtime; rank 1 raises at its third step."""

import sys

import torch

from finetune.config import parse_config
from finetune.runtime import make_runtime

cfg = parse_config(sys.argv[1:])
with make_runtime(cfg) as runtime:
    model = torch.nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    model, optimizer, scheduler, _, _ = runtime.prepare(model, optimizer, scheduler, None, None)
    for step in range(1000):
        if step == 3 and runtime.rank == 1:
            raise RuntimeError("rank 1 failed on purpose at step 3")
        runtime.backward(model(torch.randn(8, 4)).pow(2).mean())
        optimizer.step()
        optimizer.zero_grad()
