"""Experiment tracking with the real components under both launchers: an MLflow server on localhost (SQLite
store), W&B offline (no account), TensorBoard event files read with TensorBoard's own reader.

Two 2-process runs of the same flags serve most tests: one under ``accelerate launch``, one under torchrun that
is stopped with SIGTERM and resumed. Each must hold the same series in every tracker, and the torchrun one must
be one run in each, its steps neither missing nor repeated.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import re
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pytest
from helpers import (
    HUB_TOKEN,
    REPO,
    accelerate_cmd,
    classify_flags,
    free_port,
    log_history,
    one_error_line,
    python_cmd,
    read_results,
    run,
    suspended,
    tensorboard_scalars,
    torchrun_cmd,
    wait_for,
)

from finetune.config import parse_config
from finetune.errors import UserError
from finetune.observability.trackers import RUN_FILE, RUN_ID_TAG, Trackers, TrackerSettings

TRACKED = ["--report_to", "tensorboard,mlflow,wandb", "--hub_token", HUB_TOKEN]
STEPS = 12  # 42 examples in global batches of 8: 6 steps an epoch, 2 epochs
INTERVAL_KEYS = {"loss", "learning_rate", "grad_norm", "samples_per_second", "epoch"}
FINAL_KEYS = {"train_loss", "train_runtime", "train_samples_per_second", "train_tokens_per_second",
              "padding_efficiency"}


class MLflowServer:
    """``mlflow server`` on a free localhost port, its runs in SQLite and its artifacts under ``folder``."""

    def __init__(self, folder: Path):
        self.folder = folder
        self.url = f"http://127.0.0.1:{free_port()}"
        self.process: subprocess.Popen

    def start(self) -> None:
        port = self.url.rsplit(":", 1)[1]
        with open(self.folder / "server.log", "ab") as log:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "mlflow", "server", "--host", "127.0.0.1", "--port", port, "--workers", "1",
                 "--backend-store-uri", f"sqlite:///{self.folder / 'mlflow.db'}",
                 "--artifacts-destination", str(self.folder / "artifacts")],
                stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                # its background job runners (5 processes) serve features these tests do not use
                env={**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"})
        try:
            wait_for(self.healthy, "the mlflow server to start", self.process, timeout=180, interval=0.5,
                     log=self.folder / "server.log")
        except AssertionError:
            self.stop()  # the processes the server started too
            raise

    def healthy(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.url}/health", timeout=5) as response:
                return response.status == 200
        except OSError:
            return False

    def stop(self) -> None:
        """End the server and every process it started: SIGTERM, then SIGKILL to what is left after 15 s."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGTERM)
        try:
            wait_for(self.ended, "the mlflow server's processes to end on SIGTERM", timeout=15, interval=0.1)
        except AssertionError:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, signal.SIGKILL)
            wait_for(self.ended, "the mlflow server's processes to end on SIGKILL", timeout=15, interval=0.1)

    def ended(self) -> bool:
        """No process of the server's group is left."""
        self.process.poll()  # reaped, the leader no longer counts as a member of its group
        try:
            os.killpg(self.process.pid, 0)
        except ProcessLookupError:
            return True
        return False

    @property
    def running(self) -> bool:
        return self.process.poll() is None

    def client(self):
        import mlflow

        return mlflow.MlflowClient(tracking_uri=self.url)

    def store_client(self):
        """A client on the server's database itself, for reading it while the server is stopped."""
        import mlflow

        return mlflow.MlflowClient(tracking_uri=f"sqlite:///{self.folder / 'mlflow.db'}")

    def run_named(self, name: str):
        """The one MLflow run of the classify experiment with this name."""
        client = self.client()
        experiment = client.get_experiment_by_name("classify")
        runs = client.search_runs([experiment.experiment_id], filter_string=f"attributes.run_name = '{name}'")
        assert len(runs) == 1, [r.info.run_id for r in runs]
        return runs[0]

    def history(self, run_id: str, key: str) -> list[tuple[int, float]]:
        return [(m.step, m.value) for m in sorted(self.client().get_metric_history(run_id, key),
                                                  key=lambda m: (m.step, m.timestamp))]


@pytest.fixture(scope="module")
def mlflow_server(tmp_path_factory):
    server = MLflowServer(tmp_path_factory.mktemp("mlflow"))
    server.start()
    yield server
    server.stop()


