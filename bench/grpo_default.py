"""The GRPO recipe's default run beside the base model it starts from, and the usual pipeline (the chat recipe's
default run, then GRPO from its adapter), on the same 47 validation prompts.

    python bench/grpo_default.py     # about 25 minutes on 2 CPU cores: bench/results/grpo-default.json

Each model is evaluated exactly as the recipe evaluates: greedy replies to every validation prompt, scored by the
routing reward (1 where the reply's first line names the ticket's team and no other). The runs are launched as
the README launches them, under ``bench/probe.py`` for their peak resident memory; the reward curve is each step's
mean reward over the completions it sampled (``log_history.jsonl``).
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


def held_out_reward(model: str | None) -> float:
    """The GRPO recipe's evaluation reward of ``model`` (default: the base model) on the validation prompts."""
    return recipe_metrics("grpo", "GRPOArguments", "GRPOTask",
                          ["--model_name_or_path", model] if model else [])["eval_reward"]


def grpo_run(output_dir: Path, *flags: str) -> dict:
    run, wall, peak = launch_default_run("grpo", output_dir, *flags)
    steps = [step for step in map(json.loads, open(output_dir / "log_history.jsonl")) if "reward" in step]
    return {"held_out_reward": run["eval_reward"], "wall_seconds": wall, "peak_rss_mib": peak,
            "global_step": run["global_step"], "train_runtime": run["train_runtime"],
            "training_reward_curve": [round(step["reward"], 4) for step in steps],
            # groups whose completions all scored alike, which give no gradient: what stalls learning
            "frac_reward_zero_std_curve": [step["frac_reward_zero_std"] for step in steps],
            "grad_norm_curve": [round(step["grad_norm"], 4) for step in steps]}


def main(results_file: Path) -> None:
    torch.set_num_threads(2)
    results = {"device": f"cpu ({torch.get_num_threads()} threads)", "torch": torch.__version__,
               "base_model": {"held_out_reward": held_out_reward(None)}}
    print(json.dumps(results), flush=True)
    with tempfile.TemporaryDirectory() as scratch:
        out = Path(scratch)
        results["default_run"] = grpo_run(out / "grpo")
        print(json.dumps(results["default_run"]), flush=True)
        _, wall, _ = launch_default_run("sft", out / "sft")
        results["sft_default_run"] = {"held_out_reward": held_out_reward(str(out / "sft")), "wall_seconds": wall}
        results["grpo_after_sft"] = grpo_run(out / "grpo-after-sft", "--model_name_or_path", str(out / "sft"))
    results_file.write_text(json.dumps(results, indent=2) + "\n")
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--results_file", type=Path, default=REPO / "bench" / "results" / "grpo-default.json")
    main(parser.parse_args().results_file)
