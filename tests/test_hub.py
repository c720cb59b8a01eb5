"""Pushing to the Hub with the real huggingface_hub client against a Hub-compatible loopback server."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import (
    FAST_FLAGS,
    HUB_READ_ONLY_TOKEN,
    HUB_TOKEN,
    REPO,
    data_flags,
    max_weight_diff,
    one_error_line,
    python_cmd,
    read_results,
    read_weights,
    run,
    serving_hub,
    torchrun_cmd,
    wait_for,
)
from hub_server import Fault
from huggingface_hub import HfApi, constants

TOKEN, READ_ONLY_TOKEN = HUB_TOKEN, HUB_READ_ONLY_TOKEN


def push_flags(small_data, model, out, repo="alice/support-classifier", token=TOKEN, *extra) -> list[str]:
    """A classify run of 6 steps pushing to ``repo``; ``model`` None is the default model."""
    return [*data_flags(small_data), *FAST_FLAGS, "--per_device_train_batch_size", "8", "--num_train_epochs", "1",
            "--output_dir", str(out), *(["--model_name_or_path", str(model)] if model else []),
            "--push_to_hub", "--hub_model_id", repo, "--hub_token", token, *extra]


def assert_token_nowhere(folder: Path, *texts: str) -> None:
    for path in folder.rglob("*"):
        if path.is_file() and not path.is_symlink():
            assert TOKEN.encode() not in path.read_bytes(), f"the token is in {path}"
    for text in texts:
        assert TOKEN not in text


def plant_what_must_not_be_pushed(tmp_path: Path, out: Path) -> None:
    """An earlier run's merged model and the user's notes in ``out``; links to a --config file that holds the
    token and to a dataset, both outside it."""
    outside = tmp_path / "outside"
    (outside / "dataset").mkdir(parents=True)
    (outside / "dataset" / "train.csv").write_text("text,label\nsecret customer data,billing\n")
    (outside / "run.yaml").write_text(f"hub_token: {TOKEN}\n")
    (out / "merged").mkdir(parents=True)
    (out / "merged" / "model.safetensors").write_text("an earlier run's merged model")
    (out / "notes.txt").write_text("the user's notes")
    (out / "run.yaml").symlink_to(outside / "run.yaml")
    (out / "dataset").symlink_to(outside / "dataset")


@pytest.fixture(scope="module")
def every_save_run(small_data, tmp_path_factory):
    """The run both ``every_save`` tests read, made once: the default model (its card names its base model, and its
    training lasts long enough for a push to land mid-run) on 2 processes, global batch 2 x 4 = 8, 4 epochs of 6
    steps, checkpoints at steps 10 and 20, into a folder that holds what must not be pushed. Yields (hub, output
    folder, the finished run); the hub serves until the module's tests are done."""
    folder = tmp_path_factory.mktemp("every_save")
    out = folder / "out"
    plant_what_must_not_be_pushed(folder, out)
    args = push_flags(small_data, None, out, "alice/support-classifier", TOKEN, "--hub_strategy", "every_save",
                      "--checkpointing_steps", "10", "--num_train_epochs", "4", "--overwrite_output_dir")
    args[args.index("--per_device_train_batch_size") + 1] = "4"
    with serving_hub(folder / "hub-cache") as hub:
        result = run(torchrun_cmd(*args), env=hub.env)
        yield hub, out, result


