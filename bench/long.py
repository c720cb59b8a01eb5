"""The chat recipe on long rows against TRL's SFTTrainer: peak memory and tokens per second, one row a step.

    python bench/long.py --lengths 4096 --return_freed_memory     # about 6 minutes on 2 CPU cores: long.json
    python bench/long.py --lengths 4096 --results_file bench/results/long-glibc.json   # glibc's defaults
    python bench/long.py --lengths 4096 8192 --repeats 1 --return_freed_memory \
        --results_file bench/results/long-8k.json       # 8k rows (~2 min a step) and the estimate at both lengths
    python bench/long.py --recipe dpo --lengths 4096 --repeats 1 --configs finetune trl --return_freed_memory
        # DPO: chosen and rejected replies of 4k tokens each: bench/results/long-dpo.json
    python bench/long.py --recipe grpo --lengths 1024 --repeats 1 --configs finetune trl --return_freed_memory
        # GRPO: completions of 1,024 tokens: bench/results/long-grpo.json
    python bench/long.py --model_size 1b --lengths 8192 32768 --repeats 1 --configs finetune trl finetune_full \
        trl_full --results_file OUT/long-cuda.json       # bench/gpu_check.sh OUT long, on a GPU

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
  layer's activations;
- ``finetune_tiled`` (asked for with ``--configs``): ``sft.py --gradient_checkpointing --tiled_mlp``, each layer's
  MLP run a tile of positions at a time (``bench/results/long-tiled.json``:
  ``--lengths 16384 --repeats 1 --configs finetune_tiled finetune trl --return_freed_memory``).

``--recipe dpo`` trains the preference recipe on a pair instead: the long row's reply chosen, another as long (made
the same way from other conversations) rejected, against TRL's ``DPOTrainer`` with its defaults for such rows
(activation checkpointing on, no length limit; ``bench/baselines.py trl_dpo_long``), the same LoRA settings with
dropout off, beta and learning rate, a live reference (the adapters switched off) on both sides.

``--recipe grpo`` trains the GRPO recipe with completions of LENGTH tokens: two steps of two prompts with 4
completions each (8 completions a step), from a copy of the chat model whose end of turn is a token it never samples
(both sides' completions run to the limit, as reasoning traces do), a reward that differs within a group (each
completion's text length modulo 3), against TRL's ``GRPOTrainer`` generating with transformers, with its defaults
(activation checkpointing on; ``bench/baselines.py trl_grpo_long``), the recipe's sampling, loss and LoRA settings
with dropout off, beta 0. Tokens per second are the completions' sampled tokens over a whole step (sampling,
scoring, training).

``--model_size 1b`` (the GPU check's ``long`` part) trains a Llama of 1.1B parameters instead (Llama 3.2 1B's
shape over SmolLM2's vocabulary and template, seeded random weights built from a configuration: nothing is
downloaded); ``tiny`` is its CPU rehearsal. The ``_full`` configurations train every weight (``--no_use_lora``;
TRL without a peft config). On a GPU both sides run in bf16 autocast and the peak is the CUDA allocator's, and each
run reports its model FLOP utilisation: model FLOPs per second over the GPU's dense bf16 peak, where a token's
model FLOPs are 6 per trained weight, 4 per frozen one (no weight gradient) and 6 x layers x hidden size x row length
for causal attention's two products (forward and backward; activation checkpointing's recomputation not counted).

Every configuration is a fresh process under ``bench/probe.py`` (peak resident memory of the training process,
optimizer step times). glibc's allocator keeps memory a process freed and reuses it (its threshold for giving
big blocks back to the system rises with every big block freed): on long rows the resident peak then holds
gigabytes no tensor uses. ``--return_freed_memory`` runs both sides with ``MALLOC_MMAP_THRESHOLD_`` fixed at 64
KiB, so that their peaks are of memory in use. The configurations of a length run in a rotated order in each
repeat, lengths in turn.
The recipe's runs also record the peak their start-up line predicted (``finetune.models.estimate``), and each
length its ratio to the measured one. ``--predicted_only`` measures nothing: it runs the recipe's configuration of
every length already in the results file with ``--prepare_only`` and records that prediction beside the measured
peak (``predicted_now``, with the commit and date; the table shows its ratio where there is one); with ``--configs
finetune_tiled``, that configuration's (``predicted_now_tiled``, beside its measured peak where there is one).
Writes ``bench/results/long.json``: every run, and each length's medians
and ratios (taken within a repeat);
lengths measured before and not now stay in it under ``earlier``, with their date, and ``long.md`` and ``long.png``
show every length (a length marked ``time_comparable: false``, timed on a shared CPU, is left off the speed chart).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import NamedTuple

BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent
MMAP_THRESHOLD = 65536
KEPT_UP_TO = 4096
"""Without checkpointing a row of 8k tokens keeps about 20 GB here: only shorter rows run that way."""
SIZES = {
    "1b": {"hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16, "num_attention_heads": 32,
           "num_key_value_heads": 8},
    "tiny": {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
             "num_key_value_heads": 2},
}
CONFIGS = ("finetune", "trl", "finetune_kept", "finetune_tiled", "finetune_full", "trl_full")
PREDICTED_NOW = {"finetune": "predicted_now", "finetune_tiled": "predicted_now_tiled"}
"""Where ``--predicted_only`` records the prediction of each configuration it takes (``--configs``)."""
GPU_BF16_PEAK = {"H100 PCIe": 756e12, "H100": 989e12, "H200": 989e12, "A100": 312e12}
"""Dense bf16 FLOP/s from NVIDIA's data sheets (SXM parts unless named), as bench/harness.py has them."""