@pytest.fixture
def live_mlflow(mlflow_server) -> MLflowServer:
    if not mlflow_server.running:  # a test that stops it ran first
        mlflow_server.start()
    return mlflow_server


def tracker_env(server: MLflowServer) -> dict:
    return {"MLFLOW_TRACKING_URI": server.url, "WANDB_MODE": "offline", "WANDB_SILENT": "true"}


def logged_steps(output_dir: Path) -> list[int]:
    """The steps of the run's log so far (none before it has one)."""
    return [row["step"] for row in log_history(output_dir)] if (output_dir / "log_history.jsonl").is_file() else []


def logged_by_step(output_dir: Path) -> dict[int, dict]:
    """The run's log, each row under its step."""
    return {row["step"]: row for row in log_history(output_dir)}


@pytest.fixture(scope="module")
def tracked_runs(mlflow_server, small_data, tiny_bert_without_dropout, tmp_path_factory):
    """The same flags under accelerate launch and under torchrun; the torchrun job is stopped with SIGTERM to
    the launcher after two logged steps and resumed with ``--resume_from_checkpoint latest``."""
    folder = tmp_path_factory.mktemp("tracked")
    if not mlflow_server.running:  # a test that stops it ran first
        mlflow_server.start()
    flags = classify_flags(small_data, tiny_bert_without_dropout, "--per_device_train_batch_size", "4",
                           "--num_train_epochs", "2", *TRACKED)
    env = tracker_env(mlflow_server)
    outs = {"accelerate": folder / "accelerate", "torchrun": folder / "torchrun"}
    run(accelerate_cmd(*flags, "--output_dir", str(outs["accelerate"])), env=env)

    command = torchrun_cmd(*flags, "--output_dir", str(outs["torchrun"]))
    log = folder / "stopped.log"
    with open(log, "w") as output:
        job = subprocess.Popen(command, cwd=REPO, stdout=output, stderr=subprocess.STDOUT, text=True,
                               env={**os.environ, **env})
        wait_for(lambda: len(logged_steps(outs["torchrun"])) >= 2, "two logged steps", job, log=log)
        with suspended(job):  # the signal comes before the job can train to the end
            job.send_signal(signal.SIGTERM)
        job.wait(timeout=300)
    stopped_at = int(re.search(r"stopped by SIGTERM at step (\d+)", log.read_text()).group(1))
    assert 2 <= stopped_at < STEPS
    resumed = run(torchrun_cmd(*flags, "--output_dir", str(outs["torchrun"]), "--resume_from_checkpoint", "latest"),
                  env=env)
    assert f"resumed from {outs['torchrun'] / 'checkpoints' / f'step_{stopped_at}'}" in resumed.stdout
    return outs, stopped_at


@pytest.mark.multiprocess
@pytest.mark.slow
def test_mlflow_runs_of_both_launchers_hold_the_same_history_and_configuration_and_no_token(
        mlflow_server, tracked_runs):
    outs, stopped_at = tracked_runs
    runs = {launcher: mlflow_server.run_named(launcher) for launcher in outs}
    histories = {launcher: {key: mlflow_server.history(r.info.run_id, key) for key in r.data.metrics}
                 for launcher, r in runs.items()}
    reference = logged_by_step(outs["accelerate"])

    for launcher, history in histories.items():
        assert [step for step, _ in history["loss"]] == list(range(1, STEPS + 1)), launcher
        for key in INTERVAL_KEYS:
            assert [step for step, _ in history[key]] == list(range(1, STEPS + 1)), (launcher, key)
        results = read_results(outs[launcher])
        for key in FINAL_KEYS | {"eval_accuracy", "eval_f1"}:  # all_results, at the last step
            assert history[key][-1] == (STEPS, pytest.approx(results[key], rel=1e-12)), (launcher, key)
        assert [step for step, _ in history["eval_accuracy"]] == [6, 12]
        for step, value in history["loss"]:
            assert value == pytest.approx(reference[step]["loss"], abs=1e-6)
    for (step, a), (_, b) in zip(histories["accelerate"]["loss"], histories["torchrun"]["loss"], strict=True):
        assert abs(a - b) <= 1e-6, step
    assert histories["torchrun"]["stop_signal_to_checkpoint_seconds"][0][0] == stopped_at

    params = {launcher: r.data.params for launcher, r in runs.items()}
    assert params["accelerate"]["learning_rate"] == "0.0001"
    assert params["accelerate"]["text_column"] == "text", "the recipe's own options are recorded too"
    assert params["accelerate"]["report_to"] == "tensorboard,mlflow,wandb"
    assert {k: v for k, v in params["accelerate"].items() if k != "output_dir"} == \
        {k: v for k, v in params["torchrun"].items() if k != "output_dir"}
    for r in runs.values():
        assert "hub_token" not in r.data.params
        assert not any(HUB_TOKEN in value for value in [*r.data.params.values(), *r.data.tags.values()])
    for out in outs.values():
        assert not [p for p in out.rglob("*") if p.is_file() and HUB_TOKEN.encode() in p.read_bytes()]


