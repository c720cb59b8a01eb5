"""What the launcher (torchrun, accelerate launch, Slurm's srun around them) told this process.

Every environment variable the package reads is read here, once, into a frozen dataclass.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

__all__ = ["LaunchEnvironment"]


@dataclass(frozen=True)
class LaunchEnvironment:
    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    local_world_size: int = 1
    restart_count: int = 0
    """How often torchrun's agent restarted the workers (``TORCHELASTIC_RESTART_COUNT``)."""
    requeue_count: int = 0
    """How often Slurm requeued the job (``SLURM_RESTART_COUNT``, unset before the first requeue)."""
    torchrun: bool = False
    """Started by torchrun's agent (which ``accelerate launch`` also uses for several processes)."""
    accelerate: bool = False
    """Started by ``accelerate launch``, which sets ``ACCELERATE_*`` variables."""
    accelerate_fsdp: bool = False
    """``accelerate launch`` with an FSDP config (``ACCELERATE_USE_FSDP``)."""
    master_addr: str = "127.0.0.1"
    master_port: int = 29500
    agent_store: bool = False
    """The agent hosts the rendezvous store (``TORCHELASTIC_USE_AGENT_STORE``): workers only connect to it."""
    omp_num_threads: str | None = None
    slurm_job_id: str = ""
    """The Slurm job (``SLURM_JOB_ID``, with ``SLURM_CLUSTER_NAME``): the same in every attempt of a requeued job."""
    slurm_cluster: str = ""
    torchrun_run_id: str = ""
    """torchrun's ``--rdzv_id`` (``TORCHELASTIC_RUN_ID``): a fresh id per launch on one node, ``none`` under a
    multi-process ``accelerate launch``."""
    exit_status_file: str | None = None
    """Where the main process writes its exit status (``FINETUNE_EXIT_STATUS_FILE``), for a batch script that sees
    only its launcher's: ``launch/slurm.sbatch`` requeues a stopped job only if it saved its checkpoint."""
    report_dir: str | None = None
    """Where every process writes how it ended early (``FINETUNE_REPORT_DIR``), set by ``finetune launch`` and
    ``finetune torchrun``, which then show a refusal once in place of the launcher's report."""

    @classmethod
    def read(cls) -> LaunchEnvironment:
        env = os.environ
        return cls(
            rank=int(env.get("RANK", "0")),
            local_rank=int(env.get("LOCAL_RANK", "0")),
            world_size=int(env.get("WORLD_SIZE", "1")),
            local_world_size=int(env.get("LOCAL_WORLD_SIZE", "1")),
            restart_count=int(env.get("TORCHELASTIC_RESTART_COUNT", "0")),
            requeue_count=int(env.get("SLURM_RESTART_COUNT", "0")),
            torchrun="TORCHELASTIC_RUN_ID" in env,
            accelerate=any(key.startswith("ACCELERATE_") for key in env),
            accelerate_fsdp=env.get("ACCELERATE_USE_FSDP", "false").lower() == "true",
            master_addr=env.get("MASTER_ADDR", "127.0.0.1"),
            master_port=int(env.get("MASTER_PORT", "29500")),
            agent_store=env.get("TORCHELASTIC_USE_AGENT_STORE") == "True",
            omp_num_threads=env.get("OMP_NUM_THREADS"),
            slurm_job_id=env.get("SLURM_JOB_ID", ""),
            slurm_cluster=env.get("SLURM_CLUSTER_NAME", ""),
            torchrun_run_id=env.get("TORCHELASTIC_RUN_ID", ""),
            exit_status_file=env.get("FINETUNE_EXIT_STATUS_FILE") or None,
            report_dir=env.get("FINETUNE_REPORT_DIR") or None,
        )
