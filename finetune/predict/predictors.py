"""What each recipe's model predicts for a row: a classifier its label and every label's probability, a tagger
each word's tag and the entities they spell (BIO), an embedder the text's embedding, a chat model its reply. Each
reads the columns its recipe trains on, and predicts a list of rows at a time in batches."""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from pathlib import Path

from finetune.errors import UserError

__all__ = ["Plan", "Predictor", "load_predictor", "plan_for"]


@dataclass(frozen=True)
class Plan:
    """What a folder holds, known before its weights load: the kind of model and the columns it reads."""
    folder: Path
    kind: str  # classify, tag, embed or chat
    columns: tuple[str, ...]  # classify and tag: the text column (and a pair's); embed: the text; chat: messages
    # or prompt
    base_model: str | None = None

    def rows(self, data) -> list[dict]:
        """The input file's rows, checked for the columns this kind of model reads.

        Raises:
            UserError: the file lacks them.
        """
        present = set(data.column_names)
        fits = bool(present & set(self.columns)) if self.kind == "chat" else set(self.columns) <= present
        if not fits:
            wanted = (" or " if self.kind == "chat" else " and ").join(repr(column) for column in self.columns)
            raise UserError(f"--input has no {wanted} column (columns: {', '.join(data.column_names)}); a "
                            f"{self.kind} model reads {wanted}, as its recipe trains on")
        rows, words = data.to_list(), self.kind == "tag"
        for number, row in enumerate(rows, 1):
            where = f"--input row {number}"
            if self.kind == "chat":
                messages, prompt = row.get("messages"), row.get("prompt")
                if messages is not None and not _conversation(messages):
                    raise UserError(f"{where}: messages is {str(messages)[:60]!r}, not a list of messages (each a "
                                    "role and its content); give a JSON lines file, or drop the row")
                if messages is None and not (isinstance(prompt, str) or _conversation(prompt)):
                    raise UserError(f"{where} has neither messages nor a prompt; give it one, or drop the row")
                tools_of(row, where)
                continue
            for column in self.columns:
                value = row[column]
                if not (isinstance(value, list) and all(isinstance(word, str) for word in value) if words
                        else isinstance(value, str)):
                    raise UserError(f"{where}: {column!r} is {str(value)[:60]!r} ({type(value).__name__}), not "
                                    f"{'a list of words' if words else 'a text'}; fill it in, or drop the row")
        return rows


def _conversation(messages) -> bool:
    return isinstance(messages, list) and bool(messages) and all(isinstance(m, dict) for m in messages)


@dataclass
class Predictor:
    plan: Plan
    model: object
    tokenizer: object
    batch_size: int

    def __call__(self, rows: list[dict], sampling=None, progress=None) -> list[dict]:
        results = []
        for start in range(0, len(rows), self.batch_size):
            batch = rows[start:start + self.batch_size]
            results += getattr(self, f"_{self.plan.kind}")(batch, sampling)
            if progress is not None:
                progress.update(len(batch))
        return results

    def _classify(self, rows: list[dict], sampling) -> list[dict]:
        import torch

        texts = [[row[column] for row in rows] for column in self.plan.columns]
        batch = self.tokenizer(*texts, truncation=True, padding=True, return_tensors="pt").to(self.model.device)
        with torch.no_grad():
            probabilities = self.model(**batch).logits.float().softmax(-1).tolist()
        names = self.model.config.id2label
        return [{"predicted_label": names[max(range(len(p)), key=p.__getitem__)],
                 "probabilities": {names[i]: round(value, 6) for i, value in enumerate(p)}} for p in probabilities]

    def _tag(self, rows: list[dict], sampling) -> list[dict]:
        import torch

        from finetune.tasks.tagging import entities

        words = [row[self.plan.columns[0]] for row in rows]
        batch = self.tokenizer(words, is_split_into_words=True, truncation=True, padding=True,
                               return_tensors="pt").to(self.model.device)
        with torch.no_grad():
            best = self.model(**batch).logits.argmax(-1).tolist()
        names, results = self.model.config.id2label, []
        for row, (sentence, ids) in enumerate(zip(words, best, strict=True)):
            tags = ["O"] * len(sentence)  # words past the model's length keep O
            seen = set()
            for position, word in enumerate(batch.word_ids(row)):
                if word is not None and word not in seen:  # a word's tag is its first piece's, as it trained
                    seen.add(word)
                    tags[word] = names[ids[position]]
            spans = sorted(entities(tags), key=lambda span: span[1])
            results.append({"predicted_tags": tags, "entities": [
                {"type": kind, "start": first, "end": last + 1, "text": " ".join(sentence[first:last + 1])}
                for kind, first, last in spans]})
        return results

    @functools.cached_property
    def _embedding(self) -> tuple:
        """The folder's pooling and the length it cuts texts at, read once."""
        from finetune.models.sentence_folder import base_pooling

        limit = json.loads((self.plan.folder / "sentence_bert_config.json").read_text())["max_seq_length"]
        return base_pooling(self.plan.folder), limit

    def _embed(self, rows: list[dict], sampling) -> list[dict]:
        import torch

        from finetune.tasks.embedding import embed

        pooling, limit = self._embedding
        batch = self.tokenizer([row[self.plan.columns[0]] for row in rows], truncation=True, max_length=limit,
                               padding=True, return_tensors="pt").to(self.model.device)
        with torch.no_grad():
            vectors = embed(self.model, batch["input_ids"], batch["attention_mask"], pooling)
        return [{"embedding": vector} for vector in vectors.tolist()]

    def _chat(self, rows: list[dict], sampling) -> list[dict]:
        from finetune.predict.generation import replies

        prompts = [prompt_of(row) for row in rows]
        tools = [tools_of(row, "--input") for row in rows]
        return [{"reply": reply} for reply in replies(self.model, self.tokenizer, prompts, sampling, tools=tools)]


