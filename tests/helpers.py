"""What the tests share: launching recipes (in this process or as a user launches them), reading what a run
wrote, the checks of a refused run, waiting for a process, and finding a launcher's workers.

Fixtures (data files, tiny models, shared runs) live in ``conftest.py``; this module holds plain functions.
"""

from __future__ import annotations

import contextlib
import csv
import functools
import hashlib
import importlib.util
import io
import json
import os
import resource
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Protocol

import psutil
import pytest
from safetensors.torch import load_file

REPO = Path(__file__).resolve().parents[1]
CPU_DDP_CONFIG = str(REPO / "accelerate_configs" / "cpu_ddp.yaml")

# Small, fast runs: short sequences, a few examples.
FAST_FLAGS = ["--max_seq_length", "48", "--per_device_eval_batch_size", "4", "--logging_steps", "1"]

HUB_TOKEN = "hf_secretTokenValue123456"
HUB_READ_ONLY_TOKEN = "hf_readOnlyToken987654"



@contextlib.contextmanager
def serving_hub(cache: Path):
    """A Hub-compatible server on loopback (tests/hub_server.py) where alice's tokens work; ``server.env`` points
    the huggingface_hub client of a launched run at it, with its cache in ``cache``."""
    from hub_server import HubServer

    with HubServer(tokens={HUB_TOKEN: "alice", HUB_READ_ONLY_TOKEN: "alice"},
                   read_only_tokens=frozenset({HUB_READ_ONLY_TOKEN})) as server:
        server.env = {"HF_ENDPOINT": server.url, "HF_HUB_OFFLINE": "0", "HF_HUB_CACHE": str(cache),
                      "HF_HUB_DISABLE_TELEMETRY": "1", "HF_TOKEN": ""}
        yield server

def recipe_path(name: str = "classify") -> str:
    return str(REPO / "recipes" / f"{name}.py")


# -- launching

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


def python_cmd(*args, script: str | None = None) -> list[str]:
    return [sys.executable, script or recipe_path(), *args]


def accelerate_cmd(*args, num_processes: int = 2, script: str | None = None, config: str | None = None) -> list[str]:
    """``accelerate launch`` of ``script`` with ``accelerate_configs/CONFIG`` (the CPU DDP one unless given)."""
    config_file = str(REPO / "accelerate_configs" / config) if config else CPU_DDP_CONFIG
    return [sys.executable, "-m", "accelerate.commands.launch", "--config_file", config_file,
            "--num_processes", str(num_processes), "--main_process_port", str(free_port()), script or recipe_path(),
            *args]


def torchrun_cmd(*args, nproc: int = 2, script: str | None = None) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc),
            "--master_port", str(free_port()), script or recipe_path(), *args]


def launch_cmd(launcher: str, *args, processes: int = 2, script: str | None = None) -> list[str]:
    """``accelerate launch`` (with the CPU DDP config) or ``torchrun`` of ``script`` with ``processes``."""
    if launcher == "accelerate":
        return accelerate_cmd(*args, num_processes=processes, script=script)
    return torchrun_cmd(*args, nproc=processes, script=script)


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


def train_here(recipe: str, *flags: str, check: bool = True) -> subprocess.CompletedProcess:
    """``recipes/RECIPE.py FLAGS`` run in this process, as its command line runs it (``run_main``): its exit
    status and what it printed. For runs whose point is not the launcher: the libraries are imported already,
    which saves each run the seconds a new process spends importing them."""
    from finetune.errors import run_main

    stdout, stderr, status = io.StringIO(), io.StringIO(), 0
    with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
        try:
            run_main(load_recipe(recipe).main, list(flags))
        except SystemExit as exit_:
            status = exit_.code
    result = subprocess.CompletedProcess([recipe, *flags], status, stdout.getvalue(), stderr.getvalue())
    if check and status != 0:
        raise AssertionError(f"{recipe} {' '.join(flags)} exited {status}\n{result.stdout[-3000:]}\n"
                             f"{result.stderr[-6000:]}")
    return result


