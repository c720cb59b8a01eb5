"""Shared helpers: small data files, a dropout-free copy of the default model, and launchers.

Every training run here is a real process started the way a user starts it (python, torchrun,
accelerate launch), offline.
"""

from __future__ import annotations

import csv
import functools
import hashlib
import importlib.util
import json
import os
import resource
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import psutil
import pytest
from safetensors.torch import load_file

REPO = Path(__file__).resolve().parents[1]
RECIPE = str(REPO / "recipes" / "classify.py")
CPU_DDP_CONFIG = str(REPO / "accelerate_configs" / "cpu_ddp.yaml")

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Tokenized data is cached per session: runs of the same data share a cache, and none outlives the tests.
os.environ["HF_DATASETS_CACHE"] = tempfile.mkdtemp(prefix="finetune-tests-datasets-")

# Small, fast runs: short sequences, a few examples.
FAST_FLAGS = ["--max_seq_length", "48", "--per_device_eval_batch_size", "4", "--logging_steps", "1"]


HUB_TOKEN = "hf_secretTokenValue123456"
HUB_READ_ONLY_TOKEN = "hf_readOnlyToken987654"


@pytest.fixture
def hub(tmp_path):
    """A Hub-compatible server on loopback (tests/hub_server.py) where alice's tokens work; ``hub.env`` points
    the huggingface_hub client of a launched run at it."""
    from hub_server import HubServer

    with HubServer(tokens={HUB_TOKEN: "alice", HUB_READ_ONLY_TOKEN: "alice"},
                   read_only_tokens=frozenset({HUB_READ_ONLY_TOKEN})) as server:
        server.env = {"HF_ENDPOINT": server.url, "HF_HUB_OFFLINE": "0", "HF_HUB_CACHE": str(tmp_path / "hub-cache"),
                      "HF_HUB_DISABLE_TELEMETRY": "1", "HF_TOKEN": ""}
        yield server


def pytest_sessionfinish(session, exitstatus):
    shutil.rmtree(os.environ["HF_DATASETS_CACHE"], ignore_errors=True)


def tokenizing(tmp_path: Path):
    """A fresh ``Tokenizing`` writing under ``tmp_path``, for tokenizing a split in a test."""
    from finetune.prepared_data import Tokenizing

    return Tokenizing(Path(tempfile.mkdtemp(dir=tmp_path)), workers=None)


def pytest_collection_modifyitems(config, items):
    """GPU checks run only when a -m expression names them (`pytest -m gpu`): deselected, never skipped."""
    if "gpu" in (config.getoption("markexpr") or ""):
        return
    gpu = [item for item in items if item.get_closest_marker("gpu")]
    if gpu:
        config.hook.pytest_deselected(items=gpu)
        items[:] = [item for item in items if not item.get_closest_marker("gpu")]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(cmd: list[str], timeout: float = 300, check: bool = True, env: dict | None = None):
    """Run a command; on an unexpected exit status show its output in the failure."""
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=REPO,
                            env={**os.environ, **(env or {})})
    if check and result.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} exited {result.returncode}\n{result.stdout[-3000:]}\n"
                             f"{result.stderr[-6000:]}")
    return result


def python_cmd(*args) -> list[str]:
    return [sys.executable, RECIPE, *args]


def accelerate_cmd(*args, num_processes: int = 2, script: str = RECIPE) -> list[str]:
    return [sys.executable, "-m", "accelerate.commands.launch", "--config_file", CPU_DDP_CONFIG,
            "--num_processes", str(num_processes), "--main_process_port", str(free_port()), script, *args]


def torchrun_cmd(*args, nproc: int = 2, script: str = RECIPE) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc),
            "--master_port", str(free_port()), script, *args]


def read_results(output_dir) -> dict:
    return json.loads((Path(output_dir) / "all_results.json").read_text())


def read_weights(folder) -> dict:
    return load_file(str(Path(folder) / "model.safetensors"))


def max_weight_diff(a, b) -> float:
    wa, wb = read_weights(a), read_weights(b)
    assert wa.keys() == wb.keys()
    return max((wa[k].float() - wb[k].float()).abs().max().item() for k in wa)


def weight_distance(a, b) -> float:
    """The L2 distance between two saved models' weights."""
    wa, wb = read_weights(a), read_weights(b)
    assert wa.keys() == wb.keys()
    return sum(((wa[k].float() - wb[k].float()) ** 2).sum().item() for k in wa) ** 0.5


def log_history(folder) -> list[dict]:
    return [json.loads(line) for line in (folder / "log_history.jsonl").read_text().splitlines()]


