"""The preference recipe's default run beside the base model it starts from, on the same validation pairs.

    python bench/dpo_default.py     # about 6 minutes on 2 CPU cores: bench/results/dpo-default.json

The base model is evaluated exactly as the recipe evaluates (its rewards are 0 by definition: it is the
reference), with greedy replies to all 32 validation prompts for their routing accuracy; then the default run is
launched as the README launches it, under ``bench/probe.py`` for its peak resident memory; then the model it
trained (the base with the saved adapter folded in) replies to the same prompts. The converted model is the
one ``HF_HOME`` holds (``bench/sft_default.py`` times the conversion).
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

from finetune.default_preferences import NUM_EVAL  # noqa: E402

ARGUMENTS = ("dpo", "DPOArguments", "DPOTask")
REPLIES = ["--eval_generate", str(NUM_EVAL)]


def main(results_file: Path) -> None:
    torch.set_num_threads(2)
    base = recipe_metrics(*ARGUMENTS, REPLIES)
    print("base model:", json.dumps(base), flush=True)
    with tempfile.TemporaryDirectory() as scratch:
        tuned, wall, peak = launch_default_run("dpo", Path(scratch))
        replies = recipe_metrics(*ARGUMENTS, [*REPLIES, "--model_name_or_path", f"{scratch}/out"])
    results = {"device": f"cpu ({torch.get_num_threads()} threads)", "torch": torch.__version__,
               "base_model": base, "default_run": tuned,
               "default_run_routing_accuracy": replies["eval_routing_accuracy"],
               "default_run_wall_seconds": wall, "default_run_peak_rss_mib": peak}
    results_file.write_text(json.dumps(results, indent=2) + "\n")
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--results_file", type=Path, default=REPO / "bench" / "results" / "dpo-default.json")
    main(parser.parse_args().results_file)
