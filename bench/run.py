"""The benchmark: each recipe against what users would otherwise run, side by side, same work on both sides.

    python bench/run.py                          # classify: ~23 minutes on 2 CPU cores -> bench/results/latest.*
    python bench/run.py --suite hub_push         # ~5 minutes -> bench/results/hub-push.*
    python bench/run.py --suite token_classify   # ~9 minutes -> bench/results/token-classify.*
    python bench/run.py --suite embed --repeats 3  # ~15 minutes -> bench/results/embed.*  (sentence-transformers)
    python bench/run.py --suite sft              # ~16 minutes -> bench/results/sft.*  (needs pip install -e ".[bench]")
    python bench/run.py --suite dpo              # ~35 minutes -> bench/results/dpo.*  (needs pip install -e ".[bench]")
    python bench/run.py --suite grpo             # ~25 minutes -> bench/results/grpo.* (needs pip install -e ".[bench]")
    python bench/run.py --suite agent --repeats 3  # ~45 minutes -> bench/results/agent.* (as grpo)
    python bench/run.py --suite long --repeats 1   # ~2.5 hours -> bench/results/long.* (bench/long.py; --lengths)

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

FLOP counts (``suites.classifier_flops``, ``suites.chat_flops``): a weight that trains costs 6 FLOPs per token it
multiplies (2 forward, 4 backward), a frozen one 4. The *useful* count charges that only for real tokens: for
classification the encoder per real token plus the head (pooler, classifier) per example; for chat with LoRA the
frozen linear layers and output head plus the adapters, per real token. Embedding lookups, attention's own products
(which grow with padded length) and element-wise work are not counted. The machine's matmul rate is 2n^3 / t for an
n = 2048 float32 product (bf16 and n = 8192 on a GPU), best of 6, measured in every repeat; on a GPU listed in
``GPU_BF16_PEAK`` the model FLOP utilisation divides by its data-sheet bf16 peak instead.

The dpo suite trains the preference recipe on the first 32 embedded pairs for one epoch (two for its precomputed
and live reference pair), batch 8, against TRL's DPOTrainer and a hand-written loop over the recipe's batches, all
with the recipe's LoRA settings, learning rate, beta and length limit, LoRA dropout off and a live reference (the
adapters switched off) unless named; its ratios are of pairs per second, the per-token ones beside them.

The grpo suite trains the GRPO recipe with its defaults (16 completions a step, groups of 4, at most 16 tokens
each) on the first 32 embedded prompts for one epoch (8 steps) against TRL's GRPOTrainer generating with
transformers, both with the routing reward, LoRA dropout off and beta 0. Its ratio is of completions per second
over whole steps (sampling, scoring and training, from the first step's sampling to the last optimizer step); the
table splits each side's step into the three.

The agent suite trains GRPO with a live tool (``--tools``) on the embedded order tickets
(``finetune.data.embedded.order_tickets``): 16 tickets, 8 steps of 8 episodes, from the chat recipe's adapter
trained on the tickets' tool-use conversations first (merged; both sides start from it), against TRL's
GRPOTrainer with ``tools=``, generating with transformers, with the same settings (``baselines.trl_agent``). Its
ratio is of episodes per second over whole steps (each episode's turns and tool calls are its sampling); the held-out
success of each side's adapter on 40 tickets is judged alike, by the recipe's greedy episodes.

The long suite is ``bench/long.py``: the chat recipe on one row of 4k, 8k, 16k and 32k tokens a step
(``--lengths`` chooses), with ``--gradient_checkpointing``, against TRL's SFTTrainer with its defaults for such rows,
memory handed back to the system as it is freed; each length keeps its own date in ``long.json``, and the table
and chart show every length measured.

The embed suite trains the embedding recipe on the first 1,280 embedded ticket-answer pairs for one epoch against
sentence-transformers' trainer with the same model, loss, optimizer settings and global batch (32; and 128, the
recipe accumulating 4 micro-batches of 32, theirs the cached loss in mini-batches of 32); each side's held-out
MRR@10 on 600 reworded tickets is compared too.

On a CUDA machine the same command uses the GPU (bf16 autocast, NCCL for the 2-process configurations
when there are 2 GPUs) and writes ``*-cuda.{json,md,png}``.

This file is the command line; the suites are in ``suites.py``, running them in ``harness.py``, their result files
in ``report.py``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import long
from harness import Settings, detect_machine, run_suite
from report import collect, markdown, merge_into_latest, write
from suites import SUITES

BENCH = Path(__file__).resolve().parent


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
    parser.add_argument("--lengths", type=int, nargs="+", default=[4096, 8192, 16384, 32768],
                        help="The long suite's row lengths.")
    parser.add_argument("--suite", choices=[*SUITES, "long"], default="classify",
                        help="classify: the comparisons above; hub_push: checkpoints pushed to a loopback Hub "
                             "against the same checkpoints not pushed (about 5 minutes); token_classify: the "
                             "tagging recipe against Trainer run the run_ner.py way, speed and F1; sft: the chat "
                             "recipe, packed and padded, against TRL's SFTTrainer; dpo: the preference recipe "
                             "against TRL's DPOTrainer; grpo: the GRPO recipe against TRL's GRPOTrainer; agent: "
                             "GRPO with a tool against TRL's GRPOTrainer(tools=...); long: the chat recipe on "
                             "rows of 4k-32k tokens against TRL's SFTTrainer.")
    args = parser.parse_args()
    if args.repeats < 1:
        sys.exit("error: --repeats must be at least 1")
    if args.suite == "long":  # one row a step, each run its own process: bench/long.py measures it
        long.main(args.lengths, args.repeats, return_freed=True, results_file=Path(args.results_dir) / "long.json",
                  model_size=None, chosen=None, recipe="sft")
        return
    suite = SUITES[args.suite]
    if args.per_device_train_batch_size and not suite.takes_batch_size:
        takers = " and ".join(s.name for s in SUITES.values() if s.takes_batch_size)
        sys.exit(f"error: --per_device_train_batch_size is the {takers} suites'; the others use the recipes' batch")

    settings = Settings(args.repeats, args.train_examples or suite.train_examples, args.per_device_train_batch_size)
    machine = detect_machine()
    results = collect(suite, settings, machine, run_suite(suite, settings, machine))
    out, suffix = Path(args.results_dir), "-cuda" if machine.gpus else ""
    write(results, out, suite.results_file + suffix)
    merge_into_latest(out, suffix)
    print(markdown(results))


if __name__ == "__main__":
    main()
