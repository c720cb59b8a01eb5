"""The embedded default for named-entity tagging: support-ticket sentences with their words tagged in BIO form.

Generated, not downloaded, so the default run works offline; deterministic (a fixed seed, no other
randomness). Entities: ``ORDER`` (order ids, written several ways, bare numbers among them), ``PRODUCT`` (one
to three words), ``DATE`` (absolute, relative, numeric), ``AMOUNT`` (currency before or after the number) and
``EMAIL``. Hard cases on purpose: entities at the start and end of a sentence, two entities of one type side by
side, words that look like entities and are not ("pro", "basic", "may", "3 days", a ticket number, "order" on
its own), lower-case chat messages, sentences with no entity at all, and in validation only: products and an
e-mail domain never seen in training, and sentences shaped unlike any training sentence.
"""

from __future__ import annotations

import random

from datasets import ClassLabel, Dataset, DatasetDict, Features, Sequence, Value

from finetune.data.embedded import EmbeddedDataset

__all__ = ["ENTITY_TYPES", "TAGGED_TICKETS", "TAG_NAMES", "make_tagged_tickets"]

ENTITY_TYPES = ["ORDER", "PRODUCT", "DATE", "AMOUNT", "EMAIL"]
TAG_NAMES = ["O"] + [f"{prefix}-{kind}" for kind in ENTITY_TYPES for prefix in ("B", "I")]
NUM_TRAIN, NUM_EVAL = 1200, 300
_SEED = 20261201

_FIRST = ["anna", "bo", "chen", "dara", "eli", "femi", "gus", "hana", "ivan", "jo", "kai", "lena", "mo", "nia",
          "omar", "pia", "quinn", "raj", "sara", "tom", "uma", "vik", "wen", "yara", "zed"]
_DOMAINS = ["example.com", "mail.example.org", "example.net", "corp.example.io", "example.co.uk", "post.example.de"]
_PRODUCTS = ["Pro plan", "Team plan", "Basic plan", "Enterprise plan", "desktop client", "mobile app",
             "smart thermostat", "wireless headphones", "Aero 3 laptop", "travel adapter", "Pro", "Nimbus router",
             "photo printer", "Aero 5 tablet", "USB-C dock", "standing desk", "noise-cancelling earbuds",
             "Family plan", "web dashboard", "Lumo lamp", "Vega 2 speaker", "charging cable", "backup drive"]
_MONTHS = ["January", "February", "March", "April", "May", "June", "July", "August", "September", "October",
           "November", "December"]
_WEEKDAYS = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"]


def _order(rng: random.Random) -> str:
    number = f"{rng.choice('ABCDEFGHKMPRTX')}{rng.randint(100, 99999)}"
    return rng.choice([number, f"#{number}", f"{number[0]}-{number[1:]}", f"order-{number}",
                       str(rng.randint(10**6, 10**8))])


def _date(rng: random.Random) -> str:
    day, month = rng.randint(1, 28), rng.choice(_MONTHS)
    return rng.choice([f"{month} {day}", f"{day} {month}", f"2026-{_MONTHS.index(month) + 1:02d}-{day:02d}",
                       f"last {rng.choice(_WEEKDAYS)}", f"next {rng.choice(_WEEKDAYS)}", rng.choice(_WEEKDAYS),
                       f"{month} {day}th" if day > 3 else f"{month} {day}", f"the {day}th of {month}",
                       f"{day}/{_MONTHS.index(month) + 1}"])


def _amount(rng: random.Random) -> str:
    value = rng.choice([f"{rng.randint(1, 500)}", f"{rng.randint(1, 500)}.{rng.randint(0, 99):02d}",
                        f"{rng.randint(1, 9)},{rng.randint(0, 999):03d}"])
    return rng.choice([f"${value}", f"€{value}", f"£{value}", f"{value} EUR", f"{value} USD", f"{value} dollars"])


def _email(rng: random.Random, domains: list[str]) -> str:
    name = rng.choice(_FIRST)
    user = rng.choice([name, f"{name}.{rng.choice(_FIRST)}", f"{name}_{rng.randint(1, 99)}", f"{name}-support"])
    return f"{user}@{rng.choice(domains)}"


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
    "I may cancel the {PRODUCT} if this is not fixed by {DATE} .",
    "A basic question : can I pay {AMOUNT} per year instead ?",
    "Ticket 4471 was closed but order {ORDER} is still open .",
    "Send the {PRODUCT} back ? I paid {AMOUNT} for it on {DATE} !",
    "The 2 boxes of order {ORDER} came on different days .",
    "{EMAIL} is my new address , please update it .",
]
HELD_OUT_TEMPLATES = 4
"""The last templates appear in validation only: the model must tag sentences shaped unlike any it trained on."""


def _sentence(rng: random.Random, template: str, products: list[str], domains: list[str]
              ) -> tuple[list[str], list[str]]:
    make = {"ORDER": lambda: _order(rng), "PRODUCT": lambda: rng.choice(products), "DATE": lambda: _date(rng),
            "AMOUNT": lambda: _amount(rng), "EMAIL": lambda: _email(rng, domains)}
    tokens, tags = [], []
    for word in template.split():
        if word.startswith("{") and word.endswith("}"):
            kind = word[1:-1]
            value = make[kind]().split()
            tokens += value
            tags += [f"B-{kind}"] + [f"I-{kind}"] * (len(value) - 1)
        else:
            tokens.append(word)
            tags.append("O")
    if template[0].islower() or rng.random() < 0.1:  # chat-style messages come in lower case
        tokens = [t.lower() for t in tokens]
    return tokens, tags


def _split(rng: random.Random, size: int, templates: list[str], products: list[str], domains: list[str]
           ) -> dict[str, list]:
    rows = [_sentence(rng, rng.choice(templates), products, domains) for _ in range(size)]
    return {"tokens": [tokens for tokens, _ in rows],
            "ner_tags": [[TAG_NAMES.index(tag) for tag in tags] for _, tags in rows]}


def make_tagged_tickets() -> DatasetDict:
    """``train`` (1,200) and ``validation`` (300) sentences with ``tokens`` and ``ner_tags``.

    ``ner_tags`` is a sequence of ``ClassLabel`` whose names (``TAG_NAMES``) become the model's ``id2label``.
    """
    rng = random.Random(_SEED)
    features = Features({"tokens": Sequence(Value("string")), "ner_tags": Sequence(ClassLabel(names=TAG_NAMES))})
    # A fifth of the products and one e-mail domain are never seen in training.
    seen_products, seen_domains = _PRODUCTS[:-5], _DOMAINS[:-1]
    train = _split(rng, NUM_TRAIN, _TEMPLATES[:-HELD_OUT_TEMPLATES], seen_products, seen_domains)
    validation = _split(rng, NUM_EVAL, _TEMPLATES, _PRODUCTS, _DOMAINS)
    return DatasetDict(train=Dataset.from_dict(train, features=features),
                       validation=Dataset.from_dict(validation, features=features))


TAGGED_TICKETS = EmbeddedDataset("tagged support tickets (embedded default)", make_tagged_tickets)
