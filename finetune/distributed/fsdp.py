"""Sharded data parallelism with PyTorch's FSDP2 (``fully_shard``) and ``torch.distributed.checkpoint``.

Each process holds 1/N of every weight, gradient and optimizer state; a block's weights are gathered just
before it runs and freed after. Launch with ``torchrun --nproc_per_node=N script.py``. Like ``finetune.distributed.ddp``
the functions are public, for a training loop of your own::

    info = init_sharding()                          # a process group, also for one process
    model = shard_model(model.to(info.device), info, optimizer)  # the optimizer now steps the shards
    ...
    norm = clip_grad_norm_(model, 1.0)              # the norm over every process's shards
    save_sharded(folder, model, optimizer)          # every process writes its own shards
    load_sharded(folder, model, optimizer)          # at this or another number of processes
    state = full_state_dict(model)                  # every process calls it; rank 0 gets the full weights

It imports neither accelerate nor the training loop.
"""

from __future__ import annotations

import pickle
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

from finetune.distributed.ddp import DistributedInfo, init_distributed

__all__ = [
    "MODEL_FOLDER",
    "OPTIMIZER_FOLDER",
    "clip_grad_norm_",
    "full_state_dict",
    "generate_in_lockstep",
    "init_sharding",
    "is_sharded",
    "load_sharded",
    "save_sharded",
    "set_gradient_sync",
    "shard_model",
    "sharded_shapes",
    "transformer_block_classes",
]

MODEL_FOLDER = "pytorch_model_fsdp_0"
OPTIMIZER_FOLDER = "optimizer_0"
"""Where a checkpoint's model and optimizer shards go: the folder names of Accelerate's sharded ``save_state``."""

_METADATA_GLOBALS = {
    ("torch.distributed.checkpoint.metadata", name) for name in (
        "Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata", "TensorProperties",
        "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING")
} | {("torch", dtype) for dtype in ("float32", "bfloat16", "float16", "int64")} | {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"), ("torch", "Size"),
    ("torch.serialization", "_get_layout"), ("pathlib", "PosixPath"),
}
"""What the ``.metadata`` file of a checkpoint this module wrote refers to, and nothing that could run code."""


def init_sharding(backend: str | None = None, timeout: timedelta = timedelta(minutes=30)) -> DistributedInfo:
    """``ddp.init_distributed``, with a process group also for a lone process: a device mesh needs one."""
    info = init_distributed(backend, timeout)
    if not dist.is_initialized():
        dist.init_process_group(backend or ("nccl" if info.device.type == "cuda" else "gloo"), store=dist.HashStore(),
                                rank=0, world_size=1, timeout=timeout)
    return info


def _base_model(model: torch.nn.Module) -> torch.nn.Module:
    """The transformers model inside a peft wrapper (or ``model`` itself): it holds every weight, and
    ``generate`` calls its forward directly, past the wrapper."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def transformer_block_classes(model: torch.nn.Module) -> list[str]:
    """The class names of ``model``'s transformer blocks: those its transformers class keeps whole
    (``_no_split_modules``), less one that holds the input embeddings (BERT's embedding layer is listed too)."""
    base = _base_model(model)
    embeddings = base.get_input_embeddings() if hasattr(base, "get_input_embeddings") else None
    names = set(getattr(base, "_no_split_modules", None) or ())
    holding_embeddings = {type(module).__name__ for module in base.modules()
                          if embeddings is not None and any(child is embeddings for child in module.modules())}
    return sorted(names - holding_embeddings)


def shard_model(model: torch.nn.Module, info: DistributedInfo, optimizer: torch.optim.Optimizer | None = None,
                bf16: bool = False) -> torch.nn.Module:
    """Shard ``model`` (on ``info.device``) in place across all processes; returns it.

    Every transformer block (``transformer_block_classes``) gets ``fully_shard``, then the model itself,
    over a one-dimensional device mesh. Parameters become DTensors, so an ``optimizer`` built on the model
    before is pointed at them (its state must still be empty).
    ``bf16``: weights are gathered and computed in bfloat16 while gradients are reduced, and the optimizer
    steps, in float32.

    Raises:
        ValueError: the model names no transformer block class (nothing to shard one block at a time).
    """
    base = _base_model(model)
    block_classes = transformer_block_classes(model)
    blocks = [module for module in base.modules() if type(module).__name__ in block_classes]
    if not blocks:
        raise ValueError(f"{type(base).__name__} names no transformer block class (_no_split_modules) to shard")
    names = {id(param): name for name, param in model.named_parameters()}
    mesh = init_device_mesh(info.device.type, (info.world_size,))
    policy = (MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16
              else MixedPrecisionPolicy())
    for block in reversed(blocks):  # inner blocks first, should a block hold another
        fully_shard(block, mesh=mesh, mp_policy=policy)
    fully_shard(base, mesh=mesh, mp_policy=policy)
    if dist.get_backend() == "gloo":
        # gloo's AVG reduce-scatter gave wrong gradients under fully_shard in some torch releases (pytorch #162338):
        # sum, then divide.
        for module in base.modules():
            if isinstance(module, FSDPModule):
                module.set_force_sum_reduction_for_comms(True)
    generate_in_lockstep(model)
    if optimizer is not None:
        sharded = dict(model.named_parameters())
        for group in optimizer.param_groups:
            group["params"] = [sharded[names[id(param)]] for param in group["params"]]
    return model


def generate_in_lockstep(model: torch.nn.Module) -> None:
    """Have transformers' ``generate`` run every process's decoding steps in lockstep on a sharded model: each
    forward gathers weights from all processes, so one whose replies ended early must keep joining in."""
    _base_model(model)._is_fsdp_managed_module = True  # what transformers' own FSDP2 sharding sets


def is_sharded(model: torch.nn.Module) -> bool:
    """Whether ``model``'s weights are split across the processes, so that each forward gathers them from all:
    by ``shard_model`` or Accelerate's FSDP2, or by DeepSpeed ZeRO-3 under Accelerate (its parameters carry a
    ``ds_id``, which is what DeepSpeed's own ``is_zero_param`` reads)."""
    return (any(isinstance(module, FSDPModule) for module in model.modules())
            or any(hasattr(parameter, "ds_id") for parameter in model.parameters()))


def set_gradient_sync(model: torch.nn.Module, sync: bool) -> None:
    """Whether the next backward reduce-scatters gradients (the last micro-step of an accumulation window) or
    only adds to each process's unsharded gradients."""
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_requires_gradient_sync(sync, recurse=False)


def clip_grad_norm_(model: torch.nn.Module, max_norm: float) -> torch.Tensor:
    """Clip the gradients of a sharded model to ``max_norm`` in total; returns the norm before clipping, over
    every process's shards (a plain tensor, the same on every process)."""
    norm = torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.grad is not None], max_norm)
    return norm.full_tensor() if isinstance(norm, DTensor) else norm