@pytest.mark.multiprocess
@pytest.mark.slow
def test_every_save_pushes_each_checkpoint_and_then_only_what_the_run_saved_from_rank_0(every_save_run, small_data,
                                                                                      tmp_path):
    hub, out, result = every_save_run
    commits = hub.commits("alice/support-classifier")
    assert [c["summary"] for c in commits] == ["Training in progress, step 10", "Training in progress, step 20",
                                               "Final model, step 24"]
    results = read_results(out)
    assert (results["runtime"], results["world_size"]) == ("ddp", 2)
    assert [p["commit_id"] for p in results["hub_pushes"]] == [c["sha"] for c in commits]
    files = hub.files("alice/support-classifier")
    assert sorted(files) == ["README.md", "all_results.json", "config.json", "eval_predictions.jsonl",
                             "model.safetensors", "tokenizer.json", "tokenizer_config.json"]
    assert (out / "merged" / "model.safetensors").is_file() and (out / "notes.txt").is_file(), "nothing else went"
    card = files["README.md"].decode()
    assert "base_model: sentence-transformers/all-MiniLM-L6-v2" in card and "eval_accuracy" in card
    assert "from_pretrained" in card or "pipeline(" in card
    assert_token_nowhere(out, result.stdout, result.stderr)

    # Loaded through the same endpoint, the pushed model predicts what the local folder predicts.
    compare = """
import json, sys, torch
from transformers import AutoModelForSequenceClassification, AutoTokenizer
texts = [json.loads(line)["text"] for line in open(sys.argv[1])]
def predict(name):
    model, tokenizer = AutoModelForSequenceClassification.from_pretrained(name), AutoTokenizer.from_pretrained(name)
    with torch.no_grad():
        return model(**tokenizer(texts, padding=True, truncation=True, max_length=48, return_tensors="pt")).logits
print(json.dumps({"same": torch.equal(predict("alice/support-classifier"), predict(sys.argv[2]))}))
"""
    texts = tmp_path / "texts.jsonl"
    import csv

    with open(small_data["validation"], encoding="utf-8") as f:
        texts.write_text("".join(json.dumps({"text": row["text"]}) + "\n" for row in csv.DictReader(f)))
    checked = run([sys.executable, "-c", compare, str(texts), str(out)], env=hub.env)
    assert json.loads(checked.stdout.strip().splitlines()[-1]) == {"same": True}


@pytest.mark.slow
def test_checkpoint_strategy_resumes_from_the_hub_to_the_uninterrupted_weights(hub, small_data, tiny_bert, tmp_path):
    out = tmp_path / "out"
    # 6 steps per epoch, 2 epochs; the only checkpoint, at step 8, is mid-way through the second epoch.
    args = push_flags(small_data, tiny_bert, out, "alice/resumable", TOKEN, "--hub_strategy", "checkpoint",
                      "--checkpointing_steps", "8", "--num_train_epochs", "2", "--hub_revision", "experiment")
    run(python_cmd(*args), env=hub.env)
    assert {c["branch"] for c in hub.commits("alice/resumable")} == {"experiment"}
    files = hub.files("alice/resumable", branch="experiment")
    assert json.loads(files["last-checkpoint/progress.json"])["global_step"] == 8
    uninterrupted = tmp_path / "uninterrupted"
    shutil.copytree(out, uninterrupted)
    shutil.rmtree(out)

    resumed = run(python_cmd(*args, "--resume_from_checkpoint", "hub:alice/resumable"), env=hub.env)
    assert "resumed from" in resumed.stdout
    assert max_weight_diff(uninterrupted, out) == 0.0


@pytest.mark.multiprocess
@pytest.mark.slow
def test_pushes_land_while_training_keeps_every_core_busy(every_save_run):
    """2 processes on the 2 cores, checkpoints at steps 10 and 20 of 24: the first lands before the end."""
    hub, out, result = every_save_run
    commits = {c["summary"]: c["time"] for c in hub.commits("alice/support-classifier")}
    assert list(commits) == ["Training in progress, step 10", "Training in progress, step 20", "Final model, step 24"]
    assert commits["Training in progress, step 10"] < (out / "model.safetensors").stat().st_mtime
    # Each push's delay is from its files being complete (a checkpoint's manifest is written last) to its commit.
    saved = [(out / "checkpoints" / f"step_{step}" / "manifest.json").stat().st_mtime for step in (10, 20)]
    saved.append((out / "model.safetensors").stat().st_mtime)
    pushes = read_results(out)["hub_pushes"]
    for push, saved_at, committed_at in zip(pushes, saved, commits.values(), strict=True):
        assert push["seconds_after_save"] == pytest.approx(committed_at - saved_at, abs=0.5), push
    assert "s after the files were saved" in result.stdout