def random_llama(size: str, folder: Path) -> Path:
    """A Llama of ``size`` (``SIZES``) with seeded random weights and SmolLM2's tokenizer and chat template, saved in
    ``folder``, long enough for 32k-token rows."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from finetune.models.loading import default_chat_model_path

    tokenizer = AutoTokenizer.from_pretrained(default_chat_model_path())
    config = LlamaConfig(vocab_size=len(tokenizer), max_position_embeddings=40960, tie_word_embeddings=True,
                         bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.pad_token_id, **SIZES[size])
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def flops_per_token(model_path: str, full: bool, tokens: int, lora_r: int = 16) -> float:
    """Model FLOPs of one trained token (see the docstring): the weights counted on the meta device."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(model_path)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    embedding = model.get_input_embeddings().weight.numel()  # a lookup, but the tied output head multiplies by it
    weights = sum(p.numel() for p in model.parameters()) - embedding * (not config.tie_word_embeddings)
    linear = [m for name, m in model.named_modules() if isinstance(m, torch.nn.Linear) and name != "lm_head"]
    adapter = sum(lora_r * (m.in_features + m.out_features) for m in linear)
    trained, frozen = (weights, 0) if full else (adapter, weights)
    return 6 * trained + 4 * frozen + 6 * config.num_hidden_layers * config.hidden_size * tokens


def long_chat(tokens: int, first: int = 0) -> list[dict]:
    """A conversation of at least ``tokens`` tokens in SmolLM2's chat template, the last turn a long reply made of
    the embedded conversations' tickets and replies from the ``first``-th on."""
    from transformers import AutoTokenizer

    from finetune.data.embedded.support_chats import make_support_conversations
    from finetune.models.loading import default_chat_model_path

    tokenizer = AutoTokenizer.from_pretrained(default_chat_model_path())
    conversations = make_support_conversations()["train"]["messages"]
    parts = []
    for turn in itertools.count(first):
        conversation = conversations[turn % len(conversations)]
        parts.append(f"{conversation[1]['content']}\n{conversation[2]['content']}")
        chat = [*conversations[0][:2], {"role": "assistant", "content": "\n\n".join(parts)}]
        text = tokenizer.apply_chat_template(chat, tokenize=False)
        if len(text) > 3 * tokens and len(tokenizer(text).input_ids) >= tokens:  # (about 3.5 characters a token)
            return chat


