"""The training loop's runtime for ``--fsdp`` under torchrun: raw DDP's process group, loaders and collectives,
with the model sharded by ``finetune.distributed.fsdp`` instead of replicated.

Checkpoints hold each process's shards (``torch.distributed.checkpoint``), resharded when loaded, so a run
resumes at another number of processes; the final save gathers the full weights onto the main process.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

import torch

from finetune.distributed.fsdp import (
    clip_grad_norm_,
    full_state_dict,
    init_sharding,
    load_sharded,
    save_sharded,
    set_gradient_sync,
    shard_model,
    sharded_shapes,
)
from finetune.runtimes.base import check_trainable_shapes, load_rng_state, save_rng_state
from finetune.runtimes.ddp import DDPRuntime

__all__ = ["FSDPRuntime", "load_sharded_state", "save_sharded_state"]


class FSDPRuntime(DDPRuntime):
    name = "fsdp"
    shards = True

    def __init__(self, *, backend, ddp_timeout, **common):
        init_sharding(backend, ddp_timeout)  # the raw-DDP runtime joins this group, one process included
        super().__init__(backend=backend, ddp_timeout=ddp_timeout, **common)

    def autocast(self):  # bf16 is the sharding's mixed-precision policy, not autocast
        return contextlib.nullcontext()

    def prepare(self, model, optimizer, scheduler, *loaders):
        # bf16 is the sharding's mixed-precision policy, not autocast: weights are gathered in bf16.
        self._model = shard_model(model.to(self.device), self.info, optimizer, bf16=self.bf16)
        self._optimizer, self._scheduler = optimizer, scheduler
        return self._model, optimizer, scheduler, *loaders

    def accumulate(self, model, ends_step):
        # Without the reduce-scatter, each process keeps adding to its unsharded gradients until the window ends.
        self._sync = ends_step
        set_gradient_sync(model, ends_step)
        return contextlib.nullcontext()

    def clip_grad_norm_(self, model, max_norm):
        return clip_grad_norm_(model, max_norm)

    def unwrap(self, model):
        return model  # sharded in place: the same module, its parameters DTensors

    def unwrapped_state_dict(self, model):
        return full_state_dict(model)

    def _save_state(self, folder):
        save_sharded_state(folder, self._model, self._optimizer, self._scheduler, self.rank)

    def _load_state(self, folder):
        load_sharded_state(folder, self._model, self._optimizer, self._scheduler, self.rank)


def save_sharded_state(folder: Path, model, optimizer, scheduler, rank: int) -> None:
    """Every process's shards of the trainable weights and optimizer state, the scheduler (from rank 0) and each
    process's RNG states, in ``folder``. Every process must call it."""
    save_sharded(folder, model, optimizer)
    if rank == 0:
        torch.save(scheduler.state_dict(), folder / "scheduler.bin")
    save_rng_state(folder, rank)


def load_sharded_state(folder: Path, model, optimizer, scheduler, rank: int) -> None:
    """Restore what ``save_sharded_state`` wrote, at this or another number of processes.

    Raises:
        pickle.UnpicklingError: a metadata file holds more than checkpoint metadata.
        UserError: the checkpoint holds other trainable weights than ``model`` (another LoRA configuration).
    """
    check_trainable_shapes(model, sharded_shapes(folder), folder)
    load_sharded(folder, model, optimizer)
    scheduler.load_state_dict(torch.load(folder / "scheduler.bin", weights_only=True))
    load_rng_state(folder, rank)