@pytest.mark.slow
def test_failed_pushes_are_retried_then_reported_and_training_completes(hub, small_data, tiny_bert, tmp_path):
    out = tmp_path / "out"
    # The first push meets a 500, another 500 and a dropped connection: all three attempts fail.
    hub.faults = [Fault("/commit/", "500", times=2), Fault("/commit/", "drop", times=1)]
    result = run(python_cmd(*push_flags(small_data, tiny_bert, out, "alice/flaky", TOKEN, "--checkpointing_steps", "3",
                                        "--with_tracking", "--report_to", "tensorboard")), env=hub.env)

    pushes = read_results(out)["hub_pushes"]
    assert "error" in pushes[0] and all("commit_id" in p for p in pushes[1:])
    assert [c["summary"] for c in hub.commits("alice/flaky")] == ["Training in progress, step 6",
                                                                  "Final model, step 6"]
    assert "push it with `hf upload alice/flaky" in result.stderr
    assert not list((out / ".hub_staging").iterdir()), "the failed copy went once a later push was done"
    assert "failed after 3 attempt(s)" in result.stderr
    # 3 attempts for the first push, then one each for the checkpoint at step 6 and the final model.
    assert sum(1 for method, path, _ in hub.requests if "/commit/" in path) == 5
    assert read_weights(out) and (out / "checkpoints" / "step_3" / "model.safetensors").is_file()
    assert list((out / "runs").rglob("events.out.tfevents.*")), "tracker output exists and holds no token"
    assert not any(name.startswith("runs/") for name in hub.files("alice/flaky"))
    assert_token_nowhere(out, result.stdout, result.stderr)


@pytest.mark.slow
def test_a_revoked_token_mid_run_is_not_retried_and_training_completes(hub, small_data, tiny_bert, tmp_path):
    out = tmp_path / "out"
    hub.faults = [Fault("/commit/", "401", times=100)]
    result = run(python_cmd(*push_flags(small_data, tiny_bert, out, "alice/revoked", TOKEN, "--hub_strategy", "end")),
                 env=hub.env)
    assert result.returncode == 0
    pushes = read_results(out)["hub_pushes"]
    assert len(pushes) == 1 and "401 Unauthorized" in pushes[0]["error"]
    assert sum(1 for method, path, _ in hub.requests if "/commit/" in path) == 1
    assert_token_nowhere(out, result.stdout, result.stderr)


@pytest.mark.slow
def test_a_stalled_hub_never_holds_training_and_hub_strict_fails_the_run(hub, small_data, tiny_bert, tmp_path):
    out = tmp_path / "out"
    stall = 60
    hub.faults = [Fault("/commit/", "stall", times=100, seconds=stall)]
    start = time.monotonic()
    result = run(python_cmd(*push_flags(small_data, tiny_bert, out, "alice/stalled", TOKEN, "--checkpointing_steps",
                                        "2", "--hub_timeout", "3", "--hub_strict")), env=hub.env, check=False)
    assert time.monotonic() - start < stall, "neither training nor the exit waited for the stalled uploads"
    results = read_results(out)
    assert results["train_runtime"] < stall / 2
    pushes = results["hub_pushes"]
    assert any("still uploading after --hub_timeout 3s" in p["error"] for p in pushes), pushes
    one_error_line(result.returncode, result.stderr, "Hub pushes failed and --hub_strict is set")
    assert (out / "model.safetensors").is_file()
    assert_token_nowhere(out, result.stdout, result.stderr)