@pytest.mark.multiprocess
@pytest.mark.slow
def test_a_stopped_and_resumed_job_continues_the_same_run_in_every_tracker(mlflow_server, tracked_runs):
    outs, stopped_at = tracked_runs
    out = outs["torchrun"]
    recorded = json.loads((out / "checkpoints" / f"step_{stopped_at}" / RUN_FILE).read_text())
    assert recorded["run_name"] == "torchrun"

    mlflow_run = mlflow_server.run_named("torchrun")  # one run, not one per attempt
    assert mlflow_run.data.tags[RUN_ID_TAG] == recorded["run_id"]
    assert mlflow_run.info.status == "FINISHED"
    for key in INTERVAL_KEYS:
        steps = [step for step, _ in mlflow_server.history(mlflow_run.info.run_id, key)]
        assert steps == list(range(1, STEPS + 1)), key  # increasing, none missing or repeated

    attempts = sorted((out / "runs" / "wandb").glob("offline-run-*"))
    assert [folder.name.rsplit("-", 1)[1] for folder in attempts] == [recorded["run_id"]] * 2
    steps = [row["_step"] for folder in attempts for row in wandb_history(folder)]
    assert steps == list(range(1, STEPS + 1))

    assert [event.step for event in tensorboard_scalars(out)["loss"]] == list(range(1, STEPS + 1))


@pytest.mark.multiprocess
@pytest.mark.slow
def test_tensorboard_event_files_hold_the_same_series_under_both_launchers(tracked_runs):
    outs, _ = tracked_runs
    series = {launcher: tensorboard_scalars(out) for launcher, out in outs.items()}
    reference = logged_by_step(outs["accelerate"])
    assert INTERVAL_KEYS | FINAL_KEYS | {"eval_accuracy"} <= set(series["accelerate"])
    assert set(series["torchrun"]) == set(series["accelerate"]) | {"stop_signal_to_checkpoint_seconds"}
    for key in ("loss", "learning_rate", "grad_norm"):
        a, b = series["accelerate"][key], series["torchrun"][key]
        assert [e.step for e in a] == [e.step for e in b] == list(range(1, STEPS + 1))
        for x, y in zip(a, b, strict=True):
            assert x.value == pytest.approx(reference[x.step][key], rel=1e-6)  # stored as float32
            assert y.value == pytest.approx(x.value, abs=1e-6)


@pytest.mark.multiprocess
@pytest.mark.slow
def test_wandb_offline_files_hold_the_same_history_under_both_launchers(tracked_runs):
    outs, _ = tracked_runs
    rows = {launcher: {row["_step"]: row for folder in sorted((out / "runs" / "wandb").glob("offline-run-*"))
                       for row in wandb_history(folder)}
            for launcher, out in outs.items()}
    reference = logged_by_step(outs["accelerate"])
    assert sorted(rows["accelerate"]) == sorted(rows["torchrun"]) == list(range(1, STEPS + 1))
    for step in range(1, STEPS + 1):
        for key in ("loss", "learning_rate", "grad_norm"):
            assert rows["accelerate"][step][key] == pytest.approx(reference[step][key], abs=1e-6)
            assert rows["torchrun"][step][key] == pytest.approx(rows["accelerate"][step][key], abs=1e-6)
    results = read_results(outs["accelerate"])
    assert rows["accelerate"][STEPS]["train_loss"] == pytest.approx(results["train_loss"], rel=1e-12)
    (first_attempt, *_) = sorted((outs["accelerate"] / "runs" / "wandb").glob("offline-run-*"))
    config = wandb_config(first_attempt)
    assert config["learning_rate"] == 0.0001 and config["text_column"] == "text"
    assert "hub_token" not in config


