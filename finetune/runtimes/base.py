"""The interface the training loop runs through (it knows no task), and what every runtime shares.

The loop never asks which launcher started it: ``launcher.make_runtime`` picks Accelerate (``accelerate``), raw
DDP (``ddp``) or FSDP on raw DDP's process group (``fsdp``), and all answer the same calls. The abstract methods
are what differs between them: loaders and the model's wrapping, accumulation and gradient synchronisation,
collectives, unwrapping, and their part of a checkpoint; the rest (the stop vote, checkpoint folders, trainable
weights and RNG states, trackers) is written once here.
"""

from __future__ import annotations

import codecs
import pickle
import random
import shutil
from abc import ABC, abstractmethod
from collections.abc import Iterable
from contextlib import AbstractContextManager, nullcontext
from datetime import timedelta
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from safetensors import SafetensorError
from torch.utils.data import DataLoader

from finetune.checkpointing.checkpoint import (
    Progress,
    checkpoint_path,
    disk_write_failure,
    prune_checkpoints,
    write_manifest,
    write_progress,
)
from finetune.checkpointing.files import fsync_directory
from finetune.data.batching import GlobalBatchSampler
from finetune.distributed.fsdp import MODEL_FOLDER
from finetune.errors import Stopped, UserError
from finetune.observability.trackers import FLUSH_TIMEOUT, STOP_FLUSH_TIMEOUT, Trackers, TrackerSettings

__all__ = ["Runtime", "TrackerSettings", "check_trainable_shapes", "load_rng_state", "load_trainable_state",
           "own_generator", "save_rng_state", "trainable_state_dict"]


SAVE_WAIT = timedelta(days=7)
_RNG_STATE_GLOBALS = [np.empty(0).__reduce__()[0], np.ndarray, np.dtype, np.dtypes.UInt32DType, codecs.encode]
"""What numpy's RNG state needs to unpickle (an array's pickle calls the first, numpy's private reconstructor), and
nothing that could run code."""