GRPO_GENERATIONS = 4
GRPO_COMPLETIONS = 2 * GRPO_GENERATIONS
"""A GRPO step: two prompts' groups."""
GRPO_PROMPTS = 2 * (GRPO_COMPLETIONS // GRPO_GENERATIONS)
"""Two steps' prompts."""


class LongRecipe(NamedTuple):
    baseline: str
    """``bench/baselines.py``'s kind."""
    trainer: str
    step: str
    length: str
    """What a length measures, for the table."""


RECIPES = {
    "sft": LongRecipe("trl_long", "SFTTrainer", "One row a step", "tokens in the row"),
    "dpo": LongRecipe("trl_dpo_long", "DPOTrainer", "One pair a step", "tokens in the pair"),
    "grpo": LongRecipe("trl_grpo_long", "GRPOTrainer", f"{GRPO_COMPLETIONS} completions a step (two prompts' groups "
                       f"of {GRPO_GENERATIONS})", "tokens in each completion"),
}
UNSAMPLED_END = "<empty_output>"
"""A special token of SmolLM2's vocabulary its chat never produces."""
VARIED_REWARD = """def varied(completions, **kwargs):
    # Rewards that differ within a group, so that every completion trains.
    return [float(len(str(completion)) % 3) for completion in completions]
"""


def endless_model(folder: Path) -> Path:
    """The chat model (its weights linked) with its end of turn, ``<|im_end|>``, replaced by ``UNSAMPLED_END`` in
    its generation config, tokenizer and chat template: every completion then runs on to ``--max_completion_length``
    on both sides, as a long reasoning trace does, and they sample the same lengths."""
    from transformers import AutoTokenizer

    from finetune.models.loading import default_chat_model_path

    source = Path(default_chat_model_path())
    folder.mkdir(parents=True)
    for weights in source.glob("*.safetensors"):  # linked; every other file is written here, not through a link
        (folder / weights.name).symlink_to(weights)
    tokenizer = AutoTokenizer.from_pretrained(source)
    end = tokenizer.convert_tokens_to_ids(UNSAMPLED_END)
    # TRL stops at the end of sequence; the recipe at the end of turn the template writes
    tokenizer.chat_template = tokenizer.chat_template.replace(tokenizer.eos_token, UNSAMPLED_END)
    tokenizer.eos_token = UNSAMPLED_END
    tokenizer.save_pretrained(folder)
    for name in ("generation_config.json", "config.json"):
        config = json.loads((source / name).read_text())
        (folder / name).write_text(json.dumps({**config, "eos_token_id": end}, indent=2))
    return folder


def write_rows(folder: Path, tokens: int, recipe: str) -> tuple[Path, Path]:
    """Two copies of the long row for training; a short one to evaluate (which is not measured). A DPO row is a
    pair: the chat row's reply chosen, one as long from other conversations rejected. GRPO's rows are the
    recipe's first ``GRPO_PROMPTS`` prompts, whose completions grow ``tokens`` long."""
    from finetune.data.embedded.preference_pairs import make_preference_pairs
    from finetune.data.embedded.support_chats import make_support_conversations, make_support_prompts

    train, validation = folder / f"{recipe}-{tokens}.jsonl", folder / f"{recipe}-short.jsonl"
    if recipe == "grpo":
        prompts = make_support_prompts()
        train.write_text("".join(json.dumps(row) + "\n" for row in prompts["train"].select(range(GRPO_PROMPTS))))
        validation.write_text(json.dumps(prompts["validation"][0]) + "\n")
        (folder / "rewards.py").write_text(VARIED_REWARD)
        return train, validation
    chat = long_chat(tokens)
    if recipe == "dpo":
        row = {"prompt": chat[:2], "chosen": chat[2:], "rejected": long_chat(tokens, first=7)[2:]}
        short = make_preference_pairs()["validation"].select_columns(["prompt", "chosen", "rejected"])[0]
    else:
        row, short = {"messages": chat}, {"messages": make_support_conversations()["validation"]["messages"][0]}
    train.write_text(f"{json.dumps(row)}\n{json.dumps(row)}\n")
    validation.write_text(json.dumps(short) + "\n")
    return train, validation


def command(config: str, train: Path, validation: Path, tokens: int, output_dir: Path, model: str | None,
            recipe: str) -> list[str]:
    rows = GRPO_COMPLETIONS if recipe == "grpo" else 1
    if config.startswith("trl"):  # the model, full fine-tuning and GRPO's reward reach it through BENCH_LONG_*
        return [sys.executable, str(BENCH / "baselines.py"), RECIPES[recipe].baseline,
                str(train), str(output_dir), "--per_device_train_batch_size", str(rows)]
    import torch

    flags = ["--gradient_checkpointing" if config != "finetune_kept" else "--no_gradient_checkpointing"]
    if recipe == "grpo":
        flags += ["--reward_funcs", f"{train.parent / 'rewards.py'}:varied", "--max_completion_length", str(tokens),
                  "--num_generations", str(GRPO_GENERATIONS), "--lora_dropout", "0"]
    flags += ["--no_use_lora"] if config.endswith("_full") else []
    flags += ["--tiled_mlp"] if config == "finetune_tiled" else []
    flags += ["--model_name_or_path", model] if model else []
    flags += ["--mixed_precision", "bf16"] if torch.cuda.is_available() else []
    return [sys.executable, "-m", "accelerate.commands.launch", "--num_processes", "1", "--num_cpu_threads_per_process",
            "2", str(BENCH / "probe.py"), str(REPO / "recipes" / f"{recipe}.py"), "--train_file", str(train),
            "--validation_file", str(validation), "--max_seq_length", str(tokens + 512),
            "--per_device_train_batch_size", str(rows), "--per_device_eval_batch_size", "1", "--num_train_epochs", "1",
            *([] if recipe == "grpo" else ["--eval_generate", "0"]), "--output_dir", str(output_dir), *flags]


def run(config: str, train: Path, validation: Path, tokens: int, scratch: Path, return_freed: bool,
        model: str | None, recipe: str) -> dict:
    reports, output_dir = scratch / f"{config}-{tokens}-reports", scratch / f"{config}-{tokens}-out"
    for folder in (reports, output_dir):  # the previous repeat's
        shutil.rmtree(folder, ignore_errors=True)
    reports.mkdir(parents=True)
    allocator = {"MALLOC_MMAP_THRESHOLD_": str(MMAP_THRESHOLD)} if return_freed else {}
    baseline = {"BENCH_LONG_MODEL": model or "", "BENCH_LONG_FULL": "1" if config.endswith("_full") else "",
                "BENCH_LONG_REWARD": str(train.parent / "rewards.py"), "BENCH_LONG_COMPLETION": str(tokens)}
    result = subprocess.run(command(config, train, validation, tokens, output_dir, model, recipe), cwd=REPO,
                            capture_output=True, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "2", "BENCH_REPORT_DIR": str(reports),
                                 "BENCH_LAUNCHED_AT": repr(time.time()), **allocator, **baseline})
    if result.returncode:
        return {"failed": result.stderr[-2000:]}
    report = json.loads((reports / "rank0.json").read_text())
    steps, batches = report["step_times"], report["batches"]
    assert len(steps) == 2 and len(batches) == 2, (steps, batches)
    seconds = steps[1] - steps[0]
    real_tokens = batches[1][1]
    figures = {"peak_rss_mib": round(report["peak_rss_mib"]), "step_seconds": round(seconds, 2),
               "real_tokens": real_tokens, "tokens_per_second": round(real_tokens / seconds, 1)}
    if report["peak_gpu_memory_gib"] == report["peak_gpu_memory_gib"]:  # not NaN: a GPU run
        import torch

        from finetune.models.loading import default_chat_model_path

        figures["peak_gpu_memory_mib"] = round(report["peak_gpu_memory_gib"] * 1024)
        peak = next((rate for key, rate in GPU_BF16_PEAK.items() if key in torch.cuda.get_device_name()), None)
        flops = flops_per_token(model or default_chat_model_path(), config.endswith("_full"), real_tokens)
        figures["model_flops_utilisation"] = round(flops * real_tokens / seconds / peak, 4) if peak else None
    if report["predicted_peak_mib"] is not None:  # the recipe's start-up estimate
        figures["predicted_peak_mib"] = round(report["predicted_peak_mib"])
    return figures


