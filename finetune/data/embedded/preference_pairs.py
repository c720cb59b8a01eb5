"""The embedded default data of the preference recipe: pairs of replies to the chat recipe's support tickets.

Each pair's prompt is a support conversation's system line and ticket (``support_chats``); the chosen
reply is that conversation's reply, which names the team owning the ticket; the rejected reply names another
team with the same sentence after it, or is a curt reply that names no team (half each, by a fixed seed).
Validation pairs come from the chat data's validation tickets, less any whose prompt a training pair has.
Few and short, for a default run of a few minutes on two CPU cores.
"""

from __future__ import annotations

import random

from datasets import Dataset, DatasetDict

from finetune.data.embedded import EmbeddedDataset
from finetune.data.embedded.support_chats import make_support_conversations, routing_metrics
from finetune.data.embedded.support_tickets import LABEL_NAMES

__all__ = ["PREFERENCE_PAIRS", "make_preference_pairs"]

NUM_TRAIN, NUM_EVAL = 120, 32
_SEED = 20261201
_CURT = ["We received your message.", "Thank you for writing.", "Please wait for an answer.",
         "Noted, someone will reply."]


def make_preference_pairs() -> DatasetDict:
    """``train`` (120) and ``validation`` (32) rows: ``prompt`` and ``chosen``/``rejected`` as message lists, and
    the ticket's ``team``."""
    conversations = make_support_conversations()
    rng = random.Random(_SEED)

    def pairs(split, count, unseen=None):
        rows = {"prompt": [], "chosen": [], "rejected": [], "team": []}
        for messages, team in zip(conversations[split]["messages"], conversations[split]["team"], strict=True):
            if len(rows["team"]) == count:
                break
            if unseen and messages[:-1] in unseen["prompt"]:  # the generated tickets repeat now and then
                continue
            reply = messages[-1]["content"]
            if rng.random() < 0.5:
                rejected = reply.replace(f"Team: {team}", f"Team: {rng.choice([t for t in LABEL_NAMES if t != team])}")
            else:
                rejected = rng.choice(_CURT)
            rows["prompt"].append(messages[:-1])
            rows["chosen"].append([{"role": "assistant", "content": reply}])
            rows["rejected"].append([{"role": "assistant", "content": rejected}])
            rows["team"].append(team)
        return rows

    train = pairs("train", NUM_TRAIN)
    validation = pairs("validation", NUM_EVAL, unseen=train)
    return DatasetDict(train=Dataset.from_dict(train), validation=Dataset.from_dict(validation))


PREFERENCE_PAIRS = EmbeddedDataset("support preference pairs (embedded default)", make_preference_pairs,
                                   answer_column="team", score_replies=routing_metrics)
