"""launch/slurm.sbatch on a real Slurm: Debian's slurm-wlm on this machine, one node, started for these tests by
launch/local_slurm.sh (and installed by it where missing)."""

from __future__ import annotations

import contextlib
import os
import re
import subprocess
from pathlib import Path

import psutil
import pytest
from helpers import (
    HUB_TOKEN,
    REPO,
    classify_flags,
    limit_file_size,
    log_history,
    max_weight_diff,
    parity_flags,
    read_results,
    snapshot,
    training_processes,
    wait_for,
)

from finetune.checkpointing.checkpoint import checkpoint_path, find_latest_checkpoint, verify_checkpoint

pytestmark = [pytest.mark.slurm, pytest.mark.slow]

SBATCH = str(REPO / "launch" / "slurm.sbatch")
ENDED = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY")


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    """``SLURM_CONF`` of a one-node cluster whose daemons live as long as this module's tests."""
    folder = tmp_path_factory.mktemp("slurm")
    script = str(REPO / "launch" / "local_slurm.sh")
    started = subprocess.run([script, "start", str(folder)], capture_output=True, text=True, timeout=600)
    assert started.returncode == 0, started.stdout + started.stderr
    try:
        yield {"SLURM_CONF": str(folder / "slurm.conf")}
    finally:
        subprocess.run([script, "stop", str(folder)], timeout=60)


