"""The embedded datasets the recipes train on offline, generated deterministically, each with what scores it:
support tickets (classification), tagged ticket sentences (tagging), support conversations and preference pairs
made from them (chat, DPO), whose replies name the team that owns the ticket.

Each module's ``EmbeddedDataset`` is what a recipe names as its default data. Imports nothing of the package
outside this folder.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

__all__ = ["EmbeddedDataset"]


@dataclass(frozen=True)
class EmbeddedDataset:
    """A recipe's default data: how the start-up line names it and what makes it; for data whose replies a program
    can check, the validation column that check reads and the check itself (metrics of replies to the first
    validation prompts, given those rows' answers)."""

    name: str
    make: Callable[[], Any]
    answer_column: str | None = None
    score_replies: Callable[[list[str], list], dict[str, float]] | None = None

    def answers(self, raw, cfg) -> list | None:
        """The validation rows' answers when ``cfg`` trains on this data (no --train_file, no --dataset_name) and the
        data has a check; else None."""
        if self.answer_column is None or cfg.train_file or cfg.dataset_name:
            return None
        return list(raw["validation"][self.answer_column])
