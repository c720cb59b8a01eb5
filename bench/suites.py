"""The benchmark's suites: what each configuration runs, what each suite compares and checks, what it trains on.

A ``Suite`` names its configurations (``Config``, each a process tree started the way a user starts it), the ratios,
figures, differences and peak-memory ratios it checks against targets, the results file it writes, the data it
writes for its configurations and the FLOPs one of its training steps costs. ``SUITES`` holds them by name, in the
order ``merge_into_latest`` reads their results.
"""

from __future__ import annotations

import csv
import json
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import NamedTuple

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from finetune.data.embedded.support_tickets import make_support_tickets  # noqa: E402
from finetune.models.loading import default_model_path  # noqa: E402

HUB_TOKEN = "hf_benchmarkToken"
LATEST = "latest"
"""The classify suite's results file, which also carries every other suite's ratios."""


@dataclass
class Config:
    """One configuration: a recipe under a launcher, or a baseline (``bench/baselines.py``), as a user starts it."""

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
    start_model: str | None = None
    """A model folder the suite's ``write_data`` leaves in the data's folder (its path there), which the run
    trains from rather than the recipe's default model."""


class Ratio(NamedTuple):
    """The numerator configuration's measure over the denominator's, taken within each repeat."""

    numerator: str
    denominator: str
    target: float


class Figure(NamedTuple):
    """One configuration's own figure (a measure of its runs), at least the target."""

    config: str
    measure: str
    target: float


class Difference(NamedTuple):
    """The median of the first configuration's measure minus the second's median, at least the target."""

    first: str
    second: str
    measure: str
    target: float


def write_tickets(folder: Path, train_examples: int, eval_examples: int) -> tuple[Path, Path]:
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


def write_prompt_data(folder: Path, train_examples: int, eval_examples: int) -> tuple[Path, Path]:
    """The GRPO recipe's embedded prompts (system and user messages) with each ticket's ``team``, which the
    routing reward reads, as jsonl files both sides read: the first ``train_examples`` of its 160 training prompts
    and the first ``eval_examples`` validation prompts."""
    from finetune.data.embedded.support_chats import make_support_prompts

    return _write_first_rows(folder, make_support_prompts(), train_examples, eval_examples)


def write_answer_pairs(folder: Path, train_examples: int, eval_examples: int) -> tuple[Path, Path]:
    """The embedding recipe's embedded pairs (``anchor`` a ticket, ``positive`` its answer) as jsonl files both
    sides read: the first ``train_examples`` of its 2,400 training pairs and the first ``eval_examples`` held-out
    ones (worded anew)."""
    from finetune.data.embedded.support_answers import make_support_answers

    return _write_first_rows(folder, make_support_answers(), train_examples, eval_examples)


def _write_first_rows(folder: Path, splits, train_examples: int, eval_examples: int) -> tuple[Path, Path]:
    """The first rows of an embedded dataset's ``train`` and ``validation`` splits as ``train.jsonl`` and
    ``validation.jsonl`` in ``folder``."""
    paths = []
    for split, count in (("train", train_examples), ("validation", eval_examples)):
        path = folder / f"{split}.jsonl"
        path.write_text("".join(json.dumps(row) + "\n" for row in splits[split].select(range(count)).to_list()))
        paths.append(path)
    return paths[0], paths[1]


def embedder_flops() -> dict:
    """FLOPs of one training step of the default embedder per real token (every encoder weight trains: 6 a use);
    the extra pass without gradients of a cached loss is not useful work and is not counted."""
    from transformers import AutoConfig, AutoModel

    with torch.device("meta"):
        model = AutoModel.from_config(AutoConfig.from_pretrained(default_model_path()))
    return {"per_token": 6 * sum(p.numel() for name, p in model.named_parameters() if name.startswith("encoder.")),
            "per_example": 0}


LONG_CHAT_TOKENS, LONG_CHAT_TRAIN, LONG_CHAT_EVAL = 512, 8, 8
"""The memory comparison: one training step at batch 8, then one evaluation batch of 8, every row 512 tokens.
One step: a second adds what the C allocator keeps of the first step's freed memory (0.5 to 3 GB more resident
here, varying from run to run, on both sides), which hides the difference measured."""
LONG_PAIRS = 2
"""The DPO memory comparison: one training step at batch 2 pairs (4 rows of ``LONG_CHAT_TOKENS``), then one
evaluation batch of 2 pairs. Larger batches cost minutes a repeat here (one step of 4 pairs takes TRL about 100 s)
and, at 8 pairs, 22 GB resident for TRL, near this machine's 24."""


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


