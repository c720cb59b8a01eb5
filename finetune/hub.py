"""Pushing checkpoints and the final model to the Hugging Face Hub without ever holding training up.

Only the main process talks to the Hub. The repository is created at start-up, so a bad token fails
in seconds; every push after that is a job for a separate upload process (``hub_uploader.py``), retried
with backoff, and its outcome is recorded rather than raised. Training never waits for an upload.
"""

from __future__ import annotations

import fnmatch
import json
import os
import queue
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

from huggingface_hub import HfApi, ModelCard, ModelCardData, get_token, snapshot_download
from huggingface_hub.errors import HfHubHTTPError

from finetune.errors import UserError
from finetune.hub_uploader import describe
from finetune.task import ModelCardInfo

__all__ = ["HubPusher", "download_last_checkpoint", "model_card"]

IGNORE_PATTERNS = ["checkpoints/*", "runs/*", "*.log", "*.tmp", "__pycache__/*"]
"""Kept out of the final push besides hidden files: local checkpoints, tracker logs, caches."""
MODEL_FILES = ["config.json", "model.safetensors", "tokenizer*", "vocab*", "special_tokens_map.json", "merges.txt"]
"""What a checkpoint contributes to the repository's top level under ``every_save``: a loadable model."""
LAST_CHECKPOINT = "last-checkpoint"


class HubPusher:
    """Pushes one run's checkpoints and final model to one Hub repository (main process only).

    Pushes are done in order by ``hub_uploader.py`` in a process of its own, so uploading takes neither
    the GIL nor a busy core from training. On other processes every method does nothing, so callers need
    no rank check.
    """

    def __init__(self, *, enabled: bool, output_dir: str, repo_id: str | None, token: str | None, private: bool,
                 revision: str | None, strategy: str, timeout: int):
        self.enabled = enabled
        self.strategy = strategy
        self.timeout = timeout
        self.revision = revision
        self.statuses: list[dict] = []
        self._pushes = 0
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
        # The token reaches the uploader in its environment, never on a command line others can read.
        self._uploader = subprocess.Popen(
            [sys.executable, str(Path(__file__).with_name("hub_uploader.py")), self.repo_id,
             *([self.revision] if self.revision else [])],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env={**os.environ, "HF_TOKEN": self.token},
        )
        self._reader = threading.Thread(target=self._read_outcomes, name="hub-push-outcomes", daemon=True)
        self._reader.start()
        # Jobs reach the uploader through a thread: a pipe write blocks once the uploader stops reading (busy
        # with a long push, or starved of CPU), and training must never wait for that.
        self._jobs: queue.SimpleQueue[dict | None] = queue.SimpleQueue()
        self._writer = threading.Thread(target=self._write_jobs, name="hub-push-jobs", daemon=True)
        self._writer.start()

    def push_checkpoint(self, folder: Path, step: int, model_config, tokenizer) -> None:
        """Queue the model at ``folder`` (``every_save``), plus the full state (``checkpoint``).

        ``model_config`` and ``tokenizer`` are saved beside the weights so each pushed step loads with
        ``from_pretrained``.
        """
        if not self.enabled or self.strategy == "end":
            return
        # Hard links freeze the files as they are now: pruning may delete the folder before the upload.
        stage = Path(folder).parent.parent / ".hub_staging" / f"step_{step}"
        shutil.rmtree(stage, ignore_errors=True)  # left by an earlier run that failed to push this step
        shutil.copytree(folder, stage, copy_function=_link_or_copy)
        checkpoint_files = [path.relative_to(stage).as_posix() for path in stage.rglob("*") if path.is_file()]
        model_config.save_pretrained(stage)
        tokenizer.save_pretrained(stage)
        files = _files(stage, "", allow=MODEL_FILES)
        if self.strategy == "checkpoint":  # the checkpoint as its manifest lists it, without the loading files
            files += _files(stage, LAST_CHECKPOINT, allow=checkpoint_files)
        self._submit(files, f"Training in progress, step {step}", stage)

    def push_final(self, output_dir: str, step: int) -> None:
        """Queue the final model folder (with its model card), ignoring checkpoints and logs."""
        if self.enabled:
            self._submit(_files(Path(output_dir), "", ignore=IGNORE_PATTERNS), f"Final model, step {step}")

    def finish(self) -> list[dict]:
        """Wait up to ``--hub_timeout`` for queued pushes; report and return every push's outcome."""
        if not self.enabled:
            return []
        self._jobs.put(None)  # no more pushes: the uploader exits once the queued ones are done
        deadline = time.monotonic() + self.timeout
        try:
            self._writer.join(timeout=self.timeout)
            self._uploader.wait(timeout=max(0.0, deadline - time.monotonic()))
            unfinished = f"the uploader stopped with exit status {self._uploader.returncode}"
        except subprocess.TimeoutExpired:
            self._uploader.kill()
            self._uploader.wait()
            unfinished = f"still uploading after --hub_timeout {self.timeout}s"
        self._reader.join()  # the uploader has exited, so its output has ended
        done = {status["push"] for status in self.statuses}
        self.statuses += [{"push": number, "error": unfinished}
                          for number in range(1, self._pushes + 1) if number not in done]
        self.statuses.sort(key=lambda status: status["push"])
        for status in self.statuses:
            outcome = (f"commit {status['commit_id']}, {status['seconds_after_save']:.1f} s after the files were saved"
                       if "commit_id" in status else f"FAILED: {status['error']}")
            print(f"hub push {status['push']} ({status.get('message', '')}) to {self.repo_id}: {outcome}", flush=True)
        return list(self.statuses)

    def _submit(self, files: list[tuple[str, str]], message: str, stage: Path | None = None) -> None:
        self._pushes += 1
        self._jobs.put({"push": self._pushes, "message": message, "files": files,
                        "stage": str(stage) if stage else None, "saved_at": time.time()})

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


def _link_or_copy(source: str, destination: str) -> None:
    try:
        os.link(source, destination)
    except OSError:  # a filesystem without hard links
        shutil.copy2(source, destination)


def _files(folder: Path, prefix: str, allow: list[str] | None = None,
           ignore: list[str] | None = None) -> list[tuple[str, str]]:
    """(path in the repository, local path) of the files in ``folder`` to push; hidden files and folders
    (``.git/``, ``.env``, ...) never are."""
    files = []
    for path in sorted(p for p in folder.rglob("*") if p.is_file()):
        relative = path.relative_to(folder).as_posix()
        if any(part.startswith(".") for part in path.relative_to(folder).parts):
            continue
        if allow is not None and not any(fnmatch.fnmatch(relative, pattern) for pattern in allow):
            continue
        if ignore is not None and any(fnmatch.fnmatch(relative, pattern) for pattern in ignore):
            continue
        files.append((f"{prefix}/{relative}" if prefix else relative, str(path)))
    return files


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
