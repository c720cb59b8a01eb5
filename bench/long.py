"""The chat recipe on long rows against TRL's SFTTrainer: peak memory and tokens per second, one row a step.

    python bench/long.py --lengths 4096 --return_freed_memory     # about 6 minutes on 2 CPU cores: long.json
    python bench/long.py --lengths 4096 --results_file bench/results/long-glibc.json   # glibc's defaults
    python bench/long.py --lengths 4096 8192 --repeats 1 --return_freed_memory \
        --results_file bench/results/long-8k.json       # 8k rows (~2 min a step) and the estimate at both lengths

Each row is one conversation of about LENGTH tokens: the system and user turns of an embedded support
conversation, then one long assistant reply (the replies of consecutive embedded conversations, each after its
ticket), which trains, as a reasoning trace does. Two copies of the row train for one epoch, so each run makes two
optimizer steps of one row; the figure of time is the second step's (the first includes warm-up), tokens per second
the row's tokens over it. Both sides: SmolLM2-135M-Instruct with the recipe's LoRA (r 16 on every linear layer,
dropout 0.05), learning rate and weight decay, float32, 2 threads:

- ``finetune``: ``sft.py --gradient_checkpointing``, launched as the README launches it;
- ``trl``: TRL's ``SFTTrainer`` with its defaults for such rows: activation checkpointing on, padding-free
  batches, no length limit (``bench/baselines.py trl_long``);
- ``finetune_kept`` (rows up to 4,096 tokens): ``sft.py`` without checkpointing, what it costs to keep every
  layer's activations.

Every configuration is a fresh process under ``bench/probe.py`` (peak resident memory of the training process,
optimizer step times). glibc's allocator keeps memory a process freed and reuses it (its threshold for giving
big blocks back to the system rises with every big block freed): on long rows the resident peak then holds
gigabytes no tensor uses. ``--return_freed_memory`` runs both sides with ``MALLOC_MMAP_THRESHOLD_`` fixed at 64
KiB, so that their peaks are of memory in use. The configurations of a length run in a rotated order in each
repeat, lengths in turn.
The recipe's runs also record the peak their start-up line predicted (``finetune.models.estimate``), and each
length its ratio to the measured one. Writes ``bench/results/long.json``: every run, and each length's medians
and ratios (taken within a repeat);
lengths measured before and not now stay in it under ``earlier``, with their date.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent
MMAP_THRESHOLD = 65536
KEPT_UP_TO = 4096
"""Without checkpointing a row of 8k tokens keeps about 20 GB here: only shorter rows run that way."""


def long_chat(tokens: int) -> list[dict]:
    """A conversation of at least ``tokens`` tokens in SmolLM2's chat template, the last turn a long reply."""
    from transformers import AutoTokenizer

    from finetune.data.embedded.support_chats import make_support_conversations
    from finetune.models.loading import default_chat_model_path

    tokenizer = AutoTokenizer.from_pretrained(default_chat_model_path())
    conversations = make_support_conversations()["train"]["messages"]
    parts = []
    for turn in itertools.count():
        conversation = conversations[turn % len(conversations)]
        parts.append(f"{conversation[1]['content']}\n{conversation[2]['content']}")
        chat = [*conversations[0][:2], {"role": "assistant", "content": "\n\n".join(parts)}]
        text = tokenizer.apply_chat_template(chat, tokenize=False)
        if len(text) > 3 * tokens and len(tokenizer(text).input_ids) >= tokens:  # (about 3.5 characters a token)
            return chat


def write_rows(folder: Path, tokens: int) -> tuple[Path, Path]:
    """Two copies of the long row for training; a short conversation to evaluate (which is not measured)."""
    from finetune.data.embedded.support_chats import make_support_conversations

    train, validation = folder / f"long-{tokens}.jsonl", folder / "short.jsonl"
    row = json.dumps({"messages": long_chat(tokens)})
    train.write_text(f"{row}\n{row}\n")
    validation.write_text(json.dumps({"messages": make_support_conversations()["validation"]["messages"][0]}) + "\n")
    return train, validation


def command(config: str, train: Path, validation: Path, tokens: int, output_dir: Path) -> list[str]:
    if config == "trl":
        return [sys.executable, str(BENCH / "baselines.py"), "trl_long", str(train), str(output_dir),
                "--per_device_train_batch_size", "1"]
    checkpointing = ["--gradient_checkpointing"] if config == "finetune" else []
    return [sys.executable, "-m", "accelerate.commands.launch", "--num_processes", "1", "--num_cpu_threads_per_process",
            "2", str(BENCH / "probe.py"), str(REPO / "recipes" / "sft.py"), "--train_file", str(train),
            "--validation_file", str(validation), "--max_seq_length", str(tokens + 512),
            "--per_device_train_batch_size", "1", "--per_device_eval_batch_size", "1", "--num_train_epochs", "1",
            "--eval_generate", "0", "--output_dir", str(output_dir), *checkpointing]