def test_an_attempt_that_died_after_its_checkpoint_leaves_no_step_twice(live_mlflow, tmp_path, monkeypatch):
    """A torchrun restart or a Slurm requeue after a crash resumes from the last checkpoint (step 3 here) while
    the dead attempt had logged up to step 5: TensorBoard shows the new attempt's steps 4 and 5, MLflow keeps
    the values it has (it cannot delete one), and each step is there once."""
    monkeypatch.setenv("MLFLOW_TRACKING_URI", live_mlflow.url)
    first = TrackerSettings(("tensorboard", "mlflow"), project="classify", run_name="crashed",
                            logging_dir=str(tmp_path / "runs"), config={"learning_rate": 0.1})
    attempts = [(first, range(1, 6), 0), (dataclasses.replace(first, resumed_at=3), range(4, 9), 100)]
    for settings, steps, offset in attempts:
        trackers = Trackers(settings)
        for step in steps:
            trackers.log({"loss": step + offset}, step)
        trackers.close()
    tensorboard = [(e.step, e.value) for e in tensorboard_scalars(tmp_path)["loss"]]
    assert tensorboard == [(1, 1), (2, 2), (3, 3), (4, 104), (5, 105), (6, 106), (7, 107), (8, 108)]
    mlflow_run = live_mlflow.run_named("crashed")
    assert live_mlflow.history(mlflow_run.info.run_id, "loss") == [
        (1, 1), (2, 2), (3, 3), (4, 4), (5, 5), (6, 106), (7, 107), (8, 108)]
    assert mlflow_run.data.params == {"learning_rate": "0.1"}


