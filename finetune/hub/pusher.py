"""Pushing checkpoints and the final model to the Hugging Face Hub without ever holding training up.

Only the main process talks to the Hub. The repository is created at start-up, so a bad token fails
in seconds; every push after that is a job for a separate upload process (``uploader.py``), retried
with backoff, and its outcome is recorded rather than raised. Training never waits for an upload. A push
holds exactly what the run saved for it, never a file reached through a symbolic link.
"""

from __future__ import annotations

import contextlib
import fnmatch
import json
import math
import os
import queue
import shutil
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from huggingface_hub import HfApi, ModelCard, ModelCardData, get_token, snapshot_download
from huggingface_hub.errors import HfHubHTTPError

from finetune.checkpointing.checkpoint import MANIFEST_FILE
from finetune.checkpointing.preemption import STOP_GRACE
from finetune.errors import UserError
from finetune.hub.uploader import TIMED_OUT_EXIT_CODE, describe
from finetune.task import ModelCardInfo

__all__ = ["HubPusher", "download_last_checkpoint", "model_card"]

TOKENIZER_FILES = ["tokenizer*", "vocab*", "special_tokens_map.json", "merges.txt", "chat_template.jinja"]
MODEL_FILES = ["config.json", "model.safetensors", *TOKENIZER_FILES]
"""What a checkpoint of a whole model puts at the repository's top level: a model that loads."""
ADAPTER_FILES = ["adapter_config.json", "adapter_model.safetensors", *TOKENIZER_FILES]
"""What a LoRA run's checkpoint puts there: the adapter as peft saves it, which loads onto its base model."""
LAST_CHECKPOINT = "last-checkpoint"


