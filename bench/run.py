"""The benchmark: each recipe against what users would otherwise run, side by side, same work on both sides.

    python bench/run.py                          # classify: ~23 minutes on 2 CPU cores -> bench/results/latest.*
    python bench/run.py --suite hub_push         # ~5 minutes -> bench/results/hub-push.*
    python bench/run.py --suite token_classify   # ~9 minutes -> bench/results/token-classify.*
    python bench/run.py --suite sft              # ~16 minutes -> bench/results/sft.*  (needs pip install -e ".[bench]")
    python bench/run.py --suite dpo              # ~35 minutes -> bench/results/dpo.*  (needs pip install -e ".[bench]")

Each suite writes a JSON file with every run's raw figures, a Markdown table and a PNG chart of throughput per
configuration (median, min-max bars). ``latest.json`` also carries every other suite's ratios, read from their
result files whenever a suite runs (``merged_ratios`` names the file each came from).

The classify suite trains the default MiniLM for one epoch on the same slice of the embedded support tickets
(mostly short messages with a long tail), with per-device batch 32, learning rate 1e-4 and sequences cut at
128 tokens. Each configuration is a fresh process tree started the way a user starts it; the configurations
run interleaved, in a rotated order, ``--repeats`` times. Throughput is measured over the whole training, from
the first training batch to the last optimizer step, so every configuration is measured on the same examples
and the same real tokens (start-up, before the first batch, is reported apart). Figures are medians over the
repeats with their spread (min-max), and every ratio is taken within one repeat before the median is taken.

FLOP counts (``training_flops``): a weight that trains costs 6 FLOPs per token it multiplies (2 forward, 4
backward), a frozen one 4. The *useful* count charges that only for real tokens: for classification the
encoder per real token plus the head (pooler, classifier) per example; for chat with LoRA the frozen linear
layers and output head plus the adapters, per real token. Embedding lookups, attention's own products (which
grow with padded length) and element-wise work are not counted. The machine's matmul rate is 2n^3 / t for an
n = 2048 float32 product (bf16 and n = 8192 on a GPU), best of 6, measured in every repeat; on a GPU listed in
``GPU_BF16_PEAK`` the model FLOP utilisation divides by its data-sheet bf16 peak instead.

The dpo suite trains the preference recipe on the first 32 embedded pairs for one epoch (two for its precomputed
and live reference pair), batch 8, against TRL's DPOTrainer and a hand-written loop over the recipe's batches, all
with the recipe's LoRA settings, learning rate, beta and length limit, LoRA dropout off and a live reference (the
adapters switched off) unless named; its ratios are of pairs per second, the per-token ones beside them.

On a CUDA machine the same command uses the GPU (bf16 autocast, NCCL for the 2-process configurations
when there are 2 GPUs) and writes ``*-cuda.{json,md,png}``.
"""

from __future__ import annotations

import argparse
import csv
import json
import multiprocessing
import os
import platform
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent
sys.path.insert(0, str(REPO))

from finetune.data.embedded.support_tickets import make_support_tickets  # noqa: E402
from finetune.models.loading import default_model_path  # noqa: E402

HUB_TOKEN = "hf_benchmarkToken"
GPU_BF16_PEAK = {"H100 PCIe": 756e12, "H100": 989e12, "H200": 989e12, "A100": 312e12}
"""Dense bf16 FLOP/s from NVIDIA's data sheets (SXM parts unless named), by a part of the device name."""


@dataclass
class Config:
    name: str
    what: str
    launcher: str  # accelerate, torchrun or python (a baseline)
    processes: int = 1
    threads: int = 2
    accumulation: int = 1
    recipe_flags: list[str] = field(default_factory=list)
    recipe: str = "classify"
    """classify runs on the CSV slice of support tickets; token_classify on its own embedded default."""
    epochs: int = 1
    """Passes over the training data (the recipes; the baselines train one)."""
    batch_size: int | None = None
    """The memory comparisons' batch per device on both sides; None: the suite's (its recipe's by default)."""
    long_chats: bool = False
    """sft and dpo: trains and evaluates on chats (or pairs) cut to ``LONG_CHAT_TOKENS`` (the memory comparison),
    not the embedded conversations (or pairs)."""


TRAINING = [
    Config("recipe_accelerate", "classify.py, accelerate launch", "accelerate"),
    Config("recipe_ddp", "classify.py, torchrun (raw DDP)", "torchrun"),
    Config("loop_random", "hand-written loop (a): random batches, torch's default AdamW", "python"),
    Config("loop_same_optimizer", "hand-written loop (b): the recipe's batches and optimizer (fused AdamW)", "python"),
    Config("trainer_default", "Trainer, default arguments", "python"),
    Config("trainer_grouped", "Trainer, group by length", "python"),
    Config("ddp_2proc", "classify.py, torchrun, 2 processes x 1 thread", "torchrun", processes=2, threads=1),
    Config("ddp_accum", "classify.py, torchrun, 1 process x 2 threads, accumulation 2", "torchrun", accumulation=2),
    Config("ddp_2proc_accum", "classify.py, torchrun, 2 processes x 1 thread, accumulation 2", "torchrun",
           processes=2, threads=1, accumulation=2),
]
HUB_PUSH = [
    Config("recipe_checkpoints", "classify.py, accelerate launch, a checkpoint every 8 steps", "accelerate",
           recipe_flags=["--checkpointing_steps", "8"]),
    Config("recipe_hub_push", "classify.py, accelerate launch, a checkpoint every 8 steps pushed to a Hub",
           "accelerate", recipe_flags=["--checkpointing_steps", "8", "--push_to_hub", "--hub_model_id",
                                       "bench/classifier", "--hub_token", HUB_TOKEN]),
]