def tokenizing(tmp_path: Path):
    """A fresh ``Tokenizing`` writing under ``tmp_path``, for tokenizing a split in a test."""
    import tempfile

    from finetune.data.cache import Tokenizing

    return Tokenizing(Path(tempfile.mkdtemp(dir=tmp_path)), workers=None)


def run_on(recipe: str, model, data: list[str], out, *flags: str, launcher: str | None = None, processes: int = 1,
           env: dict | None = None) -> subprocess.CompletedProcess:
    """``recipes/RECIPE.py`` on ``model`` and the ``data`` flags into ``out``: in this process (``launcher`` None),
    or as ``python``, ``accelerate`` or ``torchrun`` launch it (``env`` for a launched run)."""
    flags = [*data, "--model_name_or_path", str(model), "--output_dir", str(out), *flags]
    if launcher is None:
        assert env is None, "a run in this process has this process's environment"
        return train_here(recipe, *flags)
    if launcher == "python":
        return run(python_cmd(*flags, script=recipe_path(recipe)), env=env)
    return run(launch_cmd(launcher, *flags, processes=processes, script=recipe_path(recipe)), env=env)


# -- refusals

def one_error_line(returncode: int, stderr: str, *expected: str) -> str:
    """The run exited with status 2 after exactly one ``error:`` line holding each of ``expected``, and no
    traceback; returns that line."""
    errors = [line for line in stderr.splitlines() if line.startswith("error: ")]
    assert returncode == 2 and len(errors) == 1 and "Traceback" not in stderr, stderr[-3000:]
    for words in expected:
        assert words in errors[0], errors[0]
    return errors[0]


def refused_here(main: Callable, argv: list[str], capsys, *expected: str) -> str:
    """``run_main(main, argv)`` (a command's entry point) in this process exits with status 2 having written nothing
    to stderr but one ``error:`` line, which holds each of ``expected``; returns the line."""
    from finetune.errors import run_main

    capsys.readouterr()
    with pytest.raises(SystemExit) as stop:
        run_main(main, argv)
    lines = capsys.readouterr().err.strip().splitlines()
    assert stop.value.code == 2 and len(lines) == 1 and lines[0].startswith("error: "), lines
    for words in expected:
        assert words in lines[0], lines[0]
    return lines[0]


def assert_refused(recipe: str, flags: list[str], folder: Path, *expected: str) -> str:
    """``recipes/RECIPE.py FLAGS``, in this process, ends with one ``error:`` line holding each of ``expected``
    (exit status 2, no traceback), and no file under ``folder`` changed; returns the line."""
    before = snapshot(folder)
    result = train_here(recipe, *flags, check=False)
    line = one_error_line(result.returncode, result.stderr, *expected)
    assert snapshot(folder) == before, "nothing already on disk changed"
    return line


def snapshot(folder: Path) -> dict[str, str]:
    """Every file under ``folder`` with its SHA-256, to show that nothing changed."""
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


# -- waiting for and finding processes

class Running(Protocol):
    """What ``wait_for`` watches: a ``subprocess.Popen``, or a job of another kind (a Slurm job) with its two
    methods. ``str()`` of it names it in a failure."""

    def poll(self) -> object:
        """None while it runs; once it has ended, how it ended (an exit status, a job state)."""

    def kill(self) -> None:
        """End it."""


def wait_for(condition: Callable[[], object], what: str, job: Running | None = None,
             timeout: float = 300, interval: float = 0.01, log: Path | None = None):
    """Poll ``condition`` every ``interval`` seconds until it is true and return its value; fail if ``job`` ends
    first or ``timeout`` seconds pass (then ending ``job``), showing ``log``'s end, when given."""
    deadline = time.monotonic() + timeout
    while True:
        # whether the job has ended is asked first: a condition the job meets as it ends is then seen
        ended = job.poll() if job is not None else None
        if found := condition():
            return found
        if ended is not None or time.monotonic() > deadline:
            if ended is not None:
                why = f"{job} ended"
            else:
                why = f"not within {timeout} s" + (f" ({job}, now killed)" if job is not None else "")
                if job is not None:
                    job.kill()
            tail = log.read_text(errors="replace")[-6000:] if log and log.exists() else ""
            raise AssertionError(f"gave up waiting for {what}: {why}\n{tail}")
        time.sleep(interval)