@pytest.mark.parametrize(("token", "reason"), [("hf_wrongToken000", "401 Unauthorized"),
                                               pytest.param(READ_ONLY_TOKEN, "403 Forbidden", marks=pytest.mark.slow)])
def test_a_bad_token_fails_within_seconds_before_training(hub, small_data, tiny_bert, tmp_path, token, reason):
    out = tmp_path / "out"
    start = time.monotonic()
    result = run(python_cmd(*push_flags(small_data, tiny_bert, out, "alice/denied", token)), env=hub.env, check=False)
    line = one_error_line(result.returncode, result.stderr, reason)
    assert line.startswith("error: cannot create the Hub repository alice/denied")
    assert token not in result.stderr + result.stdout
    assert not out.exists(), "nothing was trained or written"
    assert time.monotonic() - start < 60


def test_the_uploader_process_commits_in_order_at_low_priority_and_ends_with_its_input(hub, tmp_path, monkeypatch):
    """The upload process on its own: JSON jobs in, one outcome per job out, niced, done at end of input."""
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)  # conftest turned this process offline
    HfApi(endpoint=hub.url, token=TOKEN).create_repo("alice/uploads")
    for name in ("a.txt", "b.txt"):
        (tmp_path / name).write_text(name)
    stage = tmp_path / ".hub_staging" / "step_3"
    stage.mkdir(parents=True)
    older = tmp_path / ".hub_staging" / "step_2"  # a failed push's copy, superseded by this one
    older.mkdir()
    uploader = subprocess.Popen([sys.executable, "finetune/hub/uploader.py", "alice/uploads", "60"], text=True,
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                env={**os.environ, **hub.env, "HF_TOKEN": TOKEN})
    jobs = [{"push": 1, "message": "first", "files": [["a.txt", str(tmp_path / "a.txt")]], "stage": str(stage),
             "saved_at": time.time()},
            {"push": 2, "message": "second", "files": [["b.txt", str(tmp_path / "b.txt")]], "stage": None,
             "saved_at": time.time()}]
    uploader.stdin.write(json.dumps(jobs[0]) + "\n")
    uploader.stdin.flush()
    first = json.loads(uploader.stdout.readline())
    # A low share of the CPU, but a real one: at idle priority uploads starve while training keeps every core busy.
    assert os.getpriority(os.PRIO_PROCESS, uploader.pid) == 10
    assert os.sched_getscheduler(uploader.pid) == os.SCHED_OTHER
    assert 0 <= first["seconds_after_save"] < 30
    uploader.stdin.write(json.dumps(jobs[1]) + "\n")
    uploader.stdin.close()
    second = json.loads(uploader.stdout.readline())
    assert uploader.wait(timeout=30) == 0

    commits = hub.commits("alice/uploads")
    assert [c["summary"] for c in commits][-2:] == ["first", "second"]
    assert [first["commit_id"], second["commit_id"]] == [c["sha"] for c in commits][-2:]
    assert hub.files("alice/uploads")["b.txt"] == b"b.txt"
    assert not stage.exists() and not older.exists(), "a pushed staging copy and older ones are removed"


@pytest.mark.parametrize("spelling", [["--hub_token", TOKEN], [f"--hub_token={TOKEN}"], [f"--hub-token={TOKEN}"],
                                      ["--hub-token", TOKEN], ["--hub_tok", TOKEN], [f"--hub_tok={TOKEN}"]])
def test_the_model_card_never_shows_the_token_however_the_flag_was_written(spelling):
    from finetune.hub.pusher import model_card
    from finetune.task import ModelCardInfo

    card = model_card(base_model=None, task=ModelCardInfo("text-classification", "text classification", "use it",
                                                          "base/model"),
                      recipe="classify", repo_id="alice/x", title="x", data_source="data", results={},
                      hyper_parameters={}, command=["recipes/classify.py", *spelling, "--seed", "1"], token=TOKEN)
    assert TOKEN not in str(card) and "***" in str(card)


