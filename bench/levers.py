"""What the per-step costs the recipe avoids or pays are worth, measured side by side in one process.

    python bench/levers.py     # about a minute on 2 CPU cores -> bench/results/levers.{json,md}

Each pair runs alternately, 7 rounds, and reports medians, next to the median time of a whole
training step (forward, backward, fused AdamW) on a length-grouped batch of median length from the
benchmark's data.

- AdamW as torch builds it by default (foreach) against ``fused=True``, which the recipe uses.
- Padding a batch: transformers' ``DataCollatorWithPadding`` (the recipe's collator), per batch.
- Reading the loss back every step (``loss.item()``) against not doing so. On a CPU there is no queue
  of work to drain, so this costs little here; on a GPU it stalls the launch queue every step.
- The chat recipe's loss: next-token cross-entropy over logits of SmolLM2's shape (a batch of 8 x 60 tokens,
  49,152-word vocabulary), forward and backward, with the labels shifted (the vocabulary dimension stays
  contiguous) against the logits shifted and transposed (a softmax over a strided dimension).
- On a CPU, a training step with 1 thread against 2 (what ``accelerate launch`` gives a lone process by
  default against what the recipe gives it).
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from transformers import AutoModelForSequenceClassification, AutoTokenizer, DataCollatorWithPadding  # noqa: E402

from finetune.data.embedded.support_tickets import make_support_tickets  # noqa: E402
from finetune.models.loading import default_model_path  # noqa: E402

ROUNDS = 7
RESULTS = Path(__file__).resolve().parent / "results" / "levers"


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

    vocabulary_logits = torch.randn(8, 60, 49152, device=device)
    next_tokens = torch.randint(0, 49152, (8, 60), device=device)

    def language_model_loss(shift_labels: bool):
        def run():
            logits = vocabulary_logits.clone().requires_grad_()
            if shift_labels:
                labels = torch.nn.functional.pad(next_tokens[:, 1:], (0, 1), value=-100)
                losses = torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="none")
            else:
                losses = torch.nn.functional.cross_entropy(logits[:, :-1].transpose(1, 2), next_tokens[:, 1:],
                                                           reduction="none")
            losses.sum().backward()
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
        for shift_labels in (True, False):
            label = "chat loss, labels shifted" if shift_labels else "chat loss, logits shifted and transposed"
            samples.setdefault(label, []).append(timed(language_model_loss(shift_labels)))
        if device.type == "cpu":
            torch.set_num_threads(1)
            samples.setdefault("2 training steps, 1 CPU thread", []).append(timed(training_step(False)))
            torch.set_num_threads(2)

    whole_step = statistics.median(samples["2 training steps, no host read"]) / 2
    rows = []
    for label, values in samples.items():
        median = statistics.median(values)
        share = median / whole_step / (2 if label.startswith("2 ") else 1)
        rows.append({"measured": label, "median_ms": median * 1000, "min_ms": min(values) * 1000,
                     "max_ms": max(values) * 1000, "of_a_training_step": share})
    heading = (f"{device.type}: a training step on a batch of 32 x {batch['input_ids'].shape[1]} tokens "
               f"(2 threads on a CPU) takes {whole_step * 1000:.0f} ms (median of {ROUNDS} rounds)")
    table = "\n".join([heading, "", "| measured | median ms (min-max) | of a training step |", "|---|---|---|",
                       *(f"| {r['measured']} | {r['median_ms']:.1f} ({r['min_ms']:.1f}-{r['max_ms']:.1f}) | "
                         f"{r['of_a_training_step']:.1%} |" for r in rows)]) + "\n"
    suffix = "-cuda" if device.type == "cuda" else ""
    RESULTS.with_name(f"levers{suffix}.json").write_text(json.dumps(
        {"device": device.type, "rounds": ROUNDS, "training_step_ms": whole_step * 1000, "levers": rows}, indent=2)
        + "\n")
    RESULTS.with_name(f"levers{suffix}.md").write_text(table)
    print(table)


if __name__ == "__main__":
    main()
