"""Data at scale: tokenized once into a cache, shared by the processes, memory-mapped, epochs planned in numpy.

    python bench/data_scale.py    # about 40 minutes on 2 CPU cores -> bench/results/data-scale.{json,md}

Synthetic data, made deterministically: classification rows of 20-80 words (2,000 and 1,000,000 rows) and chats
of a system line, a 60-200-word ticket and a 30-120-word reply (2,000, 100,000 and 200,000 conversations).
Every training run is 2 processes under torchrun, 2 optimizer steps, against the same small validation file
(2,000 rows; 100 chats), the recipe's default model, with the probe of ``bench/probe.py``.

- cold build: ``--prepare_only --preprocessing_num_workers 2`` into empty caches (the raw file's Arrow copy
  included), rows per second of the build; beside it the peer, ``datasets.map(batched=True, num_proc=2)`` the
  run_glue way on the same file and tokenizer from an empty cache (for chats: each chat rendered once by the
  template, then tokenized); the ratio is peer rows/s over ours (target <= 1.5).
- warm start: launch to the first optimizer step with the cache built, minus the same run on 2,000 rows
  (target <= 15 s at 1M rows).
- memory: the peak resident (RSS) and unique (USS) memory of each training process, sampled every 0.2 s from
  outside; the larger of the two processes, against the 2,000-row run (target: within 300 MiB).
- epoch plan: seconds to plan an epoch in each process; a 10M-row cache (the 1M-row cache's files copied ten
  times) opened and planned by 2 processes at once (target < 10 s each).
- mid-epoch resume: launch to the first step of a run resumed from a checkpoint moved to the middle of the
  1M-row epoch (its progress edited and its manifest rewritten), under both launchers, against the fresh start.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import psutil

BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent
sys.path.insert(0, str(REPO))

from finetune.checkpointing.checkpoint import read_progress, write_manifest, write_progress  # noqa: E402

WORDS = ("refund order parcel login password charge card tracking error crash app update invoice billing "
         "account delivery courier address screen payment subscription renew cancel reset email phone code "
         "the a my your is was not again please today yesterday since week month help still wrong twice "
         "late missing broken slow cannot open sign in out new old plan pro basic premium store").split()
LABELS = ("billing", "technical", "shipping", "account")
CLASSIFY, SFT = str(REPO / "recipes" / "classify.py"), str(REPO / "recipes" / "sft.py")


def sentences(rng: np.random.Generator, count: int, low: int, high: int) -> list[str]:
    lengths = rng.integers(low, high + 1, count)
    words = np.array(WORDS)[rng.integers(0, len(WORDS), int(lengths.sum()))]
    ends = np.cumsum(lengths)
    return [" ".join(words[end - length:end]) for end, length in zip(ends, lengths, strict=True)]


def make_classify(path: Path, rows: int, seed: int) -> Path:
    rng = np.random.default_rng(seed)
    with open(path, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["text", "label"])
        for start in range(0, rows, 100_000):
            count = min(100_000, rows - start)
            writer.writerows(zip(sentences(rng, count, 20, 80), np.array(LABELS)[rng.integers(0, 4, count)],
                                 strict=True))
    return path


def make_chats(path: Path, rows: int, seed: int) -> Path:
    rng = np.random.default_rng(seed)
    with open(path, "w") as f:
        for start in range(0, rows, 50_000):
            count = min(50_000, rows - start)
            for ticket, reply, team in zip(sentences(rng, count, 60, 200), sentences(rng, count, 30, 120),
                                           np.array(LABELS)[rng.integers(0, 4, count)], strict=True):
                f.write(json.dumps({"messages": [
                    {"role": "system", "content": "Route the ticket: name the team, then reply."},
                    {"role": "user", "content": ticket},
                    {"role": "assistant", "content": f"Team: {team}\n{reply}"}]}) + "\n")
    return path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class MemoryWatch:
    """Peak RSS and USS of every process under ``root`` that runs ``marker``, sampled every 0.2 s."""

    def __init__(self, root: int, marker: str):
        self.root, self.marker = root, marker
        self.peaks: dict[int, dict[str, float]] = {}
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()

    def _sample(self) -> None:
        while not self._done.wait(0.2):
            try:
                children = psutil.Process(self.root).children(recursive=True)
            except psutil.Error:
                return
            for child in children:
                try:
                    if self.marker not in " ".join(child.cmdline()):
                        continue
                    info = child.memory_full_info()
                except psutil.Error:
                    continue
                peak = self.peaks.setdefault(child.pid, {"rss_mib": 0.0, "uss_mib": 0.0})
                peak["rss_mib"] = max(peak["rss_mib"], info.rss / 2**20)
                peak["uss_mib"] = max(peak["uss_mib"], info.uss / 2**20)

    def stop(self) -> dict[str, float]:
        self._done.set()
        self._thread.join()
        return {key: max((p[key] for p in self.peaks.values()), default=float("nan")) for key in ("rss_mib", "uss_mib")}


def launch(recipe: str, flags: list[str], scratch: Path, launcher: str = "torchrun") -> dict:
    """Run ``recipe`` on 2 processes under the probe: wall seconds, launch to first step, peak memory, stdout."""
    reports = Path(tempfile.mkdtemp(dir=scratch))
    if launcher == "torchrun":
        command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
                   str(free_port())]
    else:
        command = [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
                   str(REPO / "accelerate_configs" / "cpu_ddp.yaml"), "--num_processes", "2", "--main_process_port",
                   str(free_port())]
    started = time.time()
    process = subprocess.Popen([*command, str(BENCH / "probe.py"), recipe, *flags], cwd=REPO, text=True,
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               env={**os.environ, "BENCH_REPORT_DIR": str(reports), "BENCH_LAUNCHED_AT": str(started)})
    watch = MemoryWatch(process.pid, recipe)
    output, _ = process.communicate()
    memory = watch.stop()
    if process.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} {recipe} exited {process.returncode}:\n{output[-4000:]}")
    ranks = [json.loads((reports / f"rank{rank}.json").read_text()) for rank in range(2)]
    return {"wall_seconds": time.time() - started,
            "launch_to_first_step_seconds": max(r["step_times"][0] if r["step_times"] else float("nan")
                                                for r in ranks) - started,
            "peak_rss_mib_probe": max(r["peak_rss_mib"] for r in ranks), **{f"peak_{k}": v for k, v in memory.items()},
            "output": output}


def built_seconds(output: str) -> float:
    line = next(line for line in output.splitlines() if line.startswith("tokenized data:"))
    return float(line.split("built in ", 1)[1].split(" s", 1)[0])


PEER = {
    "classify": """
