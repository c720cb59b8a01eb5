"""Record which training examples each process gets, epoch by epoch, through a real runtime.

Launched by the tests with accelerate launch or torchrun; writes OUT/rank_R.json. Each batch the loader
yields must be the batch the sampler's plan says it is: the loop scales each batch's loss by its plan.
"""

import json
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from finetune.config import parse_config
from finetune.data.batching import GlobalBatchSampler, TokenizedDataset
from finetune.runtimes.launcher import make_runtime


@dataclass
class NoOptions:
    pass


out = Path(sys.argv[1])
cfg, _ = parse_config(NoOptions, sys.argv[2:])
lengths = [(i * 7) % 23 + 1 for i in range(45)]  # 45 examples: the last global batch is short
dataset = TokenizedDataset.from_dict({"input_ids": [[i] * n for i, n in enumerate(lengths)]})


def collate(rows):
    return {"ids": torch.tensor([row["input_ids"][0] for row in rows])}


with make_runtime(cfg, tracking=None) as runtime:
    sampler = GlobalBatchSampler(lengths, cfg.per_device_train_batch_size, runtime.world_size, seed=cfg.seed,
                                 group_by_length=cfg.group_by_length)
    model = torch.nn.Linear(1, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    _, _, _, loader, _ = runtime.prepare(model, optimizer, scheduler, runtime.train_loader(dataset, sampler, collate),
                                         runtime.eval_loader(dataset, 4, collate))
    seen = []
    for epoch in range(2):
        epoch_ids = []
        for batch, planned in zip(runtime.epoch_batches(loader, epoch), sampler.plan(epoch, runtime.rank),
                                  strict=True):
            assert batch["ids"].tolist() == list(planned), (batch["ids"].tolist(), list(planned))
            epoch_ids.append(list(planned)[:planned.num_real])
        seen.append(epoch_ids)
    (out / f"rank_{runtime.rank}.json").write_text(json.dumps({"world_size": runtime.world_size, "epochs": seen}))