def classifier_flops() -> dict:
    """FLOPs of one training step of the default classifier, per real token and per example (multiply-adds counted
    as 2): a weight that trains costs 6 FLOPs per use (2 forward, 2 for the input's gradient, 2 for its own); the
    encoder's per token, the pooler's and classifier's per example."""
    from transformers import AutoConfig, AutoModelForSequenceClassification

    config = AutoConfig.from_pretrained(default_model_path(), num_labels=4)
    with torch.device("meta"):
        model = AutoModelForSequenceClassification.from_config(config)
    per_token = sum(p.numel() for name, p in model.named_parameters() if ".encoder." in f".{name}")
    per_example = sum(p.numel() for name, p in model.named_parameters()
                      if name.startswith(("classifier", "bert.pooler", "pooler")))
    return {"per_token": 6 * per_token, "per_example": 6 * per_example}


def chat_flops(live_reference: bool) -> dict:
    """FLOPs of one training step of the default chat model with every chat recipe's LoRA options, per real token
    (multiply-adds counted as 2): every linear layer and the output head frozen, 4 FLOPs per use (no gradient of
    its own), plus the adapters trained, 6. A ``live_reference`` (DPO's) adds the reference's forward pass, 2 per
    frozen weight, at every step; a precomputed reference runs it once per pair, so over 2 epochs its figure counts
    one reference pass too many."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from finetune.models.loading import default_chat_model_path
    from finetune.models.lora import add_lora
    from finetune.tasks.causal_lm import ChatModelArguments

    lora = ChatModelArguments()
    with torch.device("meta"):
        model = add_lora(AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(default_chat_model_path())),
                         lora.lora_r, lora.lora_alpha, lora.lora_dropout, lora.lora_target_modules)
    linear = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    frozen = sum(m.weight.numel() for m in linear if not m.weight.requires_grad)
    trained = sum(m.weight.numel() for m in linear if m.weight.requires_grad)
    reference = 2 * frozen if live_reference else 0
    return {"per_token": 4 * frozen + 6 * trained + reference, "per_example": 0}


@dataclass(frozen=True)
class Suite:
    """What ``bench/run.py --suite NAME`` runs, checks and writes."""

    name: str
    results_file: str
    """Its result files' name, before ``-cuda`` on a GPU and the extension."""
    configs: list[Config]
    ratios_of: str = "samples_per_second"
    """The throughput its ratios are taken of (both are reported beside them)."""
    ratios: dict[str, Ratio] = field(default_factory=dict)
    figures: dict[str, Figure] = field(default_factory=dict)
    differences: dict[str, Difference] = field(default_factory=dict)
    memory_ratios: dict[str, Ratio] = field(default_factory=dict)
    """Peak memory per process (resident on a CPU, allocated on a GPU), the most of any process: at most the
    target."""
    seeded: bool = False
    """Each repeat trains with another seed on both sides (42, 43, ...): where F1 is compared, as one seed's F1
    varies more than the tolerance (0.973 to 0.984 for the tagging recipe's seeds 42 to 46)."""
    write_data: Callable[[Path, int, int], tuple[Path, Path]] = write_tickets
    """Writes the training and evaluation files into a folder, given how many examples of each."""
    train_examples: int = 960
    """Its default ``--train_examples``."""
    eval_examples: int = 64
    write_long_data: Callable[[Path], tuple[Path, Path]] | None = None
    """Writes the data of its ``long_chats`` configurations (the memory comparison)."""
    flops: Callable[[], dict] = classifier_flops
    """FLOPs of one of its training steps per real token and per example: what counts as useful work."""
    takes_batch_size: bool = False
    """``--per_device_train_batch_size`` applies (the chat suites); the others train at the recipes' batch."""
    quality: str = "eval_f1"
    """The held-out figure of each run, from its ``all_results.json`` (the baselines that are compared write it)."""


