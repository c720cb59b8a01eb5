"""Conversations for chat fine-tuning: checking rows, rendering them with the model's chat template, and
marking which tokens train (every assistant turn, nothing else).

Trained tokens are found by position, not by searching the text for a response marker: the conversation
is rendered turn by turn, and each assistant turn is the span between the rendering of the conversation
before it (with the generation prompt) and the rendering that includes it. Offsets from the tokenizer map
those character spans onto tokens.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

import datasets
from transformers import PreTrainedTokenizerBase

from finetune.batching import TokenizedDataset
from finetune.errors import UserError

__all__ = ["IGNORE", "ROLES", "GenerationPrompt", "generation_prompts", "read_conversations", "require_chat_template",
           "tokenize_conversations", "write_generations"]

IGNORE = -100
ROLES = ("system", "user", "assistant")


def read_conversations(split: datasets.Dataset, name: str) -> list[list[dict]]:
    """Each row as a list of ``{role, content}`` messages, from a ``messages`` column or from ``prompt`` and
    ``completion`` columns (each a string or a list of messages).

    Raises:
        UserError: neither column layout, an unknown role, content that is not text, an empty conversation
            or one with no assistant turn; the message names the row.
    """
    columns = split.column_names
    if "messages" in columns:
        rows = list(split["messages"])
    elif "prompt" in columns and "completion" in columns:
        rows = [_as_messages(prompt, "user") + _as_messages(completion, "assistant")
                for prompt, completion in zip(split["prompt"], split["completion"], strict=True)]
    else:
        raise UserError(f"{name} data has no 'messages' column and no 'prompt' and 'completion' columns (columns: "
                        f"{', '.join(columns)}); give conversations as a list of {{role, content}} messages")
    for number, messages in enumerate(rows, start=1):
        _check_conversation(messages, f"{name} row {number}")
    return [[{"role": m["role"], "content": m["content"]} for m in messages] for messages in rows]


def _as_messages(value, role: str) -> list[dict]:
    return [{"role": role, "content": value}] if isinstance(value, str) else list(value or [])


def _check_conversation(messages, where: str) -> None:
    if not isinstance(messages, list) or not messages:
        raise UserError(f"{where}: the conversation is empty; give at least a user and an assistant message")
    for turn, message in enumerate(messages, start=1):
        if not isinstance(message, dict) or "role" not in message or "content" not in message:
            raise UserError(f"{where}, message {turn}: not a {{role, content}} object")
        if message["role"] not in ROLES:
            raise UserError(f"{where}, message {turn}: unknown role {message['role']!r}; use one of "
                            f"{', '.join(ROLES)}")
        if not isinstance(message["content"], str):
            raise UserError(f"{where}, message {turn}: content is {type(message['content']).__name__}, not text; "
                            "give each message's content as a string")
    if not any(m["role"] == "assistant" for m in messages):
        raise UserError(f"{where}: no assistant message, so nothing to train; add the reply or drop the row")


def require_chat_template(tokenizer: PreTrainedTokenizerBase, template_file: str | None, model: str) -> None:
    """Give ``tokenizer`` the template in ``template_file`` (``--chat_template``), if any.

    Raises:
        UserError: the file is missing, or the tokenizer still has no template.
    """
    if template_file:
        if not os.path.isfile(template_file):
            raise UserError(f"--chat_template {template_file}: no such file; give a Jinja template file")
        with open(template_file, encoding="utf-8") as f:
            tokenizer.chat_template = f.read()
    if not tokenizer.chat_template:
        raise UserError(f"{model} has no chat template; give one with --chat_template FILE")


def tokenize_conversations(conversations: list[list[dict]], tokenizer: PreTrainedTokenizerBase, max_length: int,
                           name: str) -> TokenizedDataset:
    """Input ids cut to ``max_length``, labels on assistant tokens only, and the trained tokens of each row
    as its loss units.

    Raises:
        UserError: the template does not render turn by turn, or rows have no trained token left after the cut.
    """
    columns = {"input_ids": [], "labels": []}
    empty = []
    for number, messages in enumerate(conversations, start=1):
        text, spans = _render(messages, tokenizer, f"{name} row {number}")
        encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        ids, offsets = encoded["input_ids"], encoded["offset_mapping"]
        labels = [token if any(start <= begin < end for start, end in spans) else IGNORE
                  for token, (begin, _) in zip(ids, offsets, strict=True)]
        labels[0] = IGNORE  # the first token has nothing before it to predict it from
        ids, labels = ids[:max_length], labels[:max_length]
        if all(label == IGNORE for label in labels):
            empty.append(number)
        columns["input_ids"].append(ids)
        columns["labels"].append(labels)
    if empty:
        shown = ", ".join(map(str, empty[:10])) + (f" and {len(empty) - 10} more" if len(empty) > 10 else "")
        raise UserError(f"{name} row(s) {shown}: no reply token is left within --max_seq_length {max_length}; "
                        "raise --max_seq_length or shorten those prompts")
    units = [sum(label != IGNORE for label in labels) for labels in columns["labels"]]
    return TokenizedDataset(columns, loss_units=units)


def _render(messages: list[dict], tokenizer, where: str) -> tuple[str, list[tuple[int, int]]]:
    """The conversation's text and the character span of every assistant turn in it."""
    text = tokenizer.apply_chat_template(messages, tokenize=False)
    spans = []
    for turn, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        before = tokenizer.apply_chat_template(messages[:turn], tokenize=False, add_generation_prompt=True)
        through = tokenizer.apply_chat_template(messages[:turn + 1], tokenize=False)
        if not (text.startswith(through) and through.startswith(before)):
            raise UserError(f"{where}: the chat template renders earlier turns differently once later ones follow, "
                            "so replies cannot be located by position; give --chat_template a template that "
                            "renders a conversation turn by turn")
        spans.append((len(before), len(through)))
    return text, spans


@dataclass
class GenerationPrompt:
    """What asks a model for a conversation's last reply, and that reply."""

    messages: list[dict]
    """The conversation up to its last assistant turn."""
    token_ids: list[int]
    """``messages`` rendered with the generation prompt."""
    reference: str


def generation_prompts(conversations: list[list[dict]], tokenizer: PreTrainedTokenizerBase
                       ) -> list[GenerationPrompt]:
    prompts = []
    for messages in conversations:
        last = max(i for i, m in enumerate(messages) if m["role"] == "assistant")
        text = tokenizer.apply_chat_template(messages[:last], tokenize=False, add_generation_prompt=True)
        prompts.append(GenerationPrompt(messages[:last], tokenizer(text, add_special_tokens=False)["input_ids"],
                                        messages[last]["content"]))
    return prompts


def write_generations(path: str, prompts: list[GenerationPrompt], generations: list[str]) -> None:
    """``eval_generations.jsonl``: each prompt's messages, its reference reply and the generated one, in order."""
    with open(path, "w") as f:
        for prompt, generation in zip(prompts, generations, strict=True):
            f.write(json.dumps({"messages": prompt.messages, "reference": prompt.reference,
                                "generation": generation}) + "\n")
