"""Raw ``torch.distributed`` data parallelism, as plain functions and as a ``Runtime``.

Launch with ``torchrun --nproc_per_node=N script.py``. The functions are public so a training script of
your own can use them directly::

    info = init_distributed()                      # process group from torchrun's environment
    model = wrap_model(model.to(info.device), info)
    sampler = DistributedSampler(dataset)          # sampler.set_epoch(epoch) every epoch
    ...
    save_unwrapped(model, "out", info)             # rank 0 saves model.module; the others wait
    destroy_distributed()

``DDPRuntime`` is the same calls behind the interface the recipes train through, writing checkpoints
in the layout ``accelerator.save_state`` writes, so either runtime resumes the other's checkpoints.
"""

from __future__ import annotations

import contextlib
import os
import random
from dataclasses import dataclass
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler

from finetune.checkpoint import load_state_dict_unwrapped
from finetune.config import ClassifyConfig
from finetune.errors import UserError
from finetune.runtime import Runtime, own_generator

__all__ = [
    "DDPRuntime",
    "DistributedInfo",
    "all_reduce_sum",
    "destroy_distributed",
    "init_distributed",
    "load_state_dict_unwrapped",
    "save_unwrapped",
    "unwrap",
    "wrap_model",
]


@dataclass(frozen=True)
class DistributedInfo:
    rank: int
    local_rank: int
    world_size: int
    device: torch.device

    @property
    def is_main_process(self) -> bool:
        return self.rank == 0


def init_distributed(backend: str | None = None, timeout: timedelta = timedelta(minutes=30)) -> DistributedInfo:
    """Join the process group torchrun describes in RANK, WORLD_SIZE, LOCAL_RANK and MASTER_ADDR/PORT.

    The backend is nccl when CUDA is available and gloo otherwise, unless ``backend`` is given. On GPU
    each process takes the device ``cuda:LOCAL_RANK``. Without torchrun's variables this is a single
    process with no group.
    """
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if torch.cuda.is_available():
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
    if world_size > 1 and not dist.is_initialized():
        backend = backend or ("nccl" if device.type == "cuda" else "gloo")
        # device_id binds NCCL's communicator to this GPU eagerly, so a mismatch fails here, not mid-run.
        dist.init_process_group(backend, store=_attempt_store(timeout), rank=rank, world_size=world_size,
                                timeout=timeout, device_id=device if backend == "nccl" else None)
    return DistributedInfo(rank, local_rank, world_size, device)


def _attempt_store(timeout: timedelta) -> dist.Store:
    """The rendezvous store, with a key space of its own for this restart attempt.

    torchrun's agent keeps one store across restarts. Without a prefix, the workers of a restarted
    attempt read the dead attempt's peer addresses and fail to connect ("Connection refused") or hang.
    """
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    world_size = int(os.environ["WORLD_SIZE"])
    agent_hosts_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world_size,
                          is_master=not agent_hosts_store and int(os.environ["RANK"]) == 0, timeout=timeout)
    return dist.PrefixStore(f"finetune/attempt_{attempt}", store)


def destroy_distributed() -> None:
    """Leave the process group, if one was joined."""
    if dist.is_initialized():
        dist.destroy_process_group()


