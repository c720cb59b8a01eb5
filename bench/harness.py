"""Running a suite: each configuration's command line and launch, its timing and peak memory, the machine's matmul
rate, and the repeats, interleaved in a rotated order.

Each configuration is a fresh process tree under ``bench/probe.py``, which writes a report per process (batches,
optimizer step times, peak memory); ``summarize`` turns one run's reports into its figures.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import platform
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from suites import HUB_TOKEN, Config, Suite

BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent

STEP_SPLIT = ("generation_seconds_per_step", "scoring_seconds_per_step", "training_seconds_per_step")
"""Where a reinforcement-learning step's time goes (``step_split``)."""

GPU_BF16_PEAK = {"H100 PCIe": 756e12, "H100": 989e12, "H200": 989e12, "A100": 312e12}
"""Dense bf16 FLOP/s from NVIDIA's data sheets (SXM parts unless named), by a part of the device name."""


@dataclass
class Machine:
    device: torch.device
    gpus: int
    bf16_peak: float | None
    """The GPU's dense bf16 FLOP/s, for model FLOP utilisation; None on a CPU or a GPU not listed."""


@dataclass
class Settings:
    """What the command line asked of a suite, defaults filled in."""

    repeats: int
    train_examples: int
    per_device_train_batch_size: int | None


@dataclass
class Measurements:
    """What a suite's repeats produced."""

    configs: list[Config]
    """The configurations run; on a machine with one GPU the 2-process ones are ``skipped``."""
    skipped: list[str]
    runs: dict[str, list[dict]]
    """Per configuration, each repeat's figures (``summarize``)."""
    matmul: list[float]
    """The machine's matmul FLOP/s, measured in every repeat."""
    flops: dict
    """The suite's FLOPs of one training step per real token and per example."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def command(config: Config, train_csv: Path, eval_csv: Path, output_dir: Path, gpus: int, seed: int | None,
            batch_size: int | None) -> list[str]:
    shared = ["--seed", str(seed)] if seed is not None else []
    if batch_size:
        shared += ["--per_device_train_batch_size", str(batch_size)]
    if config.start_model:
        shared += ["--model_name_or_path", str(train_csv.parent / config.start_model)]
    if config.launcher == "python":
        evaluation = (["--eval_file", str(eval_csv)] if config.long_chats or config.recipe == "embed"
                      or config.start_model else [])
        return [sys.executable, str(BENCH / "baselines.py"), config.name, str(train_csv), str(output_dir), *shared,
                *evaluation]
    if config.recipe in ("classify", "embed", "sft", "dpo", "grpo"):
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
               batch_size: int | None, quality: str) -> dict:
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
    results = output_dir / "all_results.json"  # the recipes' own results, and the baselines' that write them
    figure = json.loads(results.read_text()).get(quality) if results.is_file() else None
    return {"reports": [json.loads(p.read_text()) for p in sorted(report_dir.glob("rank*.json"))],
            "wall_seconds": time.time() - launched_at, "quality": figure}


def summarize(config: Config, run: dict, flops: dict, matmul_rate: float, peak: float | None) -> dict:
    """One run's figures over its whole training: every example of the epoch, so that each configuration is
    measured on the same examples and tokens, from the first training batch to the last optimizer step."""
    reports = run["reports"]
    main = next(r for r in reports if r["rank"] == 0)
    steps = main["step_times"]
    batches = [b for r in reports for b in r["batches"]]
    start = min(b[3] for b in batches)
    seconds = steps[-1] - start
    samples, real_tokens = sum(b[0] for b in batches), sum(b[1] for b in batches)
    useful_flops = flops["per_token"] * real_tokens + flops["per_example"] * samples
    return {
        **step_split(main.get("phases", []), start, steps[-1], len(steps)),
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
        "quality": run["quality"],
    }


def step_split(phases: list, start: float, end: float, steps: int) -> dict:
    """Seconds per optimizer step spent sampling completions, scoring them and on the rest (training), over the
    measured window; empty where nothing was sampled."""
    if not phases:
        return {}
    spent = {"generation": 0.0, "scoring": 0.0}
    for phase, began, ended in phases:
        if began >= start and ended <= end:
            spent[phase] += ended - began
    training = end - start - sum(spent.values())
    return dict(zip(STEP_SPLIT, (spent["generation"] / steps, spent["scoring"] / steps, training / steps), strict=True))


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


def bf16_peak(device: torch.device) -> float | None:
    """The GPU's dense bf16 peak from its data sheet, for model FLOP utilisation; None if not listed."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name()
    return next((peak for key, peak in GPU_BF16_PEAK.items() if key in name), None)


def detect_machine() -> Machine:
    """The GPUs if there are any, else the CPU at the 2 threads every configuration gets."""
    gpus = torch.cuda.device_count()
    device = torch.device("cuda" if gpus else "cpu")
    if gpus:
        print(f"GPU: {torch.cuda.get_device_name()} x {gpus}", flush=True)
    else:
        torch.set_num_threads(2)
        print(f"CPU: {platform.processor() or platform.machine()}, {os.cpu_count()} cores", flush=True)
    return Machine(device, gpus, bf16_peak(device))


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


def run_suite(suite: Suite, settings: Settings, machine: Machine) -> Measurements:
    """Every configuration of the suite ``settings.repeats`` times, interleaved, each repeat starting one
    configuration further on, on data written to a scratch folder."""
    skipped = [c.name for c in suite.configs if machine.gpus == 1 and c.processes > 1]
    configs = [c for c in suite.configs if c.name not in skipped]
    flops = suite.flops()
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "HF_HUB_DISABLE_TELEMETRY": "1"}
    env = {k: v for k, v in env.items() if not k.startswith("ACCELERATE_")}
    runs: dict[str, list[dict]] = {c.name: [] for c in configs}
    matmul: list[float] = []
    with tempfile.TemporaryDirectory(prefix="finetune-bench-") as scratch_name:
        scratch = Path(scratch_name)
        data = suite.write_data(scratch, settings.train_examples, suite.eval_examples)
        long_data = suite.write_long_data(scratch) if suite.write_long_data else None
        hub = None
        if any("--push_to_hub" in c.recipe_flags for c in configs):
            urls = multiprocessing.get_context("spawn").Queue()
            hub = multiprocessing.get_context("spawn").Process(target=serve_hub, args=(urls,), daemon=True)
            hub.start()
            env.update(HF_ENDPOINT=urls.get(timeout=60), HF_HUB_OFFLINE="0", HF_HUB_CACHE=str(scratch / "hub-cache"),
                       HF_TOKEN="")
        try:
            for repeat in range(settings.repeats):
                matmul.append(matmul_rate(machine.device))
                order = configs[repeat % len(configs):] + configs[:repeat % len(configs)]
                seed = 42 + repeat if suite.seeded else None
                for config in order:
                    run = run_config(config, long_data if config.long_chats else data, scratch, env, machine.gpus,
                                     seed, config.batch_size if config.long_chats
                                     else settings.per_device_train_batch_size, suite.quality)
                    runs[config.name].append(summarize(config, run, flops, matmul[-1], machine.bf16_peak))
                    latest = runs[config.name][-1]
                    print(f"[{repeat + 1}/{settings.repeats}] {config.name:<20} {latest['samples_per_second']:7.1f} "
                          f"samples/s  {latest['tokens_per_second']:7.1f} tokens/s  "
                          f"padding {latest['padding_efficiency']:.3f}  "
                          f"{latest['wall_seconds']:5.1f} s", flush=True)
        finally:
            if hub is not None:
                hub.terminate()
    return Measurements(configs, skipped, runs, matmul, flops)
