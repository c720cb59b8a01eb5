"""The embedded data of the agent task: support tickets that name an order, which only a tool call answers.

An embedded table of orders (status, carrier, the team that owns it), drawn by a fixed seed, and the tool
``lookup_order`` that reads it: a ticket says which order, not how it stands nor whose it is, so a reply that
states the status and routes the ticket right has looked the order up. Training tickets and validation tickets
name different orders: the held-out figure is of order ids the model has not seen.

- ``make_order_conversations``: for the chat recipe (``--tools`` with this module's ``lookup_order``), tickets that
  name one order, each answered as an agent would: the call, the tool's result, the reply.
- ``make_order_prompts``: for GRPO, tickets alone with the asked order's ``order_id``, ``status`` and ``team``;
  ``resolved`` is the reward. Half the training tickets and every validation ticket name a second order, one that
  is fine, before the one asked about: what no demonstration showed, and what GRPO has to learn from the reward.

``python -m finetune.data.embedded.order_tickets FOLDER`` writes both as jsonl files a recipe's ``--train_file``
and ``--validation_file`` read.
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

from datasets import Dataset, DatasetDict

__all__ = ["ORDERS", "STATUSES", "SYSTEM_PROMPT", "TEAMS", "lookup_order", "make_order_conversations",
           "make_order_prompts", "resolved", "stated", "write_files"]

STATUSES = ("processing", "shipped", "delivered", "delayed", "lost", "returned")
TEAMS = ("shipping", "billing", "returns")
_CARRIERS = ("DHL", "UPS", "FedEx", "DPD", "GLS")
NUM_ORDERS, NUM_TRAIN_ORDERS = 80, 60
_SEED = 20261206
SYSTEM_PROMPT = ("You are a support agent. Look up the order the ticket names, then tell the customer its status and "
                 "name the team the ticket goes to.")
_TICKETS = [
    "Where is my order {order}? It should have arrived by now.",
    "Hi, can you check on order {order} for me?",
    "Order {order} has not shown up yet. What is going on?",
    "I would like an update on my order {order}, please.",
    "My parcel, order {order}, seems to be stuck somewhere.",
    "Can you tell me what is happening with order {order}?",
    "Hello, I am still waiting for order {order}.",
    "Please look into order {order}, I have heard nothing for days.",
]
_TWO_ORDERS = [
    "Order {other} came on time, but {order} has not arrived. Where is it?",
    "I already got {other}. What about order {order}?",
    "Not {other}, that one is fine: can you check order {order}?",
    "My order {other} arrived, order {order} did not. Please look into it.",
]


def _orders() -> dict[str, dict[str, str]]:
    rng = random.Random(_SEED)
    ids = rng.sample(range(10000, 100000), NUM_ORDERS)
    return {str(number): {"status": rng.choice(STATUSES), "carrier": rng.choice(_CARRIERS), "team": rng.choice(TEAMS)}
            for number in ids}


ORDERS = _orders()
"""Order id -> its status, carrier and owning team; the first ``NUM_TRAIN_ORDERS`` (in order) are the training
tickets', the rest the validation tickets'."""


def lookup_order(order_id: str) -> str:
    """Looks up an order: its status, carrier and the team that owns it.

    Args:
        order_id: The order's number, such as 51842.
    """
    order = ORDERS[str(order_id).strip().lstrip("#")]
    return f"order {order_id}: {order['status']}, carrier {order['carrier']}, team {order['team']}"


def _reply(order_id: str) -> str:
    order = ORDERS[order_id]
    return f"Your order {order_id} is {order['status']}.\nTeam: {order['team']}"


def _tickets(orders: list[str], templates: list[int], each: bool) -> list[tuple[str, str]]:
    """``(order id, ticket)``: each order with every template of ``templates`` (``each``), or with one of them in
    turn."""
    chosen = [[t] for t in templates] if not each else [templates]
    return [(order, _TICKETS[template].format(order=order))
            for k, order in enumerate(orders) for template in chosen[k % len(chosen)]]


def _splits() -> dict[str, list[str]]:
    ids = list(ORDERS)
    return {"train": ids[:NUM_TRAIN_ORDERS], "validation": ids[NUM_TRAIN_ORDERS:]}


def make_order_conversations() -> DatasetDict:
    """``messages`` (system, ticket, the call, the tool's result, the reply) and the order's columns: a ticket per
    order, the training orders' with templates 0-3 in turn, the validation orders' with 4-5. Few: a conversation is
    about 360 tokens under Qwen2.5's template with the tool, most of them the tool's description."""
    made = {}
    for split, templates in (("train", [0, 1, 2, 3]), ("validation", [4, 5])):
        rows = []
        for order, ticket in _tickets(_splits()[split], templates, each=False):
            call = {"type": "function", "function": {"name": "lookup_order", "arguments": {"order_id": order}}}
            rows.append({"messages": [{"role": "system", "content": SYSTEM_PROMPT},
                                      {"role": "user", "content": ticket},
                                      {"role": "assistant", "content": "", "tool_calls": [call]},
                                      {"role": "tool", "name": "lookup_order", "content": lookup_order(order)},
                                      {"role": "assistant", "content": _reply(order)}],
                         "order_id": order, **ORDERS[order]})
        made[split] = Dataset.from_list(rows)
    return DatasetDict(made)


def make_order_prompts() -> DatasetDict:
    """``prompt`` (system and ticket) and the asked order's ``order_id``, ``status``, ``carrier`` and ``team``:
    each training order in a one-order ticket (templates 4-7 in turn, none an SFT conversation's) and in a
    two-order ticket (the first two two-order templates in turn); each validation order in two two-order tickets
    (the other two templates). The other order is the split's next one that differs in status or team."""
    made = {}
    for split, two_order_templates in (("train", [0, 1]), ("validation", [2, 3])):
        orders, rows = _splits()[split], []
        for k, order in enumerate(orders):
            asked = (ORDERS[order]["status"], ORDERS[order]["team"])
            other = next(o for o in orders[k + 1:] + orders[:k] if (ORDERS[o]["status"], ORDERS[o]["team"]) != asked)
            tickets = [_TWO_ORDERS[t].format(other=other, order=order) for t in two_order_templates]
            if split == "train":
                tickets = [_TICKETS[4 + k % 4].format(order=order), tickets[k % 2]]
            rows += [{"prompt": [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": ticket}],
                      "order_id": order, **ORDERS[order]} for ticket in tickets]
        made[split] = Dataset.from_list(rows)
    return DatasetDict(made)


def stated(reply: str, names: tuple[str, ...]) -> list[str]:
    """Which of ``names`` the reply says, as words."""
    words = set(reply.lower().replace(".", " ").replace(",", " ").replace(":", " ").split())
    return [name for name in names if name in words]


def resolved(prompts, completions, status, team, **columns) -> list[float]:
    """A reward function (TRL's signature): 1 where the episode's last reply states the order's status and no
    other, and names its team and no other, else 0."""
    finals = [(c[-1].get("content") or "") if isinstance(c, list) else c for c in completions]
    return [float(stated(final, STATUSES) == [true_status] and stated(final, TEAMS) == [true_team])
            for final, true_status, true_team in zip(finals, status, team, strict=True)]


def write_files(folder: Path) -> dict[str, Path]:
    """The conversations and prompts as jsonl files in ``folder``: ``conversations_train.jsonl``, ...; returns
    them by name."""
    folder.mkdir(parents=True, exist_ok=True)
    written = {}
    for name, made in (("conversations", make_order_conversations()), ("prompts", make_order_prompts())):
        for split, rows in made.items():
            written[f"{name}_{split}"] = path = folder / f"{name}_{split}.jsonl"
            with open(path, "w") as f:
                f.writelines(json.dumps(row) + "\n" for row in rows)
    return written


if __name__ == "__main__":
    write_files(Path(sys.argv[1] if len(sys.argv) > 1 else "outputs/orders"))