# ratio: (numerator configuration, denominator configuration, target); ratios of samples per second
TRAINING_RATIOS = {
    "accelerate_vs_same_optimizer_loop": ("recipe_accelerate", "loop_same_optimizer", 0.97),
    "ddp_vs_same_optimizer_loop": ("recipe_ddp", "loop_same_optimizer", 0.97),
    "accelerate_vs_trainer_default": ("recipe_accelerate", "trainer_default", 1.5),
    "accelerate_vs_trainer_grouped": ("recipe_accelerate", "trainer_grouped", 1.0),
    "ddp_vs_trainer_default": ("recipe_ddp", "trainer_default", 1.5),
    "ddp_vs_trainer_grouped": ("recipe_ddp", "trainer_grouped", 1.0),
    "ddp_2proc_vs_1proc": ("ddp_2proc", "recipe_ddp", 0.9),
    "ddp_2proc_vs_1proc_accumulation": ("ddp_2proc_accum", "ddp_accum", 0.9),
}
HUB_PUSH_RATIOS = {"hub_push_vs_no_push": ("recipe_hub_push", "recipe_checkpoints", 0.97)}
TOKEN_CLASSIFY = [
    Config("token_classify_recipe", "token_classify.py, accelerate launch, embedded default (3 epochs)",
           "accelerate", recipe="token_classify"),
    Config("trainer_ner", "Trainer the run_ner.py way, same data, model, batch, learning rate and epochs", "python",
           recipe="token_classify"),
]
TOKEN_CLASSIFY_RATIOS = {"token_classify_vs_trainer": ("token_classify_recipe", "trainer_ner", 1.2)}
# difference: (configuration, configuration, measure, target): the median of the first's measure minus the
# second's median, at least the target
TOKEN_CLASSIFY_DIFFERENCES = {"token_classify_f1_minus_trainer_f1": ("token_classify_recipe", "trainer_ner", "f1",
                                                                     -0.01)}