def test_hidden_files_symbolic_links_and_what_they_lead_to_are_never_pushed(tmp_path):
    from finetune.hub.pusher import _files

    folder, outside = tmp_path / "checkpoint", tmp_path / "outside"
    for name in ("checkpoint/model.safetensors", "checkpoint/sub/config.json", "checkpoint/.env",
                 "checkpoint/.git/config", "checkpoint/sub/.secret", "outside/data/train.csv", "outside/run.yaml"):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text("x")
    (folder / "run.yaml").symlink_to(outside / "run.yaml")  # a --config file that holds the token
    (folder / "data").symlink_to(outside / "data")  # a linked dataset
    assert _files(folder) == ["model.safetensors", "sub/config.json"]


@pytest.mark.multiprocess
@pytest.mark.slow
def test_a_sigterm_to_torchrun_stops_the_run_and_the_stop_checkpoint_still_reaches_the_hub(hub, small_data, tiny_bert,
                                                                                         tmp_path):
    """torchrun passes the SIGTERM to its worker's whole process group: the uploader is in a session of its own."""
    out = tmp_path / "out"
    args = push_flags(small_data, tiny_bert, out, "alice/stopped", TOKEN, "--per_device_train_batch_size", "4",
                      "--num_train_epochs", "20")
    job = subprocess.Popen(torchrun_cmd(*args, nproc=1), cwd=REPO, stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT, text=True, env={**os.environ, **hub.env})
    lines = []
    for line in job.stdout:
        lines.append(line)
        if line.startswith("training classify on"):
            job.send_signal(signal.SIGTERM)
            break
    output = "".join(lines) + job.communicate(timeout=120)[0]
    step = int(re.search(r"stopped by SIGTERM at step (\d+)", output).group(1))
    assert [c["summary"] for c in hub.commits("alice/stopped")] == [f"Training in progress, step {step}"], output
    # Reported by the run, or, if it ran out of its time after the signal first, by the uploader it left behind.
    assert re.search(rf"hub push 1 \(Training in progress, step {step}\) to alice/stopped(, after the run ended)?: "
                     "commit", output), output[-3000:]
    assert not list((out / ".hub_staging").iterdir()), "the pushed staging copy is gone"
    assert hub.files("alice/stopped")["model.safetensors"] == (
        out / "checkpoints" / f"step_{step}" / "model.safetensors").read_bytes()


class Saves:
    """Stands for a model config or tokenizer: ``save_pretrained`` writes one small file."""

    def __init__(self, name: str):
        self.name = name

    def save_pretrained(self, folder) -> None:
        (Path(folder) / self.name).write_text("{}")


class WholeModel:
    """Stands for a model without LoRA: its config saves as ``config.json``."""

    config = Saves("config.json")


def test_the_uploader_leads_its_own_low_priority_session_and_a_dead_one_is_reported_once(hub, tmp_path, capfd,
                                                                                        monkeypatch):
    from finetune.hub.pusher import HubPusher

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "ENDPOINT", hub.url)
    for name, value in hub.env.items():
        monkeypatch.setenv(name, value)
    pusher = HubPusher(enabled=True, output_dir=str(tmp_path), repo_id="alice/dead", token=TOKEN, private=False,
                       revision=None, strategy="every_save", timeout=30)
    # In a session of its own, it is a scheduling group of its own, which it puts at nice 10 as well: else it
    # would share the CPU with training's session as an equal.
    autogroup = Path(f"/proc/{pusher._uploader.pid}/autogroup")
    wait_for(lambda: autogroup.read_text().strip().endswith("nice 10"), "the uploader at nice 10", timeout=30)
    assert os.getsid(pusher._uploader.pid) == pusher._uploader.pid
    os.kill(pusher._uploader.pid, signal.SIGSTOP)  # holds the first push while its staging copy is looked at
    for step in (1, 2, 3):
        folder = tmp_path / "checkpoints" / f"step_{step}"
        folder.mkdir(parents=True)
        for name in ("model.safetensors", "optimizer.bin", "progress.json"):
            (folder / name).write_text(f"{name} {step}")
        pusher.push_checkpoint(folder, step, WholeModel(), Saves("tokenizer.json"))
        if step == 1:
            staged = tmp_path / ".hub_staging" / "step_1"
            assert sorted(p.name for p in staged.iterdir()) == ["config.json", "model.safetensors", "tokenizer.json"]
            os.kill(pusher._uploader.pid, signal.SIGKILL)
            pusher._uploader.wait()
    assert sorted(p.name for p in (tmp_path / ".hub_staging").iterdir()) == ["step_1"]
    assert capfd.readouterr().err.count("warning: the Hub uploader stopped (exit status -9)") == 1
    pushes = pusher.finish()
    assert [("error" in p, p.get("message")) for p in pushes] == [
        (True, f"Training in progress, step {step}") for step in (1, 2, 3)]


