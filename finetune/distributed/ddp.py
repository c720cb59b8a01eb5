"""Raw ``torch.distributed`` data parallelism, as plain functions a training loop of one's own can call.

Launch with ``torchrun --nproc_per_node=N script.py``. The functions are public so a training script of
your own can use them directly::

    info = init_distributed()                      # process group from torchrun's environment
    model = wrap_model(model.to(info.device), info)
    sampler = DistributedSampler(dataset)          # sampler.set_epoch(epoch) every epoch
    ...
    save_unwrapped(model, "out", info)             # rank 0 saves model.module; the others wait
    destroy_distributed()

The layer imports neither accelerate nor anything else of the package's training loop; the loop's
runtime on top of it is ``finetune.runtimes.ddp``.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from finetune.checkpointing.checkpoint import load_state_dict_unwrapped
from finetune.environment import LaunchEnvironment

__all__ = [
    "DistributedInfo",
    "all_gather_padded",
    "all_gather_rows",
    "all_reduce_max",
    "all_reduce_sum",
    "pad_second_dim",
    "destroy_distributed",
    "init_distributed",
    "load_state_dict_unwrapped",
    "save_unwrapped",
    "unwrap",
    "world_size",
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
    env = LaunchEnvironment.read()
    if torch.cuda.is_available():
        torch.cuda.set_device(env.local_rank)
        device = torch.device("cuda", env.local_rank)
    else:
        device = torch.device("cpu")
    if env.world_size > 1 and not dist.is_initialized():
        backend = backend or ("nccl" if device.type == "cuda" else "gloo")
        # device_id binds NCCL's communicator to this GPU eagerly, so a mismatch fails here, not mid-run.
        dist.init_process_group(backend, store=_attempt_store(env, timeout), rank=env.rank,
                                world_size=env.world_size, timeout=timeout,
                                device_id=device if backend == "nccl" else None)
    return DistributedInfo(env.rank, env.local_rank, env.world_size, device)


def _attempt_store(env: LaunchEnvironment, timeout: timedelta) -> dist.Store:
    """The rendezvous store, with a key space of its own for this restart attempt.

    torchrun's agent keeps one store across restarts. Without a prefix, the workers of a restarted
    attempt read the dead attempt's peer addresses and fail to connect ("Connection refused") or hang.
    """
    store = dist.TCPStore(env.master_addr, env.master_port, env.world_size,
                          is_master=not env.agent_store and env.rank == 0, timeout=timeout)
    return dist.PrefixStore(f"finetune/attempt_{env.restart_count}", store)


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


def all_gather_padded(tensor: torch.Tensor, pad_index: int = -100) -> list[torch.Tensor]:
    """Every process's ``tensor``, in rank order; a second dimension that differs between processes is
    padded with ``pad_index`` to the longest (token-level outputs of batches padded per process)."""
    if world_size() == 1:
        return [tensor]
    tensor = tensor.contiguous()
    if tensor.dim() > 1:
        longest = all_reduce_max(torch.tensor(tensor.shape[1], device=tensor.device))
        tensor = pad_second_dim(tensor, int(longest), pad_index)
    parts = [torch.empty_like(tensor) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, tensor)
    return parts


def world_size() -> int:
    """The processes of the default group (1 where there is none)."""
    return dist.get_world_size() if dist.is_initialized() else 1


def all_gather_rows(tensor: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Every process's rows of ``tensor`` concatenated in rank order (processes may hold different numbers of
    rows), and where this process's first row is in the result."""
    if world_size() == 1:
        return tensor, 0
    counts = [int(n) for n in all_gather_padded(torch.tensor([len(tensor)], device=tensor.device))]
    padded = torch.zeros((max(counts), *tensor.shape[1:]), dtype=tensor.dtype, device=tensor.device)
    padded[:len(tensor)] = tensor
    parts = all_gather_padded(padded)
    return torch.cat([part[:n] for part, n in zip(parts, counts, strict=True)]), sum(counts[:dist.get_rank()])


def pad_second_dim(tensor: torch.Tensor, length: int, pad_index: int) -> torch.Tensor:
    """``tensor`` with its second dimension padded at the end with ``pad_index`` to ``length``."""
    return torch.nn.functional.pad(tensor, [0, 0] * (tensor.dim() - 2) + [0, length - tensor.shape[1]],
                                   value=pad_index)


def all_reduce_max(tensor: torch.Tensor) -> torch.Tensor:
    """Largest ``tensor`` over all processes (a new tensor on its device)."""
    return _all_reduced(tensor, dist.ReduceOp.MAX)


def all_reduce_sum(tensor: torch.Tensor) -> torch.Tensor:
    """Sum of ``tensor`` over all processes (a new tensor on its device; the input is left as it was)."""
    return _all_reduced(tensor, dist.ReduceOp.SUM)


def _all_reduced(tensor: torch.Tensor, op) -> torch.Tensor:
    # NCCL reduces GPU tensors only: a CPU tensor (a tally kept on the host) is reduced on this process's GPU there
    reduced = tensor.clone()
    if dist.is_initialized():
        if dist.get_backend() == "nccl" and tensor.device.type == "cpu":
            reduced = reduced.to(torch.cuda.current_device())
        dist.all_reduce(reduced, op=op)
    return reduced.to(tensor.device)


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
