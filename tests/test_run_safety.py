"""Bad numbers, full disks and bad input: nothing wrong reaches disk, and the run ends with one clear error."""

from __future__ import annotations

import contextlib
import json
import math
import shutil
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest
import torch
from helpers import (
    FILE_SIZE_LIMIT,
    REPO,
    assert_refused,
    classify_flags,
    limit_file_size,
    log_history,
    one_error_line,
    python_cmd,
    snapshot,
    train_here,
    wait_for,
)

from finetune.checkpointing.checkpoint import Progress, verify_checkpoint, write_manifest, write_progress


def test_a_non_finite_loss_stops_the_run_before_anything_from_that_step_is_saved(small_data, tiny_bert, tmp_path):
    """At learning rate 1e30 the first step's update makes the second step's loss non-finite: the check before
    the checkpoint of step 2 stops the run (the log's is not due until step 4)."""
    out = tmp_path / "out"
    result = train_here("classify", *classify_flags(small_data, tiny_bert, "--learning_rate", "1e30",
                                                    "--max_train_steps", "4", "--checkpointing_steps", "1",
                                                    "--checkpoints_total_limit", "1", "--logging_steps", "10",
                                                    "--output_dir", str(out)), check=False)
    one_error_line(result.returncode, result.stderr, "was not finite at step 2, so nothing from that step on was saved")
    assert [p.name for p in (out / "checkpoints").iterdir()] == ["step_1"], "step 1's checkpoint is kept"
    verify_checkpoint(out / "checkpoints" / "step_1")
    assert not (out / "model.safetensors").exists()


def test_a_non_finite_last_step_is_neither_logged_nor_saved(small_data, tiny_bert, tmp_path):
    """No checkpoints and a log every 10 steps: the last step's log (always written) is the only check left before
    the final save, and it stops the run."""
    out = tmp_path / "out"
    result = train_here("classify", *classify_flags(small_data, tiny_bert, "--learning_rate", "1e30",
                                                    "--max_train_steps", "2", "--logging_steps", "10",
                                                    "--output_dir", str(out)), check=False)
    one_error_line(result.returncode, result.stderr, "was not finite at step 2, so nothing from that step on was saved")
    assert not out.exists(), "no loss was logged, no model, results or predictions saved"


def test_a_checkpoint_the_disk_cannot_hold_is_one_clear_error_and_the_earlier_ones_are_intact(small_data, tiny_bert,
                                                                                               tmp_path):
    """The disk fills once step 1's checkpoint is complete: the run is frozen there and its files limited."""
    out = tmp_path / "out"
    stderr = open(tmp_path / "stderr.txt", "w+")  # read back at the end
    job = subprocess.Popen(python_cmd(*classify_flags(small_data, tiny_bert, "--max_train_steps", "20",
                                                      "--checkpointing_steps", "1", "--output_dir", str(out))),
                           cwd=REPO, stdout=subprocess.DEVNULL, stderr=stderr, text=True,
                           preexec_fn=lambda: signal.signal(signal.SIGXFSZ, signal.SIG_IGN))
    wait_for((out / "checkpoints" / "step_1" / "manifest.json").exists, "step 1's checkpoint", job, interval=0.001)
    job.send_signal(signal.SIGSTOP)
    psutil.Process(job.pid).rlimit(psutil.RLIMIT_FSIZE, (FILE_SIZE_LIMIT, FILE_SIZE_LIMIT))
    job.send_signal(signal.SIGCONT)
    job.wait(timeout=300)
    stderr.seek(0)
    error = one_error_line(job.returncode, stderr.read(), "(File too large", "free disk space",
                           "earlier checkpoints are intact")
    failed = int(error.split("cannot write checkpoint ")[1].split(" (")[0].rsplit("step_", 1)[1])
    assert failed >= 2
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == [f"step_{s}" for s in range(1, failed)], \
        "no .partial folder is left behind"
    for step in range(1, failed):
        verify_checkpoint(out / "checkpoints" / f"step_{step}")


