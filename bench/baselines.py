"""What the recipe is measured against: a hand-written PyTorch loop and transformers' Trainer.

    python bench/baselines.py {loop_random,loop_grouped,trainer_default,trainer_grouped} TRAIN_CSV OUT_DIR

All four train the same model on the same CSV for one epoch with the recipe's defaults: per-device
batch 32, learning rate 1e-4, sequences cut at 128 tokens, each batch padded to its own longest row.

- ``loop_random``: the loop everyone writes. A shuffled DataLoader, AdamW with torch's defaults, a
  linear schedule and gradient clipping at 1.0 (the recipe clips and schedules too).
- ``loop_grouped``: the same loop over the batch order the recipe's sampler plans (grouped by length),
  so it processes exactly the batches the recipe does and the ratio between the two is the package's
  own overhead.
- ``trainer_default``: ``Trainer`` with default ``TrainingArguments`` (fused AdamW, no weight decay,
  linear schedule, clipping at 1.0), given the tokenizer, so it pads per batch.
- ``trainer_grouped``: the same with Trainer's length-grouped sampler.

Run under ``bench/probe.py``'s hooks (installed here), like the recipe.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import datasets  # noqa: E402
import probe  # noqa: E402
import torch  # noqa: E402
from transformers import (  # noqa: E402
    AutoModelForSequenceClassification,
    AutoTokenizer,
    DataCollatorWithPadding,
    Trainer,
    TrainingArguments,
    get_linear_schedule_with_warmup,
)

from finetune.batching import GlobalBatchSampler  # noqa: E402
from finetune.config import TrainConfig  # noqa: E402
from finetune.models import default_model_path  # noqa: E402

RECIPE = TrainConfig()  # the recipes' shared defaults, which every configuration uses
BATCH_SIZE, LEARNING_RATE = RECIPE.per_device_train_batch_size, RECIPE.learning_rate
MAX_LENGTH, SEED = RECIPE.max_seq_length, RECIPE.seed


class CountingCollator:
    """Pads like ``DataCollatorWithPadding`` and tells the probe what each batch held."""

    def __init__(self, tokenizer):
        self.pad = DataCollatorWithPadding(tokenizer, return_tensors="pt")

    def __call__(self, features):
        batch = self.pad(features)
        probe.record_batch(batch["attention_mask"], len(features))
        return batch


def hand_written_loop(model, train, collate, batch_sampler, device, bf16):
    model.to(device).train()
    loader = torch.utils.data.DataLoader(train, batch_sampler=batch_sampler, collate_fn=collate)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LEARNING_RATE)
    scheduler = get_linear_schedule_with_warmup(optimizer, 0, len(loader))
    for batch in loader:
        batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
            loss = model(**batch).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()


def main(kind: str, train_csv: str, output_dir: str) -> None:
    probe.install()
    torch.manual_seed(SEED)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    bf16 = device.type == "cuda"
    tokenizer = AutoTokenizer.from_pretrained(default_model_path())
    raw = datasets.load_dataset("csv", data_files=train_csv, split="train")
    train = raw.map(lambda batch: tokenizer(batch["text"], truncation=True, max_length=MAX_LENGTH),
                    batched=True, remove_columns=["text"]).rename_column("label", "labels")
    model = AutoModelForSequenceClassification.from_pretrained(
        default_model_path(), num_labels=len(set(train["labels"]))
    )
    collate = CountingCollator(tokenizer)

    if kind.startswith("loop"):
        train = train.with_format(None).to_list()  # plain rows: what a hand-written loop indexes
        if kind == "loop_grouped":
            batches = GlobalBatchSampler([len(row["input_ids"]) for row in train], BATCH_SIZE, 1, seed=SEED,
                                         group_by_length=True)
        else:
            generator = torch.Generator().manual_seed(SEED)
            batches = torch.utils.data.BatchSampler(
                torch.utils.data.RandomSampler(train, generator=generator), BATCH_SIZE, drop_last=False
            )
        hand_written_loop(model, train, collate, batches, device, bf16)
        return

    # transformers 5 names the sampler with train_sampling_strategy; 4.x had group_by_length.
    if kind == "trainer_grouped":
        fields = TrainingArguments.__dataclass_fields__
        grouped = ({"train_sampling_strategy": "group_by_length"} if "train_sampling_strategy" in fields
                   else {"group_by_length": True})
    else:
        grouped = {}
    args = TrainingArguments(
        output_dir=output_dir,
        per_device_train_batch_size=BATCH_SIZE,
        learning_rate=LEARNING_RATE,
        num_train_epochs=1,
        seed=SEED,
        bf16=bf16,
        save_strategy="no",
        report_to="none",
        **grouped,
    )
    Trainer(model=model, args=args, train_dataset=train, processing_class=tokenizer, data_collator=collate).train()


if __name__ == "__main__":
    main(*sys.argv[1:])
