"""What the per-step costs the recipe avoids or pays are worth, measured side by side in one process.

    python bench/levers.py     # about a minute on 2 CPU cores; prints a Markdown table

Each pair runs alternately, 7 rounds, and reports medians, next to the median time of a whole
training step (forward, backward, fused AdamW) on a length-grouped batch of median length from the
benchmark's data.

- AdamW as torch builds it by default (foreach) against ``fused=True``, which the recipe uses.
- Padding a batch: transformers' ``DataCollatorWithPadding`` (the recipe's collator), per batch.
- Reading the loss back every step (``loss.item()``) against not doing so. On a CPU there is no queue
  of work to drain, so this costs little here; on a GPU it stalls the launch queue every step.
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from transformers import AutoModelForSequenceClassification, AutoTokenizer, DataCollatorWithPadding  # noqa: E402

from finetune.default_dataset import make_support_tickets  # noqa: E402
from finetune.models import default_model_path  # noqa: E402

ROUNDS = 7


def timed(function) -> float:
    start = time.perf_counter()
    function()
    return time.perf_counter() - start


def main() -> None:
    torch.manual_seed(0)
    if not torch.cuda.is_available():
        torch.set_num_threads(2)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    tokenizer = AutoTokenizer.from_pretrained(default_model_path())
    model = AutoModelForSequenceClassification.from_pretrained(default_model_path(), num_labels=4).to(device)
    # A length-grouped batch of median length: the 32 examples around the median of the benchmark's slice.
    rows = tokenizer(list(make_support_tickets()["train"]["text"][:960]), truncation=True, max_length=128)
    by_length = sorted(range(960), key=lambda i: len(rows["input_ids"][i]))
    features = [{key: rows[key][i] for key in rows} | {"labels": i % 4} for i in by_length[464:496]]
    collate = DataCollatorWithPadding(tokenizer, return_tensors="pt")
    batch = {k: v.to(device) for k, v in collate(features).items()}
    optimizers = {name: torch.optim.AdamW(model.parameters(), lr=1e-5, fused=(name == "fused"))
                  for name in ("foreach", "fused")}

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize()

    def backward():
        model(**batch).loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        sync()

    def step(optimizer):
        def run():
            optimizer.step()
            sync()
        return run

    def training_step(read_loss: bool):
        def run():
            for _ in range(2):
                loss = model(**batch).loss
                loss.backward()
                optimizers["fused"].step()
                optimizers["fused"].zero_grad()
                if read_loss:
                    loss.item()
            sync()
        return run

    samples: dict[str, list[float]] = {}
    for _ in range(ROUNDS):
        for name, optimizer in optimizers.items():
            backward()
            samples.setdefault(f"AdamW step, {name}", []).append(timed(step(optimizer)))
            optimizer.zero_grad()
        samples.setdefault("padding a batch of 32 (DataCollatorWithPadding)", []).append(
            timed(lambda: collate(features)))
        for read_loss in (False, True):
            label = "2 training steps, loss.item() each step" if read_loss else "2 training steps, no host read"
            samples.setdefault(label, []).append(timed(training_step(read_loss)))

    whole_step = statistics.median(samples["2 training steps, no host read"]) / 2
    print(f"{device.type}: a training step on a batch of 32 x {batch['input_ids'].shape[1]} tokens takes "
          f"{whole_step * 1000:.0f} ms (median)\n")
    print("| measured | median ms | of a training step |\n|---|---|---|")
    for label, values in samples.items():
        median = statistics.median(values)
        share = median / whole_step / (2 if label.startswith("2 ") else 1)
        print(f"| {label} | {median * 1000:.1f} | {share:.1%} |")


if __name__ == "__main__":
    main()
