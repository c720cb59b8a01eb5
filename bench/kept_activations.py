"""What a training step of the chat recipe's model keeps for its backward pass: LoRA's dropout three ways, and
with its layers recomputed in the backward pass (``--gradient_checkpointing``).

    python bench/kept_activations.py        # about a minute; writes bench/results/kept-activations.json

SmolLM2-135M-Instruct with LoRA (r 16 on every linear layer), one forward pass of the recipe's loss over 8 rows
of 512 tokens (the last 162 of each trained, as in the memory comparison of bench/run.py --suite sft): the bytes
of every tensor autograd keeps for the backward pass (each storage once, the weights not counted), counted with
``torch.autograd.graph.saved_tensors_hooks`` (``finetune.models.estimate.kept_for_backward``, which the recipes'
start-up estimate uses). The three ways: peft's own layers with dropout 0.05, the package's
(``finetune.models.lora.add_lora``, whose ``DropoutLinear`` keeps the dropout's mask instead of a dropped copy), and no
dropout; then the package's with dropout 0.05 and every layer checkpointed, where the count adds each layer's input,
which the recompute holds outside autograd. The count is exact and the same on every run, unlike resident memory,
which the C allocator blurs.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import torch
import transformers
from peft import LoraConfig, get_peft_model

from finetune.models.estimate import kept_for_backward
from finetune.models.loading import default_chat_model_path
from finetune.models.lora import add_lora
from finetune.models.memory import checkpoint_activations
from finetune.tasks.causal_lm import label_log_probs

REPO = Path(__file__).resolve().parent.parent
ROWS, TOKENS, TRAINED = 8, 512, 162


def kept_by(way: str) -> int:
    """The MiB kept one way, in a process of its own."""
    torch.manual_seed(0)
    ids = torch.randint(3, 49_000, (ROWS, TOKENS))
    labels = ids.clone()
    labels[:, :TOKENS - TRAINED] = -100
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": labels}
    model = transformers.AutoModelForCausalLM.from_pretrained(default_chat_model_path())
    if way == "peft_dropout_0.05":
        model = get_peft_model(model, LoraConfig(r=16, lora_alpha=32, lora_dropout=0.05, target_modules="all-linear",
                                                 task_type="CAUSAL_LM"))
    else:
        model = add_lora(model, 16, 32, 0.0 if way == "no_dropout" else 0.05, "all-linear")
    if way == "finetune_dropout_0.05_checkpointed":
        checkpoint_activations(model)
    return round(kept_for_backward(lambda: label_log_probs(model.train(), dict(batch)), model) / 2**20)


def main(results_file: Path) -> None:
    ways = ["peft_dropout_0.05", "finetune_dropout_0.05", "no_dropout", "finetune_dropout_0.05_checkpointed"]
    kept = {}
    for way in ways:
        with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
            kept[way] = pool.submit(kept_by, way).result()
    results = {"model": "SmolLM2-135M-Instruct, LoRA r 16 on all-linear", "batch": f"{ROWS} x {TOKENS} tokens",
               "kept_for_backward_mib": kept,
               "finetune_vs_peft": round(kept["finetune_dropout_0.05"] / kept["peft_dropout_0.05"], 3),
               "checkpointed_vs_kept": round(kept["finetune_dropout_0.05_checkpointed"] / kept["finetune_dropout_0.05"],
                                             3)}
    results_file.write_text(json.dumps(results, indent=2) + "\n")
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--results_file", type=Path, default=REPO / "bench" / "results" / "kept-activations.json")
    main(parser.parse_args().results_file)