# ratio: (configuration, its figure, target)
TRAINING_FIGURES = {
    "padding_efficiency": ("recipe_accelerate", "padding_efficiency", 0.9),
    "useful_flops_vs_matmul": ("recipe_accelerate", "useful_flops_vs_matmul", 0.5),
}
SFT = [
    Config("sft_padded", "sft.py, accelerate launch, --no_packing (padded, grouped by length; the default without "
           "flash-attention)", "accelerate", recipe="sft", recipe_flags=["--eval_generate", "0", "--no_packing"]),
    Config("sft_packed", "sft.py, accelerate launch, --packing (padding-free; the default with flash-attention)",
           "accelerate", recipe="sft", recipe_flags=["--eval_generate", "0", "--packing"]),
    Config("loop_sft", "hand-written loop over the recipe's padded batches, its optimizer (fused AdamW)", "python",
           recipe="sft"),
    Config("trl_padding_free", "TRL SFTTrainer, padding_free=True, activation checkpointing off", "python",
           recipe="sft"),
    Config("trl_default", "TRL SFTTrainer, its defaults (padded, activation checkpointing on)", "python",
           recipe="sft"),
]
SFT_RATIOS = {  # the first two compare the CPU default (padded); the third packs on both sides
    "sft_vs_trl_padding_free": ("sft_padded", "trl_padding_free", 1.0),
    "sft_vs_trl_default": ("sft_padded", "trl_default", 1.5),
    "sft_packed_vs_trl_padding_free": ("sft_packed", "trl_padding_free", 1.0),
    "padded_vs_packed": ("sft_padded", "sft_packed", 1.0),
    "sft_vs_same_optimizer_loop": ("sft_padded", "loop_sft", 0.97),
}
SFT_FIGURES = {"sft_padding_efficiency": ("sft_padded", "padding_efficiency", 0.97)}
LONG_CHAT_TOKENS, LONG_CHAT_TRAIN, LONG_CHAT_EVAL = 512, 8, 8
"""The memory comparison: one training step at batch 8, then one evaluation batch of 8, every row 512 tokens.
One step: a second adds what the C allocator keeps of the first step's freed memory (0.5 to 3 GB more resident
here, varying from run to run, on both sides), which hides the difference measured."""
SFT_MEMORY = [
    Config("sft_memory", f"sft.py, accelerate launch, padded, batch 8 x {LONG_CHAT_TOKENS} tokens, evaluation "
           "batch 8", "accelerate", recipe="sft", long_chats=True,
           recipe_flags=["--eval_generate", "0", "--no_packing", "--max_seq_length", str(LONG_CHAT_TOKENS),
                         "--per_device_eval_batch_size", str(LONG_CHAT_EVAL)]),
    Config("trl_memory", f"TRL SFTTrainer, padded, activation checkpointing off, batch 8 x {LONG_CHAT_TOKENS} "
           "tokens, evaluation batch 8", "python", recipe="sft", long_chats=True),
]
# peak memory ratio: (numerator configuration, denominator configuration, target): at most the target
SFT_MEMORY_RATIOS = {"sft_peak_memory_vs_trl": ("sft_memory", "trl_memory", 1.0)}
DPO_FLAGS = ["--eval_generate", "0", "--lora_dropout", "0"]
"""The recipe's defaults but LoRA's dropout: dropout is off on every side of this suite (TRL turns the model's own
off by default; the recipe's model has none)."""
DPO = [
    Config("dpo_recipe", "dpo.py, accelerate launch, live reference (the default)", "accelerate", recipe="dpo",
           recipe_flags=DPO_FLAGS),
    Config("loop_dpo", "hand-written loop over the recipe's batches and LoRA model, its optimizer (fused AdamW), "
           "DPO's loss with a live reference", "python", recipe="dpo"),
    Config("trl_dpo", "TRL DPOTrainer, live reference, activation checkpointing off", "python", recipe="dpo"),
    Config("trl_dpo_default", "TRL DPOTrainer, its defaults (live reference, activation checkpointing on)",
           "python", recipe="dpo"),
    Config("dpo_live_2_epochs", "dpo.py, accelerate launch, live reference, 2 epochs", "accelerate", recipe="dpo",
           epochs=2, recipe_flags=DPO_FLAGS),
    Config("dpo_precomputed_2_epochs", "dpo.py, accelerate launch, --precompute_ref_log_probs, 2 epochs",
           "accelerate", recipe="dpo", epochs=2, recipe_flags=[*DPO_FLAGS, "--precompute_ref_log_probs"]),
]
DPO_RATIOS = {  # ratios of pairs per second; the 2-epoch pair includes the evaluation after the first epoch
    "dpo_vs_trl": ("dpo_recipe", "trl_dpo", 1.0),
    "dpo_vs_trl_default": ("dpo_recipe", "trl_dpo_default", 1.5),
    "dpo_precomputed_vs_live": ("dpo_precomputed_2_epochs", "dpo_live_2_epochs", 1.2),
    "dpo_vs_same_optimizer_loop": ("dpo_recipe", "loop_dpo", 0.97),
}
LONG_PAIRS = 2
"""The DPO memory comparison: one training step at batch 2 pairs (4 rows of ``LONG_CHAT_TOKENS``), then one
evaluation batch of 2 pairs. Larger batches cost minutes a repeat here (one step of 4 pairs takes TRL about 100 s)
and, at 8 pairs, 22 GB resident for TRL, near this machine's 24."""
DPO_MEMORY = [
    Config("dpo_memory", f"dpo.py, accelerate launch, live reference, batch {LONG_PAIRS} pairs x 2 rows x "
           f"{LONG_CHAT_TOKENS} tokens, evaluation batch {LONG_PAIRS} pairs", "accelerate", recipe="dpo",
           long_chats=True, batch_size=LONG_PAIRS,
           recipe_flags=[*DPO_FLAGS, "--max_seq_length", str(LONG_CHAT_TOKENS),
                         "--per_device_eval_batch_size", str(LONG_PAIRS)]),
    Config("trl_dpo_memory", f"TRL DPOTrainer, live reference, activation checkpointing off, batch {LONG_PAIRS} "
           f"pairs x 2 rows x {LONG_CHAT_TOKENS} tokens, evaluation batch {LONG_PAIRS} pairs", "python",
           recipe="dpo", long_chats=True, batch_size=LONG_PAIRS),
]
DPO_MEMORY_RATIOS = {"dpo_peak_memory_vs_trl": ("dpo_memory", "trl_dpo_memory", 1.0)}
SEEDED_SUITES = {"token_classify"}
"""Suites whose repeats each train with another seed on both sides (42, 43, ...): their F1 is compared, and one
seed's F1 varies more than the tolerance (0.973 to 0.984 for the tagging recipe's seeds 42 to 46)."""
SUITES = {  # name: (configurations, ratios, figures, differences, results file, throughput ratios are taken of)
    "training": (TRAINING, TRAINING_RATIOS, TRAINING_FIGURES, {}, "latest", "samples_per_second"),
    "hub_push": (HUB_PUSH, HUB_PUSH_RATIOS, {}, {}, "hub-push", "samples_per_second"),
    "token_classify": (TOKEN_CLASSIFY, TOKEN_CLASSIFY_RATIOS, {}, TOKEN_CLASSIFY_DIFFERENCES, "token-classify",
                       "samples_per_second"),
    # Conversations differ in length and the two sides batch them in different orders: tokens per second.
    "sft": (SFT + SFT_MEMORY, SFT_RATIOS, SFT_FIGURES, {}, "sft", "tokens_per_second"),
    # Both sides train on the same pairs, each pair once an epoch: pairs per second.
    "dpo": (DPO + DPO_MEMORY, DPO_RATIOS, {}, {}, "dpo", "samples_per_second"),
}
MEMORY_RATIOS = {"sft": SFT_MEMORY_RATIOS, "dpo": DPO_MEMORY_RATIOS}
"""Per suite: peak memory per process (resident on a CPU, allocated on a GPU), the most of any process."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def write_data(folder: Path, train_examples: int, eval_examples: int) -> tuple[Path, Path]:
    """The first rows of the embedded support tickets, as CSV files every configuration reads."""
    tickets = make_support_tickets()
    paths = []
    for split, count in (("train", train_examples), ("validation", eval_examples)):
        path = folder / f"{split}.csv"
        rows = tickets[split].select(range(count))
        with open(path, "w", newline="") as f:
            writer = csv.writer(f)
            writer.writerow(["text", "label"])
            writer.writerows(zip(rows["text"], rows["label"], strict=True))
        paths.append(path)
    return paths[0], paths[1]


def write_chat_data(folder: Path, train_examples: int, eval_examples: int) -> tuple[Path, Path]:
    """The chat recipe's embedded conversations, as jsonl files both sides read: the first ``train_examples``,
    or all 160 repeated in order as often as it takes (a GPU's batches need more than 160)."""
    from finetune.data.embedded.support_chats import make_support_conversations

    conversations = make_support_conversations()
    paths = []
    for split, count in (("train", train_examples), ("validation", eval_examples)):
        messages = conversations[split]["messages"]
        path = folder / f"{split}.jsonl"
        path.write_text("".join(json.dumps({"messages": messages[i % len(messages)]}) + "\n" for i in range(count)))
        paths.append(path)
    return paths[0], paths[1]


def write_pair_data(folder: Path, train_examples: int, eval_examples: int) -> tuple[Path, Path]:
    """The preference recipe's embedded pairs as jsonl files both sides read (prompt, chosen and rejected message
    lists): the first ``train_examples`` of its 120 training pairs, repeated in order as often as it takes, and the
    first ``eval_examples`` validation pairs."""
    from finetune.data.embedded.preference_pairs import make_preference_pairs

    pairs = make_preference_pairs()
    paths = []
    for split, count in (("train", train_examples), ("validation", eval_examples)):
        rows = pairs[split].select_columns(["prompt", "chosen", "rejected"]).to_list()
        path = folder / f"{split}.jsonl"
        path.write_text("".join(json.dumps(rows[i % len(rows)]) + "\n" for i in range(count)))
        paths.append(path)
    return paths[0], paths[1]


def long_chats(first: int, count: int) -> list[list[dict]]:
    """Chats longer than ``LONG_CHAT_TOKENS`` (518 to 612 tokens, prompts of 301 to 354): the system turn, then 14
    of the embedded conversations' tickets as one user turn and their replies as one reply; the ``first`` of them
    onwards."""
    from finetune.data.embedded.support_chats import make_support_conversations

    conversations = make_support_conversations()["train"]["messages"]
    chats = []
    for chat in range(first, first + count):
        parts = [conversations[(chat * 14 + i) % len(conversations)] for i in range(14)]
        chats.append([parts[0][0], *({"role": role, "content": "\n\n".join(
            turn["content"] for part in parts for turn in part if turn["role"] == role)}
            for role in ("user", "assistant"))])
    return chats


def write_long_data(folder: Path, train_examples: int, eval_examples: int, as_pairs: bool) -> tuple[Path, Path]:
    """``long_chats`` as jsonl files both sides read: conversations (``messages``), or ``as_pairs`` preference
    pairs whose chosen reply is the chat's own and whose rejected reply is the next chat's, so that both rows of
    a pair are cut to ``LONG_CHAT_TOKENS``."""
    paths = []
    for split, count, first in (("train", train_examples, 0), ("validation", eval_examples, train_examples)):
        chats = long_chats(first, count + 1)
        rows = ([{"prompt": chat[:2], "chosen": chat[2:], "rejected": following[2:]}
                 for chat, following in zip(chats, chats[1:], strict=False)] if as_pairs
                else [{"messages": chat} for chat in chats[:count]])
        path = folder / f"long-{split}.jsonl"
        path.write_text("".join(json.dumps(row) + "\n" for row in rows))
        paths.append(path)
    return paths[0], paths[1]


CHAT_DATA = {"sft": write_chat_data, "dpo": write_pair_data}
"""The suites that train a chat model, and what writes their data."""


def command(config: Config, train_csv: Path, eval_csv: Path, output_dir: Path, gpus: int, seed: int | None,
            batch_size: int | None) -> list[str]:
    shared = ["--seed", str(seed)] if seed is not None else []
    if batch_size:
        shared += ["--per_device_train_batch_size", str(batch_size)]
    if config.launcher == "python":
        evaluation = ["--eval_file", str(eval_csv)] if config.long_chats else []
        return [sys.executable, str(BENCH / "baselines.py"), config.name, str(train_csv), str(output_dir), *shared,
                *evaluation]
    if config.recipe in ("classify", "sft", "dpo"):
        recipe_flags = ["--train_file", str(train_csv), "--validation_file", str(eval_csv), "--num_train_epochs",
                        str(config.epochs)]
    else:
        recipe_flags = []  # the recipe's embedded default, as a user runs it
    recipe_flags += shared
    recipe_flags += ["--output_dir", str(output_dir), "--gradient_accumulation_steps", str(config.accumulation),
                     *config.recipe_flags]
    if gpus:
        recipe_flags += ["--mixed_precision", "bf16"]
    script = [str(BENCH / "probe.py"), str(REPO / "recipes" / f"{config.recipe}.py"), *recipe_flags]
    if config.launcher == "torchrun":
        return [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(config.processes),
                "--master_port", str(free_port()), *script]
    launch = [sys.executable, "-m", "accelerate.commands.launch", "--num_processes", str(config.processes),
              "--num_machines", "1", "--dynamo_backend", "no", "--mixed_precision", "bf16" if gpus else "no",
              "--main_process_port", str(free_port())]
    if not gpus:
        launch += ["--num_cpu_threads_per_process", str(config.threads)]
    elif config.processes > 1:
        launch += ["--multi_gpu"]
    return [*launch, *script]


def run_config(config: Config, data: tuple[Path, Path], scratch: Path, env: dict, gpus: int, seed: int | None,
               batch_size: int | None) -> dict:
    report_dir = scratch / f"{config.name}-reports"
    output_dir = scratch / f"{config.name}-out"
    for folder in (report_dir, output_dir):
        shutil.rmtree(folder, ignore_errors=True)
    report_dir.mkdir()
    launched_at = time.time()
    result = subprocess.run(
        command(config, *data, output_dir, gpus, seed, batch_size), cwd=REPO, capture_output=True, text=True,
        env={**env, "OMP_NUM_THREADS": str(config.threads), "MKL_NUM_THREADS": str(config.threads),
             "BENCH_REPORT_DIR": str(report_dir), "BENCH_LAUNCHED_AT": repr(launched_at)},
    )
    if result.returncode != 0:
        sys.exit(f"error: {config.name} exited {result.returncode}:\n{result.stdout[-2000:]}\n{result.stderr[-4000:]}")
    results = output_dir / "all_results.json"  # the recipes' and the NER baseline's own results
    f1 = json.loads(results.read_text()).get("eval_f1") if results.is_file() else None
    return {"reports": [json.loads(p.read_text()) for p in sorted(report_dir.glob("rank*.json"))],
            "wall_seconds": time.time() - launched_at, "f1": f1}


def summarize(config: Config, run: dict, flops: dict, matmul_rate: float, peak: float | None) -> dict:
    """One run's figures over its whole training: every example of the epoch, so that each configuration is
    measured on the same examples and tokens, from the first training batch to the last optimizer step."""
    reports = run["reports"]
    main = next(r for r in reports if r["rank"] == 0)
    steps = main["step_times"]
    batches = [b for r in reports for b in r["batches"]]
    seconds = steps[-1] - min(b[3] for b in batches)
    samples, real_tokens = sum(b[0] for b in batches), sum(b[1] for b in batches)
    useful_flops = flops["per_token"] * real_tokens + flops["per_example"] * samples
    return {
        "samples_per_second": samples / seconds,
        "tokens_per_second": real_tokens / seconds,
        "samples": samples,
        "real_tokens": real_tokens,
        "padding_efficiency": real_tokens / sum(b[2] for b in batches),
        "useful_gflops_per_second": useful_flops / seconds / 1e9,
        "useful_flops_vs_matmul": useful_flops / seconds / matmul_rate,
        "model_flops_utilisation": useful_flops / seconds / peak if peak else float("nan"),
        "seconds_to_first_step": steps[0] - main["launched_at"],
        "peak_rss_mib": [round(r["peak_rss_mib"]) for r in sorted(reports, key=lambda r: r["rank"])],
        "peak_gpu_memory_gib": max(r.get("peak_gpu_memory_gib", float("nan")) for r in reports),
        "all_reduces_per_optimizer_step": main["all_reduces_at_step"][-1] / len(steps),
        "all_reduces_per_micro_step": main["all_reduces_at_step"][-1] / (len(steps) * config.accumulation),
        "optimizer_steps": len(steps),
        "threads_per_process": main["threads"],
        "wall_seconds": run["wall_seconds"],
        "f1": run["f1"],
    }


def matmul_rate(device: torch.device) -> float:
    """FLOP/s of a dense matrix product large enough to keep every core (or the GPU) busy."""
    n, dtype = (8192, torch.bfloat16) if device.type == "cuda" else (2048, torch.float32)
    a, b = (torch.randn(n, n, device=device, dtype=dtype) for _ in range(2))
    best = float("inf")
    for _ in range(6):  # best of 6: the first also pays for warming up
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        a @ b
        if device.type == "cuda":
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - start)
    return 2 * n**3 / best


