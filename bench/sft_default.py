"""The chat recipe's default run beside the base model it starts from, on the same validation tickets.

    python bench/sft_default.py     # about 4 minutes on 2 CPU cores: bench/results/sft-default.json

As on a fresh machine, the run starts with an empty ``HF_HOME``: first the one-time conversion of the GGUF
weights (timed on its own), then the base model is evaluated exactly as the recipe evaluates (the task's own
loss and greedy replies, all 48 validation conversations in one batch), then the default run is launched as
the README launches it, under ``bench/probe.py`` for its peak resident memory, and its ``all_results.json``,
wall time and peak are recorded beside the base model's.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from finetune.config import parse_config  # noqa: E402
from finetune.data.cache import load_or_build  # noqa: E402


def recipe_metrics(recipe_name: str, arguments: str, task_class: str, flags: list[str]) -> dict:
    """The recipe's evaluation metrics of the model its ``flags`` load, computed as the recipe computes them
    (the task's own loss and greedy replies), all validation examples in one batch."""
    spec = importlib.util.spec_from_file_location(f"{recipe_name}_recipe", REPO / "recipes" / f"{recipe_name}.py")
    recipe = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(recipe)
    cfg, args = parse_config(getattr(recipe, arguments), flags, defaults=recipe.DEFAULTS)
    task = getattr(recipe, task_class)(args)
    tokenizer = task.load_tokenizer(cfg)
    setup = task.setup(cfg, tokenizer, load_or_build(task, cfg, tokenizer))
    batch = (setup.eval_collate or setup.collate)([setup.eval_set[i] for i in range(len(setup.eval_set))])
    with torch.no_grad():
        metrics = task.metrics(task.eval_outputs(setup.model.eval(), batch))
    return {f"eval_{name}": value for name, value in metrics.items()}


def launch_default_run(recipe_name: str, output_dir: Path, *flags: str) -> tuple[dict, float, int]:
    """The recipe launched as the README launches it (with no flags: its default run), under ``bench/probe.py``:
    its ``all_results.json``, wall seconds and peak resident MiB."""
    reports = output_dir.with_name(output_dir.name + "-reports")
    reports.mkdir()
    start = time.perf_counter()
    subprocess.run([sys.executable, "-m", "accelerate.commands.launch", "--num_processes", "1",
                    str(REPO / "bench" / "probe.py"), str(REPO / "recipes" / f"{recipe_name}.py"), *flags,
                    "--output_dir", str(output_dir)], cwd=REPO, check=True,
                   env={**os.environ, "BENCH_REPORT_DIR": str(reports), "BENCH_LAUNCHED_AT": repr(time.time())})
    wall = time.perf_counter() - start
    peak = json.loads((reports / "rank0.json").read_text())["peak_rss_mib"]
    return json.loads((output_dir / "all_results.json").read_text()), wall, round(peak)


def main(results_file: Path) -> None:
    torch.set_num_threads(2)
    with tempfile.TemporaryDirectory() as scratch:
        os.environ["HF_HOME"] = f"{scratch}/hf-home"  # nothing converted yet, as on a fresh machine
        start = time.perf_counter()
        subprocess.run([sys.executable, "-c", "from finetune.models.loading import default_chat_model_path as p; p()"],
                       cwd=REPO, check=True)
        conversion = time.perf_counter() - start
        base = recipe_metrics("sft", "SFTArguments", "SFTTask", ["--no_use_lora"])
        print("base model:", json.dumps(base), flush=True)
        tuned, wall, peak = launch_default_run("sft", Path(scratch, "out"))
    results = {"device": f"cpu ({torch.get_num_threads()} threads)", "torch": torch.__version__,
               "conversion_seconds": conversion, "base_model": base, "default_run": tuned,
               "default_run_wall_seconds": wall, "default_run_peak_rss_mib": peak}
    results_file.write_text(json.dumps(results, indent=2) + "\n")
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--results_file", type=Path, default=REPO / "bench" / "results" / "sft-default.json")
    main(parser.parse_args().results_file)