@pytest.mark.filterwarnings("ignore:The ``noload`` loader strategy is deprecated")  # MLflow's own SQLAlchemy use
@pytest.mark.slow
def test_a_tracker_server_that_goes_away_mid_run_costs_a_warning_not_the_run(
        mlflow_server, small_data, tiny_bert, tmp_path):
    out = tmp_path / "server_gone"
    steps = 168  # 8 epochs in batches of 2: the server goes while training still has most steps to do
    command = python_cmd(*classify_flags(small_data, tiny_bert, "--per_device_train_batch_size", "2",
                                         "--num_train_epochs", "8", "--report_to", "mlflow", "--output_dir", str(out)))
    # Without retries a refused connection fails at once (MLflow's default retries for minutes, on the
    # tracker's thread, while training goes on).
    env = {**os.environ, **tracker_env(mlflow_server), "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "0"}
    log = tmp_path / "run.log"
    client = mlflow_server.client()

    def recorded_some() -> bool:
        experiment = client.get_experiment_by_name("classify")
        runs = experiment and client.search_runs([experiment.experiment_id], "attributes.run_name = 'server_gone'")
        return bool(runs) and "loss" in runs[0].data.metrics

    with open(log, "w") as output:
        job = subprocess.Popen(command, cwd=REPO, stdout=output, stderr=subprocess.STDOUT, text=True, env=env)
        wait_for(recorded_some, "the first metrics in MLflow", job, log=log, interval=0.05)
        with suspended(job):
            mlflow_server.stop()
            stopped_after = max(logged_steps(out))
        assert job.wait(timeout=300) == 0, log.read_text()[-4000:]
    assert stopped_after < steps, "the server went before training ended"
    output = log.read_text()
    assert read_results(out)["global_step"] == steps and (out / "model.safetensors").is_file()
    assert output.count("warning: mlflow failed at") == 1
    report = re.search(r"warning: mlflow did not record (\d+) of (\d+) logs \(steps ([\d, -]+)\)", output)
    assert report, output[-3000:]
    missed = {step for part in report.group(3).split(", ")
              for step in range(int(part.split("-")[0]), int(part.split("-")[-1]) + 1)}
    store = mlflow_server.store_client()  # what reached the server, read from its database
    (server_run,) = store.search_runs([store.get_experiment_by_name("classify").experiment_id],
                                      "attributes.run_name = 'server_gone'")
    recorded = [m.step for m in store.get_metric_history(server_run.info.run_id, "loss")]
    assert sorted(recorded) == list(range(1, len(recorded) + 1)) and recorded
    assert set(recorded) | missed == set(range(1, steps + 1)), "every step was either recorded or reported"
    assert max(recorded) < steps


def test_logging_never_waits_for_a_server_that_does_not_answer(tmp_path, monkeypatch, capsys):
    """A server that accepts connections and never answers: ``log`` returns at once, the end waits as long as
    it is told, then says what was not recorded."""
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(64)
        monkeypatch.setenv("MLFLOW_TRACKING_URI", f"http://127.0.0.1:{silent.getsockname()[1]}")
        monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
        settings = TrackerSettings(("mlflow",), project="classify", run_name="silent", logging_dir=str(tmp_path),
                                   config={"learning_rate": 0.1})
        trackers = Trackers(settings)
        start = time.monotonic()
        for step in range(1, 21):
            trackers.log({"loss": 1.0 / step}, step)
        queued_in = time.monotonic() - start
        # Taken while the server holds it: once the socket closes, the thread may end before the test looks.
        (thread,) = [thread for thread in threading.enumerate() if thread.name == "tracker-mlflow"]
        start = time.monotonic()
        trackers.close(timeout=2)
        closed_in = time.monotonic() - start
    # MLflow's own timeout is 120 s a request: a log that waited for the server would take that long.
    assert queued_in < 5
    assert 2 <= closed_in < 10
    # The socket closed, the hung request fails: the tracker's thread ends, with its one warning.
    thread.join(timeout=60)
    assert not thread.is_alive()
    messages = capsys.readouterr().err
    assert "mlflow did not record 20 of 20 logs (steps 1-20) and did not end its run within 2 s" in messages
    assert messages.count("warning: mlflow failed at its start") == 1


@dataclasses.dataclass
class NoOptions:
    pass


@pytest.mark.parametrize(("flags", "trackers"), [
    ([], ()),
    (["--with_tracking"], ("tensorboard", "mlflow", "wandb")),
    (["--report_to", "all"], ("tensorboard", "mlflow", "wandb")),
    (["--with_tracking", "--report_to", "none"], ()),
    (["--report_to", "wandb, TensorBoard"], ("wandb", "tensorboard")),
])
def test_report_to_names_the_trackers(flags, trackers):
    cfg, _ = parse_config(NoOptions, flags)
    assert cfg.trackers == trackers


def test_an_unknown_tracker_is_one_error_line(tmp_path):
    result = run(python_cmd("--report_to", "tensorboard,comet_ml", "--output_dir", str(tmp_path)), check=False)
    assert one_error_line(result.returncode, result.stderr) == (
        "error: --report_to tensorboard,comet_ml: 'comet_ml' is not a tracker here; name some of tensorboard, "
        "mlflow, wandb (comma-separated), or all or none")
    assert not any(tmp_path.iterdir()), "nothing was written"
    with pytest.raises(UserError, match="give tracker names, or all or none alone"):
        parse_config(NoOptions, ["--report_to", "all,mlflow"])


def wandb_records(folder: Path):
    """The records of an offline W&B run's ``.wandb`` file, parsed with W&B's own protobuf schema.

    The file is a LevelDB-style log (W&B's reader for it lives in its Go service now): a 7-byte header, then
    32 KiB blocks of records, each with a CRC32, a length and a kind (full, or first/middle/last of a split one).
    """
    import zlib

    from wandb.proto import wandb_internal_pb2

    (path,) = folder.glob("run-*.wandb")
    data = path.read_bytes()
    assert data[:4] == b":W&B"
    position, pending = 7, b""
    while position + 7 <= len(data):
        if (left := 32768 - position % 32768) < 7:
            position += left
            continue
        checksum, length, kind = struct.unpack("<IHB", data[position:position + 7])
        if kind == 0:
            break
        payload = data[position + 7:position + 7 + length]
        assert zlib.crc32(bytes([kind]) + payload) == checksum
        position += 7 + length
        pending = payload if kind in (1, 2) else pending + payload
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            yield record


def wandb_history(folder: Path) -> list[dict]:
    return [{item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item}
            for record in wandb_records(folder) if record.WhichOneof("record_type") == "history"]


def wandb_config(folder: Path) -> dict:
    config = {}
    for record in wandb_records(folder):
        if record.WhichOneof("record_type") == "config":
            config |= {item.key or "/".join(item.nested_key): json.loads(item.value_json)
                       for item in record.config.update}
    return config