def training_processes(processes: Iterable[psutil.Process], script: str = "classify.py",
                       rank: int | None = None) -> list[psutil.Process]:
    """Of ``processes``, those training ``script``: started by a launcher for it (``RANK`` in their environment,
    which the launcher's and a batch script's own processes, whose command lines name the script too, lack), of
    one ``rank`` when given. Processes that have ended meanwhile are left out."""
    found = []
    for process in processes:
        try:
            if script not in " ".join(process.cmdline()):
                continue
            environ = process.environ()
        except psutil.NoSuchProcess:
            continue
        if "RANK" in environ and (rank is None or environ["RANK"] == str(rank)):
            found.append(process)
    return found


def workers(job: subprocess.Popen, script: str = "classify.py", rank: int | None = None) -> list[psutil.Process]:
    """The training processes a launcher started for ``script`` (of one ``rank``, when given)."""
    return training_processes(psutil.Process(job.pid).children(recursive=True), script, rank)


@contextlib.contextmanager
def suspended(job: subprocess.Popen):
    """``job`` and every process it started stopped (SIGSTOP) for the block: what a test does meanwhile happens,
    for the job, between two of its instructions however fast it trains."""
    processes = [psutil.Process(job.pid), *psutil.Process(job.pid).children(recursive=True)]
    for process in processes:
        process.suspend()
    try:
        yield
    finally:
        for process in processes:
            with contextlib.suppress(psutil.NoSuchProcess):
                process.resume()


def start_and_signal(command: list[str], sig: signal.Signals, target: str, recipe: str = "classify"
                     ) -> tuple[int, str]:
    """Start ``command``; once training starts, send ``sig`` to the launcher or to rank 1's worker."""
    job = subprocess.Popen(command, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines = []
    for line in job.stdout:
        lines.append(line)
        if f"training {recipe} on" in line:  # (another process's unfinished line may come before it)
            break
    else:
        raise AssertionError("".join(lines[-40:]))
    if target == "launcher":
        job.send_signal(sig)
    else:
        (worker,) = workers(job, f"{recipe}.py", rank=1)
        worker.send_signal(sig)
    rest, _ = job.communicate(timeout=300)
    return job.returncode, "".join(lines) + rest


def stopped_step(output: str, sig: signal.Signals) -> int:
    line = next(line for line in output.splitlines() if line.startswith(f"stopped by {sig.name} at step "))
    return int(line.split(" at step ")[1].split(":")[0])


FILE_SIZE_LIMIT = 1 << 20
"""What ``limit_file_size`` allows: less than the tiny models' weights, more than any other file of a run."""


def limit_file_size():
    """In a child process (``preexec_fn``): files stop growing at ``FILE_SIZE_LIMIT`` (EFBIG), as on a full disk;
    the signal that comes with it is ignored so that the write fails instead of killing the process.
    ``sbatch --propagate=FSIZE`` passes the limit on to its job."""
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (FILE_SIZE_LIMIT, FILE_SIZE_LIMIT))


# -- data files

def note_longest_texts(monkeypatch) -> list[int]:
    """From now on in the test, the length of the longest text each tokenizer call gets, in call order."""
    import transformers

    longest = []
    call = transformers.PreTrainedTokenizerBase.__call__

    def noting(self, text=None, *args, **kwargs):
        longest.append(max(map(len, text if isinstance(text, list) else [text]), default=0))
        return call(self, text, *args, **kwargs)

    monkeypatch.setattr(transformers.PreTrainedTokenizerBase, "__call__", noting)
    return longest


def write_csv(path: Path, rows: list[dict]) -> Path:
    with open(path, "w", newline="", encoding="utf-8") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    return path


def write_jsonl(path: Path, rows: list[dict]) -> str:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines()]


# -- flags for the classify recipe on conftest's ``small_data``