def test_a_sharded_checkpoint_goes_whole_to_last_checkpoint_and_resumes_from_there(hub, tmp_path, capfd,
                                                                                   monkeypatch):
    """An FSDP checkpoint holds shards and torch.distributed.checkpoint's hidden .metadata, no model that loads:
    every_save pushes nothing of it (saying so once), checkpoint pushes all of it, and what comes back verifies."""
    from finetune.checkpointing.checkpoint import Progress, write_manifest
    from finetune.hub.pusher import HubPusher

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "ENDPOINT", hub.url)
    for name, value in hub.env.items():
        monkeypatch.setenv(name, value)
    for step in (2, 4):
        folder = tmp_path / "out" / "checkpoints" / f"step_{step}"
        for name in ("pytorch_model_fsdp_0/.metadata", "pytorch_model_fsdp_0/__0_0.distcp",
                     "pytorch_model_fsdp_0/__1_0.distcp", "optimizer_0/.metadata", "optimizer_0/__0_0.distcp",
                     "scheduler.bin", "random_states_0.pkl", "progress.json"):
            (folder / name).parent.mkdir(parents=True, exist_ok=True)
            (folder / name).write_bytes(f"{name} of step {step}".encode())
        write_manifest(folder, Progress(global_step=step))
    for strategy in ("every_save", "checkpoint"):
        pusher = HubPusher(enabled=True, output_dir=str(tmp_path / "out"), repo_id=f"alice/sharded-{strategy}",
                           token=TOKEN, private=False, revision=None, strategy=strategy, timeout=30)
        for step in (2, 4):
            pusher.push_checkpoint(tmp_path / "out" / "checkpoints" / f"step_{step}", step, WholeModel(),
                                   Saves("tokenizer.json"))
        assert not [push for push in pusher.finish() if "error" in push]
    assert capfd.readouterr().err.count("note: sharded (FSDP) checkpoints hold no model that loads") == 1
    assert not hub.files("alice/sharded-every_save")
    pushed, folder = hub.files("alice/sharded-checkpoint"), tmp_path / "out" / "checkpoints" / "step_4"
    assert sorted(pushed) == sorted(f"last-checkpoint/{p.relative_to(folder).as_posix()}"
                                    for p in folder.rglob("*") if p.is_file())
    # As a resume fetches it (--resume_from_checkpoint hub:...), in a process of its own.
    fetch = ("import sys; from finetune.checkpointing.checkpoint import verify_checkpoint; "
             "from finetune.hub.pusher import download_last_checkpoint as fetch; "
             "folder = fetch(sys.argv[1], None, sys.argv[2]); "
             "verify_checkpoint(folder); print(folder)")
    downloaded = Path(run([sys.executable, "-c", fetch, "hub:alice/sharded-checkpoint", TOKEN], env=hub.env)
                      .stdout.strip())
    assert (downloaded / "pytorch_model_fsdp_0" / ".metadata").read_bytes() == (
        folder / "pytorch_model_fsdp_0" / ".metadata").read_bytes()