import sys, time, datasets, transformers
from finetune.models.loading import default_model_path
tokenizer = transformers.AutoTokenizer.from_pretrained(default_model_path())
start = time.perf_counter()
raw = datasets.load_dataset("csv", data_files=sys.argv[1], split="train")
raw.map(lambda b: tokenizer(b["text"], padding=False, max_length=128, truncation=True), batched=True, num_proc=2,
        remove_columns=["text"])
print(time.perf_counter() - start)
""",
    "sft": """
import sys, time, datasets, transformers
from finetune.models.loading import default_chat_model_path
tokenizer = transformers.AutoTokenizer.from_pretrained(default_chat_model_path())
def encode(batch):
    texts = [tokenizer.apply_chat_template(m, tokenize=False) for m in batch["messages"]]
    return tokenizer(texts, add_special_tokens=False, truncation=True, max_length=1024)
start = time.perf_counter()
raw = datasets.load_dataset("json", data_files=sys.argv[1], split="train")
raw.map(encode, batched=True, num_proc=2, remove_columns=["messages"])
print(time.perf_counter() - start)
""",
}


def peer_seconds(kind: str, data: Path, scratch: Path) -> float:
    cache = tempfile.mkdtemp(dir=scratch)
    result = subprocess.run([sys.executable, "-c", PEER[kind], str(data)], cwd=REPO, capture_output=True, text=True,
                            check=True, env={**os.environ, "HF_DATASETS_CACHE": cache})
    shutil.rmtree(cache)
    return float(result.stdout.strip().splitlines()[-1])


def open_and_plan(folder: Path, processes: int = 2) -> list[dict]:
    """Each of ``processes`` processes at once: open the cache and plan an epoch of its rank, timed."""
    code = """
import json, sys, time
from pathlib import Path
start = time.perf_counter()
from finetune.data.batching import GlobalBatchSampler, TokenizedDataset
from finetune.data.cache import _open
imported = time.perf_counter()
train = TokenizedDataset(_open(Path(sys.argv[1])).train)
opened = time.perf_counter()
plan = GlobalBatchSampler(train.lengths, 32, 2, seed=42, group_by_length=True).plan(0, int(sys.argv[2]))
planned = time.perf_counter()
print(json.dumps({"rows": len(train), "batches": len(plan), "import_seconds": imported - start,
                  "open_seconds": opened - imported, "plan_seconds": planned - opened,
                  "open_and_plan_seconds": planned - imported}))
"""
    children = [subprocess.Popen([sys.executable, "-c", code, str(folder), str(rank)], cwd=REPO, text=True,
                                 stdout=subprocess.PIPE) for rank in range(processes)]
    return [json.loads(child.communicate()[0]) for child in children]


def move_to_mid_epoch(checkpoint: Path, rows: int, global_batch: int) -> int:
    """Rewrite ``checkpoint``'s progress to the middle of its first epoch (and its manifest to match)."""
    progress = read_progress(checkpoint)
    progress.batches_in_epoch = progress.global_step = rows // global_batch // 2
    write_progress(checkpoint, progress)
    (checkpoint / "manifest.json").unlink()
    write_manifest(checkpoint, progress)
    return progress.global_step