def full_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every weight of a sharded model, gathered whole on the CPU of rank 0 (other ranks get an empty dict).

    Every process must call it: the shards are gathered through collectives.
    """
    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def _trainable_states(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> tuple[dict, dict]:
    """This process's shards of the weights that train (frozen ones come from the base model again) and of the
    optimizer state, under the unwrapped model's names."""
    model_state, optimizer_state = get_state_dict(model, optimizer)
    trainable = {name for name, param in model.named_parameters() if param.requires_grad}
    return {name: value for name, value in model_state.items() if name in trainable}, optimizer_state


def save_sharded(folder: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Write this process's shards of the trainable weights and of the optimizer state under ``folder``.

    Every process must call it; each writes its own files, the main process the metadata beside them.
    """
    model_state, optimizer_state = _trainable_states(model, optimizer)
    dcp.save({"model": model_state}, checkpoint_id=Path(folder) / MODEL_FOLDER)
    dcp.save({"optimizer": optimizer_state}, checkpoint_id=Path(folder) / OPTIMIZER_FOLDER)


def sharded_shapes(folder: Path) -> dict[str, tuple[int, ...]]:
    """The full shape of each weight in the sharded checkpoint ``folder``.

    Both of its metadata files are read with an unpickler that takes checkpoint metadata only:
    torch.distributed.checkpoint itself unpickles them with no restriction, and a crafted one could run code.

    Raises:
        pickle.UnpicklingError: a metadata file holds anything else.
    """
    for name in (OPTIMIZER_FOLDER, MODEL_FOLDER):
        with open(Path(folder) / name / ".metadata", "rb") as f:
            metadata = _MetadataUnpickler(f).load()
    return {key.removeprefix("model."): tuple(entry.size) for key, entry in metadata.state_dict_metadata.items()
            if key.startswith("model.")}


def load_sharded(folder: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Load what ``save_sharded`` wrote, resharded for this run's processes (any number of them).

    Every process must call it. Read the folder's ``sharded_shapes`` first: that checks its metadata.
    """
    model_state, optimizer_state = _trainable_states(model, optimizer)
    dcp.load({"model": model_state}, checkpoint_id=Path(folder) / MODEL_FOLDER)
    dcp.load({"optimizer": optimizer_state}, checkpoint_id=Path(folder) / OPTIMIZER_FOLDER)
    set_state_dict(model, optimizer, model_state_dict=model_state, optim_state_dict=optimizer_state,
                   options=StateDictOptions(strict=False))


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module, name):
        if (module, name) not in _METADATA_GLOBALS:
            raise pickle.UnpicklingError(f"global '{module}.{name}' is not checkpoint metadata")
        return super().find_class(module, name)
