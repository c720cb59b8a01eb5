"""Rows split across the processes a launcher started, and their results gathered back in input order: each row
predicted once, whatever the number of processes."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from finetune.environment import LaunchEnvironment

__all__ = ["device_for", "predict_shared"]


def device_for(env: LaunchEnvironment):
    import torch

    return torch.device(f"cuda:{env.local_rank}") if torch.cuda.is_available() else torch.device("cpu")


def predict_shared(rows: Sequence, predict: Callable[[list], list], env: LaunchEnvironment) -> list | None:
    """``predict`` over this process's rows (every ``world_size``-th, from its rank); on the main process the
    results of all, in the order of ``rows`` (None on the others)."""
    import torch.distributed as dist

    mine = predict(list(rows[env.rank::env.world_size]))
    if env.world_size == 1:
        return mine
    gathered = [None] * env.world_size if env.rank == 0 else None
    dist.gather_object(mine, gathered, dst=0)
    if env.rank != 0:
        return None
    ordered = [None] * len(rows)
    for rank, results in enumerate(gathered):
        ordered[rank::env.world_size] = results
    return ordered
