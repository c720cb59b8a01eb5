"""The agent pipeline on the embedded order tickets (``finetune.data.embedded.order_tickets``): the chat recipe
on tool-use conversations, then GRPO with the live tool from its adapter, each held out on tickets about orders
neither step saw, and the base model they start from.

    python bench/agent_default.py     # about 20 minutes on 2 CPU cores: bench/results/agent-default.{json,png}

GRPO runs at ``--learning_rate 1e-4``: at the recipe's 1e-3 (``--learning_rate 1e-3 --results_file
bench/results/agent-default-lr-1e-3.json``) the policy collapsed after step 7 (bench/results/agent-default-lr-1e-3.json:
every later completion ran to the token budget without a call).

Each step is launched as docs/grpo.md launches it, under ``bench/probe.py`` for its peak resident memory. Held-out
success is the GRPO recipe's evaluation: each validation ticket's greedy episode (the model calls the tool, reads
its result, replies), scored by ``resolved`` (1 where the last reply states the order's status and its team and no
other).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

from sft_default import launch_default_run, recipe_metrics  # noqa: E402
from suites import AGENT_GRPO, AGENT_TOOLS  # noqa: E402

from finetune.data.embedded.order_tickets import write_files  # noqa: E402

GRPO = [*AGENT_GRPO, "--max_train_steps", "20"]
"""(No --learning_rate: ``main`` adds it.)"""


def main(results_file: Path, learning_rate: str) -> None:
    torch.set_num_threads(2)
    grpo = [*GRPO, "--learning_rate", learning_rate]
    results = {"device": f"cpu ({torch.get_num_threads()} threads)", "torch": torch.__version__,
               "sft_flags": AGENT_TOOLS, "grpo_flags": grpo}
    with tempfile.TemporaryDirectory() as scratch:
        data = write_files(Path(scratch, "orders"))
        conversations = ["--train_file", str(data["conversations_train"]), "--validation_file",
                         str(data["conversations_validation"])]
        prompts = ["--train_file", str(data["prompts_train"]), "--validation_file", str(data["prompts_validation"])]
        base = recipe_metrics("grpo", "GRPOArguments", "GRPOTask", [*prompts, *grpo])
        results["base_model"] = {"held_out_success": base["eval_reward"],
                                 "tool_calls_per_episode": base["eval_tools/calls/mean"]}
        print(json.dumps(results), flush=True)
        sft, wall, peak = launch_default_run("sft", Path(scratch, "sft"), *conversations, *AGENT_TOOLS,
                                             "--eval_generate", "0")
        alone = recipe_metrics("grpo", "GRPOArguments", "GRPOTask",
                               [*prompts, *grpo, "--model_name_or_path", str(Path(scratch, "sft"))])
        results["sft"] = {"held_out_success": alone["eval_reward"],
                          "tool_calls_per_episode": alone["eval_tools/calls/mean"], "wall_seconds": wall,
                          "peak_rss_mib": peak, "train_runtime": sft["train_runtime"]}
        print(json.dumps(results["sft"]), flush=True)
        run, wall, peak = launch_default_run("grpo", Path(scratch, "grpo"), *prompts, *grpo,
                                             "--model_name_or_path", str(Path(scratch, "sft")))
        steps = [json.loads(line) for line in open(Path(scratch, "grpo", "log_history.jsonl"))]
        trained = [step for step in steps if "reward" in step]
        results["sft_then_grpo"] = {
            "held_out_success": run["eval_reward"], "tool_calls_per_episode": run["eval_tools/calls/mean"],
            "wall_seconds": wall, "peak_rss_mib": peak, "train_runtime": run["train_runtime"],
            "training_reward_curve": [round(step["reward"], 4) for step in trained],
            "tool_calls_curve": [round(step["tools/calls/mean"], 4) for step in trained],
            "frac_reward_zero_std_curve": [step["frac_reward_zero_std"] for step in trained],
            "seconds_per_step": {key: round(sum(step[key] for step in trained) / len(trained), 2)
                                 for key in ("generation_seconds", "tool_seconds", "reward_seconds",
                                             "training_seconds")}}
    results_file.write_text(json.dumps(results, indent=2) + "\n")
    plot(results, results_file.with_suffix(".png"))
    print(json.dumps(results, indent=2))


def plot(results: dict, path: Path) -> None:
    """The GRPO step's curve: each step's mean reward and tool calls per episode of its training episodes, and
    held-out success before GRPO (the chat recipe alone, at step 0) and after it."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot

    grpo = results["sft_then_grpo"]
    steps = range(1, len(grpo["training_reward_curve"]) + 1)
    figure, axes = pyplot.subplots(figsize=(7, 3.2))
    axes.plot(steps, grpo["training_reward_curve"], marker="o", label="reward of the step's 8 episodes (mean)")
    axes.plot(steps, grpo["tool_calls_curve"], marker="s", linestyle="--", label="tool calls per episode")
    axes.scatter([0, len(steps)], [results["sft"]["held_out_success"], grpo["held_out_success"]], s=80, marker="*",
                 color="black", zorder=3, label="held-out success (40 tickets, greedy)")
    axes.set_xticks(range(0, len(steps) + 1, 2))
    axes.set_xlabel("GRPO step (after the chat recipe)")
    axes.set_ylim(-0.05, 1.1)
    axes.set_title("Agent task: GRPO with the live tool, SmolLM2-135M, 2-core CPU", fontsize=10)
    axes.legend(fontsize=8, loc="lower right")
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    pyplot.close(figure)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--results_file", type=Path, default=REPO / "bench" / "results" / "agent-default.json")
    parser.add_argument("--learning_rate", default="1e-4", help="GRPO's")
    args = parser.parse_args()
    main(args.results_file, args.learning_rate)