class Job:
    """A job submitted with ``sbatch launch/slurm.sbatch [script options] recipes/classify.py ...`` from the
    repository; ``preexec_fn`` runs in sbatch's process (its resource limits go to the job)."""

    def __init__(self, slurm: dict, log_dir: Path, sbatch_options: list[str], recipe_flags: list[str],
                 script_options: tuple[str, ...] = (), preexec_fn=None):
        self.env = {**os.environ, **slurm}
        self.id = self.command("sbatch", "--parsable", f"--output={log_dir}/%x-%j.out", *sbatch_options, SBATCH,
                               *script_options, "recipes/classify.py", *recipe_flags, preexec_fn=preexec_fn).strip()
        self.log = log_dir / f"finetune-{self.id}.out"

    def command(self, *command: str, preexec_fn=None) -> str:
        done = subprocess.run(command, capture_output=True, text=True, timeout=60, cwd=REPO, env=self.env,
                              preexec_fn=preexec_fn)
        assert done.returncode == 0, f"{' '.join(command)}: {done.stderr}"
        return done.stdout

    def scontrol(self, *args: str) -> str:
        return self.command("scontrol", *args)

    def info(self) -> dict[str, str]:
        return dict(re.findall(r"(\w+)=(\S*)", self.scontrol("show", "job", "--oneliner", self.id)))

    def __str__(self) -> str:
        """Its id and state, as ``wait_for`` names it in a failure."""
        return f"job {self.id} ({self.info()['JobState']})"

    def poll(self) -> str | None:
        """Its state once it has ended, None before: what ``wait_for`` watches (as ``subprocess.Popen.poll``)."""
        state = self.info()["JobState"]
        return state if state in ENDED else None

    def kill(self) -> None:
        """Cancel it (``wait_for`` gave up on it)."""
        subprocess.run(["scancel", self.id], capture_output=True, timeout=60, env=self.env)

    def wait(self, condition, what: str, timeout: float = 300):
        """``wait_for`` ``condition`` while this job runs, asking Slurm every half second, its log shown on failure."""
        return wait_for(condition, what, self, timeout=timeout, interval=0.5, log=self.log)

    def wait_until_ended(self, timeout: float = 300) -> dict[str, str]:
        return self.wait(lambda: (info := self.info())["JobState"] in ENDED and info, "end", timeout)

    def output(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""

    def attempt_lines(self) -> list[str]:
        return [line for line in self.output().splitlines() if line.startswith("[slurm.sbatch")]

    def warn(self) -> None:
        """Signal the batch script as ``--signal=B:USR1@N`` does before the time limit, without waiting for it."""
        self.command("scancel", "--batch", "--signal=USR1", self.id)

    def processes(self) -> list[psutil.Process]:
        """This job's processes on the node."""
        found = []
        for process in psutil.process_iter():
            try:
                if process.environ().get("SLURM_JOB_ID") == self.id:
                    found.append(process)
            except psutil.Error:
                continue
        return found

    def start_requeued_now(self) -> None:
        """Slurm holds a requeued job about two minutes before it may start again; a test need not wait. A few
        seconds it must: slurmd refuses to launch a job whose credential dates from the second it revoked the
        last one in (seen: "Job credential revoked", the job FAILED)."""
        self.wait(lambda: (info := self.info())["JobState"] == "PENDING" and info["Restarts"] == "1", "requeue",
                  timeout=200)
        self.scontrol("update", f"JobId={self.id}", "StartTime=now+3", "TimeLimit=10")


def written(folder: Path) -> dict[str, tuple[str, int]]:
    """Each file's checksum and modification time."""
    return {path: (digest, (folder / path).stat().st_mtime_ns) for path, digest in snapshot(folder).items()}


def checkpoint_at_least(out: Path, step: int):
    latest = find_latest_checkpoint(str(out)) if (out / "checkpoints").is_dir() else None
    return latest if latest and int(latest.name.split("_")[1]) >= step else None


def test_two_torchruns_joined_by_rendezvous_train_to_the_weights_of_plain_torchrun(
        slurm, parity_runs, small_data, tiny_bert_without_dropout, tmp_path):
    """Two torchrun agents (as on two nodes) with one process each meet at the c10d rendezvous on the first
    node: the same 2-process training as ``torchrun --nproc_per_node=2``."""
    out = tmp_path / "out"
    job = Job(slurm, tmp_path, ["--ntasks-per-node=2", "--cpus-per-task=1"],
              [*parity_flags(small_data, tiny_bert_without_dropout, 4), "--output_dir", str(out)])
    info = job.wait_until_ended()
    assert info["JobState"] == "COMPLETED" and info["ExitCode"] == "0:0", job.output()[-4000:]
    lines = job.attempt_lines()
    assert "2 torchrun(s) x 1 process(es)" in lines[0] and lines[-1].endswith("attempt 1: trained to the end")
    assert read_results(out)["world_size"] == 2
    assert max_weight_diff(parity_runs("torchrun", 2, 4), out) <= 1e-6


def test_a_requeued_job_resumes_by_itself_to_the_same_weights_keeping_its_checkpoints(
        slurm, parity_runs, small_data, tiny_bert_without_dropout, tmp_path):
    out = tmp_path / "out"
    job = Job(slurm, tmp_path, ["--cpus-per-task=2"],
              [*parity_flags(small_data, tiny_bert_without_dropout, 4), "--output_dir", str(out)])
    # Frozen as soon as its checkpoint is complete, while Slurm is told, so that the tiny model's run cannot train
    # to its end first (Slurm sends the step SIGCONT with its SIGTERM).
    def trainers_started():
        found = training_processes(job.processes())
        return found if len(found) == 2 else None

    trainers = job.wait(trainers_started, "both training processes")
    first = wait_for(lambda: checkpoint_path(str(out), 4) if (checkpoint_path(str(out), 4) / "manifest.json").exists()
                     else None, "step 4's checkpoint", interval=0.001)
    for process in trainers:
        process.suspend()
    kept = written(first)
    job.scontrol("requeue", job.id)
    for process in trainers:
        with contextlib.suppress(psutil.NoSuchProcess):
            process.resume()

    job.start_requeued_now()
    info = job.wait_until_ended()
    assert info["JobState"] == "COMPLETED" and info["ExitCode"] == "0:0", job.output()[-4000:]
    lines = job.attempt_lines()
    assert any("attempt 1: stopped by Slurm" in line for line in lines), lines
    assert lines[-1].endswith("attempt 2: trained to the end"), lines
    stopped_at = int(re.search(r"stopped by SIGTERM at step (\d+)", job.output()).group(1))
    assert f"resumed from {out / 'checkpoints' / f'step_{stopped_at}'} at step {stopped_at}" in job.output()
    assert written(first) == kept, "the checkpoint written before the requeue is untouched"
    assert read_results(out)["global_step"] == 9
    assert max_weight_diff(parity_runs("torchrun", 2, 4), out) <= 1e-6


def test_the_warning_before_the_time_limit_leaves_a_checkpoint_the_requeued_job_resumes_from(
        slurm, small_data, tiny_bert_without_dropout, tmp_path):
    """The limit brought down to 2 minutes once the job trains, with the warning 90 s before it: Slurm (which
    checks limits every 30 s) warns at its next check, where the limit is under 2 minutes away; the script passes
    the warning on, the step is saved, and the script requeues the job. (Submitted with the 2-minute limit, the
    warning would be due from the first second, and could come before the training could take it.) The second
    attempt, the last of --max_attempts 2, stops on a warning too and is not requeued."""
    out = tmp_path / "out"
    # Only the stop writes a checkpoint: one every few of a thousand steps would fill the disk.
    flags = classify_flags(small_data, tiny_bert_without_dropout, "--per_device_train_batch_size", "4",
                           "--max_train_steps", "100000", "--output_dir", str(out))
    job = Job(slurm, tmp_path, ["--cpus-per-task=2", "--time=10", "--signal=B:USR1@90"], flags,
              script_options=("--max_attempts", "2"))
    job.wait(lambda: "training classify on" in job.output(), "training")
    job.scontrol("update", f"JobId={job.id}", "TimeLimit=2")

    job.start_requeued_now()
    stop = re.search(r"stopped by SIGUSR1 at step (\d+): (\S+) was complete on disk ([\d.]+) s", job.output())
    assert stop, job.output()[-4000:]
    assert any("attempt 1: stopped before the time limit; requeued" in line for line in job.attempt_lines())
    checkpoint = Path(stop.group(2))
    verify_checkpoint(checkpoint)
    assert find_latest_checkpoint(str(out)) == checkpoint and not (out / "model.safetensors").exists()

    job.wait(lambda: f"resumed from {checkpoint} at step {stop.group(1)}" in job.output(), "resume")
    # A step of its own first: resumed at an epoch's end, the second attempt evaluates before it trains.
    job.wait(lambda: log_history(out)[-1]["step"] > int(stop.group(1)), "a step after the resume")
    job.warn()
    info = job.wait_until_ended()
    assert (info["JobState"], info["ExitCode"], info["Restarts"]) == ("FAILED", "143:0", "1"), info
    assert job.attempt_lines()[-1].endswith("attempt 2: stopped before the time limit with a checkpoint; not "
                                            "requeued: this was the last of --max_attempts 2; submit the same "
                                            "command to go on")
    second = re.findall(r"stopped by SIGUSR1 at step (\d+)", job.output())
    assert len(second) == 2 and int(second[-1]) > int(stop.group(1)), "the second attempt trained on"
    assert find_latest_checkpoint(str(out)).name == f"step_{second[-1]}"


def test_a_warned_job_whose_checkpoint_fails_is_not_requeued_and_its_token_is_on_no_command_line(
        slurm, small_data, tiny_bert, tmp_path):
    """The training exits 2 (a full disk), not with the stopped status 143: requeueing would fail the same way
    every attempt. The --hub_token given to the script reaches the training as HF_TOKEN only."""
    out = tmp_path / "out"
    flags = classify_flags(small_data, tiny_bert, "--per_device_train_batch_size", "4", "--max_train_steps", "100000",
                           "--output_dir", str(out), "--hub_token", HUB_TOKEN)
    job = Job(slurm, tmp_path, ["--cpus-per-task=1", "--propagate=FSIZE"], flags, preexec_fn=limit_file_size)
    job.wait(lambda: "training classify on" in job.output(), "training")
    processes = job.processes()
    workers = training_processes(processes)
    assert len(workers) == 1 and workers[0].environ()["HF_TOKEN"] == HUB_TOKEN
    assert len(processes) >= 4, processes  # the batch script, srun, torchrun and the training
    assert not [p.cmdline() for p in processes if HUB_TOKEN in " ".join(p.cmdline())]
    job.warn()
    info = job.wait_until_ended()
    assert (info["JobState"], info["ExitCode"], info["Restarts"]) == ("FAILED", "2:0", "0"), info
    assert job.attempt_lines()[-1].endswith("attempt 1: stopped before the time limit, but the training ended with "
                                            "exit status 2, not with a checkpoint; not requeued (the log above says "
                                            "why)")
    assert re.search(r"error: cannot write checkpoint \S+ \(File too large", job.output())
    assert "--hub_token taken out of the recipe's flags" in job.attempt_lines()[0]
    assert HUB_TOKEN not in job.output()


def test_the_script_refuses_an_attempt_beyond_max_attempts_and_a_bad_count():
    """Its own checks, before it asks Slurm for anything."""
    env = {**os.environ, "SLURM_JOB_ID": "7", "SLURM_RESTART_COUNT": "3"}
    over = subprocess.run(["bash", SBATCH, "--max_attempts", "3", "recipes/classify.py"], capture_output=True,
                          text=True, env=env, cwd=REPO, timeout=60)
    assert over.returncode == 1 and over.stdout.strip().endswith(
        "job 7 attempt 4: not started: the job has had its --max_attempts 3 attempts; submit it again to go on")
    bad = subprocess.run(["bash", SBATCH, "--max_attempts=0", "recipes/classify.py"], capture_output=True, text=True,
                         env=env, cwd=REPO, timeout=60)
    assert bad.returncode == 2 and bad.stderr.strip() == (
        "error: --max_attempts is '0'; it must be a positive whole number")