def training_flops(suite: str) -> dict:
    """FLOPs of one training step per real token and per example (multiply-adds counted as 2).

    A weight that trains costs 6 FLOPs per use (2 forward, 2 for the input's gradient, 2 for its own); a frozen
    one 4 (no gradient of its own). Classification: the encoder per token, pooler and classifier per example.
    Chat with LoRA: every linear layer and the output head frozen, per token, plus the adapters trained. DPO adds
    the reference's forward pass (2 per frozen weight) at every step, as a live reference runs it; a precomputed
    reference runs it once per pair, so over 2 epochs its figure counts one reference pass too many.
    """
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForSequenceClassification

    if suite in ("sft", "dpo"):
        from finetune.models.loading import default_chat_model_path
        from finetune.models.lora import add_lora
        from finetune.tasks.causal_lm import ChatModelArguments

        lora = ChatModelArguments()  # every chat recipe's LoRA options
        with torch.device("meta"):
            model = add_lora(AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(default_chat_model_path())),
                             lora.lora_r, lora.lora_alpha, lora.lora_dropout, lora.lora_target_modules)
        linear = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
        frozen = sum(m.weight.numel() for m in linear if not m.weight.requires_grad)
        trained = sum(m.weight.numel() for m in linear if m.weight.requires_grad)
        reference = 2 * frozen if suite == "dpo" else 0
        return {"per_token": 4 * frozen + 6 * trained + reference, "per_example": 0}
    config = AutoConfig.from_pretrained(default_model_path(), num_labels=4)
    with torch.device("meta"):
        model = AutoModelForSequenceClassification.from_config(config)
    per_token = sum(p.numel() for name, p in model.named_parameters() if ".encoder." in f".{name}")
    per_example = sum(p.numel() for name, p in model.named_parameters()
                      if name.startswith(("classifier", "bert.pooler", "pooler")))
    return {"per_token": 6 * per_token, "per_example": 6 * per_example}


