"""Gather token-level outputs of different lengths through a real runtime and write what came back.

Launched by the tests with accelerate launch or torchrun; rank 0 writes OUT/gathered.json. Example i has
``lengths[i]`` tokens, each worth i; batches are padded per process with -100.
"""

import json
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from finetune.config import parse_config
from finetune.data.batching import TokenizedDataset
from finetune.runtimes.launcher import make_runtime


@dataclass
class NoOptions:
    pass


out = Path(sys.argv[1])
cfg, _ = parse_config(NoOptions, sys.argv[2:])
lengths = [(i * 5) % 11 + 1 for i in range(23)]  # 23 examples: a prime, so the last batches are uneven
dataset = TokenizedDataset.from_dict({"input_ids": [[i] * n for i, n in enumerate(lengths)]})


def collate(rows):
    longest = max(len(row["input_ids"]) for row in rows)
    return {"ids": torch.tensor([row["input_ids"] + [-100] * (longest - len(row["input_ids"])) for row in rows]),
            "index": torch.tensor([row["input_ids"][0] for row in rows])}


with make_runtime(cfg, tracking=None) as runtime:
    model = torch.nn.Linear(1, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    *_, loader = runtime.prepare(model, optimizer, scheduler, runtime.eval_loader(dataset, 3, collate))
    rows = []
    for batch in loader:
        ids, index = runtime.gather_for_metrics((batch["ids"], batch["index"]))
        rows += [[value for value in row.tolist() if value != -100] for row in ids]
        assert index.tolist() == [row[0] for row in rows[-len(index):]]
    if runtime.is_main_process:
        (out / "gathered.json").write_text(json.dumps({"world_size": runtime.world_size, "rows": rows}))
    # Leave as the training loop does, after a barrier the main process answers last: a rank that exits while
    # another still finishes a collective with it can make gloo abort that one at exit.
    runtime.wait_for_save()
