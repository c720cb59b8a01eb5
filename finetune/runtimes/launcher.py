"""The runtime a launcher asked for, and the CPU threads a lone process should use.

``--runtime auto`` is raw DDP under torchrun and Accelerate otherwise (``accelerate launch`` or plain
python); ``--fsdp`` shards on top of raw DDP's process group, under torchrun or plain python. The loop never
asks which it got.
"""

from __future__ import annotations

from datetime import timedelta

import psutil
import torch

from finetune.config import TrainConfig
from finetune.environment import LaunchEnvironment
from finetune.errors import UserError
from finetune.runtimes.accelerate import AccelerateRuntime
from finetune.runtimes.base import Runtime, TrackerSettings
from finetune.runtimes.ddp import DDPRuntime
from finetune.runtimes.fsdp import FSDPRuntime

__all__ = ["launcher_chose_one_thread", "make_runtime"]


def make_runtime(cfg: TrainConfig, tracking: TrackerSettings | None) -> Runtime:
    """The runtime ``cfg.runtime`` names, set up for this process.

    Raises:
        UserError: sharding asked of Accelerate where it does not shard: ``--fsdp`` without Accelerate's FSDP
            config, or that config on a machine without GPUs (where Accelerate would train unsharded copies).
    """
    env = LaunchEnvironment.read()
    accelerator = torch.accelerator.is_available()
    if not accelerator and launcher_chose_one_thread(env):
        torch.set_num_threads(psutil.cpu_count(logical=False) or 1)
    kind = cfg.runtime
    if kind == "auto":
        kind = "ddp" if (env.torchrun or cfg.fsdp) and not env.accelerate else "accelerate"
    if kind == "accelerate" and env.accelerate_fsdp and not accelerator:
        raise UserError("Accelerate runs FSDP on GPUs only and this machine has none; to shard on CPUs, launch "
                        "torchrun --nproc_per_node=N RECIPE --fsdp")
    if kind == "accelerate" and cfg.fsdp and not env.accelerate_fsdp:
        raise UserError("--fsdp shards with the raw torch runtime (torchrun or plain python, --runtime auto or ddp); "
                        "under accelerate launch, pass --config_file accelerate_configs/fsdp.yaml instead (GPUs only)")
    timeout = timedelta(seconds=cfg.ddp_timeout)
    common = {"mixed_precision": cfg.mixed_precision, "seed": cfg.seed, "tracking": tracking}
    if kind == "ddp":
        return (FSDPRuntime if cfg.fsdp else DDPRuntime)(backend=cfg.ddp_backend, ddp_timeout=timeout, **common)
    return AccelerateRuntime(ddp_timeout=timeout, project_dir=cfg.output_dir,
                             gradient_accumulation_steps=cfg.gradient_accumulation_steps, **common)


def launcher_chose_one_thread(env: LaunchEnvironment) -> bool:
    """Whether ``accelerate launch`` pinned this lone CPU process to one thread by its own default.

    Without a config that says ``use_cpu``, the launcher sets ``OMP_NUM_THREADS=1`` for every process, a
    lone one included, which leaves the other cores of the machine idle. A count the user chose (in the
    launcher's own environment or with ``--num_cpu_threads_per_process``) is theirs and is kept.
    """
    if not env.accelerate or env.local_world_size != 1 or env.omp_num_threads != "1":
        return False
    try:
        launcher = psutil.Process().parent()
        chosen = "OMP_NUM_THREADS" in launcher.environ() or any(
            word.startswith("--num_cpu_threads_per_process") for word in launcher.cmdline())
    except psutil.Error:  # the launcher is gone or not ours to read: keep what it set
        return False
    return not chosen