def bf16_peak(device: torch.device) -> float | None:
    """The GPU's dense bf16 peak from its data sheet, for model FLOP utilisation; None if not listed."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name()
    return next((peak for key, peak in GPU_BF16_PEAK.items() if key in name), None)


def lowest_cpu_priority() -> None:
    """Run only on CPU time nothing else wants: SCHED_IDLE where Linux offers it, else nice 19."""
    if hasattr(os, "sched_setscheduler") and hasattr(os, "SCHED_IDLE"):
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
    if hasattr(os, "nice"):
        os.nice(19)


def serve_hub(urls) -> None:
    """The loopback Hub of the tests, at the lowest CPU priority: a real Hub is another machine, so its
    work should not take CPU from the training measured here."""
    lowest_cpu_priority()
    sys.path.insert(0, str(REPO / "tests"))
    from hub_server import HubServer

    with HubServer(tokens={HUB_TOKEN: "bench"}) as server:
        urls.put(server.url)
        threading.Event().wait()


def spread(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=5, help="Interleaved runs of every configuration.")
    parser.add_argument("--train_examples", type=int, default=None,
                        help="Training examples (an epoch); default 960, 80 conversations for the sft suite (beyond "
                             "its 160, repeated) and 32 pairs for the dpo suite (beyond its 120, repeated).")
    parser.add_argument("--per_device_train_batch_size", type=int, default=None,
                        help="The sft and dpo suites' batch on every side; default the recipes' (8). A GPU needs "
                             "far more to be busy, and --train_examples to match.")
    parser.add_argument("--results_dir", default=str(BENCH / "results"), help="Where the result files go.")
    parser.add_argument("--suite", choices=SUITES, default="training",
                        help="training: the comparisons above; hub_push: checkpoints pushed to a loopback Hub "
                             "against the same checkpoints not pushed (about 5 minutes); token_classify: the "
                             "tagging recipe against Trainer run the run_ner.py way, speed and F1; sft: the chat "
                             "recipe, packed and padded, against TRL's SFTTrainer; dpo: the preference recipe "
                             "against TRL's DPOTrainer.")
    args = parser.parse_args()
    if args.repeats < 1:
        sys.exit("error: --repeats must be at least 1")
    if args.per_device_train_batch_size and args.suite not in CHAT_DATA:
        sys.exit("error: --per_device_train_batch_size is the sft and dpo suites'; the others use the recipes' batch")

    gpus = torch.cuda.device_count()
    device = torch.device("cuda" if gpus else "cpu")
    configs, ratios, figures, differences, results_name, throughput = SUITES[args.suite]
    args.train_examples = args.train_examples or {"sft": 80, "dpo": 32}.get(args.suite, 960)
    skipped = [c.name for c in configs if gpus == 1 and c.processes > 1]
    configs = [c for c in configs if c.name not in skipped]
    if gpus:
        print(f"GPU: {torch.cuda.get_device_name()} x {gpus}", flush=True)
    else:
        torch.set_num_threads(2)
        print(f"CPU: {platform.processor() or platform.machine()}, {os.cpu_count()} cores", flush=True)

    flops, peak = training_flops(args.suite), bf16_peak(device)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "HF_HUB_DISABLE_TELEMETRY": "1"}
    env = {k: v for k, v in env.items() if not k.startswith("ACCELERATE_")}
    runs: dict[str, list[dict]] = {c.name: [] for c in configs}
    matmul: list[float] = []
    with tempfile.TemporaryDirectory(prefix="finetune-bench-") as scratch_name:
        scratch = Path(scratch_name)
        if args.suite in CHAT_DATA:
            data = CHAT_DATA[args.suite](scratch, args.train_examples, 8)
            long_data = (write_long_data(scratch, LONG_PAIRS, LONG_PAIRS, as_pairs=True) if args.suite == "dpo"
                         else write_long_data(scratch, LONG_CHAT_TRAIN, LONG_CHAT_EVAL, as_pairs=False))
        else:
            data, long_data = write_data(scratch, args.train_examples, 64), None
        hub = None
        if any("--push_to_hub" in c.recipe_flags for c in configs):
            urls = multiprocessing.get_context("spawn").Queue()
            hub = multiprocessing.get_context("spawn").Process(target=serve_hub, args=(urls,), daemon=True)
            hub.start()
            env.update(HF_ENDPOINT=urls.get(timeout=60), HF_HUB_OFFLINE="0", HF_HUB_CACHE=str(scratch / "hub-cache"),
                       HF_TOKEN="")
        try:
            for repeat in range(args.repeats):
                matmul.append(matmul_rate(device))
                order = configs[repeat % len(configs):] + configs[:repeat % len(configs)]
                seed = 42 + repeat if args.suite in SEEDED_SUITES else None
                for config in order:
                    run = run_config(config, long_data if config.long_chats else data, scratch, env, gpus, seed,
                                     config.batch_size if config.long_chats else args.per_device_train_batch_size)
                    runs[config.name].append(summarize(config, run, flops, matmul[-1], peak))
                    latest = runs[config.name][-1]
                    print(f"[{repeat + 1}/{args.repeats}] {config.name:<20} {latest['samples_per_second']:7.1f} "
                          f"samples/s  {latest['tokens_per_second']:7.1f} tokens/s  "
                          f"padding {latest['padding_efficiency']:.3f}  "
                          f"{latest['wall_seconds']:5.1f} s", flush=True)
        finally:
            if hub is not None:
                hub.terminate()

    results = collect(configs, ratios, figures, differences, runs, matmul, flops, peak, args, device, skipped,
                      throughput, MEMORY_RATIOS.get(args.suite, {}))
    out = Path(args.results_dir)
    out.mkdir(parents=True, exist_ok=True)
    results_name += "-cuda" if gpus else ""
    (out / f"{results_name}.json").write_text(json.dumps(results, indent=2) + "\n")
    (out / f"{results_name}.md").write_text(markdown(results))
    plot(results, out / f"{results_name}.png")
    merge_into_latest(out, "-cuda" if gpus else "")
    print(markdown(results))


def merge_into_latest(out: Path, suffix: str) -> None:
    """Every suite's ratios also in ``latest.json`` (the training suite's file), read from each suite's result
    file in ``out``: its ratios, spreads, per-sample and per-token ratios and targets under their own names, and
    ``merged_ratios`` saying which suite and file each came from. Rebuilt whenever a suite runs, so a training run
    keeps the other suites' ratios; nothing to merge into before the training suite has run."""
    latest_path = out / f"latest{suffix}.json"
    if not latest_path.is_file():
        return
    latest = json.loads(latest_path.read_text())
    sections = ("ratios", "ratio_spread", "ratio_per_sample_and_per_token", "targets")
    for name in latest.pop("merged_ratios", {}):
        for section in sections:
            latest[section].pop(name, None)
    merged = {}
    for suite, (*_, results_name, _) in SUITES.items():
        path = out / f"{results_name}{suffix}.json"
        if results_name == "latest" or not path.is_file():
            continue
        results = json.loads(path.read_text())
        for name in results["ratios"]:
            if name in latest["ratios"]:
                sys.exit(f"error: the {suite} suite's ratio {name} is also another suite's; rename one")
            for section in sections:
                if name in results[section]:
                    latest[section][name] = results[section][name]
            merged[name] = {"suite": suite, "file": path.name}
    latest["merged_ratios"] = merged
    latest_path.write_text(json.dumps(latest, indent=2) + "\n")