def assert_same_training(a, b) -> None:
    """The same steps, the same gradient norm and loss at each step, and the same final weights.

    Gradient norms are compared because AdamW normalises a uniform scale error in the gradient away:
    the weights alone would not show it.
    """
    history_a, history_b = log_history(a), log_history(b)
    assert [h["step"] for h in history_a] == [h["step"] for h in history_b] == list(range(1, 10))
    for step_a, step_b in zip(history_a, history_b, strict=True):
        assert step_b["grad_norm"] == pytest.approx(step_a["grad_norm"], rel=1e-5), (step_a, step_b)
        assert step_b["loss"] == pytest.approx(step_a["loss"], rel=1e-5), (step_a, step_b)
    assert_weights_match_a_parity_run(a, b)


def assert_weights_match_a_parity_run(reference, other) -> None:
    """Equal up to float rounding, for two of ``parity_runs``' 9-step runs (checkpoints at steps 4 and 8).

    AdamW's update is close to the sign of the gradient for weights whose gradient is near zero, so summing in
    another order can move a few of them by a fraction of a step: the check is an L2 distance under 1% of what
    the last optimizer step moved the weights (the smallest step, its learning rate decayed to 1.1e-5), and no
    single weight off by more than a fifth of one early step (2e-5 at learning rate 1e-4).
    """
    last_step = weight_distance(Path(reference) / "checkpoints" / "step_8", reference)
    assert weight_distance(reference, other) < 0.01 * last_step
    assert max_weight_diff(reference, other) <= 2e-5