class HubPusher:
    """Pushes one run's checkpoints and final model to one Hub repository (main process only).

    Pushes are done in order by ``uploader.py`` in a process of its own, so uploading takes neither
    the GIL nor a busy core from training. On other processes every method does nothing, so callers need
    no rank check.
    """

    def __init__(self, *, enabled: bool, output_dir: str, repo_id: str | None, token: str | None, private: bool,
                 revision: str | None, strategy: str, timeout: int,
                 save_beside_adapter: Callable[[Any, Path], list[str]] = lambda model, folder: []):
        self.enabled = enabled
        self.save_beside_adapter = save_beside_adapter
        self.strategy = strategy
        self.timeout = timeout
        self.revision = revision
        self.statuses: list[dict] = []
        self._messages: list[str] = []  # push n's commit message is the n-th
        if not self.enabled:
            return
        self.token = token or get_token()
        if not self.token:
            raise UserError("--push_to_hub needs a token: pass --hub_token, set HF_TOKEN or run `hf auth login`")
        self.api = HfApi(token=self.token)
        self.repo_id = repo_id or Path(output_dir).resolve().name
        try:
            if "/" not in self.repo_id:
                self.repo_id = f"{self.api.whoami()['name']}/{self.repo_id}"
            self.api.create_repo(self.repo_id, private=private, exist_ok=True)
            if self.revision:
                self.api.create_branch(self.repo_id, branch=self.revision, exist_ok=True)
        except (HfHubHTTPError, OSError) as err:
            raise UserError(
                f"cannot create the Hub repository {self.repo_id}: {describe(err, self.token)}; check the token "
                "(--hub_token or HF_TOKEN) and that it may write to that namespace"
            ) from None
        # The token reaches the uploader in its environment, never on a command line others can read. In a session
        # of its own, a signal a launcher sends this process's group (torchrun's SIGTERM, a terminal's Ctrl-C)
        # misses it, and it ignores those Slurm sends every process: the push of a stop's checkpoint still lands.
        self._uploader = subprocess.Popen(
            [sys.executable, str(Path(__file__).with_name("uploader.py")), self.repo_id, str(timeout),
             *([self.revision] if self.revision else [])],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env={**os.environ, "HF_TOKEN": self.token},
            start_new_session=True,
        )
        self._said_uploader_stopped = self._said_sharded = False
        self._reader = threading.Thread(target=self._read_outcomes, name="hub-push-outcomes", daemon=True)
        self._reader.start()
        # Jobs reach the uploader through a thread: a pipe write blocks once the uploader stops reading (busy
        # with a long push, or starved of CPU), and training must never wait for that.
        self._jobs: queue.SimpleQueue[dict | None] = queue.SimpleQueue()
        self._writer = threading.Thread(target=self._write_jobs, name="hub-push-jobs", daemon=True)
        self._writer.start()

    def push_checkpoint(self, folder: Path, step: int, model, tokenizer) -> None:
        """Queue the model at ``folder`` (``every_save``), plus the full state (``checkpoint``).

        ``model`` (unwrapped, as it is at this checkpoint) gives its config, or with LoRA its adapter as peft saves
        it with what ``save_beside_adapter`` writes (a 4-bit base's quantization), and ``tokenizer`` is saved
        beside them, so each pushed step loads with ``from_pretrained`` and merges as the run's own folder does.
        The push replaces whatever else the repository holds: its top level is always one model that loads.
        """
        if not self.enabled or self.strategy == "end":
            return
        message = f"Training in progress, step {step}"
        if not self._uploader_runs():
            self._messages.append(message)
            self.statuses.append({"push": len(self._messages), "message": message, "error": "the uploader had stopped"})
            return
        # Hard links freeze the files as they are now (pruning may delete the folder before the upload), and only
        # those pushed are staged: a lagging upload holds no optimizer state it will not send.
        checkpoint_files = _checkpoint_files(Path(folder))
        # A sharded (FSDP) checkpoint holds each process's shards, not a model that loads: it goes to the Hub only
        # whole, as the checkpoint to resume from, and the model only at the end.
        whole_model = "model.safetensors" in checkpoint_files
        if not whole_model and self.strategy == "every_save":
            if not self._said_sharded:
                print("note: sharded (FSDP) checkpoints hold no model that loads, so --hub_strategy every_save pushes "
                      "the final model only; --hub_strategy checkpoint also pushes each checkpoint to "
                      f"{LAST_CHECKPOINT}/ to resume from", file=sys.stderr, flush=True)
                self._said_sharded = True
            return
        stage = Path(folder).parent.parent / ".hub_staging" / f"step_{step}"
        shutil.rmtree(stage, ignore_errors=True)  # left by an earlier run that failed to push this step
        # A LoRA checkpoint's model.safetensors holds the adapter under peft's internal names, which no
        # from_pretrained reads: the adapter is saved again as peft saves it.
        adapter = hasattr(model, "peft_config")
        loadable = ADAPTER_FILES if adapter else MODEL_FILES
        checkpoint_files = [name for name in checkpoint_files
                            if self.strategy == "checkpoint" or (not adapter and _matches(name, MODEL_FILES))]
        for name in checkpoint_files:
            (stage / name).parent.mkdir(parents=True, exist_ok=True)
            _link_or_copy(Path(folder) / name, stage / name)
        files = []
        if whole_model:
            (model if adapter else model.config).save_pretrained(stage)
            tokenizer.save_pretrained(stage)
            beside = self.save_beside_adapter(model, stage) if adapter else []
            files = [(name, str(stage / name)) for name in _files(stage) if _matches(name, loadable) or name in beside]
        if self.strategy == "checkpoint":  # the checkpoint as its manifest lists it, without the loading files
            files += [(f"{LAST_CHECKPOINT}/{name}", str(stage / name)) for name in checkpoint_files]
        self._submit(files, message, stage)

    def push_final(self, output_dir: str, files: list[str], step: int) -> None:
        """Queue the final model: ``files``, the paths under ``output_dir`` that the final save wrote (the model
        card among them), and nothing else of the folder.

        They are pushed from hard links (``.hub_staging/final_ID``, ID this run's): a push left to the uploader after
        a stop outlives the run and its hold on the folder, and a later run there replaces the folder's files. The
        push replaces whatever else the repository holds but this run's ``last-checkpoint/``.
        """
        if not self.enabled:
            return
        stage = Path(output_dir) / ".hub_staging" / f"final_{uuid.uuid4().hex[:12]}"
        for name in files:
            (stage / name).parent.mkdir(parents=True, exist_ok=True)
            _link_or_copy(Path(output_dir) / name, stage / name)
        self._submit([(name, str(stage / name)) for name in files], f"Final model, step {step}", stage,
                     keep=LAST_CHECKPOINT if self.strategy == "checkpoint" else None)

    def finish(self, stopped_at: Callable[[], float] = lambda: math.inf) -> list[dict]:
        """Wait for the queued pushes, then report and return every push's outcome.

        The wait ends after ``--hub_timeout``, which kills pushes still running, or ``STOP_GRACE`` after a stop
        signal (``stopped_at()``: its wall-clock time, ``inf`` while none came), which leaves them to the uploader:
        it goes on by itself for at most ``--hub_timeout`` and reports to this run's log.
        """
        if not self.enabled:
            return []
        self._jobs.put(None)  # no more pushes: the uploader exits once the queued ones are done
        deadline = time.monotonic() + self.timeout
        while self._uploader.poll() is None and time.monotonic() < min(
                deadline, time.monotonic() + stopped_at() + STOP_GRACE - time.time()):
            with contextlib.suppress(subprocess.TimeoutExpired):
                self._uploader.wait(timeout=0.2)
        # The uploader's own deadline, the same --hub_timeout counted from a moment earlier, may come first.
        if self._uploader.poll() not in (None, TIMED_OUT_EXIT_CODE):
            unfinished = f"the uploader stopped with exit status {self._uploader.returncode}"
        elif stopped_at() < math.inf and self._uploader.returncode is None:
            unfinished = (f"not done when the run stopped; the uploader (pid {self._uploader.pid}) goes on by itself "
                          f"for at most --hub_timeout {self.timeout}s and reports to this run's log")
        else:
            self._uploader.kill()
            self._uploader.wait()
            unfinished = f"still uploading after --hub_timeout {self.timeout}s"
        if self._uploader.returncode is not None:
            self._reader.join()  # the uploader has exited, so its output has ended
        statuses = list(self.statuses)
        done = {status["push"] for status in statuses}
        statuses += [{"push": number, "message": message, "error": unfinished}
                     for number, message in enumerate(self._messages, start=1) if number not in done]
        statuses.sort(key=lambda status: status["push"])
        for status in statuses:
            if "commit_id" in status:
                outcome = (f"commit {status['commit_id']}, {status['seconds_after_save']:.1f} s after the files "
                           "were saved")
            elif "superseded_by" in status:
                outcome = f"skipped: push {status['superseded_by']}, queued behind it, holds a newer checkpoint"
            else:
                outcome = f"FAILED: {status['error']}"
            print(f"hub push {status['push']} ({status['message']}) to {self.repo_id}: {outcome}", flush=True)
        return statuses

    def _uploader_runs(self) -> bool:
        """Whether the uploader still runs; the first time it does not, say so."""
        if self._uploader.poll() is None:
            return True
        if not self._said_uploader_stopped:
            self._said_uploader_stopped = True
            print(f"warning: the Hub uploader stopped (exit status {self._uploader.returncode}); later checkpoints are "
                  "neither staged nor pushed, and the run's pushes are reported as failed at its end",
                  file=sys.stderr, flush=True)
        return False

    def _submit(self, files: list[tuple[str, str]], message: str, stage: Path | None = None,
                keep: str | None = None) -> None:
        self._messages.append(message)
        self._jobs.put({"push": len(self._messages), "message": message, "files": files,
                        "stage": str(stage) if stage else None, "saved_at": time.time(), "keep": keep})

    def _write_jobs(self) -> None:
        try:
            for job in iter(self._jobs.get, None):
                self._uploader.stdin.write(json.dumps(job) + "\n")
                self._uploader.stdin.flush()
            self._uploader.stdin.close()
        except OSError:  # the uploader is gone; finish() reports its pushes as not done
            pass

    def _read_outcomes(self) -> None:
        for line in self._uploader.stdout:
            self.statuses.append(json.loads(line))