def collect(configs, ratio_specs, figure_specs, difference_specs, runs, matmul, flops, peak, args, device,
            skipped, throughput="samples_per_second", memory_specs=None) -> dict:
    repeats = args.repeats
    ratios, per_measure, checks, ceilings = {}, {}, {}, {}
    for name, (first, second, measure, target) in difference_specs.items():
        # Medians over the seeds of each side, then their difference: the seeds pair no two runs.
        median_gap = (statistics.median(r[measure] for r in runs[first])
                      - statistics.median(r[measure] for r in runs[second]))
        ratios[name] = {"median": median_gap, "min": median_gap, "max": median_gap}
        checks[name] = target
    for name, (numerator, denominator, target) in ratio_specs.items():
        if numerator in runs and denominator in runs:
            # Each ratio within one repeat (the two runs side by side), then the median over repeats.
            per_measure[name] = {measure: spread([runs[numerator][i][measure] / runs[denominator][i][measure]
                                                  for i in range(repeats)])
                                 for measure in ("samples_per_second", "tokens_per_second")}
            ratios[name] = per_measure[name][throughput]
            checks[name] = target
    for name, (config, measure, target) in figure_specs.items():
        ratios[name] = spread([r[measure] for r in runs[config]])
        checks[name] = target

    def peak_memory(run: dict) -> float:
        return run["peak_gpu_memory_gib"] if device.type == "cuda" else max(run["peak_rss_mib"])

    for name, (numerator, denominator, target) in (memory_specs or {}).items():
        ratios[name] = spread([peak_memory(runs[numerator][i]) / peak_memory(runs[denominator][i])
                               for i in range(repeats)])
        ceilings[name] = target
    per_config = {}
    for config in configs:
        figures = runs[config.name]
        per_config[config.name] = {
            "what": config.what,
            "processes": config.processes,
            "threads_per_process": figures[0]["threads_per_process"],
            "gradient_accumulation_steps": config.accumulation,
            "epochs": config.epochs,
            "samples": figures[0]["samples"],
            "real_tokens": figures[0]["real_tokens"],
            **{measure: spread([f[measure] for f in figures]) for measure in (
                "samples_per_second", "tokens_per_second", "padding_efficiency", "useful_gflops_per_second",
                "useful_flops_vs_matmul", "model_flops_utilisation", "seconds_to_first_step",
                "peak_gpu_memory_gib", "all_reduces_per_optimizer_step",
                "all_reduces_per_micro_step")},
            "peak_rss_mib_per_process": [max(f["peak_rss_mib"][rank] for f in figures)
                                         for rank in range(config.processes)],
            "optimizer_steps": figures[0]["optimizer_steps"],
            "eval_f1": spread([f["f1"] for f in figures]) if figures[0]["f1"] is not None else None,
            "runs": figures,
        }
    return {
        "device": torch.cuda.get_device_name() if device.type == "cuda" else f"cpu ({os.cpu_count()} cores)",
        "torch": torch.__version__,
        "suite": args.suite,
        "repeats": repeats,
        "ratios_of": throughput,
        "train_examples": args.train_examples,
        "per_device_train_batch_size": args.per_device_train_batch_size,
        "window": "the whole training: every example, from the first training batch to the last optimizer step",
        "matmul_gflops_per_second": spread([m / 1e9 for m in matmul]),
        "training_flops": flops,
        "bf16_peak_tflops": peak / 1e12 if peak else None,
        "ratios": {name: value["median"] for name, value in ratios.items()},
        "ratio_spread": ratios,
        "ratio_per_sample_and_per_token": per_measure,
        "targets": {**{name: {"at_least": target, "met": ratios[name]["median"] >= target}
                       for name, target in checks.items()},
                    **{name: {"at_most": target, "met": ratios[name]["median"] <= target}
                       for name, target in ceilings.items()}},
        "skipped": {name: "needs 2 GPUs" for name in skipped},
        "configs": per_config,
    }