class Runtime(ABC):
    """What the training loop needs from a distributed runtime. Use it as a context manager."""

    name: str
    world_size: int
    rank: int
    device: torch.device
    shards = False
    """Whether each process holds only its shard of the weights and optimizer state (FSDP)."""
    _cpu_group_handle = None
    _trackers: Trackers | None = None

    @property
    def shards_weights(self) -> bool:
        """Whether each process holds only its shard of the weights, by this runtime (FSDP) or an engine it hands
        the model to (DeepSpeed ZeRO-3)."""
        return self.shards

    @property
    def is_main_process(self) -> bool:
        return self.rank == 0

    def print(self, *values) -> None:
        """``print`` on the main process only."""
        if self.is_main_process:
            print(*values, flush=True)

    def __enter__(self) -> Runtime:
        return self

    def __exit__(self, exc_type, *exc_info) -> None:
        try:
            if self._trackers is not None:
                # A stop has a scheduler's kill grace to fit in: its checkpoint is complete, the trackers get little.
                self._trackers.close(STOP_FLUSH_TIMEOUT if exc_type is Stopped else FLUSH_TIMEOUT)
        finally:
            self.close()

    def _start_tracking(self, tracking: TrackerSettings | None) -> None:
        """The trackers ``tracking`` names, on the main process; the same under every launcher."""
        if tracking and self.is_main_process:
            self._trackers = Trackers(tracking)

    @abstractmethod
    def train_loader(self, dataset, sampler: GlobalBatchSampler, collate_fn) -> DataLoader:
        """A loader over this process's share of every global batch that ``sampler`` plans."""

    @abstractmethod
    def eval_loader(self, dataset, batch_size: int, collate_fn) -> DataLoader:
        """A loader over this process's share of the evaluation set, in order."""

    @abstractmethod
    def prepare(self, model, optimizer, scheduler, *loaders) -> tuple:
        """Move to the device and wrap for data parallelism; returns them all in the same order."""

    @abstractmethod
    def epoch_batches(self, train_loader, epoch: int, skip_batches: int = 0) -> Iterable[dict]:
        """Batches of ``epoch`` (its own shuffle), the first ``skip_batches`` left out (resuming)."""

    @abstractmethod
    def accumulate(self, model, ends_step: bool) -> AbstractContextManager:
        """Context for one micro-step, the last before an optimizer step where ``ends_step`` (the loop counts them;
        the loader's position cannot say, as a rollout takes a whole window from it before it trains): gradients
        are all-reduced only then."""

    @property
    @abstractmethod
    def sync_gradients(self) -> bool:
        """True inside the micro-step that ends an accumulation window: time to step the optimizer."""

    def optimizer_step_was_skipped(self) -> bool:
        """Whether the optimizer step just taken (asked once after each) left the weights as they were: an fp16
        loss scaler found gradients that overflowed, and lowered its scale for the next step."""
        return False

    @abstractmethod
    def backward(self, loss: torch.Tensor) -> None:
        """Backpropagate ``loss``, already normalised over the whole window and all processes."""

    @abstractmethod
    def clip_grad_norm_(self, model, max_norm: float) -> torch.Tensor: ...

    @abstractmethod
    def gather_for_metrics(self, tensors: tuple[torch.Tensor, ...], pad_index: int = -100
                           ) -> tuple[torch.Tensor, ...]:
        """All processes' values of one evaluation batch, each example exactly once, in dataset order.

        A second dimension may differ between processes (token-level outputs): it is padded with
        ``pad_index`` to the longest.
        """

    @abstractmethod
    def reduce_sum(self, tensor: torch.Tensor) -> torch.Tensor: ...

    @abstractmethod
    def wait_for_everyone(self) -> None: ...

    def wait_for_save(self) -> None:
        """Wait for the processes that write files (a checkpoint, the final model, the data cache) to finish,
        however long that takes.

        A plain barrier is a collective bound by ``--ddp_timeout`` (and NCCL's watchdog): a slow disk or a
        long tokenization on one process would abort the others. This waits on a separate gloo group with no practical
        limit; a main process that dies is noticed by the launcher, which ends the job.
        """
        if self.world_size > 1:
            dist.monitored_barrier(group=self._cpu_group(), timeout=SAVE_WAIT)

    def autocast(self) -> AbstractContextManager:
        """The autocast the prepared model's forward runs under (none here): to run the model as ``prepare`` would
        have it run before it is prepared (the memory predicted before the model loads)."""
        return nullcontext()

    def first_refusal(self, message: str | None) -> str | None:
        """The message of the first process (by rank) that refused, for every process; None where none did.

        A refusal that only some processes meet (the data builders) ends every process at once, with the same
        message, rather than leaving the others to wait until the launcher kills them."""
        if self.world_size == 1:
            return message
        messages: list[str | None] = [None] * self.world_size
        dist.all_gather_object(messages, message, group=self._cpu_group())
        return next((message for message in messages if message is not None), None)

    def max_over_processes(self, values: list[float]) -> list[float]:
        """Each value's maximum over all processes.

        It runs on a gloo group over CPU tensors, so on a GPU it neither waits for the device's queued
        work nor makes the device wait: cheap enough for every optimizer step.
        """
        if self.world_size == 1:
            return values
        tensor = torch.tensor(values, dtype=torch.float64)
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=self._cpu_group())
        return tensor.tolist()

    def _cpu_group(self):
        if self._cpu_group_handle is None:
            self._cpu_group_handle = dist.new_group(backend="gloo")
        return self._cpu_group_handle

    @abstractmethod
    def unwrap(self, model) -> torch.nn.Module: ...

    @abstractmethod
    def unwrapped_state_dict(self, model) -> dict[str, torch.Tensor]: ...

    @abstractmethod
    def _save_state(self, folder: Path) -> None:
        """Write model, optimizer, scheduler and every process's RNG states into ``folder``."""

    @abstractmethod
    def _load_state(self, folder: Path) -> None:
        """Restore what ``_save_state`` wrote: weights from safetensors, the rest with ``weights_only``."""

    def load_state(self, folder: Path) -> None:
        """Restore a checkpoint; a file that would need arbitrary code to unpickle is refused.

        Raises:
            UserError: a file in ``folder`` holds more than tensors and plain values, or the checkpoint is
                sharded and this run is not (or the other way round).
        """
        if (folder / MODEL_FOLDER).is_dir() != self.shards:
            raise UserError(
                f"{folder} was written by a sharded (FSDP) run; resume it with --fsdp under torchrun, or with "
                "accelerate_configs/fsdp.yaml on GPUs" if not self.shards else
                f"{folder} was written by a run that did not shard (DDP); resume it without --fsdp")
        try:
            self._load_state(folder)
        except pickle.UnpicklingError as err:
            reason = str(err).strip().splitlines()[0]
            raise UserError(f"{folder} holds a file that is not plain tensors and values ({reason[:200]}); "
                            "it was not loaded, since loading it could run code") from None

    def log(self, values: dict[str, float], step: int) -> None:
        """Queue ``values`` for the trackers (main process only); returns at once, whatever they do."""
        if self._trackers is not None:
            self._trackers.log(values, step)

    @abstractmethod
    def close(self) -> None: ...

    def save_checkpoint(self, output_dir: str, progress: Progress, keep: int | None) -> Path:
        """Write a complete checkpoint for ``progress`` atomically, then prune old ones; returns its folder."""
        final = checkpoint_path(output_dir, progress.global_step)
        partial = final.with_name(final.name + ".partial")
        if self.is_main_process:
            shutil.rmtree(partial, ignore_errors=True)
            partial.mkdir(parents=True)
        self.wait_for_everyone()
        try:
            self._save_state(partial)
            self.wait_for_save()
            if self.is_main_process:
                write_progress(partial, progress)
                if self._trackers is not None:
                    self._trackers.settings.write_run(partial)
                write_manifest(partial, progress)
                _put_in_place(partial, final)
                prune_checkpoints(output_dir, keep, progress)
        except (OSError, RuntimeError, SafetensorError) as err:
            shutil.rmtree(partial, ignore_errors=True)
            if (reason := disk_write_failure(err)) is None:
                raise
            raise UserError(f"cannot write checkpoint {final} ({reason}); free disk space or choose another "
                            "--output_dir; earlier checkpoints are intact") from None
        self.wait_for_save()
        return final