def prompt_of(row: dict) -> list[dict]:
    """The messages a reply follows: a ``messages`` row up to its last assistant turn (all of it where it ends
    with another), or a ``prompt`` (a string is one user turn)."""
    from finetune.tasks.chat import without_nulls

    if row.get("messages") is not None:  # (a file mixing both kinds of rows gives each both columns)
        messages = [without_nulls(message) for message in row["messages"]]  # Arrow gives each every key
        last = max((i for i, m in enumerate(messages) if m["role"] == "assistant"), default=None)
        return messages[:last] if last is not None and last == len(messages) - 1 else messages
    prompt = row["prompt"]
    return [{"role": "user", "content": prompt}] if isinstance(prompt, str) else [without_nulls(m) for m in prompt]


def tools_of(row: dict, where: str) -> list[dict] | None:
    """A chat row's ``tools`` (function schemas, a list or its JSON text), None where it has none.

    Raises:
        UserError: they are not a list of schemas; the message says ``where``.
    """
    from finetune.tasks.chat import read_tools

    tools = read_tools(row.get("tools"), where)
    return json.loads(tools) if tools else None


LABELLED = {"ForSequenceClassification": "classify", "ForTokenClassification": "tag"}


def plan_for(folder: str | Path, text_column: str | None = None, text_pair_column: str | None = None,
             base_model: str | None = None) -> Plan:
    """What ``folder`` holds, from its configuration alone: a classifier or tagger (reading the columns its run
    read, each replaced where ``text_column`` or ``text_pair_column`` is given; by default its recipe's ``text`` or
    ``tokens``), an embedder (``text_column``, by default ``text``) or a chat model (a model or an adapter;
    ``messages`` or ``prompt``).

    Raises:
        UserError: ``folder`` holds no trained model, or an adapter whose base cannot be read.
    """
    from finetune.models.trained import check_trained_folder, trained_config

    folder = Path(folder)
    check_trained_folder(folder)
    config_file = folder / "config.json"
    config = json.loads(config_file.read_text()) if config_file.is_file() else {}
    if (folder / "modules.json").is_file():  # the embedding recipe's sentence-transformers folder
        return Plan(folder, "embed", (text_column or "text",))
    for suffix, kind in LABELLED.items():
        if any(name.endswith(suffix) for name in config.get("architectures", [])):
            columns = config.get("finetune_text_columns") or ["text" if kind == "classify" else "tokens"]
            for position, given in enumerate((text_column, text_pair_column)):
                if given:
                    columns[position:position + 1] = [given]
            return Plan(folder, kind, tuple(columns))
    trained_config(folder, base_model)
    return Plan(folder, "chat", ("messages", "prompt"), base_model)


def load_predictor(plan: Plan, batch_size: int, device) -> Predictor:
    """The model ``plan`` names, with its tokenizer, on ``device``."""
    import transformers

    from finetune.models.loading import from_pretrained, load_model
    from finetune.models.trained import load_trained

    if plan.kind == "chat":
        trained = load_trained(plan.folder, plan.base_model)
        return Predictor(plan, trained.model.to(device), trained.tokenizer, batch_size)
    auto_class = {"classify": transformers.AutoModelForSequenceClassification, "embed": transformers.AutoModel,
                  "tag": transformers.AutoModelForTokenClassification}[plan.kind]
    model = load_model(auto_class, str(plan.folder)).to(device).eval()
    return Predictor(plan, model, from_pretrained(transformers.AutoTokenizer, str(plan.folder)), batch_size)