CLASSIFY = Suite(
    "classify",
    results_file=LATEST,
    configs=[
        Config("recipe_accelerate", "classify.py, accelerate launch", "accelerate"),
        Config("recipe_ddp", "classify.py, torchrun (raw DDP)", "torchrun"),
        Config("loop_random", "hand-written loop (a): random batches, torch's default AdamW", "python"),
        Config("loop_same_optimizer", "hand-written loop (b): the recipe's batches and optimizer (fused AdamW)",
               "python"),
        Config("trainer_default", "Trainer, default arguments", "python"),
        Config("trainer_grouped", "Trainer, group by length", "python"),
        Config("ddp_2proc", "classify.py, torchrun, 2 processes x 1 thread", "torchrun", processes=2, threads=1),
        Config("ddp_accum", "classify.py, torchrun, 1 process x 2 threads, accumulation 2", "torchrun",
               accumulation=2),
        Config("ddp_2proc_accum", "classify.py, torchrun, 2 processes x 1 thread, accumulation 2", "torchrun",
               processes=2, threads=1, accumulation=2),
    ],
    ratios={
        "accelerate_vs_same_optimizer_loop": Ratio("recipe_accelerate", "loop_same_optimizer", 0.97),
        "ddp_vs_same_optimizer_loop": Ratio("recipe_ddp", "loop_same_optimizer", 0.97),
        "accelerate_vs_trainer_default": Ratio("recipe_accelerate", "trainer_default", 1.5),
        "accelerate_vs_trainer_grouped": Ratio("recipe_accelerate", "trainer_grouped", 1.0),
        "ddp_vs_trainer_default": Ratio("recipe_ddp", "trainer_default", 1.5),
        "ddp_vs_trainer_grouped": Ratio("recipe_ddp", "trainer_grouped", 1.0),
        "ddp_2proc_vs_1proc": Ratio("ddp_2proc", "recipe_ddp", 0.9),
        "ddp_2proc_vs_1proc_accumulation": Ratio("ddp_2proc_accum", "ddp_accum", 0.9),
    },
    figures={
        "padding_efficiency": Figure("recipe_accelerate", "padding_efficiency", 0.9),
        "useful_flops_vs_matmul": Figure("recipe_accelerate", "useful_flops_vs_matmul", 0.5),
    },
)
HUB_PUSH = Suite(
    "hub_push",
    results_file="hub-push",
    configs=[
        Config("recipe_checkpoints", "classify.py, accelerate launch, a checkpoint every 8 steps", "accelerate",
               recipe_flags=["--checkpointing_steps", "8"]),
        Config("recipe_hub_push", "classify.py, accelerate launch, a checkpoint every 8 steps pushed to a Hub",
               "accelerate", recipe_flags=["--checkpointing_steps", "8", "--push_to_hub", "--hub_model_id",
                                           "bench/classifier", "--hub_token", HUB_TOKEN]),
    ],
    ratios={"hub_push_vs_no_push": Ratio("recipe_hub_push", "recipe_checkpoints", 0.97)},
)
TOKEN_CLASSIFY = Suite(
    "token_classify",
    results_file="token-classify",
    configs=[
        Config("token_classify_recipe", "token_classify.py, accelerate launch, embedded default (3 epochs)",
               "accelerate", recipe="token_classify"),
        Config("trainer_ner", "Trainer the run_ner.py way, same data, model, batch, learning rate and epochs",
               "python", recipe="token_classify"),
    ],
    ratios={"token_classify_vs_trainer": Ratio("token_classify_recipe", "trainer_ner", 1.2)},
    differences={"token_classify_f1_minus_trainer_f1": Difference("token_classify_recipe", "trainer_ner", "quality",
                                                                  -0.01)},
    seeded=True,
)
KEPT = ["--no_gradient_checkpointing"]
"""Every activation kept, as the TRL configurations they are compared with run (unset, the recipe chooses by its
predicted peak, which a larger batch on another machine could turn on)."""
SFT = Suite(
    "sft",
    results_file="sft",
    configs=[
        Config("sft_padded", "sft.py, accelerate launch, --no_packing (padded, grouped by length; the default "
               "without flash-attention)", "accelerate", recipe="sft",
               recipe_flags=["--eval_generate", "0", "--no_packing", *KEPT]),
        Config("sft_packed", "sft.py, accelerate launch, --packing (padding-free; the default with "
               "flash-attention)", "accelerate", recipe="sft",
               recipe_flags=["--eval_generate", "0", "--packing", *KEPT]),
        Config("loop_sft", "hand-written loop over the recipe's padded batches, its optimizer (fused AdamW)",
               "python", recipe="sft"),
        Config("trl_padding_free", "TRL SFTTrainer, padding_free=True, activation checkpointing off", "python",
               recipe="sft"),
        Config("trl_default", "TRL SFTTrainer, its defaults (padded, activation checkpointing on)", "python",
               recipe="sft"),
        Config("sft_memory", f"sft.py, accelerate launch, padded, batch 8 x {LONG_CHAT_TOKENS} tokens, evaluation "
               "batch 8", "accelerate", recipe="sft", long_chats=True,
               recipe_flags=["--eval_generate", "0", "--no_packing", *KEPT, "--max_seq_length", str(LONG_CHAT_TOKENS),
                             "--per_device_eval_batch_size", str(LONG_CHAT_EVAL)]),
        Config("trl_memory", f"TRL SFTTrainer, padded, activation checkpointing off, batch 8 x {LONG_CHAT_TOKENS} "
               "tokens, evaluation batch 8", "python", recipe="sft", long_chats=True),
    ],
    # Conversations differ in length and the two sides batch them in different orders: tokens per second.
    ratios_of="tokens_per_second",
    ratios={  # the first two compare the CPU default (padded); the third packs on both sides
        "sft_vs_trl_padding_free": Ratio("sft_padded", "trl_padding_free", 1.0),
        "sft_vs_trl_default": Ratio("sft_padded", "trl_default", 1.5),
        "sft_packed_vs_trl_padding_free": Ratio("sft_packed", "trl_padding_free", 1.0),
        "padded_vs_packed": Ratio("sft_padded", "sft_packed", 1.0),
        "sft_vs_same_optimizer_loop": Ratio("sft_padded", "loop_sft", 0.97),
    },
    figures={"sft_padding_efficiency": Figure("sft_padded", "padding_efficiency", 0.97)},
    memory_ratios={"sft_peak_memory_vs_trl": Ratio("sft_memory", "trl_memory", 1.0)},
    write_data=write_chat_data,
    train_examples=80,
    eval_examples=8,
    write_long_data=partial(write_long_data, train_examples=LONG_CHAT_TRAIN, eval_examples=LONG_CHAT_EVAL,
                            as_pairs=False),
    flops=partial(chat_flops, live_reference=False),
    takes_batch_size=True,
)
DPO_FLAGS = ["--eval_generate", "0", "--lora_dropout", "0", *KEPT]
"""The recipe's defaults but LoRA's dropout: dropout is off on every side of this suite (TRL turns the model's own
off by default; the recipe's model has none)."""
DPO = Suite(
    "dpo",
    results_file="dpo",
    configs=[
        Config("dpo_recipe", "dpo.py, accelerate launch, live reference (the default)", "accelerate", recipe="dpo",
               recipe_flags=DPO_FLAGS),
        Config("loop_dpo", "hand-written loop over the recipe's batches and LoRA model, its optimizer (fused AdamW), "
               "DPO's loss with a live reference", "python", recipe="dpo"),
        Config("trl_dpo", "TRL DPOTrainer, live reference, activation checkpointing off", "python", recipe="dpo"),
        Config("trl_dpo_default", "TRL DPOTrainer, its defaults (live reference, activation checkpointing on)",
               "python", recipe="dpo"),
        Config("dpo_live_2_epochs", "dpo.py, accelerate launch, live reference, 2 epochs", "accelerate",
               recipe="dpo", epochs=2, recipe_flags=DPO_FLAGS),
        Config("dpo_precomputed_2_epochs", "dpo.py, accelerate launch, --precompute_ref_log_probs, 2 epochs",
               "accelerate", recipe="dpo", epochs=2, recipe_flags=[*DPO_FLAGS, "--precompute_ref_log_probs"]),
        Config("dpo_memory", f"dpo.py, accelerate launch, live reference, batch {LONG_PAIRS} pairs x 2 rows x "
               f"{LONG_CHAT_TOKENS} tokens, evaluation batch {LONG_PAIRS} pairs", "accelerate", recipe="dpo",
               long_chats=True, batch_size=LONG_PAIRS,
               recipe_flags=[*DPO_FLAGS, "--max_seq_length", str(LONG_CHAT_TOKENS),
                             "--per_device_eval_batch_size", str(LONG_PAIRS)]),
        Config("trl_dpo_memory", f"TRL DPOTrainer, live reference, activation checkpointing off, batch {LONG_PAIRS} "
               f"pairs x 2 rows x {LONG_CHAT_TOKENS} tokens, evaluation batch {LONG_PAIRS} pairs", "python",
               recipe="dpo", long_chats=True, batch_size=LONG_PAIRS),
    ],
    # Both sides train on the same pairs, each pair once an epoch: pairs per second. The 2-epoch pair's ratio
    # includes the evaluation after the first epoch.
    ratios={
        "dpo_vs_trl": Ratio("dpo_recipe", "trl_dpo", 1.0),
        "dpo_vs_trl_default": Ratio("dpo_recipe", "trl_dpo_default", 1.5),
        "dpo_precomputed_vs_live": Ratio("dpo_precomputed_2_epochs", "dpo_live_2_epochs", 1.2),
        "dpo_vs_same_optimizer_loop": Ratio("dpo_recipe", "loop_dpo", 0.97),
    },
    memory_ratios={"dpo_peak_memory_vs_trl": Ratio("dpo_memory", "trl_dpo_memory", 1.0)},
    write_data=write_pair_data,
    train_examples=32,
    eval_examples=8,
    write_long_data=partial(write_long_data, train_examples=LONG_PAIRS, eval_examples=LONG_PAIRS, as_pairs=True),
    flops=partial(chat_flops, live_reference=True),
    takes_batch_size=True,
)
GRPO_FLAGS = ["--lora_dropout", "0", "--reward_funcs",
              f"{REPO / 'finetune' / 'data' / 'embedded' / 'support_chats.py'}:routing_reward"]
