"""Where checkpoints live, what makes one complete, and saving a model without its wrapper.

Layout under ``OUTPUT_DIR``: the final model (a plain Hugging Face folder) at the top, full training
states in ``checkpoints/step_N``. A checkpoint is written into ``step_N.partial``; once every file is
there and flushed to disk, ``manifest.json`` (step, epoch, world size, seed, versions and a SHA-256 of
each file) is written last and the folder is renamed into place. A folder named ``step_N`` with a
manifest is complete, and it is used only if every checksum still matches.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import math
import os
import re
import shutil
import socket
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, replace
from importlib.metadata import version
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from finetune.errors import UserError

__all__ = [
    "Progress",
    "check_output_dir",
    "check_unwrapped",
    "checkpoint_path",
    "disk_write_failure",
    "find_latest_checkpoint",
    "load_state_dict_unwrapped",
    "output_dir_lock",
    "prune_checkpoints",
    "read_progress",
    "resolve_resume_checkpoint",
    "resumed_progress",
    "save_model",
    "verify_checkpoint",
    "write_manifest",
    "write_progress",
]

logger = logging.getLogger(__name__)

PROGRESS_FILE = "progress.json"
MANIFEST_FILE = "manifest.json"
LOCK_FILE = ".finetune.lock"
_WRAPPER_PREFIXES = ("module.", "_orig_mod.")
_STEP_DIR = re.compile(r"^step_(\d+)$")


@dataclass
class Progress:
    """Where training stands: enough to continue exactly."""

    global_step: int = 0
    epoch: int = 0
    batches_in_epoch: int = 0
    """Micro-batches each rank has consumed in ``epoch``."""
    world_size: int = 1
    runtime: str = ""
    seed: int = 0
    per_device_train_batch_size: int | None = None
    """None in a checkpoint written before the batch was recorded."""
    gradient_accumulation_steps: int | None = None

    @property
    def global_batch_size(self) -> int:
        """Examples per optimizer step: per-device batch x processes x accumulation."""
        return self.per_device_train_batch_size * self.world_size * self.gradient_accumulation_steps

    def describe_batch(self) -> str:
        return (f"{self.global_batch_size} ({self.per_device_train_batch_size} per device x {self.world_size} "
                f"process(es) x {self.gradient_accumulation_steps} accumulation step(s))")


def disk_write_failure(err: BaseException) -> str | None:
    """Why writing a file failed, when the disk is to blame (full, a quota, a file size limit); else None.

    Only ``OSError`` says so plainly: torch reports a failed write as a ``RuntimeError`` from its stream
    writer, safetensors as a ``SafetensorError`` that quotes the I/O error.
    """
    message = str(err)
    if isinstance(err, OSError):
        return err.strerror or message
    if isinstance(err, SafetensorError) and "I/O error: " in message:
        return message.split("I/O error: ", 1)[1]
    if isinstance(err, RuntimeError) and ("PytorchStreamWriter" in message or "unexpected pos" in message):
        return "torch could not write a file; the disk may be full"
    return None


def checkpoint_path(output_dir: str, step: int) -> Path:
    return Path(output_dir) / "checkpoints" / f"step_{step}"


def write_progress(folder: Path, progress: Progress) -> None:
    (folder / PROGRESS_FILE).write_text(json.dumps(asdict(progress), indent=2) + "\n")


def read_progress(folder: Path) -> Progress:
    return Progress(**json.loads((Path(folder) / PROGRESS_FILE).read_text()))


def resumed_progress(saved: Progress, run: Progress, folder: Path, batches_per_rank: int) -> Progress:
    """Where ``run`` (a fresh ``Progress`` with this run's processes, batch and accumulation) continues the
    checkpoint ``folder`` whose progress is ``saved``; ``batches_per_rank`` is this run's per epoch.

    The plan of global batches depends on the global batch (per-device batch x processes x accumulation),
    not on how it is split, so another world size resumes when the global batch is kept. The position in the
    epoch, in micro-batches per process, carries over through the optimizer steps done.

    Raises:
        UserError: the global batch would change (the message names the per-device batch or accumulation
            that keeps it), or another world size resumes a checkpoint that does not record its batch.
    """
    current = {"world_size": run.world_size, "runtime": run.runtime,
               "per_device_train_batch_size": run.per_device_train_batch_size,
               "gradient_accumulation_steps": run.gradient_accumulation_steps}
    if saved.per_device_train_batch_size is None:
        if saved.world_size != run.world_size:
            raise UserError(f"{folder} was written by {saved.world_size} processes and this run has {run.world_size};"
                            f" the checkpoint does not record its batch, so resume with {saved.world_size}")
        return replace(saved, **current)
    wanted = saved.global_batch_size
    if run.global_batch_size != wanted:
        per_process = run.world_size * run.gradient_accumulation_steps
        ways = [f"--per_device_train_batch_size {wanted // per_process}"] if wanted % per_process == 0 else []
        per_process = run.world_size * run.per_device_train_batch_size
        ways += [f"--gradient_accumulation_steps {wanted // per_process}"] if wanted % per_process == 0 else []
        if not ways and wanted % run.world_size == 0:
            ways = [f"--per_device_train_batch_size {wanted // run.world_size} --gradient_accumulation_steps 1"]
        fix = (f"with {run.world_size} process(es), pass {' or '.join(ways)}" if ways else
               f"resume with a number of processes that divides {wanted}, such as {saved.world_size}")
        raise UserError(f"{folder} was written with a global batch of {saved.describe_batch()} and this run's is "
                        f"{run.describe_batch()}; the order of the data depends on it, so keep it: {fix}")
    batches = saved.batches_in_epoch
    if saved.gradient_accumulation_steps != run.gradient_accumulation_steps:
        steps_done = math.ceil(batches / saved.gradient_accumulation_steps)
        batches = min(steps_done * run.gradient_accumulation_steps, batches_per_rank)
    return replace(saved, batches_in_epoch=batches, **current)


def _sha256_and_sync(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
        os.fsync(f.fileno())
    return digest.hexdigest()


def write_manifest(folder: Path, progress: Progress) -> None:
    """Flush every file in ``folder`` to disk and record its checksum; call once the folder is complete."""
    files = {p.relative_to(folder).as_posix(): _sha256_and_sync(p) for p in sorted(folder.rglob("*"))
             if p.is_file() and p.name != MANIFEST_FILE}
    manifest = {**asdict(progress), "finetune_version": version("finetune"), "torch_version": torch.__version__,
                "files": files}
    with open(folder / MANIFEST_FILE, "w") as f:
        json.dump(manifest, f, indent=2)
        f.flush()
        os.fsync(f.fileno())


def verify_checkpoint(folder: Path) -> None:
    """Check that the manifest lists exactly the files in ``folder``, each inside it, and every checksum.

    Raises:
        UserError: no manifest (an incomplete checkpoint), a listed name outside the folder, a file the
            manifest does not list, or a file missing or changed, named.
    """
    folder = Path(folder)
    manifest_path = folder / MANIFEST_FILE
    if not manifest_path.is_file():
        raise UserError(f"{folder} is not a complete checkpoint (no {MANIFEST_FILE}); "
                        "pick a checkpoints/step_N folder or use 'latest'")
    listed = json.loads(manifest_path.read_text())["files"]
    for name in listed:
        if Path(name).is_absolute() or ".." in Path(name).parts or name in ("", MANIFEST_FILE):
            raise UserError(f"{manifest_path} names {name!r}, which is not a file inside the checkpoint; the "
                            "checkpoint was not written by finetune: resume from another one")
    present = {p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file()} - {MANIFEST_FILE}
    unlisted = sorted(present - set(listed))
    if unlisted:
        raise UserError(f"{folder} holds {unlisted[0]}, which its manifest does not list; the checkpoint was "
                        "changed after it was written: resume from another one")
    for name, expected in listed.items():
        path = folder / name
        if not path.is_file():
            raise UserError(f"checkpoint file {path} is missing; resume from another checkpoint")
        if _sha256_and_sync(path) != expected:
            raise UserError(f"checkpoint file {path} is damaged (its checksum does not match the manifest); "
                            "resume from another checkpoint")


def _is_complete(folder: Path) -> bool:
    return (folder / MANIFEST_FILE).is_file()


def _complete_checkpoints(output_dir: str) -> list[tuple[int, Path]]:
    """(step, folder) of every checkpoint with a manifest, oldest first."""
    root = Path(output_dir) / "checkpoints"
    if not root.is_dir():
        return []
    return sorted((int(m.group(1)), p) for p in root.iterdir() if (m := _STEP_DIR.match(p.name)) and _is_complete(p))


def find_latest_checkpoint(output_dir: str) -> Path | None:
    """The newest checkpoint under ``output_dir/checkpoints`` whose files all verify, or None.

    A damaged newer checkpoint is skipped with a warning naming the file.
    """
    for _, folder in reversed(_complete_checkpoints(output_dir)):
        try:
            verify_checkpoint(folder)
        except UserError as err:
            print(f"warning: skipping {folder}: {err}", file=sys.stderr, flush=True)
            continue
        return folder
    return None


def resolve_resume_checkpoint(value: str | None, output_dir: str) -> Path | None:
    """The folder ``--resume_from_checkpoint`` names; ``latest`` with no checkpoint yet means a fresh start.

    Raises:
        UserError: the path is not a complete checkpoint.
    """
    if value is None:
        return None
    if value == "latest":
        return find_latest_checkpoint(output_dir)
    folder = Path(value)
    if not folder.is_dir():
        raise UserError(f"--resume_from_checkpoint {value}: no such folder; give a checkpoint folder or 'latest'")
    verify_checkpoint(folder)
    return folder


def prune_checkpoints(output_dir: str, limit: int | None) -> None:
    """Delete the oldest complete checkpoints so that at most ``limit`` remain."""
    if limit is None:
        return
    for _, folder in _complete_checkpoints(output_dir)[:-limit]:
        shutil.rmtree(folder)


def check_output_dir(output_dir: str, overwrite: bool, resuming: bool, remove: bool = True) -> None:
    """Refuse to write over a saved model or another run's checkpoints unless asked to.

    A fresh run (not resuming) with ``overwrite`` removes the other run's checkpoints first, so that pruning
    never mixes two runs' steps; only where ``remove`` is set (the process that holds ``output_dir_lock``).

    Raises:
        UserError: ``output_dir`` holds a model or complete checkpoints and neither ``overwrite`` nor
            ``resuming`` is set, or it is a file, or it cannot be written.
    """
    path = Path(output_dir)
    if path.exists() and not path.is_dir():
        raise UserError(f"--output_dir {output_dir} is a file; give a folder")
    existing = path.absolute()
    while not existing.exists():
        existing = existing.parent
    try:  # a real write, since permission bits say little to root or on read-only mounts
        os.rmdir(tempfile.mkdtemp(dir=existing, prefix=".write-test-"))
    except OSError as err:
        raise UserError(f"--output_dir {output_dir} cannot be written ({existing}: {err.strerror}); "
                        "choose another --output_dir") from None
    if resuming:
        return
    holds_model = (path / "config.json").is_file() or any(path.glob("model*.safetensors"))
    checkpoints = [folder.name for _, folder in _complete_checkpoints(output_dir)]
    if holds_model and not overwrite:
        raise UserError(f"--output_dir {output_dir} already holds a model; pass --overwrite_output_dir to replace it "
                        "or choose another --output_dir")
    if checkpoints and not overwrite:
        raise UserError(f"--output_dir {output_dir} already holds another run's checkpoints "
                        f"({', '.join(checkpoints[-3:])}); pass --resume_from_checkpoint latest to continue that run, "
                        "--overwrite_output_dir to remove them, or choose another --output_dir")
    if checkpoints and remove:
        shutil.rmtree(path / "checkpoints")


@contextlib.contextmanager
def output_dir_lock(output_dir: str):
    """Hold ``output_dir`` for one run: a second run on it is refused while this one lives.

    The lock is the kernel's (``flock`` on ``output_dir/.finetune.lock``): it ends with the process, so a
    run that was killed leaves nothing that blocks the next. The file names its holder for the refusal, and
    it is removed when the run ends, as is the folder if the run created it and left it empty.

    Raises:
        UserError: another living run holds the folder.
    """
    path = Path(output_dir)
    if path.exists() and not path.is_dir():
        raise UserError(f"--output_dir {output_dir} is a file; give a folder")
    created = not path.exists()
    lock_path = path / LOCK_FILE
    while True:
        try:
            path.mkdir(parents=True, exist_ok=True)
            descriptor = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as err:
            raise UserError(f"--output_dir {output_dir} cannot be written ({err.strerror}); choose another "
                            "--output_dir") from None
        try:
            fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(descriptor, 1024, 0).decode(errors="replace").strip() or "a process"
            os.close(descriptor)
            raise UserError(f"--output_dir {output_dir} is in use by another run ({holder}); wait for it to end or "
                            "choose another --output_dir") from None
        if os.path.exists(lock_path) and os.stat(lock_path).st_ino == os.fstat(descriptor).st_ino:
            break
        os.close(descriptor)  # the holder removed the file as we locked it: lock the current one
    try:
        os.ftruncate(descriptor, 0)
        started = time.strftime("%Y-%m-%d %H:%M:%S")
        os.pwrite(descriptor, f"pid {os.getpid()} on {socket.gethostname()}, started {started}\n".encode(), 0)
        yield
    finally:
        os.unlink(lock_path)
        os.close(descriptor)
        if created and not any(path.iterdir()):
            path.rmdir()


def check_unwrapped(state_dict: dict) -> None:
    """Raises ``ValueError`` when a key still carries a wrapper's prefix: the model was not unwrapped."""
    wrapped = [k for k in state_dict if k.startswith(_WRAPPER_PREFIXES)]
    if wrapped:
        raise ValueError(f"refusing to save a wrapped model: key {wrapped[0]!r} has a wrapper prefix")


def save_model(model: torch.nn.Module, state_dict: dict, tokenizer, output_dir: str) -> None:
    """Save an unwrapped model with ``save_pretrained`` (safetensors) and its tokenizer.

    ``state_dict`` is the full, unwrapped state (from the runtime), so sharded wrappers save correctly.
    """
    model.save_pretrained(output_dir, state_dict=state_dict, safe_serialization=True)
    tokenizer.save_pretrained(output_dir)


def load_state_dict_unwrapped(path: str | os.PathLike) -> dict[str, torch.Tensor]:
    """Load a state dict (safetensors, or a torch file as tensors only) and strip wrapper prefixes.

    A naive DDP script saves ``model.state_dict()`` of the wrapper, whose keys start with ``module.``;
    ``torch.compile`` adds ``_orig_mod.``. Both are removed, and a warning says so once.
    """
    path = Path(path)
    if path.suffix == ".safetensors":
        state = load_file(path)
    else:
        state = torch.load(path, map_location="cpu", weights_only=True)
    repaired = {}
    stripped = set()
    for key, value in state.items():
        new_key = key
        while new_key.startswith(_WRAPPER_PREFIXES):
            prefix = next(p for p in _WRAPPER_PREFIXES if new_key.startswith(p))
            stripped.add(prefix)
            new_key = new_key[len(prefix):]
        repaired[new_key] = value
    if stripped:
        logger.warning("%s: removed wrapper prefix(es) %s from the keys", path, ", ".join(sorted(stripped)))
    return repaired