def _link_or_copy(source: Path, destination: Path) -> None:
    try:
        os.link(source, destination)
    except OSError:  # a filesystem without hard links
        shutil.copy2(source, destination)


def _matches(name: str, patterns: list[str]) -> bool:
    return any(fnmatch.fnmatch(name, pattern) for pattern in patterns)


def _checkpoint_files(folder: Path) -> list[str]:
    """``_files`` of a checkpoint folder, and the hidden files its manifest lists: a sharded checkpoint's
    ``.metadata`` (torch.distributed.checkpoint's index of the shards), without which it does not load."""
    manifest = folder / MANIFEST_FILE
    listed = json.loads(manifest.read_text())["files"] if manifest.is_file() else {}
    hidden = [name for name in listed if any(part.startswith(".") for part in name.split("/"))
              and (folder / name).is_file() and not (folder / name).is_symlink()]
    return sorted({*_files(folder), *hidden})


def _files(folder: Path) -> list[str]:
    """The paths, relative to ``folder``, of its regular files: none reached through a symbolic link (a linked
    file or folder is skipped), and no hidden ones (``.git/``, ``.env``, ...)."""
    files = []
    for root, folders, names in os.walk(folder):  # never enters a linked folder
        folders[:] = [name for name in folders if not name.startswith(".")]
        for name in names:
            path = Path(root) / name
            if not name.startswith(".") and not path.is_symlink() and path.is_file():
                files.append(path.relative_to(folder).as_posix())
    return sorted(files)


