"""Stopping on a scheduler's signal: the step is saved, the exit says "stopped", and the same command resumes."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time

import pytest
from helpers import (
    REPO,
    classify_flags,
    free_port,
    launch_cmd,
    max_weight_diff,
    parity_flags,
    python_cmd,
    read_results,
    recipe_path,
    run,
    start_and_signal,
    stopped_step,
    train_here,
    wait_for,
    write_csv,
)

from finetune.checkpointing.checkpoint import find_latest_checkpoint, verify_checkpoint
from finetune.errors import STOPPED_EXIT_CODE


@pytest.mark.multiprocess
@pytest.mark.slow
# Each launcher once, each way a signal arrives once; tests/test_slurm.py signals every process under torchrun.
@pytest.mark.parametrize(("launcher", "sig", "target"), [
    pytest.param(launcher, sig, target, id=f"{launcher}-{sig.name}-to-{target}")
    for launcher, sig, target in (("torchrun", signal.SIGUSR1, "worker"), ("accelerate", signal.SIGTERM, "launcher"))])
def test_a_stop_signal_saves_that_step_and_the_same_command_resumes_to_the_same_weights(
        parity_runs, small_data, tiny_bert, tiny_bert_without_dropout, tmp_path, launcher, sig, target):
    """Every rank learns of the signal at the next optimizer step (a worker's own signal through a collective),
    saves it as a checkpoint (also between --checkpointing_steps), and exits. Under Accelerate dropout is on:
    a rank whose RNG state was not restored (Accelerate skips one it cannot load) would draw other masks."""
    out = tmp_path / "out"
    dropout = launcher == "accelerate"
    model = tiny_bert if dropout else tiny_bert_without_dropout
    flags = [*parity_flags(small_data, model, 4), "--output_dir", str(out)]
    _, output = start_and_signal(launch_cmd(launcher, *flags), sig, target)
    step = stopped_step(output, sig)
    assert 1 <= step < 9, output[-3000:]
    latest = find_latest_checkpoint(str(out))
    assert latest.name == f"step_{step}", "the stop saved the step it stopped at"
    verify_checkpoint(latest)
    assert not (out / "model.safetensors").exists(), "a stopped run saves a checkpoint, not a final model"

    resumed = run(launch_cmd(launcher, *flags, "--resume_from_checkpoint", "latest"))
    assert f"resumed from {latest} at step {step}" in resumed.stdout
    assert read_results(out)["global_step"] == 9
    assert max_weight_diff(parity_runs(launcher, 2, 4, dropout=dropout), out) <= 1e-6


@pytest.mark.multiprocess
@pytest.mark.slow
def test_a_stop_under_finetune_torchrun_exits_with_the_stopped_status_and_no_launcher_report(
        small_data, tiny_bert_without_dropout, tmp_path):
    """Plain torchrun ends a stop with a traceback of its agent and status 1: a batch script would read it as a
    failure."""
    flags = [*parity_flags(small_data, tiny_bert_without_dropout, 4), "--output_dir", str(tmp_path / "out")]
    command = [sys.executable, "-m", "finetune.cli", "torchrun", "--nproc_per_node", "2", "--master_port",
               str(free_port()), recipe_path(), *flags]
    status, output = start_and_signal(command, signal.SIGTERM, "launcher")
    assert status == STOPPED_EXIT_CODE, output[-3000:]
    step = stopped_step(output, signal.SIGTERM)
    assert find_latest_checkpoint(str(tmp_path / "out")).name == f"step_{step}"
    assert "Traceback" not in output and "ChildFailedError" not in output, output[-3000:]


def test_a_stop_during_the_final_evaluation_saves_the_last_step_without_waiting_for_the_evaluation(
        small_data, tiny_bert, tmp_path):
    """The stop is checked before every evaluation batch: 600 evaluation examples one at a time take seconds,
    and a slow evaluation (generation) could outlast the time a scheduler gives before SIGKILL."""
    from finetune.data.embedded.support_tickets import LABEL_NAMES, make_support_tickets

    validation = write_csv(tmp_path / "validation.csv", [{"text": r["text"], "label": LABEL_NAMES[r["label"]]}
                                                         for r in make_support_tickets()["validation"]])
    out = tmp_path / "out"
    job = subprocess.Popen(python_cmd("--train_file", str(small_data["train"]), "--validation_file", str(validation),
                                      "--model_name_or_path", str(tiny_bert), "--max_seq_length", "48",
                                      "--per_device_eval_batch_size", "1", "--max_train_steps", "2",
                                      "--logging_steps", "1", "--output_dir", str(out)),
                           cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    history = out / "log_history.jsonl"
    # the last step, then its evaluation
    wait_for(lambda: history.exists() and '"step": 2' in history.read_text(), "step 2", job, interval=0.002)
    job.send_signal(signal.SIGTERM)
    output = job.communicate(timeout=300)[0]
    assert job.returncode == STOPPED_EXIT_CODE, output[-3000:]
    assert stopped_step(output, signal.SIGTERM) == 2 and "epoch 0: eval_accuracy" not in output
    assert find_latest_checkpoint(str(out)).name == "step_2"
    assert not (out / "model.safetensors").exists(), "the final save did not start"


def test_a_single_process_stopped_by_ctrl_c_exits_with_the_stopped_status(small_data, tiny_bert, tmp_path):
    out = tmp_path / "out"
    flags = classify_flags(small_data, tiny_bert, "--per_device_train_batch_size", "4", "--output_dir", str(out))
    status, output = start_and_signal(python_cmd(*flags), signal.SIGINT, "launcher")
    assert status == STOPPED_EXIT_CODE, output[-3000:]
    step = stopped_step(output, signal.SIGINT)
    assert find_latest_checkpoint(str(out)).name == f"step_{step}"
    assert "Traceback" not in output
    resumed = train_here("classify", *flags, "--resume_from_checkpoint", "latest")
    assert f"at step {step}" in resumed.stdout and read_results(out)["global_step"] == 22


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.parametrize("launcher", ["accelerate", "torchrun"])
def test_every_process_resumes_from_the_checkpoint_the_main_process_found(tmp_path, launcher):
    from finetune.checkpointing.checkpoint import Progress, write_progress

    for step in (4, 8):
        folder = tmp_path / "checkpoints" / f"step_{step}"
        folder.mkdir(parents=True)
        write_progress(folder, Progress(global_step=step, world_size=2, runtime=launcher, seed=42))
    run(launch_cmd(launcher, str(tmp_path), script="tests/scripts/choose_checkpoint.py"))
    chosen = [json.loads((tmp_path / f"chosen_{rank}.json").read_text()) for rank in (0, 1)]
    assert chosen == [str(tmp_path / "checkpoints" / "step_4")] * 2


def test_a_stop_passed_on_twice_is_one_stop_and_a_second_ctrl_c_later_stops_at_once():
    """Slurm and torchrun both pass SIGUSR1 on, a terminal and torchrun both pass Ctrl-C: the worker sees a stop
    signal twice within milliseconds and must still save. A person pressing Ctrl-C again means now."""
    import os

    from finetune.checkpointing.preemption import SECOND_CTRL_C_AFTER, StopSignals

    before = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)}
    with StopSignals() as stop:
        for sig in (signal.SIGUSR1, signal.SIGUSR1, signal.SIGTERM, signal.SIGINT):
            os.kill(os.getpid(), sig)
        time.sleep(0.05)
        assert stop.number == signal.SIGUSR1 and stop.at <= time.time()
    assert {sig: signal.getsignal(sig) for sig in before} == before, "the previous handlers are back"

    script = ("import os, signal, time\nfrom finetune.checkpointing.preemption import StopSignals\n"
              "with StopSignals():\n"
              "    os.kill(os.getpid(), signal.SIGINT)\n"
              f"    time.sleep({SECOND_CTRL_C_AFTER + 0.2})\n"
              "    os.kill(os.getpid(), signal.SIGINT)\n    time.sleep(5)\nprint('survived')")
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert result.returncode == -signal.SIGINT and "survived" not in result.stdout
