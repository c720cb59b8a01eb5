"""A suite's results: its runs' figures collected into the JSON record (medians with their spread, ratios against
their targets), that record as a Markdown table and a PNG chart, and every suite's ratios merged into ``latest.json``.

``markdown`` and ``plot`` read nothing but the JSON record, so a committed result file can be rendered again.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
from pathlib import Path

import torch
from harness import STEP_SPLIT, Machine, Measurements, Settings
from suites import LATEST, SUITES, Suite


def spread(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def collect(suite: Suite, settings: Settings, machine: Machine, measured: Measurements) -> dict:
    repeats, runs = settings.repeats, measured.runs
    ratios, per_measure, checks, ceilings = {}, {}, {}, {}
    for name, difference in suite.differences.items():
        # Medians over the seeds of each side, then their difference: the seeds pair no two runs.
        median_gap = (statistics.median(r[difference.measure] for r in runs[difference.first])
                      - statistics.median(r[difference.measure] for r in runs[difference.second]))
        ratios[name] = {"median": median_gap, "min": median_gap, "max": median_gap}
        checks[name] = difference.target
    for name, ratio in suite.ratios.items():
        if ratio.numerator in runs and ratio.denominator in runs:
            # Each ratio within one repeat (the two runs side by side), then the median over repeats.
            per_measure[name] = {
                measure: spread([runs[ratio.numerator][i][measure] / runs[ratio.denominator][i][measure]
                                 for i in range(repeats)])
                for measure in ("samples_per_second", "tokens_per_second")}
            ratios[name] = per_measure[name][suite.ratios_of]
            checks[name] = ratio.target
    for name, figure in suite.figures.items():
        ratios[name] = spread([r[figure.measure] for r in runs[figure.config]])
        checks[name] = figure.target

    def peak_memory(run: dict) -> float:
        return run["peak_gpu_memory_gib"] if machine.device.type == "cuda" else max(run["peak_rss_mib"])

    for name, ratio in suite.memory_ratios.items():
        ratios[name] = spread([peak_memory(runs[ratio.numerator][i]) / peak_memory(runs[ratio.denominator][i])
                               for i in range(repeats)])
        ceilings[name] = ratio.target
    per_config = {}
    for config in measured.configs:
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
            **{measure: spread([f[measure] for f in figures]) for measure in STEP_SPLIT if measure in figures[0]},
            suite.quality: spread([f["quality"] for f in figures]) if figures[0]["quality"] is not None else None,
            "runs": figures,
        }
    return {
        "device": torch.cuda.get_device_name() if machine.device.type == "cuda" else f"cpu ({os.cpu_count()} cores)",
        "torch": torch.__version__,
        "suite": suite.name,
        "repeats": repeats,
        "ratios_of": suite.ratios_of,
        "quality": suite.quality,
        "train_examples": settings.train_examples,
        "per_device_train_batch_size": settings.per_device_train_batch_size,
        "window": "the whole training: every example, from the first training batch to the last optimizer step",
        "matmul_gflops_per_second": spread([m / 1e9 for m in measured.matmul]),
        "training_flops": measured.flops,
        "bf16_peak_tflops": machine.bf16_peak / 1e12 if machine.bf16_peak else None,
        "ratios": {name: value["median"] for name, value in ratios.items()},
        "ratio_spread": ratios,
        "ratio_per_sample_and_per_token": per_measure,
        "targets": {**{name: {"at_least": target, "met": ratios[name]["median"] >= target}
                       for name, target in checks.items()},
                    **{name: {"at_most": target, "met": ratios[name]["median"] <= target}
                       for name, target in ceilings.items()}},
        "skipped": {name: "needs 2 GPUs" for name in measured.skipped},
        "configs": per_config,
    }


def merge_into_latest(out: Path, suffix: str) -> None:
    """Every suite's ratios also in ``latest.json`` (the classify suite's file), read from each suite's result
    file in ``out``: its ratios, spreads, per-sample and per-token ratios and targets under their own names, and
    ``merged_ratios`` saying which suite and file each came from. Rebuilt whenever a suite runs, so a classify run
    keeps the other suites' ratios; nothing to merge into before the classify suite has run."""
    latest_path = out / f"{LATEST}{suffix}.json"
    if not latest_path.is_file():
        return
    latest = json.loads(latest_path.read_text())
    sections = ("ratios", "ratio_spread", "ratio_per_sample_and_per_token", "targets")
    for name in latest.pop("merged_ratios", {}):
        for section in sections:
            latest[section].pop(name, None)
    merged = {}
    for suite in SUITES.values():
        path = out / f"{suite.results_file}{suffix}.json"
        if suite.results_file == LATEST or not path.is_file():
            continue
        results = json.loads(path.read_text())
        for name in results["ratios"]:
            if name in latest["ratios"]:
                sys.exit(f"error: the {suite.name} suite's ratio {name} is also another suite's; rename one")
            for section in sections:
                if name in results[section]:
                    latest[section][name] = results[section][name]
            merged[name] = {"suite": suite.name, "file": path.name}
    latest["merged_ratios"] = merged
    latest_path.write_text(json.dumps(latest, indent=2) + "\n")


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
        f"{results['quality'].removeprefix('eval_')} |",
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
            f"{c['all_reduces_per_micro_step']['median']:g} per micro-step | {cell(c[results['quality']], 3)} |"
        )
    for name, why in results["skipped"].items():
        lines.append(f"| {name} | not run: {why} | | | | | | | | | | | | |")
    split = {name: c for name, c in results["configs"].items() if STEP_SPLIT[0] in c}
    if split:
        lines += ["", "Seconds per optimizer step, median (min-max): sampling the completions, scoring them, and the "
                      "rest (training on them).", "", "| configuration | generation | scoring | training |",
                  "|---|---|---|---|"]
        lines += [f"| {name} | " + " | ".join(cell(c[measure], 2) for measure in STEP_SPLIT) + " |"
                  for name, c in split.items()]
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


def write(results: dict, out: Path, results_file: str) -> None:
    """The JSON record, its Markdown and its chart as ``results_file``.{json,md,png} in ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{results_file}.json").write_text(json.dumps(results, indent=2) + "\n")
    (out / f"{results_file}.md").write_text(markdown(results))
    plot(results, out / f"{results_file}.png")