def model_card(*, base_model: str | None, task: ModelCardInfo, recipe: str, repo_id: str, title: str,
               data_source: str, results: dict, hyper_parameters: dict, command: list[str],
               token: str | None) -> ModelCard:
    """A model card with the base model, data, metrics, hyper-parameters, launch command and usage.

    ``base_model`` is a Hub id, or None for a local folder (which is no Hub id). ``token``'s value never
    appears in the card, wherever it stood on the command line.
    """
    data = ModelCardData(base_model=base_model, library_name=task.library_name, pipeline_tag=task.pipeline_tag,
                         tags=["finetune", task.pipeline_tag])
    rows = "\n".join(f"| {name} | {value} |" for name, value in hyper_parameters.items())
    metrics = "\n".join(f"| {k} | {v:.4f} |" for k, v in results.items() if k.startswith("eval_"))
    content = f"""---
{data.to_yaml()}
---

# {title}

Fine-tuned from `{base_model or 'a local model'}` for {task.what} on {data_source}, with `recipes/{recipe}.py`
of the finetune package ({results.get('runtime')} runtime, {results.get('world_size')} process(es),
{results.get('global_step')} optimizer steps).

## Evaluation

| metric | value |
|---|---|
{metrics}

## Training hyper-parameters

| name | value |
|---|---|
{rows}

## Launch command

```bash
{' '.join(redact_token(command, token))}
```

## How to load

```python
{task.usage.format(repo_id=repo_id)}
```
"""
    return ModelCard(content)


def redact_token(argv: list[str], token: str | None) -> list[str]:
    """``argv`` with every occurrence of ``token``'s value replaced, however the flag was spelled
    (``--hub_token X``, ``--hub-token=X``, an abbreviation such as ``--hub_tok X``)."""
    return [arg.replace(token, "***") for arg in argv] if token else list(argv)


def download_last_checkpoint(spec: str, revision: str | None, token: str | None) -> Path:
    """Fetch ``last-checkpoint/`` of the repository in ``hub:ORG/NAME`` into the local cache.

    Raises:
        UserError: the repository or its ``last-checkpoint/`` cannot be had.
    """
    repo_id = spec.removeprefix("hub:")
    try:
        local = snapshot_download(repo_id, revision=revision, allow_patterns=[f"{LAST_CHECKPOINT}/*"],
                                  token=token or None)
    except (HfHubHTTPError, OSError) as err:
        raise UserError(f"--resume_from_checkpoint {spec}: cannot download it ({describe(err, token)})") from None
    folder = Path(local) / LAST_CHECKPOINT
    if not folder.is_dir():
        raise UserError(f"--resume_from_checkpoint {spec}: the repository has no {LAST_CHECKPOINT}/; "
                        "push with --hub_strategy checkpoint")
    return folder