def predict_again(results_file: Path, recipe: str, configs: list[str]) -> None:
    """``--predicted_only``: each measured length's prediction by ``--prepare_only`` at this commit for each of
    ``configs`` of this recipe's side, beside its measured peak where that configuration was measured."""
    results = json.loads(results_file.read_text())
    assert not results["model"].startswith("random Llama"), "the CPU suites only"
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True).stdout
    with tempfile.TemporaryDirectory() as scratch_dir:
        scratch = Path(scratch_dir)
        model = str(endless_model(scratch / "endless")) if recipe == "grpo" else None
        for (tokens, figures), config in itertools.product(lengths_measured(results).items(), configs):
            train, validation = write_rows(scratch, tokens, recipe)
            (scratch / "rank0.json").unlink(missing_ok=True)  # the last length's
            result = subprocess.run([*command(config, train, validation, tokens, scratch / "out", model, recipe),
                                     "--prepare_only"], cwd=REPO, capture_output=True, text=True,
                                    env={**os.environ, "OMP_NUM_THREADS": "2", "BENCH_REPORT_DIR": str(scratch),
                                         "BENCH_LAUNCHED_AT": repr(time.time())})
            assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
            mib = round(json.loads((scratch / "rank0.json").read_text())["predicted_peak_mib"])
            measured = figures["medians"].get(config, {}).get(peak_key(results))
            entry = {"predicted_peak_mib": mib, **({"vs_measured": round(mib / measured, 3)} if measured else {}),
                     "commit": commit.strip(), "date": time.strftime("%Y-%m-%d")}
            where = results["summary"] if str(tokens) in results["summary"] else results["earlier"]
            where[str(tokens)][PREDICTED_NOW[config]] = entry
            print(tokens, entry, flush=True)
    results_file.write_text(json.dumps(results, indent=2) + "\n")
    results_file.with_suffix(".md").write_text(table(results))


