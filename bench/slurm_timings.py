"""How long a stop and a requeue take under launch/slurm.sbatch, on the one-node Slurm of launch/local_slurm.sh.

    python bench/slurm_timings.py        # about 6 minutes; writes bench/results/slurm.json

One job runs the classify recipe's default (the embedded MiniLM and data, 2 processes on the 2 CPUs) and is
stopped twice, the ways a cluster stops it: ``scontrol requeue`` (as a preemption: SIGTERM to every process),
then the time-limit warning (SIGUSR1 to the batch script, what ``--signal=B:USR1@N`` sends), and after each
the job comes back by itself. Times are read from the wall clock here and from the job's log lines.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "bench" / "results" / "slurm.json"
STEPS_BEFORE_A_STOP = 20


def main() -> None:
    with tempfile.TemporaryDirectory(prefix="slurm-timings-") as tmp:
        folder = Path(tmp)
        cluster = folder / "cluster"
        subprocess.run([REPO / "launch" / "local_slurm.sh", "start", cluster], check=True, stdout=subprocess.DEVNULL)
        env = {**os.environ, "SLURM_CONF": str(cluster / "slurm.conf"), "HF_HUB_OFFLINE": "1"}
        try:
            results = measure(folder, env)
        finally:
            subprocess.run(["scancel", "--full", "--signal=KILL", "--user=root"], env=env)
            subprocess.run([REPO / "launch" / "local_slurm.sh", "stop", cluster], check=True)
    RESULTS.write_text(json.dumps(results, indent=2) + "\n")
    print(json.dumps(results, indent=2))


def measure(folder: Path, env: dict) -> dict:
    def slurm(*command: str) -> str:
        return subprocess.run(command, check=True, capture_output=True, text=True, env=env, cwd=REPO).stdout

    def log() -> str:
        path = folder / f"finetune-{job}.out"
        return path.read_text(errors="replace") if path.exists() else ""

    def state() -> dict[str, str]:
        return dict(re.findall(r"(\w+)=(\S*)", slurm("scontrol", "show", "job", "--oneliner", job)))

    def wait(condition, what: str, timeout: float = 600) -> float:
        deadline = time.monotonic() + timeout
        while not condition():
            if time.monotonic() > deadline:
                sys.exit(f"error: no {what} after {timeout} s\n{log()[-4000:]}")
            time.sleep(0.1)
        return time.monotonic()

    def trained_to(step: int) -> bool:
        """The training's progress bar (its total is the run's step count) reached ``step``."""
        text = log()
        total = re.search(r"training classify on .*?, (\d+) steps, ", text)
        return bool(total) and any(int(done) >= step for done in re.findall(rf"\| (\d+)/{total.group(1)} \[", text))

    def stopped_line(signal: str) -> re.Match:
        return re.search(rf"stopped by {signal} at step (\d+): \S+ was complete on disk ([\d.]+) s after", log())

    def requeued(restarts: int) -> bool:
        info = state()
        return info["JobState"] == "PENDING" and info["Restarts"] == str(restarts)

    job = slurm("sbatch", "--parsable", f"--output={folder}/%x-%j.out", "--cpus-per-task=2",
                "launch/slurm.sbatch", "recipes/classify.py", "--output_dir", str(folder / "out")).strip()
    submitted = time.monotonic()
    first_steps = wait(lambda: trained_to(1), "first step")
    wait(lambda: trained_to(STEPS_BEFORE_A_STOP), "steps before the requeue")

    # A preemption's way: SIGTERM to every process of the job, then Slurm puts it back in the queue.
    requeue = time.monotonic()
    slurm("scontrol", "requeue", job)
    requeue_done = wait(lambda: requeued(1), "requeue")
    term_stop = stopped_line("SIGTERM")
    back = wait(lambda: state()["JobState"] == "RUNNING", "second attempt", timeout=400)
    resumed = wait(lambda: re.search(rf"resumed from \S+ at step {term_stop.group(1)}\b", log())
                   and trained_to(int(term_stop.group(1)) + 1), "a step after resuming")

    # The time-limit warning's way: SIGUSR1 to the batch script, which passes it on and requeues the job.
    wait(lambda: trained_to(int(term_stop.group(1)) + STEPS_BEFORE_A_STOP), "steps before the warning")
    warning = time.monotonic()
    slurm("scancel", "--batch", "--signal=USR1", job)
    warning_done = wait(lambda: requeued(2), "requeue after the warning")
    usr1_stop = stopped_line("SIGUSR1")
    slurm("scancel", job)

    return {
        "what": "classify default (embedded MiniLM and data, 2 processes x 1 thread) under launch/slurm.sbatch on a "
                "one-node Slurm 22.05 (launch/local_slurm.sh), 2 CPU cores",
        "slurm": slurm("sinfo", "--version").strip(),
        "submit_to_first_step_seconds": round(first_steps - submitted, 1),
        "requeue": {
            "signal_to_checkpoint_seconds": float(term_stop.group(2)),
            "stopped_at_step": int(term_stop.group(1)),
            "requeue_to_pending_seconds": round(requeue_done - requeue, 1),
            "pending_to_running_seconds": round(back - requeue_done, 1),
            "running_to_a_step_after_resuming_seconds": round(resumed - back, 1),
            "requeue_to_training_again_seconds": round(resumed - requeue, 1),
        },
        "time_limit_warning": {
            "signal_to_checkpoint_seconds": float(usr1_stop.group(2)),
            "stopped_at_step": int(usr1_stop.group(1)),
            "warning_to_requeued_seconds": round(warning_done - warning, 1),
        },
    }


if __name__ == "__main__":
    main()
