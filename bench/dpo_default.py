"""The preference recipe's default run beside the base model it starts from, and the usual pipeline (the chat
recipe's default run, then DPO from its adapter), on the same validation pairs.

    python bench/dpo_default.py     # about 15 minutes on 2 CPU cores: bench/results/dpo-default.json

Each model is evaluated exactly as the recipe evaluates (the base model's rewards are 0 by definition: it is the
reference), with greedy replies to all 32 validation prompts for their routing accuracy. The runs are launched
as the README launches them, under ``bench/probe.py`` for their peak resident memory; the models they trained
reply to the same prompts (a DPO run from the chat adapter is read from its ``--merge_lora`` folder: its own
adapter applies to the base with the chat adapter folded in). The converted model is the one ``HF_HOME`` holds
(``bench/sft_default.py`` times the conversion).
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

from finetune.data.embedded.preference_pairs import NUM_EVAL  # noqa: E402


def metrics_of(model: str | None) -> dict:
    """The preference recipe's evaluation of ``model`` (default: the base model), replies to every prompt."""
    where = ["--model_name_or_path", model] if model else []
    return recipe_metrics("dpo", "DPOArguments", "DPOTask", ["--eval_generate", str(NUM_EVAL), *where])


def main(results_file: Path) -> None:
    torch.set_num_threads(2)
    results = {"device": f"cpu ({torch.get_num_threads()} threads)", "torch": torch.__version__,
               "base_model": metrics_of(None)}
    with tempfile.TemporaryDirectory() as scratch:
        out = Path(scratch)
        run, wall, peak = launch_default_run("dpo", out / "dpo")
        results["default_run"] = {**run, "routing_accuracy": metrics_of(str(out / "dpo"))["eval_routing_accuracy"],
                                  "wall_seconds": wall, "peak_rss_mib": peak}
        run, wall, peak = launch_default_run("sft", out / "sft")
        results["sft_default_run"] = {"routing_accuracy": metrics_of(str(out / "sft"))["eval_routing_accuracy"],
                                      "wall_seconds": wall}
        run, wall, peak = launch_default_run("dpo", out / "dpo-after-sft", "--model_name_or_path", str(out / "sft"),
                                             "--merge_lora")
        results["dpo_after_sft"] = {**run, "routing_accuracy": metrics_of(str(out / "dpo-after-sft" / "merged"))[
            "eval_routing_accuracy"], "wall_seconds": wall, "peak_rss_mib": peak}
    results_file.write_text(json.dumps(results, indent=2) + "\n")
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--results_file", type=Path, default=REPO / "bench" / "results" / "dpo-default.json")
    main(parser.parse_args().results_file)