def assert_adapter_replies_as_generated(out: Path, base_model, max_new_tokens: int, merged_atol: float) -> int:
    """The adapter saved in ``out``, loaded onto ``base_model`` in this process, greedily replies to each prompt of
    ``out/eval_generations.jsonl`` what the run generated, and ``out/merged`` gives its logits within
    ``merged_atol``; returns how many generations there were."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(out)
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base_model), out).eval()
    merged = AutoModelForCausalLM.from_pretrained(out / "merged").eval()
    generations = [json.loads(line) for line in (out / "eval_generations.jsonl").read_text().splitlines()]
    for row in generations:
        ids = tokenizer.apply_chat_template(row["messages"], add_generation_prompt=True, return_tensors="pt",
                                            return_dict=True)
        with torch.no_grad():
            reply = model.generate(**ids, max_new_tokens=max_new_tokens, do_sample=False)[0, ids["input_ids"].shape[1]:]
            torch.testing.assert_close(merged(**ids).logits, model(**ids).logits, atol=merged_atol, rtol=0)
        assert tokenizer.decode(reply, skip_special_tokens=True) == row["generation"]
    return len(generations)


def start_and_signal(command: list[str], sig: signal.Signals, target: str) -> tuple[int, str]:
    """Start ``command``; once training starts, send ``sig`` to the launcher or to rank 1's worker."""
    job = subprocess.Popen(command, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines = []
    for line in job.stdout:
        lines.append(line)
        if line.startswith("training classify on"):
            break
    else:
        raise AssertionError("".join(lines[-40:]))
    if target == "launcher":
        job.send_signal(sig)
    else:
        workers = [p for p in psutil.Process(job.pid).children(recursive=True)
                   if p.environ().get("RANK") == "1" and "classify.py" in " ".join(p.cmdline())]
        assert len(workers) == 1, workers
        workers[0].send_signal(sig)
    rest, _ = job.communicate(timeout=300)
    return job.returncode, "".join(lines) + rest


def stopped_step(output: str, sig: signal.Signals) -> int:
    line = next(line for line in output.splitlines() if line.startswith(f"stopped by {sig.name} at step "))
    return int(line.split(" at step ")[1].split(":")[0])


@functools.cache
def load_script(folder: str, name: str):
    """``FOLDER/NAME.py`` of the repository (a recipe, a benchmark) as a module, to call it in this process."""
    spec = importlib.util.spec_from_file_location(f"{name}_{folder}", REPO / folder / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def load_recipe(name: str = "classify"):
    """``recipes/NAME.py`` as a module, to run its ``main`` in this process."""
    return load_script("recipes", name)


def assert_refused(main, flags: list[str], folder: Path, capsys, expected: str) -> None:
    """``main(flags)`` exits with status 2 and one ``error:`` line holding ``expected``, no traceback, and no
    file under ``folder`` changed."""
    from finetune.errors import run_main

    before = snapshot(folder)
    with pytest.raises(SystemExit) as exit_info:
        run_main(main, flags)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and "Traceback" not in err and expected in errors[0], err
    assert snapshot(folder) == before


def snapshot(folder: Path) -> dict[str, str]:
    """Every file under ``folder`` with its SHA-256, to show that nothing changed."""
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


def limit_file_size():
    """In a child process (``preexec_fn``): files stop growing at 20 MB (EFBIG), as on a full disk; the signal that
    comes with it is ignored so that the write fails instead of killing the process. ``sbatch --propagate=FSIZE``
    passes the limit on to its job."""
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (20 << 20, 20 << 20))


def write_csv(path: Path, rows: list[dict]) -> Path:
    with open(path, "w", newline="", encoding="utf-8") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    return path


@pytest.fixture(scope="session")
def small_data(tmp_path_factory) -> dict[str, Path]:
    """Support-ticket rows with string labels: 42 for training, 23 (a prime) for evaluation."""
    from finetune.default_dataset import LABEL_NAMES, make_support_tickets

    folder = tmp_path_factory.mktemp("data")
    dataset = make_support_tickets()

    def rows(split, count):
        short = [r for r in dataset[split] if len(r["text"]) < 160][:count]
        return [{"text": r["text"], "label": LABEL_NAMES[r["label"]]} for r in short]

    return {
        "train": write_csv(folder / "train.csv", rows("train", 42)),
        "validation": write_csv(folder / "validation.csv", rows("validation", 23)),
    }


@pytest.fixture(scope="session")
def no_dropout_model(tmp_path_factory) -> Path:
    """The default MiniLM with dropout off, for comparisons that must not depend on dropout masks."""
    from finetune.models import default_model_path

    folder = tmp_path_factory.mktemp("minilm_no_dropout")
    shutil.copytree(default_model_path(), folder, dirs_exist_ok=True)
    config = json.loads((folder / "config.json").read_text())
    config.update(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def data_flags(small_data) -> list[str]:
    return ["--train_file", str(small_data["train"]), "--validation_file", str(small_data["validation"])]


def parity_flags(small_data, model: Path, per_device_batch: int, group_by_length: bool = True) -> list[str]:
    flags = [*data_flags(small_data), *FAST_FLAGS, "--model_name_or_path", str(model),
             "--per_device_train_batch_size", str(per_device_batch), "--gradient_accumulation_steps", "2",
             "--num_train_epochs", "3", "--checkpointing_steps", "4"]
    return flags + ([] if group_by_length else ["--no_group_by_length"])


@pytest.fixture(scope="session")
def parity_runs(small_data, no_dropout_model, tmp_path_factory):
    """Training runs for comparisons, each made once per session and shared.

    ``parity_runs(launcher, processes, per_device_batch, group_by_length=True, dropout=False)`` returns the
    output folder. Every run: 42 examples in global batches of 8 (the last of each epoch short), accumulation
    of 2, 3 epochs, checkpoints every 4 steps, dropout off unless ``dropout`` (the default model's, 0.1).
    """
    from finetune.models import default_model_path

    made: dict[tuple, Path] = {}

    def get(launcher: str, processes: int, per_device_batch: int, group_by_length: bool = True,
            dropout: bool = False) -> Path:
        key = (launcher, processes, per_device_batch, group_by_length) + (("dropout",) if dropout else ())
        if key not in made:
            out = tmp_path_factory.mktemp("_".join(map(str, key))) / "out"
            model = default_model_path() if dropout else no_dropout_model
            flags = [*parity_flags(small_data, model, per_device_batch, group_by_length), "--output_dir", str(out)]
            launch = accelerate_cmd if launcher == "accelerate" else torchrun_cmd
            run(launch(*flags, **({"num_processes": processes} if launcher == "accelerate" else {"nproc": processes})))
            # Resume tests read step_4 of a two-process run, and weight comparisons read step_8's weights;
            # the rest would hold gigabytes of disk for the whole session.
            if processes == 1:
                shutil.rmtree(out / "checkpoints" / "step_4")
            (out / "checkpoints" / "step_8" / "optimizer.bin").unlink()
            made[key] = out
        return made[key]

    return get


def tensorboard_scalars(output_dir: Path) -> dict[str, list]:
    """Every scalar series of the run's TensorBoard folder, as TensorBoard reads it (purged steps dropped)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    (folder,) = [p for p in (output_dir / "runs").iterdir() if p.name != "wandb"]
    accumulator = EventAccumulator(str(folder))
    accumulator.Reload()
    return {tag: accumulator.Scalars(tag) for tag in accumulator.Tags()["scalars"]}