"""The recipe's defaults (a step: 16 completions, groups of 4, 16 tokens at most, temperature 1) with LoRA's
dropout off, as on TRL's side, and the routing reward named by its file (the recipe keeps its module name for the
embedded prompts)."""
GRPO = Suite(
    "grpo",
    results_file="grpo",
    configs=[
        Config("grpo_recipe", "grpo.py, accelerate launch, its defaults (LoRA dropout off)", "accelerate",
               recipe="grpo", recipe_flags=GRPO_FLAGS),
        Config("trl_grpo", "TRL GRPOTrainer, use_vllm=False (transformers' generate), activation checkpointing off",
               "python", recipe="grpo"),
    ],
    # Both sides sample as many completions of the same prompts: completions per second over whole steps, from the
    # first step's sampling to the last optimizer step (the "samples" of these runs are completions).
    ratios={"grpo_vs_trl": Ratio("grpo_recipe", "trl_grpo", 1.3)},
    memory_ratios={"grpo_peak_memory_vs_trl": Ratio("grpo_recipe", "trl_grpo", 1.0)},
    write_data=write_prompt_data,
    train_examples=32,
    eval_examples=8,
    flops=lambda: {"per_token": float("nan"), "per_example": float("nan")},
)
AGENT_TASK = "finetune.data.embedded.order_tickets"
AGENT_START = "sft/merged"
"""Where ``write_agent_data`` leaves the model both sides of the agent suite start from."""
AGENT_TOOLS = ["--chat_template", "qwen2_5", "--tools", f"{AGENT_TASK}:lookup_order"]
"""The agent pipeline's flags for both steps, the chat recipe's and GRPO's."""
AGENT_GRPO = [*AGENT_TOOLS, "--reward_funcs", f"{AGENT_TASK}:resolved", "--per_device_train_batch_size", "8",
              "--num_generations", "4", "--max_completion_length", "64", "--logging_steps", "1"]
