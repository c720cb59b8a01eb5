"""Losing nothing when a job dies: processes really killed, checkpoints really damaged."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest
from helpers import (
    FAST_FLAGS,
    REPO,
    accelerate_cmd,
    assert_weights_match_a_parity_run,
    classify_flags,
    data_flags,
    max_weight_diff,
    one_error_line,
    parity_flags,
    python_cmd,
    read_results,
    run,
    torchrun_cmd,
    train_here,
    wait_for,
    workers,
)

from finetune.checkpointing.checkpoint import find_latest_checkpoint, verify_checkpoint


def training_flags(small_data, model, out) -> list[str]:
    # 42 examples in batches of 8: 6 steps an epoch, 12 in all; a checkpoint every 2 steps.
    return classify_flags(small_data, model, "--per_device_train_batch_size", "8", "--num_train_epochs", "2",
                          "--checkpointing_steps", "2", "--output_dir", str(out))


def test_a_kill_while_a_checkpoint_is_written_loses_nothing(small_data, tiny_bert, tmp_path):
    uninterrupted = tmp_path / "uninterrupted"
    train_here("classify", *training_flags(small_data, tiny_bert, uninterrupted))

    out = tmp_path / "out"
    flags = training_flags(small_data, tiny_bert, out)
    job = subprocess.Popen(python_cmd(*flags), cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                           start_new_session=True)
    partial = out / "checkpoints" / "step_6.partial"
    # The weights land first; the optimizer state and the manifest follow. Freeze the job there.
    wait_for((partial / "model.safetensors").exists, "step 6's weights", job, interval=0.001)
    os.killpg(job.pid, signal.SIGSTOP)
    assert not (partial / "manifest.json").exists() and not (out / "checkpoints" / "step_6").exists()
    os.killpg(job.pid, signal.SIGKILL)
    job.wait()

    assert partial.is_dir(), "the half-written checkpoint is still there"
    latest = find_latest_checkpoint(str(out))
    assert latest.name == "step_4", "a partial checkpoint is never taken for a complete one"
    verify_checkpoint(latest)

    resumed = train_here("classify", *flags, "--resume_from_checkpoint", "latest")
    assert "resumed from" in resumed.stdout and "step_4" in resumed.stdout
    assert not partial.exists()
    assert max_weight_diff(uninterrupted, out) == 0.0


@pytest.fixture(scope="module")
def two_steps(small_data, tiny_bert, tmp_path_factory):
    """A one-process run of 2 steps (global batch 8) with its checkpoint; each test works on a copy."""
    out = tmp_path_factory.mktemp("two_steps") / "out"
    train_here("classify", *training_flags(small_data, tiny_bert, out), "--max_train_steps", "2")
    return out


def copy_of(run_folder: Path, tmp_path: Path) -> Path:
    shutil.copytree(run_folder, tmp_path / "out")
    return tmp_path / "out"


def test_a_damaged_checkpoint_is_refused_by_name(small_data, tiny_bert, two_steps, tmp_path):
    out = copy_of(two_steps, tmp_path)
    optimizer = out / "checkpoints" / "step_2" / "optimizer.bin"
    optimizer.write_bytes(optimizer.read_bytes()[:1000])
    result = train_here("classify", *training_flags(small_data, tiny_bert, out), "--resume_from_checkpoint",
                        str(out / "checkpoints" / "step_2"), check=False)
    one_error_line(result.returncode, result.stderr, f"checkpoint file {optimizer} is damaged")


@pytest.mark.multiprocess
@pytest.mark.slow
def test_resuming_with_another_global_batch_stops_with_the_numbers_to_use(small_data, tiny_bert, two_steps, tmp_path):
    out = copy_of(two_steps, tmp_path)
    result = run(torchrun_cmd(*training_flags(small_data, tiny_bert, out), "--resume_from_checkpoint",
                              str(out / "checkpoints" / "step_2")),
                 check=False)
    assert result.returncode != 0
    assert ("was written with a global batch of 8 (8 per device x 1 process(es) x 1 accumulation step(s)) and this "
            "run's is 16 (8 per device x 2 process(es)") in result.stderr
    assert "with 2 process(es), pass --per_device_train_batch_size 4" in result.stderr
    assert read_results(out)["global_step"] == 2, "the earlier run's results are untouched"


def kill_rank_after(job: subprocess.Popen, checkpoint, rank: int = 1) -> None:
    """SIGKILL the worker process of ``rank`` once ``checkpoint`` exists."""
    wait_for(checkpoint.exists, str(checkpoint), job)
    (worker,) = workers(job, rank=rank)
    worker.send_signal(signal.SIGKILL)


@pytest.mark.multiprocess
@pytest.mark.slow
def test_a_killed_worker_is_restarted_by_accelerate_and_the_job_finishes_as_if_never_killed(
        parity_runs, small_data, tiny_bert_without_dropout, tmp_path):
    """torchrun's restart (--max-restarts) of a killed worker is checked by
    test_a_restart_after_an_explicit_resume_continues_from_the_newest_checkpoint."""
    out = tmp_path / "out"
    command = accelerate_cmd(*parity_flags(small_data, tiny_bert_without_dropout, 4), "--output_dir", str(out))
    command.insert(command.index("--config_file"), "--max_restarts=1")
    job = subprocess.Popen(command, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    # Checkpoints every 4 of 9 steps: kill rank 1 once the first is complete, with 5 steps still to go, so
    # a restart that skipped steps or lost the optimizer's state would end elsewhere.
    kill_rank_after(job, out / "checkpoints" / "step_4" / "manifest.json")
    output, _ = job.communicate(timeout=300)
    assert job.returncode == 0, output[-4000:]
    assert "resumed from" in output and "step_4 at step 4" in output
    assert read_results(out)["global_step"] == 9
    assert_weights_match_a_parity_run(parity_runs("accelerate", 2, 4), out)


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.parametrize("runtime", ["ddp", "accelerate"])
def test_a_save_slower_than_the_timeout_on_rank_0_does_not_abort_the_others(small_data, tmp_path, runtime):
    """Rank 0 is frozen (SIGSTOP) once it starts writing the final model, for twice the collective timeout. (The
    default MiniLM, whose final save is long enough to catch.)"""
    out = tmp_path / "out"
    timeout = 4
    launch = torchrun_cmd if runtime == "ddp" else accelerate_cmd
    log = open(tmp_path / "output.txt", "w+")  # read back at the end
    job = subprocess.Popen(launch(*data_flags(small_data), *FAST_FLAGS, "--per_device_train_batch_size", "4",
                                  "--max_train_steps", "2", "--output_dir", str(out), "--ddp_timeout", str(timeout),
                                  "--runtime", runtime),
                           cwd=REPO, stdout=log, stderr=subprocess.STDOUT, text=True)
    rank_0 = wait_for(lambda: workers(job, rank=0), "rank 0's process", job)
    wait_for((out / ".final.partial").exists, "the final save", job, interval=0.001)
    rank_0[0].send_signal(signal.SIGSTOP)
    time.sleep(2 * timeout)
    alive = job.poll() is None
    rank_0[0].send_signal(signal.SIGCONT)
    job.wait(timeout=120)
    log.seek(0)
    assert alive, "the job died while rank 0 was saving:\n" + log.read()[-4000:]
    assert job.returncode == 0, log.read()[-4000:]
    assert '"id2label"' in (out / "config.json").read_text()
    assert read_results(out)["world_size"] == 2


class _TouchOnLoad:
    """Unpickling this creates a file: what a malicious checkpoint could do with any code."""

    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return (Path.touch, (Path(self.path),))


def test_a_checkpoint_file_that_would_run_code_is_refused(small_data, tiny_bert, two_steps, tmp_path):
    import hashlib
    import json

    import torch

    out, marker = copy_of(two_steps, tmp_path), tmp_path / "code-ran"
    flags = training_flags(small_data, tiny_bert, out)
    checkpoint = out / "checkpoints" / "step_2"
    torch.save({"state": _TouchOnLoad(marker), "param_groups": []}, checkpoint / "optimizer.bin")
    manifest = json.loads((checkpoint / "manifest.json").read_text())  # consistent, as an attacker would make it
    manifest["files"]["optimizer.bin"] = hashlib.sha256((checkpoint / "optimizer.bin").read_bytes()).hexdigest()
    (checkpoint / "manifest.json").write_text(json.dumps(manifest))

    result = train_here("classify", *flags, "--resume_from_checkpoint", str(checkpoint), check=False)
    assert not marker.exists(), "loading ran code from the checkpoint"
    one_error_line(result.returncode, result.stderr, "loading it could run code")


@pytest.mark.multiprocess
@pytest.mark.slow
def test_a_restart_before_overwrite_output_dir_acts_never_resumes_the_run_being_replaced(
        parity_runs, small_data, tiny_bert_without_dropout, tmp_path):
    """A fresh run with --overwrite_output_dir into a folder with another run's checkpoint dies before it has
    removed it (its worker killed as it starts); torchrun restarts it, and it starts fresh again."""
    from finetune.checkpointing.checkpoint import read_progress

    out = tmp_path / "out"
    replaced = out / "checkpoints" / "step_4"
    shutil.copytree(parity_runs("torchrun", 2, 4) / "checkpoints" / "step_4", replaced)
    replaced_run = read_progress(replaced).run_id
    command = torchrun_cmd(*parity_flags(small_data, tiny_bert_without_dropout, 8), "--output_dir", str(out),
                           "--overwrite_output_dir", nproc=1)
    command.insert(command.index("--nproc_per_node"), "--max-restarts=1")
    job = subprocess.Popen(command, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    (worker,) = wait_for(lambda: workers(job), "the worker", job, timeout=60, interval=0.005)
    worker.send_signal(signal.SIGKILL)
    output, _ = job.communicate(timeout=300)
    assert job.returncode == 0, output[-4000:]
    assert "resumed from" not in output
    assert read_progress(out / "checkpoints" / "step_4").run_id != replaced_run
    assert max_weight_diff(parity_runs("torchrun", 1, 8), out) <= 1e-6


@pytest.mark.multiprocess
@pytest.mark.slow
def test_a_restart_after_an_explicit_resume_continues_from_the_newest_checkpoint(
        parity_runs, small_data, tiny_bert_without_dropout, tmp_path):
    """Resumed from another folder's step_4, rank 1 killed after its own step_8 (of 9): torchrun restarts the
    workers, which continue from step_8, not from step_4 again, and end as the run never stopped."""
    start = tmp_path / "start"
    shutil.copytree(parity_runs("torchrun", 2, 4) / "checkpoints" / "step_4", start)
    out = tmp_path / "out"
    command = torchrun_cmd(*parity_flags(small_data, tiny_bert_without_dropout, 4), "--output_dir", str(out),
                           "--resume_from_checkpoint", str(start))
    command.insert(command.index("--nproc_per_node"), "--max-restarts=1")
    job = subprocess.Popen(command, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    kill_rank_after(job, out / "checkpoints" / "step_8" / "manifest.json")
    output, _ = job.communicate(timeout=300)
    assert job.returncode == 0, output[-4000:]
    resumes = [line for line in output.splitlines() if "resumed from" in line]
    assert len(resumes) == 2 and "start at step 4" in resumes[0] and "step_8 at step 8" in resumes[1], resumes
    assert_weights_match_a_parity_run(parity_runs("torchrun", 2, 4), out)
