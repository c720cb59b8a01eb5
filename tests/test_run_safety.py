"""Bad numbers and full disks: nothing wrong reaches disk, and the run ends with one clear error."""

from __future__ import annotations

import resource
import signal
import subprocess
import time

from conftest import FAST_FLAGS, REPO, data_flags, python_cmd

from finetune.checkpoint import verify_checkpoint


def test_a_non_finite_loss_stops_the_run_before_anything_from_that_step_is_saved(small_data, tmp_path):
    """At learning rate 1e30 the first step's update makes the second step's loss non-finite."""
    out = tmp_path / "out"
    result = subprocess.run(python_cmd(*data_flags(small_data), *FAST_FLAGS, "--learning_rate", "1e30",
                                       "--max_train_steps", "4", "--checkpointing_steps", "1",
                                       "--checkpoints_total_limit", "1", "--logging_steps", "10",
                                       "--output_dir", str(out)), cwd=REPO, capture_output=True, text=True)
    errors = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert result.returncode == 2 and len(errors) == 1 and "Traceback" not in result.stderr, result.stderr[-3000:]
    assert "was not finite at step 2, so nothing from that step on was saved" in errors[0]
    assert [p.name for p in (out / "checkpoints").iterdir()] == ["step_1"], "step 1's checkpoint is kept"
    verify_checkpoint(out / "checkpoints" / "step_1")
    assert not (out / "model.safetensors").exists()


def limit_file_size():
    """In the child: files stop growing at 20 MB (EFBIG), as on a full disk; the signal that comes with it is
    ignored so that the write fails instead of killing the process."""
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (20 << 20, 20 << 20))


def test_a_checkpoint_the_disk_cannot_hold_is_one_clear_error_and_leaves_no_partial_folder(small_data, tmp_path):
    out = tmp_path / "out"
    result = subprocess.run(python_cmd(*data_flags(small_data), *FAST_FLAGS, "--max_train_steps", "2",
                                       "--checkpointing_steps", "1", "--output_dir", str(out)),
                            cwd=REPO, capture_output=True, text=True, preexec_fn=limit_file_size)
    errors = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert result.returncode == 2 and len(errors) == 1 and "Traceback" not in result.stderr, result.stderr[-3000:]
    assert f"cannot write checkpoint {out / 'checkpoints' / 'step_1'} (File too large" in errors[0]
    assert "free disk space" in errors[0]
    assert list((out / "checkpoints").iterdir()) == [], "no .partial folder is left behind"


def test_a_second_run_on_a_folder_a_living_run_holds_is_refused_and_a_killed_run_blocks_nothing(small_data,
                                                                                                tmp_path):
    out = tmp_path / "out"
    flags = [*data_flags(small_data), *FAST_FLAGS, "--per_device_train_batch_size", "4", "--num_train_epochs", "3",
             "--checkpointing_steps", "1", "--output_dir", str(out)]
    first = subprocess.Popen(python_cmd(*flags), cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 120
    while not (out / "checkpoints" / "step_1" / "manifest.json").exists():
        assert first.poll() is None and time.monotonic() < deadline
        time.sleep(0.05)
    # Even with --overwrite_output_dir, which would remove the first run's checkpoints.
    second = subprocess.run(python_cmd(*flags, "--overwrite_output_dir"), cwd=REPO, capture_output=True, text=True)
    first.kill()  # SIGKILL: the lock file stays behind, the kernel's lock does not
    first.wait()
    errors = [line for line in second.stderr.splitlines() if line.startswith("error: ")]
    assert second.returncode == 2 and len(errors) == 1, second.stderr[-3000:]
    assert f"--output_dir {out} is in use by another run (pid {first.pid} on " in errors[0]
    assert (out / "checkpoints" / "step_1").is_dir(), "the refused run removed nothing"
    assert (out / ".finetune.lock").exists()

    third = subprocess.run(python_cmd(*flags, "--resume_from_checkpoint", "latest", "--checkpointing_steps", "epoch"),
                           cwd=REPO, capture_output=True, text=True)
    assert third.returncode == 0, third.stderr[-3000:]
    assert not (out / ".finetune.lock").exists(), "the lock file goes when its run ends"