"""GRPO with the live tool (a step: 8 episodes, 2 tickets x 4, at most 64 sampled tokens each over all turns), as
``bench/agent_default.py`` runs it."""
AGENT_FLAGS = ["--lora_dropout", "0", *AGENT_GRPO, "--learning_rate", "1e-4"]
"""The agent suite's GRPO: learning rate 1e-4, LoRA's dropout off, as on TRL's side."""


def write_agent_data(folder: Path, train_examples: int, eval_examples: int) -> tuple[Path, Path]:
    """The first ``train_examples`` of the order tickets' GRPO prompts and the first ``eval_examples`` held-out ones
    (``finetune.data.embedded.order_tickets``) as jsonl files both sides read; and the model both start from in
    ``AGENT_START``: the chat recipe's adapter on the tickets' tool-use conversations (2 epochs, about 4 minutes
    here), merged, as the agent pipeline's first step trains it."""
    import subprocess

    from finetune.data.embedded.order_tickets import write_files

    written = write_files(folder / "orders")
    paths = []
    for split, count in (("train", train_examples), ("validation", eval_examples)):
        path = folder / f"{split}.jsonl"
        path.write_text("".join(written[f"prompts_{split}"].read_text().splitlines(keepends=True)[:count]))
        paths.append(path)
    sft = folder / Path(AGENT_START).parent
    subprocess.run([sys.executable, "-m", "accelerate.commands.launch", "--num_processes", "1",
                    str(REPO / "recipes" / "sft.py"), "--train_file", str(written["conversations_train"]),
                    "--validation_file", str(written["conversations_validation"]), *AGENT_TOOLS,
                    "--eval_generate", "0", "--merge_lora",
                    "--output_dir", str(sft)], cwd=REPO, check=True, capture_output=True)
    return paths[0], paths[1]


