"""Where checkpoints live, what makes one complete, and saving a model without its wrapper.

Layout under ``OUTPUT_DIR``: the final model (a plain Hugging Face folder) at the top, full training
states in ``checkpoints/step_N``. A checkpoint is written into ``step_N.partial``; once every file is
there and flushed to disk, ``manifest.json`` (step, epoch, world size, seed, versions and a SHA-256 of
each file) is written last and the folder is renamed into place. A folder named ``step_N`` with a
manifest is complete, and it is used only if every checksum still matches. The final model is written
the same way, into ``.final.partial`` first.

Each checkpoint names the run it belongs to (``Progress.run_id``: new at a fresh start, kept by every
resume) and the launch that wrote it (``Progress.launch_id``): pruning and ``--overwrite_output_dir`` keep
to the run, and a launcher's automatic restart resumes only from what its own launch wrote.
"""

from __future__ import annotations

import contextlib
import errno
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
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import psutil
import torch
import xxhash
from safetensors import SafetensorError
from safetensors.torch import load_file

from finetune import __version__
from finetune.checkpointing.files import fsync_directory, replacing
from finetune.environment import LaunchEnvironment
from finetune.errors import UserError

__all__ = [
    "Progress",
    "check_output_dir",
    "check_unwrapped",
    "checkpoint_path",
    "clear_output_dir",
    "disk_write_failure",
    "find_latest_checkpoint",
    "frozen_weights_digest",
    "launch_id",
    "load_state_dict_unwrapped",
    "output_dir_lock",
    "prune_checkpoints",
    "read_progress",
    "resolve_resume_checkpoint",
    "resumed_progress",
    "save_model",
    "tensors_digest",
    "verify_checkpoint",
    "write_final_model",
    "write_manifest",
    "write_progress",
]

logger = logging.getLogger(__name__)

PROGRESS_FILE = "progress.json"
MANIFEST_FILE = "manifest.json"
LOCK_FILE = ".finetune.lock"
LOG_HISTORY = "log_history.jsonl"
FINAL_PARTIAL = ".final.partial"
SAVED_FILES = ".finetune_saved.json"
"""The files the last final save wrote, relative to the output folder: the next save removes those it does not
write."""
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
    # Which run and launch wrote the checkpoint (see the module's docstring); "" in checkpoints from before.
    run_id: str = ""
    launch_id: str = ""
    per_device_train_batch_size: int | None = None
    """None in a checkpoint written before the batch was recorded."""
    gradient_accumulation_steps: int | None = None
    frozen_weights: str = ""
    """``frozen_weights_digest`` of the model: what a LoRA checkpoint does not hold, the base it was trained on;
    "" in a checkpoint written before it was recorded."""
    task_state: dict = field(default_factory=dict)
    """What the task keeps across steps besides the model, as JSON values (GRPO's reward-failure counters): its
    ``state_dict()`` when the checkpoint was written, the same on every process."""

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


def _written_by(folder: Path) -> Progress | None:
    """The progress a checkpoint recorded, or None when it cannot be read (then it counts as no run's)."""
    try:
        return read_progress(folder)
    except (OSError, ValueError, TypeError):
        return None


def launch_id(env: LaunchEnvironment) -> str:
    """What stays the same when a launcher starts this process again: the Slurm job (every attempt of a
    requeued job), else torchrun's run id (``--rdzv_id``), else the launcher's process; "" for a process that
    no launcher restarts."""
    if env.slurm_job_id:
        return f"slurm:{env.slurm_cluster}:{env.slurm_job_id}"
    if not env.torchrun:
        return ""
    if env.torchrun_run_id not in ("", "none"):
        return f"torchrun:{env.torchrun_run_id}"
    agent = psutil.Process().parent()  # torchrun's agent (or accelerate launch's), which restarts its workers
    return f"agent:{socket.gethostname()}:{agent.pid}:{agent.create_time()}" if agent else ""