def data_flags(small_data) -> list[str]:
    return ["--train_file", str(small_data["train"]), "--validation_file", str(small_data["validation"])]


def classify_flags(small_data, model: Path, *flags: str) -> list[str]:
    """``small_data`` and ``model`` for the classify recipe, with short sequences and a log every step."""
    return [*data_flags(small_data), *FAST_FLAGS, "--model_name_or_path", str(model), *flags]


def parity_flags(small_data, model: Path, per_device_batch: int, group_by_length: bool = True) -> list[str]:
    flags = classify_flags(small_data, model, "--per_device_train_batch_size", str(per_device_batch),
                           "--gradient_accumulation_steps", "2", "--num_train_epochs", "3",
                           "--checkpointing_steps", "4")
    return flags + ([] if group_by_length else ["--no_group_by_length"])


# -- what a run wrote

def read_results(output_dir) -> dict:
    return json.loads((Path(output_dir) / "all_results.json").read_text())


def log_history(folder) -> list[dict]:
    return read_jsonl(Path(folder) / "log_history.jsonl")


def timeless_history(folder) -> list[dict]:
    """The log without its one figure that depends on the machine's speed."""
    return [{k: v for k, v in row.items() if k != "samples_per_second"} for row in log_history(folder)]


def read_weights(folder, name: str = "model.safetensors") -> dict:
    return load_file(str(Path(folder) / name))


def max_weight_diff(a, b, name: str = "model.safetensors") -> float:
    wa, wb = read_weights(a, name), read_weights(b, name)
    assert wa.keys() == wb.keys()
    return max((wa[k].float() - wb[k].float()).abs().max().item() for k in wa)


def weight_distance(a, b) -> float:
    """The L2 distance between two saved models' weights."""
    wa, wb = read_weights(a), read_weights(b)
    assert wa.keys() == wb.keys()
    return sum(((wa[k].float() - wb[k].float()) ** 2).sum().item() for k in wa) ** 0.5


def tensorboard_scalars(output_dir: Path) -> dict[str, list]:
    """Every scalar series of the run's TensorBoard folder, as TensorBoard reads it (purged steps dropped)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    (folder,) = [p for p in (output_dir / "runs").iterdir() if p.name != "wandb"]
    accumulator = EventAccumulator(str(folder))
    accumulator.Reload()
    return {tag: accumulator.Scalars(tag) for tag in accumulator.Tags()["scalars"]}


# -- comparing runs

def assert_same_steps(history: list[dict], expected: list[dict], rel: float = 1e-5) -> None:
    """The same steps, each with the same loss and gradient norm, to ``rel``.

    Gradient norms are compared because AdamW normalises a uniform scale error in the gradient away: the weights
    alone would not show it.
    """
    assert [h["step"] for h in history] == [h["step"] for h in expected]
    for ours, theirs in zip(history, expected, strict=True):
        assert ours["grad_norm"] == pytest.approx(theirs["grad_norm"], rel=rel), (ours, theirs)
        assert ours["loss"] == pytest.approx(theirs["loss"], rel=rel), (ours, theirs)


def assert_same_training(a, b) -> None:
    """Two of ``parity_runs``' 9-step runs: the same loss and gradient norm at each step, and the same final
    weights (``assert_weights_match_a_parity_run``)."""
    assert [h["step"] for h in log_history(a)] == list(range(1, 10))
    assert_same_steps(log_history(b), log_history(a))
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
    ``out/eval_generations.jsonl`` what the run generated (stopping where ``out/generation_config.json`` says), and
    ``out/merged`` gives its logits within ``merged_atol``; returns how many generations there were."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    tokenizer = AutoTokenizer.from_pretrained(out)
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base_model), out).eval()
    merged = AutoModelForCausalLM.from_pretrained(out / "merged").eval()
    generations, stops = read_jsonl(out / "eval_generations.jsonl"), GenerationConfig.from_pretrained(out)
    for row in generations:
        ids = tokenizer.apply_chat_template(row["messages"], add_generation_prompt=True, return_tensors="pt",
                                            return_dict=True)
        with torch.no_grad():
            reply = model.generate(**ids, generation_config=stops, max_new_tokens=max_new_tokens,
                                   do_sample=False)[0, ids["input_ids"].shape[1]:]
            torch.testing.assert_close(merged(**ids).logits, model(**ids).logits, atol=merged_atol, rtol=0)
        assert tokenizer.decode(reply, skip_special_tokens=True) == row["generation"]
    return len(generations)


# -- tiny models: the mechanism under test, not the model, in milliseconds a step

def tiny_llama(tokenizer, initializer_range: float = 0.02, seed: int = 0):
    """A random 2-layer Llama over ``tokenizer``'s vocabulary (SmolLM2's ids, special tokens and template)."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         tie_word_embeddings=True, bos_token_id=1, eos_token_id=2, pad_token_id=2,
                         initializer_range=initializer_range)
    return AutoModelForCausalLM.from_config(config)