def cell(value: dict | None, digits: int = 1) -> str:
    if value is None or value["median"] != value["median"]:  # NaN: not counted for this suite
        return "-"
    return f"{value['median']:.{digits}f} ({value['min']:.{digits}f}-{value['max']:.{digits}f})"


def markdown(results: dict) -> str:
    epochs = ("one epoch" if all(c.get("epochs", 1) == 1 for c in results["configs"].values())
              else "one epoch, two where a configuration says so")
    data = (f"{results['train_examples']} training examples ({epochs})" if results["suite"] != "token_classify"
            else "the recipe's embedded default (1,200 sentences, 3 epochs), seeds 42, 43, ... one per repeat")
    if results.get("per_device_train_batch_size"):
        data += f", batch {results['per_device_train_batch_size']} per device on every side"
    lines = [
        f"Device: {results['device']}, torch {results['torch']}; {results['repeats']} interleaved repeats, {data}; "
        f"measured over {results['window']}. Median (min-max) over repeats; each ratio is taken within a repeat. "
        f"Matmul rate: {cell(results['matmul_gflops_per_second'])} GFLOP/s.",
        "",
        f"| ratio (of {results['ratios_of'].replace('_', ' ')}) | median (min-max) | per sample | per real token "
        "| target | met |",
        "|---|---|---|---|---|---|",
    ]
    for name, target in results["targets"].items():
        both = results["ratio_per_sample_and_per_token"].get(name, {})
        bound = f">= {target['at_least']}" if "at_least" in target else f"<= {target['at_most']}"
        lines.append(f"| {name} | {cell(results['ratio_spread'][name], 3)} | "
                     f"{cell(both.get('samples_per_second'), 3)} | {cell(both.get('tokens_per_second'), 3)} | "
                     f"{bound} | {'yes' if target['met'] else 'NO'} |")
    memory = [name for name, target in results["targets"].items() if "at_most" in target]
    if memory:
        lines += ["", f"{', '.join(memory)}: peak memory per process (resident on a CPU, allocated on a GPU), the "
                      "most of any process, not throughput."]
    lines += [
        "",
        "| configuration | samples | real tokens | samples/s | tokens/s | padding efficiency | useful GFLOP/s | "
        "of matmul | MFU (bf16 peak) | first step (s) | peak RSS (MiB) | peak GPU memory (GiB) | all-reduces | "
        "eval F1 |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, c in results["configs"].items():
        lines.append(
            f"| {name}: {c['what']} | {c['samples']} | {c['real_tokens']} | {cell(c['samples_per_second'])} | "
            f"{cell(c['tokens_per_second'])} | {c['padding_efficiency']['median']:.3f} | "
            f"{cell(c['useful_gflops_per_second'])} | {cell(c['useful_flops_vs_matmul'], 2)} | "
            f"{cell(c['model_flops_utilisation'], 3)} | {cell(c['seconds_to_first_step'])} | "
            f"{', '.join(map(str, c['peak_rss_mib_per_process']))} | {cell(c['peak_gpu_memory_gib'])} | "
            f"{c['all_reduces_per_optimizer_step']['median']:g} per step, "
            f"{c['all_reduces_per_micro_step']['median']:g} per micro-step | {cell(c['eval_f1'], 3)} |"
        )
    for name, why in results["skipped"].items():
        lines.append(f"| {name} | not run: {why} | | | | | | | | | | | | |")
    return "\n".join(lines) + "\n"


def plot(results: dict, path: Path) -> None:
    """Throughput per configuration, median with min-max bars over the repeats."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot

    measure = results["ratios_of"]
    names = list(results["configs"])[::-1]  # the first configuration on top
    medians = [results["configs"][n][measure]["median"] for n in names]
    low = [m - results["configs"][n][measure]["min"] for n, m in zip(names, medians, strict=True)]
    high = [results["configs"][n][measure]["max"] - m for n, m in zip(names, medians, strict=True)]
    figure, axes = pyplot.subplots(figsize=(8, 0.5 * len(names) + 1.2))
    axes.barh(names, medians, xerr=[low, high], capsize=4, color="#4c72b0")
    axes.set_xlabel(f"{measure.replace('_', ' ')} (median, min-max over {results['repeats']} repeats)")
    axes.set_title(f"{results['suite']} suite, {results['device']}")
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    pyplot.close(figure)


if __name__ == "__main__":
    main()
