"""Your own training loop on finetune's raw-DDP layer: every distributed call in plain sight.

    torchrun --nproc_per_node=2 examples/raw_ddp.py OUTPUT_DIR
"""

import sys

import torch
from torch.utils.data import DataLoader, DistributedSampler
from transformers import AutoModelForSequenceClassification, AutoTokenizer, DataCollatorWithPadding

from finetune.data.embedded.support_tickets import LABEL_NAMES, make_support_tickets
from finetune.distributed.ddp import all_reduce_sum, destroy_distributed, init_distributed, save_unwrapped, wrap_model
from finetune.models.loading import default_model_path

info = init_distributed()  # nccl on GPU, gloo on CPU; rank and LOCAL_RANK from torchrun
try:
    tokenizer = AutoTokenizer.from_pretrained(default_model_path())
    train = make_support_tickets()["train"].select(range(64))
    train = train.map(lambda b: tokenizer(b["text"], truncation=True, max_length=64), batched=True,
                      remove_columns=["text"]).rename_column("label", "labels")
    sampler = DistributedSampler(train, shuffle=True, seed=0)
    loader = DataLoader(train, batch_size=8, sampler=sampler, collate_fn=DataCollatorWithPadding(tokenizer))

    torch.manual_seed(0)  # the same head on every rank (DDP also broadcasts rank 0's weights)
    model = AutoModelForSequenceClassification.from_pretrained(default_model_path(), num_labels=len(LABEL_NAMES))
    model = wrap_model(model.to(info.device), info)  # DistributedDataParallel(model, device_ids=[local_rank])
    optimizer = torch.optim.AdamW(model.parameters(), lr=5e-5)

    for epoch in range(2):
        sampler.set_epoch(epoch)  # a new shuffle each epoch, the same on every rank
        loss_sum = torch.zeros(2, device=info.device)
        for batch in loader:
            batch = {k: v.to(info.device) for k, v in batch.items()}
            loss = model(**batch).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            loss_sum += torch.stack([loss.detach(), torch.ones((), device=info.device)])
        total, batches = all_reduce_sum(loss_sum).tolist()
        if info.is_main_process:
            print(f"epoch {epoch}: mean loss {total / batches:.4f} over {info.world_size} processes")

    save_unwrapped(model, sys.argv[1], info, tokenizer)  # rank 0 saves model.module; the others wait
finally:
    destroy_distributed()
