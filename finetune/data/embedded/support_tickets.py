"""The embedded default dataset: customer-support messages labelled by the team that should answer.

It is generated, not downloaded, so the default run works offline. Generation is deterministic (a fixed
seed and no other randomness), the classes are imbalanced the way real queues are, and message length
has a long tail: most are one or two sentences, some are long rambling letters. Some messages mention a
second team's topic in passing, and about 4% of labels are wrong, as in any hand-labelled queue.
"""

from __future__ import annotations

import random

from datasets import ClassLabel, Dataset, DatasetDict, Features, Value

from finetune.data.embedded import EmbeddedDataset

__all__ = ["ISSUES", "LABEL_NAMES", "SUPPORT_TICKETS", "make_support_tickets", "message"]

LABEL_NAMES = ["billing", "technical", "shipping", "account"]
_LABEL_SHARES = [0.38, 0.27, 0.20, 0.15]
NUM_TRAIN, NUM_EVAL = 2400, 600
_SEED = 20261130
_LABEL_NOISE = 0.04

ISSUES = {
    "billing": [
        "I was charged twice for my {plan} subscription this month",
        "my invoice shows the wrong amount for {month}",
        "the refund you promised for order {order} never arrived on my card",
        "why did the price of the {plan} plan go up without notice",
        "please cancel the automatic renewal before the next payment",
        "the discount code {code} was not applied at checkout",
        "I need a receipt with our company tax number for {month}",
        "my credit card was declined but the money left my account",
        "you billed me for a seat we removed in {month}",
        "can I switch from monthly to yearly billing and get the difference back",
    ],
    "technical": [
        "the app crashes every time I open the {screen} screen",
        "sync has been stuck at {percent} percent since the last update",
        "I get error {errcode} when I try to export a report",
        "the page loads forever on {browser} but works on my phone",
        "notifications stopped working after I installed version {version}",
        "the search returns nothing even for items I can see in the list",
        "uploading a file larger than {size} megabytes fails with a timeout",
        "the dashboard charts are blank since this morning",
        "the integration with our calendar keeps disconnecting",
        "the desktop client uses all the memory and freezes my laptop",
    ],
    "shipping": [
        "my package for order {order} has not moved for {days} days",
        "the tracking number you sent does not work on the carrier site",
        "the parcel arrived damaged and the box was open",
        "I received the wrong item in order {order}",
        "can you deliver to my office instead of my home address",
        "the courier left the package at the wrong door",
        "order {order} says delivered but nothing is here",
        "how long does express delivery take to {city}",
        "one item from my order {order} is missing in the box",
        "I want to change the delivery date to next {weekday}",
    ],
    "account": [
        "I cannot log in even after resetting my password",
        "please change the email address on my profile",
        "my account was locked after too many attempts",
        "how do I add a colleague as an administrator",
        "I want to delete my account and all my data",
        "the two factor code never reaches my phone",
        "someone else seems to have signed in to my profile from {city}",
        "I need to merge two accounts I created by mistake",
        "how can I change the name shown on my profile",
        "I never received the email to verify my address",
    ],
}

_ASIDES = {
    "billing": "the last invoice looked fine by the way",
    "technical": "the app itself works fine otherwise",
    "shipping": "my previous delivery came on time",
    "account": "I can log in without trouble",
}

_OPENERS = [
    "Hello,", "Hi team,", "Good morning.", "Hey,", "Dear support,", "Hi there.", "", "", "", "",
]
_CLOSERS = [
    "Thanks.", "Thank you in advance.", "Please help.", "Regards.", "Cheers.", "This is urgent.", "", "", "",
]
_FILLER = [
    "I have been a customer for {years} years and never had a problem like this.",
    "I already tried contacting you through the chat last {weekday}.",
    "My colleague had the same experience last week.",
    "I read the help pages but they did not answer my question.",
    "It is quite frustrating because we depend on your service every day.",
    "Our team of {size} people uses the product for all our projects.",
    "I would appreciate a quick answer since I am travelling to {city} soon.",
    "Please let me know if you need any more details from me.",
    "I attached a screenshot to my previous message.",
    "We are considering renewing for another year, so this matters to us.",
    "I am writing from my work address because my personal one is not available.",
    "The weather here in {city} is terrible, which does not help my mood.",
]
_SLOTS = {
    "plan": ["Basic", "Pro", "Team", "Enterprise"],
    "month": ["January", "March", "April", "June", "August", "October", "November"],
    "order": ["A1043", "B2291", "C7780", "D0412", "E5567", "F3009"],
    "code": ["SPRING20", "WELCOME10", "LOYAL15"],
    "screen": ["settings", "reports", "calendar", "inbox"],
    "percent": ["12", "47", "80", "99"],
    "errcode": ["500", "E42", "403", "TIMEOUT-7"],
    "browser": ["Firefox", "Chrome", "Safari", "Edge"],
    "version": ["3.2", "4.0.1", "5.1"],
    "size": ["20", "50", "100", "12"],
    "days": ["four", "six", "ten", "twelve"],
    "city": ["Lisbon", "Oslo", "Denver", "Nairobi", "Osaka", "Lyon"],
    "weekday": ["Monday", "Tuesday", "Thursday", "Friday"],
    "years": ["two", "three", "five", "ten"],
}


def _fill(rng: random.Random, template: str) -> str:
    return template.format(**{slot: rng.choice(values) for slot, values in _SLOTS.items()})


def message(rng: random.Random, label: str, issue: str | None = None) -> str:
    """A ticket about ``issue`` (one of ``ISSUES[label]``; by default one drawn), in a customer's words."""
    issue = _fill(rng, issue or rng.choice(ISSUES[label]))
    issue = issue[0].upper() + issue[1:] + rng.choice([".", "!", "?", "."])
    # Lengths: most messages are the issue alone or with a greeting, a long tail adds many filler sentences.
    num_filler = min(int(rng.expovariate(0.9)), 14)
    sentences = [_fill(rng, s) for s in rng.sample(_FILLER, k=min(num_filler, len(_FILLER)))]
    sentences.insert(rng.randint(0, len(sentences)), issue)
    if rng.random() < 0.25:
        other = rng.choice([name for name in LABEL_NAMES if name != label])
        sentences.append(f"Unrelated, but {_ASIDES[other]}.")
    text = " ".join(part for part in [rng.choice(_OPENERS), *sentences, rng.choice(_CLOSERS)] if part)
    # Short chat-style messages: lower case, no greeting.
    return text.lower() if rng.random() < 0.2 else text


def _split(rng: random.Random, size: int) -> dict[str, list]:
    labels = rng.choices(range(len(LABEL_NAMES)), weights=_LABEL_SHARES, k=size)
    texts = [message(rng, LABEL_NAMES[label]) for label in labels]
    noisy = [rng.randrange(len(LABEL_NAMES)) if rng.random() < _LABEL_NOISE else label for label in labels]
    return {"text": texts, "label": noisy}


def make_support_tickets() -> DatasetDict:
    """Return the default dataset: ``train`` (2,400) and ``validation`` (600) with ``text`` and ``label``.

    ``label`` is a ``ClassLabel`` whose names become the saved model's ``id2label``.
    """
    rng = random.Random(_SEED)
    features = Features({"text": Value("string"), "label": ClassLabel(names=LABEL_NAMES)})
    return DatasetDict(
        train=Dataset.from_dict(_split(rng, NUM_TRAIN), features=features),
        validation=Dataset.from_dict(_split(rng, NUM_EVAL), features=features),
    )


SUPPORT_TICKETS = EmbeddedDataset("support tickets (embedded default)", make_support_tickets)