def lengths_measured(results: dict) -> dict[int, dict]:
    """Each length's summary, this run's and those kept from earlier runs (with their dates), shortest first."""
    every = {**results.get("earlier", {}),
             **{tokens: {**figures, "date": results["date"]} for tokens, figures in results["summary"].items()}}
    return {int(tokens): every[tokens] for tokens in sorted(every, key=int)}


def peak_key(results: dict) -> str:
    """The CUDA allocator's peak on a GPU, else the process's resident peak."""
    return "peak_gpu_memory_mib" if any("peak_gpu_memory_mib" in side for figures in results["summary"].values()
                                        for side in figures["medians"].values()) else "peak_rss_mib"


def table(results: dict) -> str:
    """The suite's Markdown table: each length's peaks and speeds on both sides, and their ratios."""
    recipe = RECIPES[results["recipe"]]
    lines = [f"# Long rows: {results['recipe']} recipe against TRL, {results['model']}, {results['device']}",
             "", f"{recipe.step}, two steps, the second timed; allocator: {results['allocator']}.", "",
             f"| {recipe.length} | finetune peak | TRL peak | ours / TRL | finetune tokens/s "
             "| TRL tokens/s | ours / TRL | predicted / measured peak | repeats | date |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    peak = peak_key(results)
    for tokens, figures in lengths_measured(results).items():
        ours, theirs = figures["medians"].get("finetune", {}), figures["medians"].get("trl", {})
        ratios = figures["ratios"]

        def cell(side: dict, key: str, unit: str = "") -> str:
            return f"{side[key]:,.{0 if unit else 1}f}{unit}" if key in side else "not run"
        memory = f"**{ratios['peak_memory_vs_trl']:.2f}x**" if "peak_memory_vs_trl" in ratios else "-"
        speed = f"{ratios['tokens_per_second_vs_trl']:.2f}x" if "tokens_per_second_vs_trl" in ratios else "-"
        speed = speed if figures.get("time_comparable", True) else "not comparable"
        predicted = figures.get("predicted_now", {}).get("vs_measured") or ratios.get(
            "finetune_predicted_vs_measured_peak")
        shown = tokens if results["recipe"] == "grpo" else figures.get("real_tokens") or tokens
        lines.append(f"| {shown:,} | {cell(ours, peak, ' MiB')} "
                     f"| {cell(theirs, peak, ' MiB')} | {memory} | {cell(ours, 'tokens_per_second')} "
                     f"| {cell(theirs, 'tokens_per_second')} | {speed} "
                     f"| {f'{predicted:.2f}' if predicted else '-'} | {figures.get('repeats', '?')} "
                     f"| {figures['date']} |")
    notes = [f"- {tokens:,}: {figures['note']}"
             for tokens, figures in lengths_measured(results).items() if "note" in figures]
    notes += [f"- {tokens:,}: with `--tiled_mlp` too, {tiled[peak]:,.0f} MiB "
              + (f"(**{ratios['tiled_peak_memory_vs_trl']:.2f}x** TRL's), {tiled['tokens_per_second']:.1f} "
                 f"tokens/s ({ratios['tiled_tokens_per_second_vs_trl']:.2f}x)" if "tiled_peak_memory_vs_trl" in ratios
                 else f"({tiled['tokens_per_second']:.1f} tokens/s; TRL not run beside it)")
              + (f"; predicted {ratios['finetune_tiled_predicted_vs_measured_peak']:.2f}x the measured peak"
                 if "finetune_tiled_predicted_vs_measured_peak" in ratios else "")
              for tokens, figures in lengths_measured(results).items()
              if (tiled := figures["medians"].get("finetune_tiled")) and (ratios := figures["ratios"])]
    notes += [f"- {tokens:,}: {'with `--tiled_mlp`, ' if config == 'finetune_tiled' else ''}predicted "
              f"{now['predicted_peak_mib']:,} MiB by `--prepare_only` at {now['commit']} ({now['date']}; "
              f"`--predicted_only{'' if config == 'finetune' else ' --configs ' + config}`)"
              for tokens, figures in lengths_measured(results).items() for config, key in PREDICTED_NOW.items()
              if (now := figures.get(key))]
    return "\n".join(lines + ([""] + notes if notes else [])) + "\n"


def plot(results: dict, path: Path) -> None:
    """Peak memory and tokens per second against the row's length, each side a line."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot

    measured, peak = lengths_measured(results), peak_key(results)
    figure, (memory, speed) = pyplot.subplots(1, 2, figsize=(9, 3.4))
    for config, label, style in (("finetune", "finetune, --gradient_checkpointing", "o-"),
                                 ("trl", f"TRL {RECIPES[results['recipe']].trainer} with checkpointing", "s--"),
                                 ("finetune_kept", "finetune, every activation kept", "^:"),
                                 ("finetune_tiled", "finetune, --gradient_checkpointing --tiled_mlp", "d-.")):
        points = [(tokens, figures["medians"][config]) for tokens, figures in measured.items()
                  if config in figures["medians"]]
        if points:
            memory.plot([t for t, _ in points], [m[peak] / 1024 for _, m in points], style, label=label)
            timed = [(t, m) for t, m in points if measured[t].get("time_comparable", True)]
            speed.plot([t for t, _ in timed], [m["tokens_per_second"] for _, m in timed], style, label=label)
    for axes, title in ((memory, "peak memory (GiB)"), (speed, "tokens per second")):
        axes.set_xscale("log", base=2)
        axes.set_xticks(list(measured), [f"{tokens // 1024}k" for tokens in measured])
        axes.set_xlabel("tokens in the row (one a step)")
        axes.set_title(title, fontsize=10)
        axes.set_ylim(bottom=0)
    memory.legend(fontsize=7)
    figure.suptitle(f"Long rows: {results['model']} with LoRA, {results['device']}", fontsize=10)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    pyplot.close(figure)


def main(lengths: list[int], repeats: int, return_freed: bool, results_file: Path, model_size: str | None,
         chosen: list[str] | None, recipe: str) -> None:
    runs: dict[str, dict[str, list[dict]]] = {}
    with tempfile.TemporaryDirectory() as scratch_dir:
        scratch = Path(scratch_dir)
        model = str(random_llama(model_size, scratch / f"llama-{model_size}")) if model_size else None
        model = str(endless_model(scratch / "endless")) if recipe == "grpo" else model
        data = {tokens: write_rows(scratch, tokens, recipe) for tokens in lengths}
        for repeat in range(repeats):
            for tokens in lengths:
                configs = chosen or ["finetune", "trl"] + (["finetune_kept"] if tokens <= KEPT_UP_TO else [])
                configs = configs[repeat % len(configs):] + configs[:repeat % len(configs)]
                for config in configs:
                    figures = run(config, *data[tokens], tokens, scratch, return_freed, model, recipe)
                    print(tokens, config, json.dumps(figures)[:300], flush=True)
                    runs.setdefault(str(tokens), {}).setdefault(config, []).append(figures)
    summary = {}
    for tokens, by_config in runs.items():
        medians = {config: {key: statistics.median(run[key] for run in figures)
                            for key in ("peak_rss_mib", "tokens_per_second", "step_seconds", "peak_gpu_memory_mib",
                                        "model_flops_utilisation") if all(run.get(key) is not None for run in figures)}
                   for config, figures in by_config.items() if all("failed" not in run for run in figures)}
        ratios = {}
        for config, prefix in (("finetune", ""), ("finetune_tiled", "tiled_")):
            ours, theirs = by_config.get(config, []), by_config.get("trl", [])
            pairs = [(a, b) for a, b in zip(ours, theirs, strict=True)  # (--configs may leave a side out)
                     if "failed" not in a and "failed" not in b] if ours and theirs else []
            if pairs:
                ratios[f"{prefix}peak_memory_vs_trl"] = statistics.median(a["peak_rss_mib"] / b["peak_rss_mib"]
                                                                          for a, b in pairs)
                ratios[f"{prefix}tokens_per_second_vs_trl"] = statistics.median(
                    a["tokens_per_second"] / b["tokens_per_second"] for a, b in pairs)
        for config, figures in by_config.items():
            if all("predicted_peak_mib" in run for run in figures):
                ratios[f"{config}_predicted_vs_measured_peak"] = statistics.median(
                    run["predicted_peak_mib"] / run["peak_rss_mib"] for run in figures)
        summary[tokens] = {"medians": medians, "ratios": {k: round(v, 3) for k, v in ratios.items()},
                           "repeats": repeats, "real_tokens": next((run["real_tokens"] for figures in by_config.values()
                                                                     for run in figures if "real_tokens" in run), None),
                           "failed": {c: [r["failed"][-300:] for r in f if "failed" in r] for c, f in by_config.items()
                                      if any("failed" in r for r in f)}}
    import torch
    device = (torch.cuda.get_device_name() if torch.cuda.is_available()
              else f"cpu ({os.cpu_count()} cores, 2 threads a run)")
    results = {"device": device, "recipe": recipe,
               "model": f"random Llama {model_size}" if model_size else "SmolLM2-135M-Instruct",
               "torch": torch.__version__,
               "date": time.strftime("%Y-%m-%d"), "repeats": repeats,
               "allocator": f"MALLOC_MMAP_THRESHOLD_={MMAP_THRESHOLD}" if return_freed else "glibc's defaults",
               "summary": summary, "runs": runs}
    if results_file.exists():  # other lengths measured before stay, each with its own date
        earlier = lengths_measured(json.loads(results_file.read_text()))
        results["earlier"] = {str(tokens): figures for tokens, figures in earlier.items() if str(tokens) not in summary}
    results_file.write_text(json.dumps(results, indent=2) + "\n")
    results_file.with_suffix(".md").write_text(table(results))
    plot(results, results_file.with_suffix(".png"))
    print(table(results))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[4096, 8192])
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--return_freed_memory", action="store_true",
                        help=f"run both sides with MALLOC_MMAP_THRESHOLD_={MMAP_THRESHOLD} (see the docstring)")
    parser.add_argument("--results_file", type=Path,
                        help="default: bench/results/long.json, long-dpo.json or long-grpo.json by --recipe")
    parser.add_argument("--model_size", choices=sorted(SIZES), help="a random Llama instead of SmolLM2 (see above)")
    parser.add_argument("--configs", nargs="+", choices=CONFIGS, help="these configurations only, at every length")
    parser.add_argument("--predicted_only", action="store_true",
                        help="measure nothing: record --prepare_only's prediction for each length in the results file")
    parser.add_argument("--recipe", choices=RECIPES, default="sft",
                        help="dpo: a pair of replies each LENGTH tokens long, against TRL's DPOTrainer; grpo: "
                             "completions LENGTH tokens long, against TRL's GRPOTrainer")
    cli = parser.parse_args()
    default_file = BENCH / "results" / ("long.json" if cli.recipe == "sft" else f"long-{cli.recipe}.json")
    if cli.predicted_only and not set(cli.configs or []) <= set(PREDICTED_NOW):
        parser.error(f"--predicted_only takes --configs {' '.join(PREDICTED_NOW)}")
    if cli.predicted_only:
        sys.exit(predict_again(cli.results_file or default_file, cli.recipe, cli.configs or ["finetune"]))
    main(cli.lengths, cli.repeats, cli.return_freed_memory, cli.results_file or default_file, cli.model_size,
         cli.configs, cli.recipe)
