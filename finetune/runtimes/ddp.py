"""The training loop's runtime on raw ``torch.distributed`` (``finetune.distributed.ddp``), for ``torchrun``.

Checkpoints use the file names and contents ``accelerator.save_state`` writes, so either runtime resumes
the other's checkpoints.
"""

from __future__ import annotations

import contextlib
from datetime import timedelta

import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler

from finetune.distributed.ddp import (
    all_gather_padded,
    all_reduce_sum,
    destroy_distributed,
    init_distributed,
    unwrap,
    wrap_model,
)
from finetune.errors import UserError
from finetune.runtimes.base import (
    Runtime,
    TrackerSettings,
    load_rng_state,
    load_trainable_state,
    own_generator,
    save_rng_state,
    trainable_state_dict,
)

__all__ = ["DDPRuntime"]


class _OrderedEval:
    """An evaluation loader that tells the runtime how many real examples each pass holds."""

    def __init__(self, loader: DataLoader, runtime: DDPRuntime):
        self.loader = loader
        self.runtime = runtime

    def __len__(self) -> int:
        return len(self.loader)

    def __iter__(self):
        self.runtime._eval_remaining = len(self.loader.dataset)
        for batch in self.loader:
            yield self.runtime._to_device(batch)


class DDPRuntime(Runtime):
    name = "ddp"

    def __init__(self, *, mixed_precision: str | None, seed: int, backend: str | None, ddp_timeout: timedelta,
                 tracking: TrackerSettings | None):
        if mixed_precision == "fp16":
            raise UserError("--mixed_precision fp16 needs a gradient scaler; use bf16, or --runtime accelerate")
        self.info = init_distributed(backend, ddp_timeout)
        self.world_size, self.rank, self.device = self.info.world_size, self.info.rank, self.info.device
        self.seed = seed
        self.bf16 = mixed_precision == "bf16"
        self._sync = True
        self._eval_remaining = 0
        self._model = self._optimizer = self._scheduler = None
        self._start_tracking(tracking)

    def train_loader(self, dataset, sampler, collate_fn):
        # No loader shards batches for us: the sampler yields this rank's shares only.
        self.train_sampler = sampler.for_rank(self.rank)
        return DataLoader(dataset, batch_sampler=self.train_sampler, collate_fn=collate_fn,
                          generator=own_generator(self.seed), pin_memory=self.device.type == "cuda")

    def eval_loader(self, dataset, batch_size, collate_fn):
        # DistributedSampler pads the set to a multiple of the world size with repeats; gather_for_metrics
        # drops them again.
        sampler = DistributedSampler(dataset, num_replicas=self.world_size, rank=self.rank, shuffle=False)
        loader = DataLoader(dataset, batch_size=batch_size, sampler=sampler, collate_fn=collate_fn,
                            generator=own_generator(self.seed))
        return _OrderedEval(loader, self)

    def prepare(self, model, optimizer, scheduler, *loaders):
        model.to(self.device)
        if self.bf16:
            model.forward = self.autocast()(model.forward)
        self._model = wrap_model(model, self.info)
        self._optimizer, self._scheduler = optimizer, scheduler
        return self._model, optimizer, scheduler, *loaders

    def _to_device(self, batch):
        return {k: v.to(self.device, non_blocking=True) for k, v in batch.items()}

    def epoch_batches(self, train_loader, epoch, skip_batches=0):
        self.train_sampler.set_epoch(epoch, skip_batches)  # the skipped batches are never fetched
        for batch in train_loader:
            yield self._to_device(batch)

    def accumulate(self, model, ends_step):
        # Skip DDP's gradient all-reduce on every micro-step but the window's last.
        self._sync = ends_step
        if self._sync or not isinstance(model, DistributedDataParallel):
            return contextlib.nullcontext()
        return model.no_sync()

    @property
    def sync_gradients(self):
        return self._sync

    def backward(self, loss):
        loss.backward()

    def clip_grad_norm_(self, model, max_norm):
        return torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)

    def gather_for_metrics(self, tensors, pad_index=-100):
        gathered = []
        for tensor in tensors:
            parts = all_gather_padded(tensor, pad_index)
            # Rank r's j-th example is example j * world_size + r of the (padded) set: interleave back.
            gathered.append(torch.stack(parts, dim=1).flatten(0, 1))
        keep = min(self._eval_remaining, len(gathered[0]))
        self._eval_remaining -= keep
        return tuple(values[:keep] for values in gathered)

    def reduce_sum(self, tensor):
        return all_reduce_sum(tensor)

    def wait_for_everyone(self):
        if dist.is_initialized():
            dist.barrier()

    def autocast(self):
        return torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.bf16)

    def unwrap(self, model):
        return unwrap(model)

    def unwrapped_state_dict(self, model):
        return unwrap(model).state_dict()

    def _save_state(self, folder):
        if self.is_main_process:
            save_file(trainable_state_dict(unwrap(self._model)), folder / "model.safetensors",
                      metadata={"format": "pt"})
            torch.save(self._optimizer.state_dict(), folder / "optimizer.bin")
            torch.save(self._scheduler.state_dict(), folder / "scheduler.bin")
        save_rng_state(folder, self.rank)

    def _load_state(self, folder):
        load_trainable_state(unwrap(self._model), load_file(folder / "model.safetensors", device=str(self.device)),
                             folder)
        self._optimizer.load_state_dict(torch.load(folder / "optimizer.bin", map_location=self.device,
                                                   weights_only=True))
        self._scheduler.load_state_dict(torch.load(folder / "scheduler.bin", weights_only=True))
        load_rng_state(folder, self.rank)

    def close(self):
        destroy_distributed()