def test_a_final_model_the_disk_cannot_hold_leaves_the_one_it_replaces_as_it_was(small_data, tiny_bert, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    for name in ("config.json", "model.safetensors", "tokenizer.json", "all_results.json"):
        (out / name).write_text(f"the earlier run's {name}")
    before = snapshot(out)
    result = subprocess.run(python_cmd(*classify_flags(small_data, tiny_bert, "--max_train_steps", "1",
                                                       "--overwrite_output_dir", "--output_dir", str(out))),
                            cwd=REPO, capture_output=True, text=True, preexec_fn=limit_file_size)
    one_error_line(result.returncode, result.stderr, f"cannot write the model to {out} (",
                   "the model there before is intact")
    assert {name: digest for name, digest in snapshot(out).items() if name != "log_history.jsonl"} == before
    assert not (out / ".final.partial").exists()


def write_checkpoint(out, step: int, run_id: str):
    folder = out / "checkpoints" / f"step_{step}"
    folder.mkdir(parents=True)
    (folder / "model.safetensors").write_bytes(b"an earlier run's weights")
    write_progress(folder, Progress(global_step=step, run_id=run_id))
    write_manifest(folder, Progress(global_step=step, run_id=run_id))
    return folder


def test_a_resume_into_a_folder_with_another_runs_later_checkpoints_is_refused(small_data, tmp_path):
    """`latest` would continue the other run afterwards, and pruning would have counted its checkpoints."""
    out = tmp_path / "out"
    resumed = write_checkpoint(out, 1, "this")
    write_checkpoint(out, 9, "other")
    write_checkpoint(out, 10, "other")
    error = assert_refused("classify", [*classify_flags(small_data, "unused"), "--output_dir", str(out),
                                        "--resume_from_checkpoint", str(resumed), "--checkpoints_total_limit", "2"],
                           out, "--overwrite_output_dir")
    assert error.startswith(f"error: --output_dir {out} holds another run's checkpoints of later steps (step_9, "
                            f"step_10) than {resumed}")


def test_bad_input_with_overwrite_output_dir_removes_nothing(tmp_path):
    """A mistyped --train_file is found when the data is read, after the output folder's checks."""
    out = tmp_path / "out"
    write_checkpoint(out, 4, "earlier")
    (out / "config.json").write_text("{}")
    (out / "log_history.jsonl").write_text(json.dumps({"step": 4, "loss": 0.5}) + "\n")
    assert_refused("classify", ["--train_file", str(tmp_path / "trian.csv"), "--validation_file",
                                str(tmp_path / "trian.csv"), "--output_dir", str(out), "--overwrite_output_dir"],
                   out, "trian.csv: no such file")


def test_a_second_run_on_a_folder_a_living_run_holds_is_refused_and_a_killed_run_blocks_nothing(small_data, tiny_bert,
                                                                                                tmp_path):
    out = tmp_path / "out"
    flags = classify_flags(small_data, tiny_bert, "--per_device_train_batch_size", "4", "--num_train_epochs", "3",
                           "--checkpointing_steps", "1", "--output_dir", str(out))
    first = subprocess.Popen(python_cmd(*flags), cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wait_for((out / "checkpoints" / "step_1" / "manifest.json").exists, "step 1's checkpoint", first, interval=0.005)
    first.send_signal(signal.SIGSTOP)  # holding the folder, for as long as the second run takes
    # Even with --overwrite_output_dir, which would remove the first run's checkpoints.
    second = train_here("classify", *flags, "--overwrite_output_dir", check=False)
    first.kill()  # SIGKILL: the lock file stays behind, the kernel's lock does not
    first.wait()
    one_error_line(second.returncode, second.stderr,
                   f"--output_dir {out} is in use by another run (pid {first.pid} on ")
    assert (out / "checkpoints" / "step_1").is_dir(), "the refused run removed nothing"
    assert (out / ".finetune.lock").exists()

    train_here("classify", *flags, "--resume_from_checkpoint", "latest", "--checkpointing_steps", "epoch")
    assert not (out / ".finetune.lock").exists(), "the lock file goes when its run ends"


@pytest.mark.parametrize("checkpointing", [[], ["--checkpointing_steps", "1"]], ids=["final save", "checkpoint"])
def test_weights_an_update_made_non_finite_are_never_saved(small_data, tiny_bert, tmp_path, checkpointing):
    """At learning rate 1e39 (finite, but not in float32) step 1's loss and gradient are finite and its update makes
    every weight NaN: neither the checkpoint of that step nor the final model is written over the earlier model."""
    out = tmp_path / "out"
    out.mkdir()
    for name in ("config.json", "model.safetensors"):
        (out / name).write_text(f"the earlier run's {name}")
    before = snapshot(out)
    result = train_here("classify", *classify_flags(small_data, tiny_bert, "--learning_rate", "1e39",
                                                    "--max_train_steps", "1", "--overwrite_output_dir",
                                                    "--output_dir", str(out), *checkpointing), check=False)
    error = one_error_line(result.returncode, result.stderr)
    assert error.startswith("error: a weight was not finite after step 1, so nothing from that step on was saved")
    assert {name: digest for name, digest in snapshot(out).items() if name != "log_history.jsonl"} == before


def test_a_model_whose_evaluation_loss_is_not_finite_is_never_saved(small_data, tiny_bert, tmp_path, monkeypatch):
    """Finite weights with a non-finite evaluation loss (the evaluation made to report NaN here, in this process)
    stop the final save: the earlier model stays."""
    import finetune.evaluation

    evaluate = finetune.evaluation.Evaluation._evaluate

    def nan_loss(self):
        metrics, outputs = evaluate(self)
        return {**metrics, "eval_loss": float("nan")}, outputs

    monkeypatch.setattr(finetune.evaluation.Evaluation, "_evaluate", nan_loss)
    out = tmp_path / "out"
    out.mkdir()
    (out / "model.safetensors").write_text("the earlier run's model")
    before = snapshot(out)
    result = train_here("classify", *classify_flags(small_data, tiny_bert, "--max_train_steps", "2",
                                                    "--overwrite_output_dir", "--output_dir", str(out)), check=False)
    error = one_error_line(result.returncode, result.stderr)
    assert error.startswith("error: the evaluation loss was not finite after step 2, so nothing from that step on was "
                            "saved")
    assert {name: digest for name, digest in snapshot(out).items() if name != "log_history.jsonl"} == before


def test_a_resume_from_an_earlier_step_of_the_folder_s_own_run_is_refused(small_data, tmp_path):
    """The run went on to step_20: resuming step_5 into the same folder would leave step_15 and step_20 beside the
    new trajectory's checkpoints, and `latest` would continue the abandoned one."""
    out = tmp_path / "out"
    resumed = write_checkpoint(out, 5, "r")
    for step in (10, 15, 20):
        write_checkpoint(out, step, "r")
    error = assert_refused("classify", [*classify_flags(small_data, "unused"), "--output_dir", str(out),
                                        "--resume_from_checkpoint", str(resumed), "--max_train_steps", "10"], out)
    assert error == (
        f"error: --output_dir {out} holds checkpoints of its own run of later steps (step_10, step_15, step_20) than "
        f"{resumed}, which this run resumes from, and `latest` would continue the trajectory this resume abandons; "
        "pass --overwrite_output_dir to remove them once this run starts, or choose another --output_dir")


@pytest.mark.parametrize("where", ["in the folder", "a copy elsewhere"])
def test_overwrite_output_dir_removes_the_steps_a_resume_abandons(small_data, tiny_bert, tmp_path, where):
    from finetune.checkpointing.checkpoint import find_latest_checkpoint, read_progress

    out = tmp_path / "out"
    flags = classify_flags(small_data, tiny_bert, "--per_device_train_batch_size", "8", "--checkpointing_steps", "1",
                           "--output_dir", str(out))
    train_here("classify", *flags, "--max_train_steps", "4")
    start = out / "checkpoints" / "step_1"
    if where == "a copy elsewhere":
        start = Path(shutil.copytree(start, tmp_path / "copy" / "step_1"))
    first_run = read_progress(start).run_id
    train_here("classify", *flags, "--max_train_steps", "2", "--resume_from_checkpoint", str(start),
               "--overwrite_output_dir", "--checkpoints_total_limit", "1")
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step_2"]
    latest = find_latest_checkpoint(str(out))
    assert latest == out / "checkpoints" / "step_2" and read_progress(latest).run_id == first_run
    assert [h["step"] for h in log_history(out)] == [1, 2], "the abandoned steps' lines went too"


def test_latest_with_every_checkpoint_damaged_is_not_advised_latest(small_data, tmp_path):
    out = tmp_path / "out"
    for step in (4, 8):
        (write_checkpoint(out, step, "r") / "model.safetensors").write_bytes(b"damaged")
    before = snapshot(out)
    result = train_here("classify", *classify_flags(small_data, "unused"), "--output_dir", str(out),
                        "--resume_from_checkpoint", "latest", check=False)
    assert result.stderr.count("warning: skipping") == 2
    assert one_error_line(result.returncode, result.stderr) == (
        f"error: --output_dir {out} holds checkpoints (step_4, step_8) of which none verifies (see the warnings "
        "above), so --resume_from_checkpoint latest has none to continue from; pass --overwrite_output_dir to start "
        "afresh and remove them, or resume from a copy elsewhere with --resume_from_checkpoint PATH")
    assert snapshot(out) == before


@contextlib.contextmanager
def accelerate_given(scaler: torch.amp.GradScaler) -> Iterator[None]:
    """Accelerate with ``scaler`` (it makes one on a GPU only), autocasting and unscaling as on a GPU. Accelerate
    keeps one precision a process, so its state is reset around the block: this process's other runs train in
    float32."""
    import accelerate
    from accelerate.state import AcceleratorState

    init = accelerate.Accelerator.__init__

    def with_scaler(self, *args, **kwargs):
        init(self, *args, **kwargs)
        self.scaler, self.native_amp = scaler, True

    AcceleratorState._reset_state(reset_partial_state=True)
    try:
        with pytest.MonkeyPatch.context() as patched:
            patched.setattr(accelerate.Accelerator, "__init__", with_scaler)
            yield
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)


def test_an_fp16_step_the_loss_scaler_skips_neither_stops_the_run_nor_moves_the_schedule(small_data, tiny_bert,
                                                                                        tmp_path):
    """fp16 under Accelerate with a loss scale so large that the first step's gradients overflow: the scaler skips
    that update and lowers its scale, and the run goes on (before, the overflowed norm stopped it as non-finite).
    The skipped step logs no gradient norm and leaves the learning rate where it was, as transformers' Trainer
    does. Accelerate makes a scaler on a GPU only, so this one is given to it here."""
    out = tmp_path / "out"
    with accelerate_given(torch.amp.GradScaler("cpu", init_scale=2.0 ** 100, backoff_factor=2.0 ** -90)):
        train_here("classify", *classify_flags(small_data, tiny_bert, "--mixed_precision", "fp16",
                                               "--max_train_steps", "3", "--logging_steps", "1", "--learning_rate",
                                               "3e-3", "--output_dir", str(out)))
    logs = log_history(out)
    assert "grad_norm" not in logs[0] and all(math.isfinite(row["grad_norm"]) for row in logs[1:])
    assert [row["learning_rate"] for row in logs] == pytest.approx([3e-3, 2e-3, 1e-3])


def test_an_fp16_step_under_accelerate_s_fsdp_is_clipped_by_its_unscaled_gradients(monkeypatch):
    """Accelerate's FSDP2 with fp16 clips through the sharded clip, which must measure and clip the gradients the
    loss scaler has unscaled, as Accelerate's own clip does: on the scaled ones (2^10 times larger here) the norm
    is that much too large and every step clipped to almost nothing. One CPU process, the sharded path taken on an
    unsharded model; the scaler given to Accelerate, which makes one on a GPU only."""
    from datetime import timedelta

    from finetune.runtimes.accelerate import AccelerateRuntime

    with accelerate_given(torch.amp.GradScaler("cpu", init_scale=2.0 ** 10)):
        runtime = AccelerateRuntime(mixed_precision="fp16", gradient_accumulation_steps=1, seed=0,
                                    ddp_timeout=timedelta(minutes=1), project_dir=".", tracking=None)
        model = torch.nn.Linear(4, 3)
        optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
        model, optimizer = runtime.accelerator.prepare(model, optimizer)
        inputs = torch.arange(8.0).reshape(2, 4) / 8
        runtime.backward(model(inputs).square().sum())
        expected = torch.nn.utils.get_total_norm([p.grad / 2.0 ** 10 for p in model.parameters()])
        monkeypatch.setattr(AccelerateRuntime, "shards", True)
        norm = runtime.clip_grad_norm_(model, 1.0)
        clipped = torch.nn.utils.get_total_norm([p.grad for p in model.parameters()])
    assert 1.0 < expected < 100.0, expected  # (finite: nothing overflowed in fp16 under the scale)
    torch.testing.assert_close(norm, expected, rtol=1e-6, atol=0)
    torch.testing.assert_close(clipped, torch.tensor(1.0), rtol=1e-5, atol=0)
