"""The embedded default for named-entity tagging: support-ticket sentences with their words tagged in BIO form.

Generated, not downloaded, so the default run works offline; deterministic (a fixed seed, no other
randomness). Entities: ``ORDER`` (order ids, written several ways), ``PRODUCT`` (one to three words),
``DATE`` (absolute and relative), ``AMOUNT`` (currency before or after the number) and ``EMAIL``. Hard cases
on purpose: entities at the start and end of a sentence, two entities of one type side by side, words that
look like entities and are not ("pro", "3 days", "order" on its own, a bare number), lower-case chat
messages, and sentences with no entity at all.
"""

from __future__ import annotations

import random

from datasets import ClassLabel, Dataset, DatasetDict, Features, Sequence, Value

__all__ = ["ENTITY_TYPES", "TAG_NAMES", "make_tagged_tickets"]

ENTITY_TYPES = ["ORDER", "PRODUCT", "DATE", "AMOUNT", "EMAIL"]
TAG_NAMES = ["O"] + [f"{prefix}-{kind}" for kind in ENTITY_TYPES for prefix in ("B", "I")]
NUM_TRAIN, NUM_EVAL = 1200, 300
_SEED = 20261201

_VALUES = {
    "ORDER": ["A1043", "B2291", "#C7780", "D-0412", "E5567", "order-F3009", "#G1180", "H7731"],
    "PRODUCT": ["Pro plan", "Team plan", "Basic plan", "Enterprise plan", "desktop client", "mobile app",
                "smart thermostat", "wireless headphones", "Aero 3 laptop", "travel adapter", "Pro"],
    "DATE": ["March 3", "3 March", "2026-03-14", "last Friday", "next Monday", "June 21st", "yesterday morning",
             "October 2", "the 5th of May", "Tuesday"],
    "AMOUNT": ["$49.99", "€12", "120 EUR", "19.00 USD", "$5", "£230", "89 dollars", "4,500 JPY"],
    "EMAIL": ["anna.k@example.com", "j.smith@mail.example.org", "support-me@example.net", "bo@example.io",
              "lee_99@example.co.uk"],
}

_TEMPLATES = [
    "I ordered the {PRODUCT} on {DATE} and order {ORDER} has still not shipped .",
    "Please refund {AMOUNT} to my card for order {ORDER} .",
    "My {PRODUCT} renewed on {DATE} for {AMOUNT} without asking me .",
    "Can you send the invoice for {ORDER} to {EMAIL} ?",
    "The {PRODUCT} keeps crashing since {DATE} .",
    "I was charged {AMOUNT} twice this month .",
    "Contact me at {EMAIL} about the {PRODUCT} please .",
    "Order {ORDER} and order {ORDER} both arrived on {DATE} , both damaged .",
    "{ORDER} is missing one item .",
    "{DATE} I paid {AMOUNT} and got nothing .",
    "my email changed from {EMAIL} to {EMAIL}",
    "Why does the {PRODUCT} cost {AMOUNT} now ?",
    "The courier said {ORDER} would come {DATE} but it never did .",
    "Please cancel {ORDER} , I found the {PRODUCT} cheaper elsewhere .",
    "I have been waiting 3 days for a reply to {EMAIL} .",
    "I am not a pro at this , how do I update the {PRODUCT} ?",
    "The order page shows an error when I pay {AMOUNT} .",
    "Thanks for the quick help , everything works now !",
    "I cannot log in and the reset email never arrives .",
    "Is the {PRODUCT} compatible with the {PRODUCT} ?",
    "hi my order {ORDER} from {DATE} is wrong",
    "refund {AMOUNT} to {EMAIL} asap",
    "Could you change the delivery of {ORDER} to {DATE} ?",
    "We bought 12 seats of the {PRODUCT} on {DATE} .",
]


def _sentence(rng: random.Random, template: str) -> tuple[list[str], list[str]]:
    tokens, tags = [], []
    for word in template.split():
        if word.startswith("{") and word.endswith("}"):
            kind = word[1:-1]
            value = rng.choice(_VALUES[kind]).split()
            tokens += value
            tags += [f"B-{kind}"] + [f"I-{kind}"] * (len(value) - 1)
        else:
            tokens.append(word)
            tags.append("O")
    if template[0].islower():  # chat-style messages come in lower case
        tokens = [t if t.startswith(("#", "$")) or "@" in t else t.lower() for t in tokens]
    return tokens, tags


def _split(rng: random.Random, size: int) -> dict[str, list]:
    rows = [_sentence(rng, rng.choice(_TEMPLATES)) for _ in range(size)]
    return {"tokens": [tokens for tokens, _ in rows],
            "ner_tags": [[TAG_NAMES.index(tag) for tag in tags] for _, tags in rows]}


def make_tagged_tickets() -> DatasetDict:
    """``train`` (1,200) and ``validation`` (300) sentences with ``tokens`` and ``ner_tags``.

    ``ner_tags`` is a sequence of ``ClassLabel`` whose names (``TAG_NAMES``) become the model's ``id2label``.
    """
    rng = random.Random(_SEED)
    features = Features({"tokens": Sequence(Value("string")), "ner_tags": Sequence(ClassLabel(names=TAG_NAMES))})
    return DatasetDict(train=Dataset.from_dict(_split(rng, NUM_TRAIN), features=features),
                       validation=Dataset.from_dict(_split(rng, NUM_EVAL), features=features))