AGENT = Suite(
    "agent",
    results_file="agent",
    configs=[
        Config("agent_recipe", "grpo.py --tools, accelerate launch (LoRA dropout off)", "accelerate", recipe="grpo",
               recipe_flags=AGENT_FLAGS, start_model=AGENT_START),
        Config("trl_agent", "TRL GRPOTrainer(tools=...), use_vllm=False (transformers' generate), activation "
               "checkpointing off", "python", recipe="grpo", start_model=AGENT_START),
    ],
    # Both sides roll out as many episodes of the same tickets: episodes per second over whole steps, from the first
    # step's sampling to the last optimizer step; each episode's sampling and tool calls count as its generation.
    ratios={"agent_vs_trl": Ratio("agent_recipe", "trl_agent", 1.3)},
    memory_ratios={"agent_peak_memory_vs_trl": Ratio("agent_recipe", "trl_agent", 1.0)},
    # Held-out success of each side's trained model on 40 tickets, judged alike (the recipe's greedy episodes): one
    # ticket is 0.025, and a side's standard error near 0.07 where success is near 0.8.
    differences={"agent_success_minus_trl": Difference("agent_recipe", "trl_agent", "quality", -0.1)},
    write_data=write_agent_data,
    train_examples=16,
    eval_examples=40,
    flops=lambda: {"per_token": float("nan"), "per_example": float("nan")},
    quality="eval_reward",
)
EMBED_BATCH, EMBED_LARGE_BATCH = 32, 128
EMBED = Suite(
    "embed",
    results_file="embed",
    configs=[
        Config("embed_recipe", f"embed.py, accelerate launch, global batch {EMBED_BATCH}", "accelerate",
               recipe="embed"),
        Config("st_mnrl", f"SentenceTransformerTrainer, MultipleNegativesRankingLoss, batch {EMBED_BATCH}", "python",
               recipe="embed"),
        Config("embed_recipe_large", f"embed.py, accelerate launch, global batch {EMBED_LARGE_BATCH}: "
               f"{EMBED_BATCH} x accumulation {EMBED_LARGE_BATCH // EMBED_BATCH}", "accelerate", recipe="embed",
               accumulation=EMBED_LARGE_BATCH // EMBED_BATCH),
        Config("st_cached_mnrl_large", f"SentenceTransformerTrainer, CachedMultipleNegativesRankingLoss, batch "
               f"{EMBED_LARGE_BATCH} in mini-batches of {EMBED_BATCH}", "python", recipe="embed"),
    ],
    # Both sides train the same loss on the same pairs at the same global batch, each pair once: pairs per second.
    ratios={"embed_vs_st": Ratio("embed_recipe", "st_mnrl", 1.3),
            "embed_vs_st_cached": Ratio("embed_recipe_large", "st_cached_mnrl_large", 1.3)},
    memory_ratios={"embed_peak_memory_vs_st_cached": Ratio("embed_recipe_large", "st_cached_mnrl_large", 1.0)},
    differences={"embed_mrr_minus_st": Difference("embed_recipe", "st_mnrl", "quality", -0.01),
                 "embed_mrr_minus_st_cached": Difference("embed_recipe_large", "st_cached_mnrl_large", "quality",
                                                         -0.01)},
    seeded=True,
    write_data=write_answer_pairs,
    train_examples=1280,
    eval_examples=600,
    flops=embedder_flops,
    quality="eval_mrr@10",
)
SUITES = {suite.name: suite for suite in (CLASSIFY, HUB_PUSH, TOKEN_CLASSIFY, EMBED, SFT, DPO, GRPO, AGENT)}