def wrap_model(model: torch.nn.Module, info: DistributedInfo) -> torch.nn.Module:
    """``DistributedDataParallel`` around ``model`` (already on ``info.device``); unchanged for one process."""
    if info.world_size == 1:
        return model
    if info.device.type == "cuda":
        return DistributedDataParallel(model, device_ids=[info.local_rank])
    return DistributedDataParallel(model)


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The model inside a DDP (or ``torch.compile``) wrapper: what to save and to load weights into."""
    while isinstance(model, DistributedDataParallel) or hasattr(model, "_orig_mod"):
        model = model.module if isinstance(model, DistributedDataParallel) else model._orig_mod
    return model


def all_reduce_sum(tensor: torch.Tensor) -> torch.Tensor:
    """Sum of ``tensor`` over all processes (a new tensor; the input is left as it was)."""
    total = tensor.clone()
    if dist.is_initialized():
        dist.all_reduce(total, op=dist.ReduceOp.SUM)
    return total


def save_unwrapped(model: torch.nn.Module, output_dir: str, info: DistributedInfo, tokenizer=None) -> None:
    """Rank 0 saves ``model.module`` with ``save_pretrained`` (safetensors); every rank returns together.

    The barrier before saving makes sure every rank has finished its last step; the one after keeps the
    others from reading or exiting before the folder is complete.
    """
    if dist.is_initialized():
        dist.barrier()
    if info.is_main_process:
        unwrap(model).save_pretrained(output_dir, safe_serialization=True)
        if tokenizer is not None:
            tokenizer.save_pretrained(output_dir)
    if dist.is_initialized():
        dist.barrier()


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
    """The recipe's runtime on raw ``torch.distributed`` (see the module docstring)."""

    name = "ddp"

    def __init__(self, cfg: ClassifyConfig):
        if cfg.mixed_precision == "fp16":
            raise UserError("--mixed_precision fp16 needs a gradient scaler; use bf16, or --runtime accelerate")
        self.info = init_distributed(cfg.ddp_backend, timedelta(seconds=cfg.ddp_timeout))
        self.world_size, self.rank, self.device = self.info.world_size, self.info.rank, self.info.device
        self.accumulation_steps = cfg.gradient_accumulation_steps
        self.seed = cfg.seed
        self.bf16 = cfg.mixed_precision == "bf16"
        self._sync = True
        self._eval_remaining = 0
        self._model = self._optimizer = self._scheduler = None
        self._writer = None
        if cfg.with_tracking and self.is_main_process and cfg.report_to in ("all", "tensorboard"):
            from torch.utils.tensorboard import SummaryWriter

            self._writer = SummaryWriter(log_dir=os.path.join(cfg.output_dir, "runs", "classify"))
        elif cfg.with_tracking and cfg.report_to not in ("all", "tensorboard"):
            raise UserError(f"--report_to {cfg.report_to} is not supported by --runtime ddp; use tensorboard")

    def train_loader(self, dataset, sampler, collate_fn):
        sampler.rank = self.rank  # no loader shards for us: the sampler yields this rank's shares only
        self.train_sampler = sampler
        return DataLoader(dataset, batch_sampler=sampler, collate_fn=collate_fn, generator=own_generator(self.seed),
                          pin_memory=self.device.type == "cuda")

    def eval_loader(self, dataset, batch_size, collate_fn):
        # DistributedSampler pads the set to a multiple of the world size with repeats; gather_for_metrics
        # drops them again.
        sampler = DistributedSampler(dataset, num_replicas=self.world_size, rank=self.rank, shuffle=False)
        loader = DataLoader(dataset, batch_size=batch_size, sampler=sampler, collate_fn=collate_fn,
                            generator=own_generator(self.seed))
        return _OrderedEval(loader, self)

    def prepare(self, model, optimizer, scheduler, train_loader, eval_loader):
        model.to(self.device)
        if self.bf16:
            model.forward = torch.autocast(self.device.type, dtype=torch.bfloat16)(model.forward)
        self._model = wrap_model(model, self.info)
        self._optimizer, self._scheduler = optimizer, scheduler
        return self._model, optimizer, scheduler, train_loader, eval_loader

    def _to_device(self, batch):
        return {k: v.to(self.device, non_blocking=True) for k, v in batch.items()}

    def epoch_batches(self, train_loader, epoch, skip_batches=0):
        self.train_sampler.set_epoch(epoch)
        total = len(train_loader)
        for index, batch in enumerate(train_loader):
            if index < skip_batches:
                continue
            self._sync = (index + 1) % self.accumulation_steps == 0 or index + 1 == total
            yield self._to_device(batch)

    def accumulate(self, model):
        # Skip DDP's gradient all-reduce on every micro-step but the window's last.
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

    def gather_for_metrics(self, tensors):
        gathered = []
        for tensor in tensors:
            parts = [torch.empty_like(tensor) for _ in range(self.world_size)]
            if self.world_size > 1:
                dist.all_gather(parts, tensor.contiguous())
            else:
                parts = [tensor]
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

    def unwrap(self, model):
        return unwrap(model)

    def unwrapped_state_dict(self, model):
        return unwrap(model).state_dict()

    def _save_state(self, folder):
        # Same file names and contents as accelerator.save_state, so the other runtime can resume them.
        if self.is_main_process:
            state = {k: v.contiguous() for k, v in self.unwrapped_state_dict(self._model).items()}
            save_file(state, folder / "model.safetensors", metadata={"format": "pt"})
            torch.save(self._optimizer.state_dict(), folder / "optimizer.bin")
            torch.save(self._scheduler.state_dict(), folder / "scheduler.bin")
        rng = {
            "step": 0,
            "random_state": random.getstate(),
            "numpy_random_seed": np.random.get_state(),
            "torch_manual_seed": torch.get_rng_state(),
        }
        if torch.cuda.is_available():
            rng["torch_cuda_manual_seed"] = torch.cuda.get_rng_state_all()
        torch.save(rng, folder / f"random_states_{self.rank}.pkl")

    def _load_state(self, folder):
        from accelerate.utils import load as load_with_numpy_allowed

        unwrap(self._model).load_state_dict(load_file(folder / "model.safetensors", device=str(self.device)))
        self._optimizer.load_state_dict(torch.load(folder / "optimizer.bin", map_location=self.device,
                                                   weights_only=True))
        self._scheduler.load_state_dict(torch.load(folder / "scheduler.bin", weights_only=True))
        rng = load_with_numpy_allowed(folder / f"random_states_{self.rank}.pkl")
        random.setstate(rng["random_state"])
        np.random.set_state(rng["numpy_random_seed"])
        torch.set_rng_state(rng["torch_manual_seed"])
        if torch.cuda.is_available() and "torch_cuda_manual_seed" in rng:
            torch.cuda.set_rng_state_all(rng["torch_cuda_manual_seed"])

    def log(self, values, step):
        if self._writer is not None:
            for key, value in values.items():
                self._writer.add_scalar(key, value, step)

    def close(self):
        if self._writer is not None:
            self._writer.close()
        destroy_distributed()