def save_tiny_llama(folder: Path, tokenizer, initializer_range: float = 0.02) -> Path:
    """``tiny_llama`` saved with its tokenizer, as a model folder a recipe loads."""
    tiny_llama(tokenizer, initializer_range).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def save_tiny_bert(folder: Path, dropout: bool) -> Path:
    """A random 2-layer BERT (hidden 32) with the default MiniLM's tokenizer and configuration otherwise: the
    recipes' encoder path (a new head on a pretrained encoder) at a twentieth of the weights."""
    import torch
    from transformers import AutoConfig, AutoModel, AutoTokenizer

    from finetune.models.loading import default_model_path

    config = AutoConfig.from_pretrained(default_model_path())
    config.update({"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2, "intermediate_size": 64})
    if not dropout:
        config.update({"hidden_dropout_prob": 0.0, "attention_probs_dropout_prob": 0.0})
    torch.manual_seed(0)
    AutoModel.from_config(config).save_pretrained(folder)
    AutoTokenizer.from_pretrained(default_model_path()).save_pretrained(folder)
    return folder


# -- a tiny causal LM over a vocabulary of its own, for the library's log-probabilities

VOCAB = 500
TINY_LM_SIZES = {"vocab_size": VOCAB, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
                 "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8, "pad_token_id": 0,
                 "bos_token_id": 1, "eos_token_id": 7}


def tiny_causal_lm(config_class=None, **extra):
    """A random 2-layer causal LM (a Llama unless ``config_class`` says otherwise; ``extra`` sizes replace its own) over
    a 500-token vocabulary."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config((config_class or LlamaConfig)(**{**TINY_LM_SIZES, **extra})).eval()


def padded_batch(lengths=(11, 4, 8, 12, 6), prompt=3) -> dict:
    """Right-padded rows of ``tiny_causal_lm`` tokens whose first ``prompt`` tokens (and the padding) are not
    labelled."""
    import torch

    from finetune.tasks.chat import IGNORE

    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(1, VOCAB, (len(lengths), max(lengths)), generator=generator)
    mask = (torch.arange(max(lengths)) < torch.tensor(lengths)[:, None]).long()
    labels = ids.masked_fill(mask == 0, IGNORE)
    labels[:, :prompt] = IGNORE
    return {"input_ids": ids * mask, "attention_mask": mask, "labels": labels}


def whole_rows_batch(rows: list[tuple[list[int], list[int]]]) -> dict:
    """Right-padded prompt + reply rows, only the replies labelled: what a shared prompt pass must equal."""
    import torch

    from finetune.tasks.chat import IGNORE

    width = max(len(p) + len(r) for p, r in rows)
    batch = {"input_ids": torch.zeros(len(rows), width, dtype=torch.long),
             "attention_mask": torch.zeros(len(rows), width, dtype=torch.long),
             "labels": torch.full((len(rows), width), IGNORE)}
    for i, (prompt, reply) in enumerate(rows):
        batch["input_ids"][i, :len(prompt) + len(reply)] = torch.tensor(prompt + reply)
        batch["attention_mask"][i, :len(prompt) + len(reply)] = 1
        batch["labels"][i, len(prompt):len(prompt) + len(reply)] = torch.tensor(reply)
    return batch