def _put_in_place(partial: Path, final: Path) -> None:
    """Renames the complete checkpoint ``partial`` to ``final``. A checkpoint already there (an earlier run of the
    same step, e.g. before a restart) is moved aside until the new one is in place, and put back if it cannot be:
    there is a complete checkpoint of the step at every moment but between two renames."""
    replaced = final.with_name(final.name + ".replaced")
    shutil.rmtree(replaced, ignore_errors=True)
    if final.exists():
        final.rename(replaced)
    try:
        partial.rename(final)
    except OSError:
        if replaced.exists():
            replaced.rename(final)
        raise
    fsync_directory(final.parent)
    shutil.rmtree(replaced, ignore_errors=True)


def trainable_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """What a checkpoint holds of an unwrapped model: the weights that train (all of them in a full fine-tune,
    the adapter with LoRA). The frozen rest is the base model, loaded again from where it came."""
    return {name: param.detach().contiguous() for name, param in model.named_parameters() if param.requires_grad}


def load_trainable_state(model: torch.nn.Module, state: dict[str, torch.Tensor], folder: Path) -> None:
    """Load what ``trainable_state_dict`` saved into an unwrapped model.

    Raises:
        UserError: the checkpoint holds other weights than those that train here (another model, another
            LoRA configuration, LoRA against a full fine-tune).
    """
    check_trainable_shapes(model, {name: tuple(tensor.shape) for name, tensor in state.items()}, folder)
    model.load_state_dict(state, strict=False)


def check_trainable_shapes(model: torch.nn.Module, found: dict[str, tuple[int, ...]], folder: Path) -> None:
    """Raises ``UserError`` unless ``found`` (a checkpoint's weight names and shapes) are the weights that train
    in ``model``, named as in the unwrapped model."""
    expected = {name: tuple(param.shape) for name, param in model.named_parameters() if param.requires_grad}
    if found != expected:
        differences = [f"{name} missing" for name in expected.keys() - found.keys()]
        differences += [f"{name} unexpected" for name in found.keys() - expected.keys()]
        differences += [f"{name}: {found[name]} in the checkpoint, {shape} here" for name, shape in expected.items()
                        if name in found and found[name] != shape]
        raise UserError(f"{folder} holds other trainable weights than this run ({len(differences)} differ, e.g. "
                        f"{sorted(differences)[0]}): it was written with another model or LoRA configuration; "
                        "resume with the flags that wrote it")


def save_rng_state(folder: Path, rank: int) -> None:
    """Write this process's RNG states (Python, numpy, torch, CUDA) as ``accelerator.save_state`` does."""
    rng = {
        "step": 0,
        "random_state": random.getstate(),
        "numpy_random_seed": np.random.get_state(),
        "torch_manual_seed": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        rng["torch_cuda_manual_seed"] = torch.cuda.get_rng_state_all()
    torch.save(rng, folder / f"random_states_{rank}.pkl")


def load_rng_state(folder: Path, rank: int) -> None:
    """Restore the RNG states ``save_rng_state`` wrote for ``rank``.

    A process the checkpoint has no states for (resuming with more processes than wrote it) keeps those the
    seed gave it, as every process of a fresh run starts: its dropout masks are new ones, which a change of
    world size makes of every process's anyway (each example meets other masks on another process).
    """
    path = folder / f"random_states_{rank}.pkl"
    if not path.exists():
        return
    with torch.serialization.safe_globals(_RNG_STATE_GLOBALS):
        rng = torch.load(path, weights_only=True)
    random.setstate(rng["random_state"])
    np.random.set_state(rng["numpy_random_seed"])
    torch.set_rng_state(rng["torch_manual_seed"])
    if torch.cuda.is_available() and "torch_cuda_manual_seed" in rng:
        torch.cuda.set_rng_state_all(rng["torch_cuda_manual_seed"])


def own_generator(seed: int) -> torch.Generator:
    """A generator for a DataLoader's worker seeds.

    Without one, every new DataLoader iterator draws from the global RNG, so a resumed run (which starts
    its iterator after restoring the RNG) would see different dropout masks from the run it continues.
    """
    return torch.Generator().manual_seed(seed)