def suite(kind: str, sizes: list[int], scratch: Path, args) -> dict:
    recipe = CLASSIFY if kind == "classify" else SFT
    make = make_classify if kind == "classify" else make_chats
    suffix = ".csv" if kind == "classify" else ".jsonl"
    validation = make(scratch / f"{kind}-validation{suffix}", 2000 if kind == "classify" else 100, seed=1)
    batch = ["--per_device_train_batch_size", "32"] if kind == "classify" else [
        "--per_device_train_batch_size", "2", "--per_device_eval_batch_size", "4"]
    results = {}
    for rows in sizes:
        data = make(scratch / f"{kind}-{rows}{suffix}", rows, seed=rows)
        cache = scratch / f"cache-{kind}-{rows}"
        common = ["--train_file", str(data), "--validation_file", str(validation), "--dataset_cache_dir", str(cache),
                  *batch]
        print(f"{kind} {rows}: cold build", flush=True)
        os.environ["HF_DATASETS_CACHE"] = tempfile.mkdtemp(dir=scratch)  # the raw file's Arrow copy is made too
        cold = launch(recipe, [*common, "--prepare_only", "--preprocessing_num_workers", "2",
                               "--output_dir", str(scratch / "unused")], scratch)
        entry = {"rows": rows, "cold_wall_seconds": cold["wall_seconds"], "cold_build_seconds": built_seconds(
            cold["output"]), "cold_peak_rss_mib": cold["peak_rss_mib"]}
        entry["cold_build_rows_per_second"] = rows / entry["cold_build_seconds"]
        print(f"{kind} {rows}: peer", flush=True)
        entry["peer_map_seconds"] = peer_seconds(kind, data, scratch)
        entry["peer_rows_per_second"] = rows / entry["peer_map_seconds"]
        entry["build_vs_peer_seconds"] = entry["cold_build_seconds"] / entry["peer_map_seconds"]
        print(f"{kind} {rows}: warm runs", flush=True)
        warm = [launch(recipe, [*common, "--max_train_steps", "2", "--logging_steps", "1", "--checkpointing_steps", "2",
                                "--output_dir", str(scratch / f"out-{kind}-{rows}-{repeat}")], scratch)
                for repeat in range(args.repeats)]
        entry["warm_launch_to_first_step_seconds"] = [w["launch_to_first_step_seconds"] for w in warm]
        entry["warm_peak_rss_mib"] = max(w["peak_rss_mib"] for w in warm)
        entry["warm_peak_uss_mib"] = max(w["peak_uss_mib"] for w in warm)
        entry["cache_bytes"] = sum(p.stat().st_size for p in cache.rglob("*") if p.is_file())
        entry["plan"] = open_and_plan(next(p for p in cache.iterdir() if p.is_dir()))
        results[rows] = entry
    small = results[sizes[0]]
    for entry in results.values():
        entry["warm_start_minus_small_seconds"] = (np.median(entry["warm_launch_to_first_step_seconds"])
                                                   - np.median(small["warm_launch_to_first_step_seconds"]))
        entry["peak_rss_minus_small_mib"] = entry["warm_peak_rss_mib"] - small["warm_peak_rss_mib"]
        entry["peak_uss_minus_small_mib"] = entry["warm_peak_uss_mib"] - small["warm_peak_uss_mib"]
    return {str(rows): entry for rows, entry in results.items()}


def resume_mid_epoch(scratch: Path, rows: int) -> dict:
    """Resume the 1M-row classify run from the middle of its epoch under both launchers, against a fresh start."""
    data, validation = scratch / f"classify-{rows}.csv", scratch / "classify-validation.csv"
    cache = scratch / f"cache-classify-{rows}"
    common = ["--train_file", str(data), "--validation_file", str(validation), "--dataset_cache_dir", str(cache),
              "--per_device_train_batch_size", "32", "--logging_steps", "1"]
    checkpoint = scratch / "mid-epoch"
    shutil.copytree(scratch / f"out-classify-{rows}-0" / "checkpoints" / "step_2", checkpoint)
    step = move_to_mid_epoch(checkpoint, rows, 64)
    results = {"resumed_at_step": step}
    for launcher in ("torchrun", "accelerate"):
        fresh = launch(CLASSIFY, [*common, "--max_train_steps", "2", "--output_dir",
                                  str(scratch / f"fresh-{launcher}")], scratch, launcher)
        resumed = launch(CLASSIFY, [*common, "--max_train_steps", str(step + 2), "--resume_from_checkpoint",
                                    str(checkpoint), "--output_dir", str(scratch / f"resumed-{launcher}")], scratch,
                         launcher)
        assert f"resumed from {checkpoint} at step {step}" in resumed["output"]
        results[launcher] = {"fresh_launch_to_first_step_seconds": fresh["launch_to_first_step_seconds"],
                             "resumed_launch_to_first_step_seconds": resumed["launch_to_first_step_seconds"]}
    return results