def run(config: str, train: Path, validation: Path, tokens: int, scratch: Path, return_freed: bool) -> dict:
    reports, output_dir = scratch / f"{config}-{tokens}-reports", scratch / f"{config}-{tokens}-out"
    for folder in (reports, output_dir):  # the previous repeat's
        shutil.rmtree(folder, ignore_errors=True)
    reports.mkdir(parents=True)
    allocator = {"MALLOC_MMAP_THRESHOLD_": str(MMAP_THRESHOLD)} if return_freed else {}
    result = subprocess.run(command(config, train, validation, tokens, output_dir), cwd=REPO, capture_output=True,
                            text=True, env={**os.environ, "OMP_NUM_THREADS": "2", "BENCH_REPORT_DIR": str(reports),
                                            "BENCH_LAUNCHED_AT": repr(time.time()), **allocator})
    if result.returncode:
        return {"failed": result.stderr[-2000:]}
    report = json.loads((reports / "rank0.json").read_text())
    steps, batches = report["step_times"], report["batches"]
    assert len(steps) == 2 and len(batches) == 2, (steps, batches)
    seconds = steps[1] - steps[0]
    real_tokens = batches[1][1]
    figures = {"peak_rss_mib": round(report["peak_rss_mib"]), "step_seconds": round(seconds, 2),
               "real_tokens": real_tokens, "tokens_per_second": round(real_tokens / seconds, 1)}
    predicted = re.search(r"predicted peak ([\d.]+) (MiB|GiB)", result.stdout)  # the recipe's start-up estimate
    if predicted:
        figures["predicted_peak_mib"] = round(float(predicted[1]) * (1024 if predicted[2] == "GiB" else 1))
    return figures


def main(lengths: list[int], repeats: int, return_freed: bool, results_file: Path) -> None:
    runs: dict[str, dict[str, list[dict]]] = {}
    with tempfile.TemporaryDirectory() as scratch_dir:
        scratch = Path(scratch_dir)
        data = {tokens: write_rows(scratch, tokens) for tokens in lengths}
        for repeat in range(repeats):
            for tokens in lengths:
                configs = ["finetune", "trl"] + (["finetune_kept"] if tokens <= KEPT_UP_TO else [])
                configs = configs[repeat % len(configs):] + configs[:repeat % len(configs)]
                for config in configs:
                    figures = run(config, *data[tokens], tokens, scratch, return_freed)
                    print(tokens, config, json.dumps(figures)[:300], flush=True)
                    runs.setdefault(str(tokens), {}).setdefault(config, []).append(figures)
    summary = {}
    for tokens, by_config in runs.items():
        medians = {config: {key: statistics.median(run[key] for run in figures)
                            for key in ("peak_rss_mib", "tokens_per_second", "step_seconds")}
                   for config, figures in by_config.items() if all("failed" not in run for run in figures)}
        ours, theirs = by_config.get("finetune", []), by_config.get("trl", [])
        pairs = [(a, b) for a, b in zip(ours, theirs, strict=True) if "failed" not in a and "failed" not in b]
        ratios = {"peak_memory_vs_trl": statistics.median(a["peak_rss_mib"] / b["peak_rss_mib"] for a, b in pairs),
                  "tokens_per_second_vs_trl": statistics.median(a["tokens_per_second"] / b["tokens_per_second"]
                                                                for a, b in pairs)} if pairs else {}
        for config, figures in by_config.items():
            if all("predicted_peak_mib" in run for run in figures):
                ratios[f"{config}_predicted_vs_measured_peak"] = statistics.median(
                    run["predicted_peak_mib"] / run["peak_rss_mib"] for run in figures)
        summary[tokens] = {"medians": medians, "ratios": {k: round(v, 3) for k, v in ratios.items()},
                           "failed": {c: [r["failed"][-300:] for r in f if "failed" in r] for c, f in by_config.items()
                                      if any("failed" in r for r in f)}}
    import torch
    results = {"device": f"cpu ({os.cpu_count()} cores, 2 threads a run)", "torch": torch.__version__,
               "date": time.strftime("%Y-%m-%d"), "repeats": repeats,
               "allocator": f"MALLOC_MMAP_THRESHOLD_={MMAP_THRESHOLD}" if return_freed else "glibc's defaults",
               "summary": summary, "runs": runs}
    if results_file.exists():  # other lengths measured before stay, each with its own date
        previous = json.loads(results_file.read_text())
        earlier = {**previous.get("earlier", {}),
                   **{tokens: {**figures, "date": previous["date"]} for tokens, figures in previous["summary"].items()}}
        results["earlier"] = {tokens: figures for tokens, figures in earlier.items() if tokens not in summary}
    results_file.write_text(json.dumps(results, indent=2) + "\n")
    print(json.dumps(summary, indent=2))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[4096, 8192])
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--return_freed_memory", action="store_true",
                        help=f"run both sides with MALLOC_MMAP_THRESHOLD_={MMAP_THRESHOLD} (see the docstring)")
    parser.add_argument("--results_file", type=Path, default=BENCH / "results" / "long.json")
    cli = parser.parse_args()
    main(cli.lengths, cli.repeats, cli.return_freed_memory, cli.results_file)
