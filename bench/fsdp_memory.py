"""What sharding saves: FSDP (``torchrun --fsdp``) against DDP on a full fine-tune of SmolLM2-135M, 2 processes.

    python bench/fsdp_memory.py      # about 20 minutes on 2 CPU cores -> bench/results/fsdp-memory.json

Both sides run the chat recipe with ``--no_use_lora`` (every weight trains) on the same conversations, batch,
optimizer (fused AdamW) and threads (one per process), interleaved, ``--repeats`` times. ``bench/probe.py`` reports
per process: the bytes of weights, gradients and optimizer state it holds at its first optimizer step
(``fsdp_state_bytes_vs_ddp``: FSDP's largest process against DDP's), its peak resident memory, and the time of
every optimizer step (``fsdp_vs_ddp``: optimizer steps per second after the first, FSDP's over DDP's in the same
repeat). Medians over the repeats, with min-max.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent
sys.path.insert(0, str(BENCH))

from harness import free_port  # noqa: E402
from report import spread  # noqa: E402
from suites import write_chat_data  # noqa: E402

SIDES = {"ddp": [], "fsdp": ["--fsdp"]}


def run_side(flags: list[str], scratch: Path, name: str) -> list[dict]:
    """One 2-process run; each process's probe report."""
    reports, out = scratch / f"{name}-reports", scratch / f"{name}-out"
    reports.mkdir()
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
               str(free_port()), str(BENCH / "probe.py"), str(REPO / "recipes" / "sft.py"), *flags, "--output_dir",
               str(out)]
    env = {"OMP_NUM_THREADS": "1", "BENCH_REPORT_DIR": str(reports), "BENCH_LAUNCHED_AT": repr(time.time())}
    result = subprocess.run(command, cwd=REPO, capture_output=True, text=True, env={**os.environ, **env})
    if result.returncode != 0:
        sys.exit(f"error: {name} exited {result.returncode}:\n{result.stderr[-4000:]}")
    return [json.loads(p.read_text()) for p in sorted(reports.glob("rank*.json"))]


def figures(reports: list[dict]) -> dict:
    main = next(r for r in reports if r["rank"] == 0)
    steps = main["step_times"]
    return {"state_bytes": [sum(r["state_bytes"].values()) for r in reports],
            "state_bytes_parts": [r["state_bytes"] for r in reports],
            "peak_rss_mib": [round(r["peak_rss_mib"]) for r in reports],
            "steps_per_second": (len(steps) - 1) / (steps[-1] - steps[0])}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=6, help="Optimizer steps per run.")
    args = parser.parse_args()
    runs: dict[str, list[dict]] = {side: [] for side in SIDES}
    with tempfile.TemporaryDirectory() as scratch_dir:
        scratch = Path(scratch_dir)
        train, validation = write_chat_data(scratch, 160, 8)
        flags = ["--no_use_lora", "--no_packing", "--eval_generate", "0", "--train_file", str(train),
                 "--validation_file", str(validation), "--per_device_train_batch_size", "4",
                 "--max_train_steps", str(args.steps), "--logging_steps", str(args.steps)]
        for repeat in range(args.repeats):
            order = list(SIDES) if repeat % 2 == 0 else list(reversed(SIDES))
            for side in order:
                runs[side].append(figures(run_side(flags + SIDES[side], scratch, f"{side}-{repeat}")))
                print(side, repeat, json.dumps(runs[side][-1]), flush=True)
    ratios = {
        "fsdp_state_bytes_vs_ddp": [max(f["state_bytes"]) / max(d["state_bytes"])
                                    for f, d in zip(runs["fsdp"], runs["ddp"], strict=True)],
        "fsdp_vs_ddp": [f["steps_per_second"] / d["steps_per_second"]
                        for f, d in zip(runs["fsdp"], runs["ddp"], strict=True)],
    }
    results = {
        "what": "SmolLM2-135M-Instruct, every weight trains (chat recipe, --no_use_lora), 2 processes x 1 thread, "
                f"batch 4 per process, {args.steps} optimizer steps, torchrun (DDP) against torchrun --fsdp",
        "device": f"cpu ({torch.get_num_threads()} threads available)", "torch": torch.__version__,
        "repeats": args.repeats,
        "ratios": {name: spread(values) for name, values in ratios.items()},
        "targets": {"fsdp_state_bytes_vs_ddp": "<= 0.55", "fsdp_vs_ddp": "reported, not a target on a CPU"},
        "per_process_state_mib": {side: spread([max(r["state_bytes"]) / 2**20 for r in runs[side]]) for side in SIDES},
        "peak_rss_mib": {side: spread([max(r["peak_rss_mib"]) for r in runs[side]]) for side in SIDES},
        "steps_per_second": {side: spread([r["steps_per_second"] for r in runs[side]]) for side in SIDES},
        "runs": runs,
    }
    path = BENCH / "results" / "fsdp-memory.json"
    path.write_text(json.dumps(results, indent=2) + "\n")
    print(json.dumps({k: results[k] for k in ("ratios", "per_process_state_mib", "peak_rss_mib")}, indent=2))


if __name__ == "__main__":
    main()