def test_a_queued_checkpoint_push_is_skipped_for_a_newer_one(hub, tmp_path, monkeypatch):
    """While the first push stalls, three more are queued: the step-2 checkpoint's gives way to step 3's."""
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    HfApi(endpoint=hub.url, token=TOKEN).create_repo("alice/lagging")
    hub.faults = [Fault("/commit/", "stall", times=1, seconds=2)]
    jobs = []
    for push, stage in enumerate(("step_1", "step_2", "step_3", None), start=1):
        (tmp_path / f"{push}.txt").write_text(str(push))
        if stage:
            (tmp_path / ".hub_staging" / stage).mkdir(parents=True)
        jobs.append({"push": push, "message": f"push {push}", "files": [[f"{push}.txt", str(tmp_path / f"{push}.txt")]],
                     "stage": str(tmp_path / ".hub_staging" / stage) if stage else None, "saved_at": time.time()})
    uploader = subprocess.Popen([sys.executable, "finetune/hub/uploader.py", "alice/lagging", "60"], text=True,
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                env={**os.environ, **hub.env, "HF_TOKEN": TOKEN})
    uploader.stdin.write(json.dumps(jobs[0]) + "\n")
    uploader.stdin.flush()
    wait_for(lambda: any("/commit/" in path for _, path, _ in hub.requests), "the first push", timeout=30)
    stdout, _ = uploader.communicate("".join(json.dumps(job) + "\n" for job in jobs[1:]), timeout=60)
    outcomes = [json.loads(line) for line in stdout.splitlines()]
    assert [o.get("superseded_by") for o in outcomes] == [None, 3, None, None]
    assert all("commit_id" in o for o in outcomes if o["push"] != 2)
    assert [c["summary"] for c in hub.commits("alice/lagging")][-3:] == ["push 1", "push 3", "push 4"]
    assert not (tmp_path / ".hub_staging" / "step_2").exists()


def test_queuing_pushes_never_waits_for_an_uploader_that_stopped_reading(hub, tmp_path):
    """200 push jobs of 100 kB each, far more than a pipe holds, queued while the uploader is stopped."""
    script = """
import os, signal, sys, time
from finetune.hub.pusher import HubPusher
pusher = HubPusher(enabled=True, output_dir=sys.argv[1], repo_id="alice/stopped", token=sys.argv[2], private=False,
                   revision=None, strategy="every_save", timeout=5)
os.kill(pusher._uploader.pid, signal.SIGSTOP)
start = time.monotonic()
for step in range(200):
    pusher._submit([["x" * 100, "y" * 1000]] * 100, f"push {step}")
print(f"queued in {time.monotonic() - start:.3f} s", flush=True)
os.kill(pusher._uploader.pid, signal.SIGKILL)
print(len([s for s in pusher.finish() if "error" in s]), "unfinished", flush=True)
"""
    result = run([sys.executable, "-c", script, str(tmp_path), TOKEN], env=hub.env)
    seconds = float(result.stdout.split("queued in ")[1].split(" s")[0])
    assert seconds < 2, result.stdout
    assert "200 unfinished" in result.stdout