def resumed_progress(saved: Progress, run: Progress, folder: Path, batches_per_rank: int) -> Progress:
    """Where ``run`` (a fresh ``Progress`` with this run's processes, batch and accumulation) continues the
    checkpoint ``folder`` whose progress is ``saved``; ``batches_per_rank`` is this run's per epoch.

    The plan of global batches depends on the global batch (per-device batch x processes x accumulation),
    not on how it is split, so another world size resumes when the global batch is kept. The position in the
    epoch, in micro-batches per process, carries over through the optimizer steps done.

    Raises:
        UserError: the global batch or the seed would change (the message names the per-device batch or
            accumulation that keeps it), another world size resumes a checkpoint that does not record its batch,
            or the frozen weights differ (another base model of the same shapes, which loading the trained weights
            would not show).
    """
    if saved.frozen_weights and saved.frozen_weights != run.frozen_weights:
        raise UserError(f"{folder} was trained on other frozen weights than this run's model (another base model, "
                        "or another version of it): the weights it holds were trained for that one; resume with the "
                        "--model_name_or_path it was started with")
    if saved.seed != run.seed:
        raise UserError(f"{folder} was written by a run with --seed {saved.seed} and this run has --seed {run.seed}; "
                        f"the order of the data depends on it, so resume with --seed {saved.seed}")
    current = {"world_size": run.world_size, "runtime": run.runtime,
               "per_device_train_batch_size": run.per_device_train_batch_size,
               "gradient_accumulation_steps": run.gradient_accumulation_steps, "frozen_weights": run.frozen_weights}
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
    manifest = {**asdict(progress), "finetune_version": __version__, "torch_version": torch.__version__,
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


def find_latest_checkpoint(output_dir: str, launch: str | None = None) -> Path | None:
    """The newest checkpoint under ``output_dir/checkpoints`` whose files all verify (of those written by the
    launch ``launch``, when given), or None.

    A damaged newer checkpoint is skipped with a warning naming the file.
    """
    for _, folder in reversed(_complete_checkpoints(output_dir)):
        if launch is not None and getattr(_written_by(folder), "launch_id", None) != launch:
            continue
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


def _checkpoints_of(output_dir: str, run_id: str) -> list[tuple[int, Path]]:
    """(step, folder) of the complete checkpoints of run ``run_id``."""
    return [(step, folder) for step, folder in _complete_checkpoints(output_dir)
            if getattr(_written_by(folder), "run_id", None) == run_id]


def prune_checkpoints(output_dir: str, limit: int | None, progress: Progress) -> None:
    """Delete this run's oldest checkpoints up to ``progress``'s step so that at most ``limit`` of them remain;
    another run's checkpoints, and this run's of later steps (from before it resumed from an earlier one), are
    left alone."""
    if limit is None:
        return
    mine = [(step, folder) for step, folder in _checkpoints_of(output_dir, progress.run_id)
            if step <= progress.global_step]
    for _, folder in mine[:-limit]:
        shutil.rmtree(folder)


def check_output_dir(output_dir: str, overwrite: bool, resume_from: Path | None, found_in_folder: bool = False
                     ) -> None:
    """Refuse to write over a saved model or checkpoints of another trajectory unless asked to; change nothing.

    ``found_in_folder``: ``resume_from`` is what ``latest`` (or a launcher's restart) found in ``output_dir``, the
    newest checkpoint there that verifies, or None when none does. What ``overwrite`` removes stays until
    ``clear_output_dir``, once the run has what it needs to start.

    Raises:
        UserError: a fresh run (``resume_from`` None) into a folder that holds a model or complete checkpoints,
            or a resumed run into one that holds complete checkpoints of later steps (``latest`` would take those:
            another run's, or those of the trajectory this resume abandons), unless ``overwrite``; ``output_dir``
            is a file or cannot be written.
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
    if overwrite:
        return
    if resume_from is not None:
        resumed = read_progress(resume_from)
        # Later checkpoints of its own run that `latest` skipped are damaged ones, which it will skip again.
        later = [(folder.name, getattr(_written_by(folder), "run_id", None) == resumed.run_id)
                 for step, folder in _complete_checkpoints(output_dir) if step > resumed.global_step]
        later = [(name, own) for name, own in later if not (own and found_in_folder)]
        if later:
            names = ", ".join(name for name, _ in later[-3:])
            whose, then = (("checkpoints of its own run", "continue the trajectory this resume abandons")
                           if any(own for _, own in later) else ("another run's checkpoints", "continue that run"))
            raise UserError(f"--output_dir {output_dir} holds {whose} of later steps ({names}) than {resume_from}, "
                            f"which this run resumes from, and `latest` would {then}; pass --overwrite_output_dir to "
                            "remove them once this run starts, or choose another --output_dir")
        return
    if any((path / name).is_file() for name in ("config.json", "adapter_config.json")) or any(
            path.glob("*model*.safetensors")):
        raise UserError(f"--output_dir {output_dir} already holds a model; pass --overwrite_output_dir to replace it "
                        "or choose another --output_dir")
    checkpoints = [folder.name for _, folder in _complete_checkpoints(output_dir)]
    if checkpoints and found_in_folder:
        raise UserError(f"--output_dir {output_dir} holds checkpoints ({', '.join(checkpoints[-3:])}) of which none "
                        "verifies (see the warnings above), so --resume_from_checkpoint latest has none to continue "
                        "from; pass --overwrite_output_dir to start afresh and remove them, or resume from a copy "
                        "elsewhere with --resume_from_checkpoint PATH")
    if checkpoints:
        raise UserError(f"--output_dir {output_dir} already holds another run's checkpoints "
                        f"({', '.join(checkpoints[-3:])}); pass --resume_from_checkpoint latest to continue that run, "
                        "--overwrite_output_dir to remove them, or choose another --output_dir")


def clear_output_dir(output_dir: str, progress: Progress, overwrite: bool, run_files: Iterable[str] = ()) -> None:
    """What a run removes once it has what it needs to start (its data, model and checkpoint loaded): with
    ``overwrite``, every other run's checkpoints and its own run's of later steps than ``progress`` (a resume from
    an earlier step abandons them); at a fresh start, an earlier run's ``log_history.jsonl`` and ``run_files`` (the
    task's files for a resume of that run), and at a resume the log's lines of later steps (logged again now, or
    abandoned). Call it on the process that holds ``output_dir_lock``."""
    if overwrite:
        for step, folder in _complete_checkpoints(output_dir):
            if getattr(_written_by(folder), "run_id", None) != progress.run_id or step > progress.global_step:
                shutil.rmtree(folder)
    log = Path(output_dir) / LOG_HISTORY
    if progress.global_step == 0:
        for name in (LOG_HISTORY, *run_files):
            (Path(output_dir) / name).unlink(missing_ok=True)
    elif log.is_file():
        lines = log.read_text().splitlines(keepends=True)
        with replacing(log) as partial:
            partial.write_text("".join(line for line in lines if _logged_step(line) <= progress.global_step))


def _logged_step(line: str) -> float:
    """The step of a ``log_history.jsonl`` line; infinity for a line cut short by a kill."""
    try:
        return json.loads(line)["step"]
    except (ValueError, KeyError, TypeError):
        return math.inf


@contextlib.contextmanager
def output_dir_lock(output_dir: str):
    """Hold ``output_dir`` for one run: a second run on it is refused while this one lives.

    The lock is the kernel's (``flock`` on ``output_dir/.finetune.lock``): it ends with the process, so a
    run that was killed leaves nothing that blocks the next. The file names its holder for the refusal, and
    it is removed when the run ends, as is the folder if the run created it and left it empty.

    The lock file is never followed through a symbolic link: one planted there would have the run truncate the
    file it points to.

    Raises:
        UserError: another living run holds the folder, or the lock file's name is a symbolic link.
    """
    path = Path(output_dir)
    if path.exists() and not path.is_dir():
        raise UserError(f"--output_dir {output_dir} is a file; give a folder")
    created = not path.exists()
    lock_path = path / LOCK_FILE
    while True:
        try:
            path.mkdir(parents=True, exist_ok=True)
            descriptor = os.open(lock_path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o644)
        except OSError as err:
            if err.errno == errno.ELOOP:
                raise UserError(f"{lock_path} is a symbolic link, not finetune's lock file; remove it or choose "
                                "another --output_dir") from None
            raise UserError(f"--output_dir {output_dir} cannot be written ({err.strerror}); choose another "
                            "--output_dir") from None
        try:
            fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(descriptor, 1024, 0).decode(errors="replace").strip() or "a process"
            os.close(descriptor)
            raise UserError(f"--output_dir {output_dir} is in use by another run ({holder}); wait for it to end or "
                            "choose another --output_dir") from None
        if os.path.lexists(lock_path) and os.lstat(lock_path).st_ino == os.fstat(descriptor).st_ino:
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


def frozen_weights_digest(model: torch.nn.Module) -> str:
    """``tensors_digest`` of the parameters that do not train: with LoRA the base model, which a checkpoint does not
    hold (``trainable_state_dict``); in a full fine-tune none."""
    return tensors_digest((name, param) for name, param in model.named_parameters() if not param.requires_grad)


def tensors_digest(tensors: Iterable[tuple[str, torch.Tensor]]) -> str:
    """An xxh3-128 hash of named tensors (a state dict's items): their names, dtypes, shapes and values."""
    digest = xxhash.xxh3_128()
    for name, tensor in tensors:
        data = tensor.detach().contiguous().cpu().reshape(-1)
        digest.update(f"{name} {data.dtype} {tuple(tensor.shape)}\n".encode())
        digest.update(data.view(torch.uint8).numpy())
    return digest.hexdigest()


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


def write_final_model(output_dir: str, write: Callable[[Path], None]) -> list[str]:
    """Write the final model with ``write(folder)`` into ``output_dir/.final.partial``, flush it to disk, then move
    each file and folder into ``output_dir`` (an entry of the same name there is replaced) and remove the files
    the previous final save wrote that this one did not (an adapter beside a new full model, an old model card,
    ``merged/``); returns the paths, relative to ``output_dir``, of the files written: what this run saved.

    Until everything is written and flushed, the model already in ``output_dir`` is untouched; a kill then
    leaves only the hidden partial folder, which the next save removes. Each file is replaced whole. Files no
    save wrote (the user's own, checkpoints, the log) stay: ``SAVED_FILES`` records what each save wrote, and
    while one save replaces another it lists the files of both.
    Raises what ``write`` raises (``.final.partial`` is removed first).
    """
    output = Path(output_dir)
    staging, replaced = output / FINAL_PARTIAL, output / ".final.replaced"
    for leftover in (staging, replaced):
        shutil.rmtree(leftover, ignore_errors=True)
    staging.mkdir()
    try:
        write(staging)
        files = sorted(path.relative_to(staging).as_posix() for path in staging.rglob("*") if path.is_file())
        for name in files:
            with open(staging / name, "rb") as f:
                os.fsync(f.fileno())
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    earlier = _saved_files(output)
    _write_saved_files(output, sorted({*earlier, *files}))
    replaced.mkdir()
    for entry in sorted(staging.iterdir()):
        target = output / entry.name
        if target.is_dir() or (entry.is_dir() and os.path.lexists(target)):  # rename replaces files, not folders
            target.rename(replaced / entry.name)
        entry.replace(target)
    fsync_directory(output)
    shutil.rmtree(replaced)
    staging.rmdir()
    for name in sorted(set(earlier) - set(files)):
        path = output / name
        path.unlink(missing_ok=True)
        for folder in path.parents:  # the folders it leaves empty, up to the output folder
            if folder == output or any(folder.iterdir()):
                break
            folder.rmdir()
    _write_saved_files(output, files)
    return files


def _saved_files(output: Path) -> list[str]:
    """The names in ``SAVED_FILES`` of files a save may have written: inside ``output``, none hidden (the lock, the
    record itself) and reached through no symbolic link, since a record edited by hand must reach nothing else."""
    try:
        names = json.loads((output / SAVED_FILES).read_text())
    except (OSError, ValueError):
        return []
    root = output.resolve()
    return [name for name in names if isinstance(name, str) and Path(name).parts and not Path(name).is_absolute()
            and not any(part == ".." or part.startswith(".") for part in Path(name).parts)
            and (output / name).parent.resolve() == (root / name).parent and not (output / name).is_dir()]


def _write_saved_files(output: Path, names: list[str]) -> None:
    with replacing(output / SAVED_FILES, durable=True) as partial:
        partial.write_text(json.dumps(names, indent=2))


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
