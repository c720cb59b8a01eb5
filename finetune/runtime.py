"""The narrow interface a recipe trains through, and its Accelerate implementation.

A recipe never asks which launcher started it: ``make_runtime`` picks Accelerate or raw DDP
(``finetune.ddp``) and both answer the same calls. The interface holds only what differs between the
two: building and preparing loaders and the model, gradient synchronisation, collectives, and
saving/restoring state.
"""

from __future__ import annotations

import os
import pickle
import shutil
from abc import ABC, abstractmethod
from collections.abc import Iterable
from contextlib import AbstractContextManager
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader

from finetune.checkpoint import Progress, checkpoint_path, prune_checkpoints, write_manifest, write_progress
from finetune.config import ClassifyConfig
from finetune.data import GlobalBatchSampler
from finetune.errors import UserError

__all__ = ["AccelerateRuntime", "Runtime", "make_runtime", "own_generator", "started_by_torchrun"]


SAVE_WAIT = timedelta(days=7)


class Runtime(ABC):
    """What a recipe needs from a distributed runtime. Use it as a context manager."""

    name: str
    world_size: int
    rank: int
    device: torch.device
    _save_group = None

    @property
    def is_main_process(self) -> bool:
        return self.rank == 0

    def print(self, *values) -> None:
        """``print`` on the main process only."""
        if self.is_main_process:
            print(*values, flush=True)

    def __enter__(self) -> Runtime:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    @abstractmethod
    def train_loader(self, dataset, sampler: GlobalBatchSampler, collate_fn) -> DataLoader:
        """A loader over this process's share of every global batch that ``sampler`` plans."""

    @abstractmethod
    def eval_loader(self, dataset, batch_size: int, collate_fn) -> DataLoader:
        """A loader over this process's share of the evaluation set, in order."""

    @abstractmethod
    def prepare(self, model, optimizer, scheduler, train_loader, eval_loader) -> tuple:
        """Move to the device and wrap for data parallelism; returns the five in the same order."""

    @abstractmethod
    def epoch_batches(self, train_loader, epoch: int, skip_batches: int = 0) -> Iterable[dict]:
        """Batches of ``epoch`` (its own shuffle), the first ``skip_batches`` left out (resuming)."""

    @abstractmethod
    def accumulate(self, model) -> AbstractContextManager:
        """Context for one micro-step: gradients are all-reduced only on the last of a window."""

    @property
    @abstractmethod
    def sync_gradients(self) -> bool:
        """True inside the micro-step that ends an accumulation window: time to step the optimizer."""

    @abstractmethod
    def backward(self, loss: torch.Tensor) -> None:
        """Backpropagate ``loss``, already normalised over the whole window and all processes."""

    @abstractmethod
    def clip_grad_norm_(self, model, max_norm: float) -> torch.Tensor: ...

    @abstractmethod
    def gather_for_metrics(self, tensors: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        """All processes' values, each evaluation example exactly once, in dataset order."""

    @abstractmethod
    def reduce_sum(self, tensor: torch.Tensor) -> torch.Tensor: ...

    @abstractmethod
    def wait_for_everyone(self) -> None: ...

    def wait_for_save(self) -> None:
        """Wait for the main process to finish writing files, however long that takes.

        A plain barrier is a collective bound by ``--ddp_timeout`` (and NCCL's watchdog): a slow disk on
        the main process would abort the others. This waits on a separate gloo group with no practical
        limit; a main process that dies is noticed by the launcher, which ends the job.
        """
        if self.world_size > 1:
            if self._save_group is None:
                self._save_group = dist.new_group(backend="gloo")
            dist.monitored_barrier(group=self._save_group, timeout=SAVE_WAIT)

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
            UserError: a file in ``folder`` holds more than tensors and plain values.
        """
        try:
            self._load_state(folder)
        except pickle.UnpicklingError as err:
            reason = str(err).strip().splitlines()[0]
            raise UserError(f"{folder} holds a file that is not plain tensors and values ({reason[:200]}); "
                            "it was not loaded, since loading it could run code") from None

    @abstractmethod
    def log(self, values: dict[str, float], step: int) -> None:
        """Send ``values`` to the trackers (main process only)."""

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
                write_manifest(partial, progress)
                if final.exists():  # an earlier run of the same step, e.g. before a restart
                    shutil.rmtree(final)
                partial.rename(final)
                _fsync_directory(final.parent)
                prune_checkpoints(output_dir, keep)
        except OSError as err:
            shutil.rmtree(partial, ignore_errors=True)
            raise UserError(f"cannot write checkpoint {final} ({err.strerror or err}); free disk space or "
                            "choose another --output_dir; earlier checkpoints are intact") from None
        self.wait_for_save()
        return final


def _fsync_directory(path: Path) -> None:
    """Make a rename inside ``path`` durable."""
    descriptor = os.open(path, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def own_generator(seed: int) -> torch.Generator:
    """A generator for a DataLoader's worker seeds.

    Without one, every new DataLoader iterator draws from the global RNG, so a resumed run (which starts
    its iterator after restoring the RNG) would see different dropout masks from the run it continues.
    """
    return torch.Generator().manual_seed(seed)


def started_by_torchrun() -> bool:
    """torchrun sets TORCHELASTIC_RUN_ID; ``accelerate launch`` sets ACCELERATE_* variables besides."""
    return "TORCHELASTIC_RUN_ID" in os.environ and not any(k.startswith("ACCELERATE_") for k in os.environ)


def make_runtime(cfg: ClassifyConfig) -> Runtime:
    """The runtime ``cfg.runtime`` names; ``auto`` is raw DDP under torchrun, Accelerate otherwise."""
    kind = cfg.runtime
    if kind == "auto":
        kind = "ddp" if started_by_torchrun() else "accelerate"
    if kind == "ddp":
        from finetune.ddp import DDPRuntime

        return DDPRuntime(cfg)
    return AccelerateRuntime(cfg)


class AccelerateRuntime(Runtime):
    """``accelerate.Accelerator`` underneath; launch with ``accelerate launch`` (or plain python)."""

    name = "accelerate"

    def __init__(self, cfg: ClassifyConfig):
        from accelerate import Accelerator, DataLoaderConfiguration, InitProcessGroupKwargs
        from accelerate.utils import ProjectConfiguration

        self._train_sampler: GlobalBatchSampler | None = None
        self.seed = cfg.seed
        launched = int(os.environ.get("WORLD_SIZE", "1"))
        cpu = not torch.accelerator.is_available()
        if launched > 1 and int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0:
            # Accelerate would join through the store the dead attempt left behind; it adopts a group
            # that already exists, so form a fresh one for this attempt first.
            from finetune.ddp import init_distributed

            init_distributed("gloo" if cpu else None, timedelta(seconds=cfg.ddp_timeout))
        self.accelerator = Accelerator(
            # Without cpu=True a multi-process launch on a machine with no accelerator starts processes
            # that each train alone; with it they form one gloo group.
            cpu=cpu,
            mixed_precision=cfg.mixed_precision,
            gradient_accumulation_steps=cfg.gradient_accumulation_steps,
            # Our scheduler counts optimizer steps, the same at any world size; Accelerate would step it
            # once per process per optimizer step.
            step_scheduler_with_optimizer=False,
            dataloader_config=DataLoaderConfiguration(even_batches=True),
            kwargs_handlers=[InitProcessGroupKwargs(timeout=timedelta(seconds=cfg.ddp_timeout))],
            log_with=cfg.report_to if cfg.with_tracking else None,
            project_config=ProjectConfiguration(project_dir=cfg.output_dir, logging_dir=f"{cfg.output_dir}/runs"),
        )
        if self.accelerator.num_processes != launched:
            raise UserError(
                f"{launched} processes were launched but Accelerate sees {self.accelerator.num_processes}: they are "
                "not one process group; launch with accelerate_configs/cpu_ddp.yaml or set use_cpu: true"
            )
        self.world_size = self.accelerator.num_processes
        self.rank = self.accelerator.process_index
        self.device = self.accelerator.device
        if cfg.with_tracking:
            tracked = {k: v for k, v in vars(cfg).items()
                       if isinstance(v, (int, float, str, bool)) and k != "hub_token"}
            self.accelerator.init_trackers("classify", config=tracked)

    def train_loader(self, dataset, sampler, collate_fn):
        # Accelerate shards batches round-robin, which is how the sampler lays out ranks' shares.
        self._train_sampler = sampler
        return DataLoader(dataset, batch_sampler=sampler, collate_fn=collate_fn, generator=own_generator(self.seed))

    def eval_loader(self, dataset, batch_size, collate_fn):
        return DataLoader(dataset, batch_size=batch_size, shuffle=False, collate_fn=collate_fn,
                          generator=own_generator(self.seed))

    def prepare(self, model, optimizer, scheduler, train_loader, eval_loader):
        return self.accelerator.prepare(model, optimizer, scheduler, train_loader, eval_loader)

    def epoch_batches(self, train_loader, epoch, skip_batches=0):
        # The prepared loader re-applies its own epoch counter to an unsharded sampler on every pass, so
        # both are set.
        train_loader.set_epoch(epoch)
        self._train_sampler.set_epoch(epoch)
        if skip_batches:
            return self.accelerator.skip_first_batches(train_loader, skip_batches)
        return train_loader

    def accumulate(self, model):
        return self.accelerator.accumulate(model)

    @property
    def sync_gradients(self):
        return self.accelerator.sync_gradients

    def backward(self, loss):
        # Accelerate divides by the accumulation steps; our loss is already the window's mean.
        self.accelerator.backward(loss * self.accelerator.gradient_accumulation_steps)

    def clip_grad_norm_(self, model, max_norm):
        return self.accelerator.clip_grad_norm_(model.parameters(), max_norm)

    def gather_for_metrics(self, tensors):
        return self.accelerator.gather_for_metrics(tensors)

    def reduce_sum(self, tensor):
        return self.accelerator.reduce(tensor, reduction="sum")

    def wait_for_everyone(self):
        self.accelerator.wait_for_everyone()

    def unwrap(self, model):
        return self.accelerator.unwrap_model(model)

    def unwrapped_state_dict(self, model):
        return self.accelerator.get_state_dict(model)

    def _save_state(self, folder):
        self.accelerator.save_state(str(folder))

    def _load_state(self, folder):
        self.accelerator.load_state(str(folder))

    def log(self, values, step):
        self.accelerator.log(values, step=step)

    def close(self):
        self.accelerator.end_training()