def ten_million(scratch: Path, rows: int) -> list[dict]:
    """The 1M-row classify cache with its training files copied ten times: 10M rows on disk, opened and planned."""
    source = next(p for p in (scratch / f"cache-classify-{rows}").iterdir() if p.is_dir())
    folder = scratch / "cache-classify-10x" / source.name
    folder.mkdir(parents=True)
    meta = json.loads((source / "prepared.json").read_text())
    files = []
    for copy in range(10):
        for name in meta["files"]["train"]:
            shutil.copyfile(source / name, folder / f"{copy}-{name}")
            files.append(f"{copy}-{name}")
    for name in meta["files"]["validation"]:
        shutil.copyfile(source / name, folder / name)
    (folder / "prepared.json").write_text(json.dumps({**meta, "files": {**meta["files"], "train": files}}))
    subprocess.run(["sync"], check=True)
    return open_and_plan(folder)


def markdown(results: dict) -> str:
    lines = ["# Data at scale (2 processes under torchrun, 2 CPU cores)", "",
             "| data | rows | cold build rows/s (2 workers) | peer map rows/s | build / peer time | warm start "
             "- 2,000-row run (s) | peak RSS / USS per process (MiB) | RSS / USS - 2,000-row run (MiB) | "
             "epoch plan (s) |",
             "|---|---|---|---|---|---|---|---|---|"]
    for kind in ("classify", "sft"):
        for rows, e in results.get(kind, {}).items():
            plan = max(p["plan_seconds"] for p in e["plan"])
            lines.append(f"| {kind} | {int(rows):,} | {e['cold_build_rows_per_second']:,.0f} | "
                         f"{e['peer_rows_per_second']:,.0f} | {e['build_vs_peer_seconds']:.2f} | "
                         f"{e['warm_start_minus_small_seconds']:+.1f} | {e['warm_peak_rss_mib']:,.0f} / "
                         f"{e['warm_peak_uss_mib']:,.0f} | {e['peak_rss_minus_small_mib']:+,.0f} / "
                         f"{e['peak_uss_minus_small_mib']:+,.0f} | {plan:.2f} |")
    if "ten_million" not in results:
        return "\n".join(lines) + "\n"
    ten = results["ten_million"]
    lines += ["", f"10M-row cache, 2 processes at once: open {max(p['open_seconds'] for p in ten):.2f} s, plan "
              f"{max(p['plan_seconds'] for p in ten):.2f} s, both {max(p['open_and_plan_seconds'] for p in ten):.2f} s "
              "(the slower process).", ""]
    resume = results["resume_mid_epoch"]
    for launcher in ("torchrun", "accelerate"):
        r = resume[launcher]
        lines.append(f"Resumed at step {resume['resumed_at_step']:,} (the middle of the 1M-row epoch) under "
                     f"{launcher}: {r['resumed_launch_to_first_step_seconds']:.1f} s from launch to the first step, "
                     f"against {r['fresh_launch_to_first_step_seconds']:.1f} s for a fresh start.")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3, help="Warm runs per size (the median is taken).")
    parser.add_argument("--classify_rows", type=int, nargs="+", default=[2000, 1_000_000])
    parser.add_argument("--chat_rows", type=int, nargs="+", default=[2000, 100_000, 200_000])
    parser.add_argument("--scratch", default=None, help="Folder for the data and caches (default: a temporary one).")
    parser.add_argument("--chats_only", action="store_true",
                        help="Only the chat suite, into bench/results/data-scale-chats.{json,md} (the others kept).")
    args = parser.parse_args()
    scratch = Path(args.scratch or tempfile.mkdtemp(prefix="data-scale-"))
    scratch.mkdir(parents=True, exist_ok=True)
    results = {"machine": {"cpus": os.cpu_count(), "memory_gib": psutil.virtual_memory().total / 2**30}}
    if not args.chats_only:
        results["classify"] = suite("classify", args.classify_rows, scratch, args)
        results["ten_million"] = ten_million(scratch, args.classify_rows[-1])
        results["resume_mid_epoch"] = resume_mid_epoch(scratch, args.classify_rows[-1])
    results["sft"] = suite("sft", args.chat_rows, scratch, args)
    out = BENCH / "results" / ("data-scale-chats" if args.chats_only else "data-scale")
    out.with_suffix(".json").write_text(json.dumps(results, indent=2) + "\n")
    out.with_suffix(".md").write_text(markdown(results))
    print(markdown(results))
    if not args.scratch:
        shutil.rmtree(scratch)


if __name__ == "__main__":
    main()
