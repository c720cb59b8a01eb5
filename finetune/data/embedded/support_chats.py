"""The embedded default data of the chat recipe: support conversations that route a ticket and answer it.

Built from the short tickets of ``finetune.data.embedded.support_tickets`` (deterministic, offline): the user writes the
ticket, the assistant's reply names the team that owns it on its first line, then says what happens next.
The data is kept small and short, so the default run fits a few minutes on two CPU cores: the cost of
LoRA on a 135M model there is about 17 ms per token.
"""

from __future__ import annotations

import random

from datasets import Dataset, DatasetDict

from finetune.data.embedded import EmbeddedDataset
from finetune.data.embedded.support_tickets import LABEL_NAMES, make_support_tickets

__all__ = ["SUPPORT_CHATS", "SUPPORT_PROMPTS", "SYSTEM_PROMPT", "make_support_conversations", "make_support_prompts",
           "routed_team", "routing_accuracy", "routing_metrics", "routing_reward"]

SYSTEM_PROMPT = "Route the ticket: name the team, then reply."
NUM_TRAIN, NUM_EVAL = 160, 48
_MAX_TICKET_CHARS = 140
_SEED = 20261130
_ANSWERS = {
    "billing": ["We will check the charge and correct your invoice.",
                "A refund, if due, reaches your card in five days."],
    "technical": ["Please send us the app version and a screenshot.", "Our engineers are looking into this error."],
    "shipping": ["We will track the parcel and update you today.", "The courier will contact you about delivery."],
    "account": ["We sent a link to reset your access.", "Your account settings will be updated within a day."],
}


def make_support_conversations() -> DatasetDict:
    """``train`` (160) and ``validation`` (48) rows with a ``messages`` column and the ticket's ``team``."""
    tickets = make_support_tickets()
    rng = random.Random(_SEED)

    def conversations(split, count):
        rows = {"messages": [], "team": []}
        for ticket in tickets[split]:
            if len(ticket["text"]) > _MAX_TICKET_CHARS:
                continue
            team = LABEL_NAMES[ticket["label"]]
            rows["messages"].append([
                {"role": "system", "content": SYSTEM_PROMPT},
                {"role": "user", "content": ticket["text"]},
                {"role": "assistant", "content": f"Team: {team}\n{rng.choice(_ANSWERS[team])}"},
            ])
            rows["team"].append(team)
            if len(rows["team"]) == count:
                break
        return Dataset.from_dict(rows)

    return DatasetDict(train=conversations("train", NUM_TRAIN), validation=conversations("validation", NUM_EVAL))


def make_support_prompts() -> DatasetDict:
    """The conversations' prompts without their replies (``prompt``: system and user messages) and the ticket's
    ``team``, for reinforcement learning; no validation prompt is a training prompt."""
    conversations = make_support_conversations()
    prompts = {split: {"prompt": [m[:-1] for m in rows["messages"]], "team": rows["team"]}
               for split, rows in conversations.items()}
    seen = {str(prompt) for prompt in prompts["train"]["prompt"]}
    unseen = [k for k, prompt in enumerate(prompts["validation"]["prompt"]) if str(prompt) not in seen]
    validation = {column: [values[k] for k in unseen] for column, values in prompts["validation"].items()}
    return DatasetDict(train=Dataset.from_dict(prompts["train"]), validation=Dataset.from_dict(validation))


def routing_reward(prompts, completions, team, **columns) -> list[float]:
    """A reward function (TRL's signature) for the support prompts: 1 where a reply's first line names the ticket's
    team and no other, else 0."""
    texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
    return [float(routed_team(text) == answer) for text, answer in zip(texts, team, strict=True)]


def routed_team(reply: str) -> str | None:
    """The team a reply's first line names, if it names exactly one."""
    first_line = reply.strip().split("\n", 1)[0].lower()
    named = [team for team in LABEL_NAMES if team in first_line]
    return named[0] if len(named) == 1 else None


def routing_accuracy(replies: list[str], teams: list[str]) -> float:
    """The share of ``replies`` whose first line names the right team (of the first ``len(replies)`` tickets)."""
    return sum(routed_team(reply) == team for reply, team in zip(replies, teams, strict=False)) / len(replies)


def routing_metrics(replies: list[str], teams: list[str]) -> dict[str, float]:
    return {"routing_accuracy": routing_accuracy(replies, teams)}


SUPPORT_CHATS = EmbeddedDataset("support conversations (embedded default)", make_support_conversations,
                                answer_column="team", score_replies=routing_metrics)
SUPPORT_PROMPTS = EmbeddedDataset("support ticket prompts (embedded default)", make_support_prompts,
                                  answer_column="team", score_replies=routing_metrics)