def test_a_checkpoint_push_deletes_what_the_last_checkpoint_held_and_its_own_does_not(hub, tmp_path, monkeypatch):
    """A 2-process run pushes last-checkpoint/ with two processes' RNG states, a 1-process resume pushes its own
    with one: in the same commit, the other goes, so the checkpoint that comes back verifies."""
    from finetune.checkpointing.checkpoint import Progress, write_manifest
    from finetune.hub.pusher import HubPusher

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "ENDPOINT", hub.url)
    for name, value in hub.env.items():
        monkeypatch.setenv(name, value)
    for step, ranks in ((4, 2), (8, 1)):
        folder = tmp_path / "out" / "checkpoints" / f"step_{step}"
        for name in ("model.safetensors", "optimizer.bin", "progress.json",
                     *(f"random_states_{rank}.pkl" for rank in range(ranks))):
            (folder / name).parent.mkdir(parents=True, exist_ok=True)
            (folder / name).write_bytes(f"{name} of step {step}".encode())
        write_manifest(folder, Progress(global_step=step, world_size=ranks))
        pusher = HubPusher(enabled=True, output_dir=str(tmp_path / "out"), repo_id="alice/resumed", token=TOKEN,
                           private=False, revision=None, strategy="checkpoint", timeout=30)
        pusher.push_checkpoint(folder, step, WholeModel(), Saves("tokenizer.json"))
        assert not [push for push in pusher.finish() if "error" in push]
    assert [c["summary"] for c in hub.commits("alice/resumed")] == ["Training in progress, step 4",
                                                                    "Training in progress, step 8"]
    files = hub.files("alice/resumed")
    assert sorted(files) == ["config.json", "last-checkpoint/manifest.json", "last-checkpoint/model.safetensors",
                             "last-checkpoint/optimizer.bin", "last-checkpoint/progress.json",
                             "last-checkpoint/random_states_0.pkl", "model.safetensors", "tokenizer.json"]
    fetch = ("import sys; from finetune.checkpointing.checkpoint import verify_checkpoint; "
             "from finetune.hub.pusher import download_last_checkpoint as fetch; "
             "verify_checkpoint(fetch(sys.argv[1], None, sys.argv[2]))")
    run([sys.executable, "-c", fetch, "hub:alice/resumed", TOKEN], env=hub.env)


def test_the_final_push_sends_the_files_as_saved_even_if_a_later_run_replaces_them(hub, tmp_path, monkeypatch):
    """A push left to the uploader after a stop outlives its run and the lock on the folder; a later run there
    then swaps in its own model (a rename, as the final save does) while the push waits for the Hub."""
    from finetune.hub.pusher import HubPusher

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "ENDPOINT", hub.url)
    for name, value in hub.env.items():
        monkeypatch.setenv(name, value)
    out = tmp_path / "out"
    out.mkdir()
    for name in ("model.safetensors", "config.json"):
        (out / name).write_text(f"this run's {name}")
    pusher = HubPusher(enabled=True, output_dir=str(out), repo_id="alice/outlived", token=TOKEN, private=False,
                       revision=None, strategy="end", timeout=30)
    os.kill(pusher._uploader.pid, signal.SIGSTOP)
    pusher.push_final(str(out), ["config.json", "model.safetensors"], 5)
    for name in ("model.safetensors", "config.json"):
        (out / f"{name}.new").write_text(f"the next run's {name}")
        (out / f"{name}.new").replace(out / name)
    os.kill(pusher._uploader.pid, signal.SIGCONT)
    assert not [push for push in pusher.finish() if "error" in push]
    assert hub.files("alice/outlived") == {"config.json": b"this run's config.json",
                                           "model.safetensors": b"this run's model.safetensors"}
    assert not list((out / ".hub_staging").iterdir()), "the pushed copy is gone"


def test_all_results_is_replaced_never_rewritten_so_a_staged_push_keeps_what_it_linked(tmp_path):
    """The final push stages hard links of the saved files; the pushes' outcomes are added to all_results.json
    while a push left to the uploader after a stop may still read its link."""
    from finetune.loop import _write_json

    results = tmp_path / "all_results.json"
    _write_json(results, {"global_step": 5})
    os.link(results, tmp_path / "staged.json")
    _write_json(results, {"global_step": 5, "hub_pushes": [{"push": 1}]})
    assert json.loads((tmp_path / "staged.json").read_text()) == {"global_step": 5}
    assert json.loads(results.read_text())["hub_pushes"] == [{"push": 1}]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["all_results.json", "staged.json"]
