"""Conversations for chat fine-tuning: checking rows, rendering them with the model's chat template, and
marking which tokens train (every assistant turn, nothing else).

Trained tokens are found by position, not by searching the text for a response marker: the conversation
is rendered turn by turn, and each assistant turn is the span between the rendering of the conversation
before it (with the generation prompt) and the rendering that includes it. Offsets from the tokenizer map
those character spans onto tokens.
"""

from __future__ import annotations

import bisect
import json
import os

import datasets
import numpy as np
from transformers import PreTrainedTokenizerBase

from finetune.data.batching import LOSS_UNITS
from finetune.data.cache import TOKEN_IDS, Tokenizing, fitting_prefixes
from finetune.errors import UserError

__all__ = ["IGNORE", "ROLES", "check_conversation", "conversation_layout", "read_conversations",
           "render_reply_spans", "require_chat_template", "tokenize_conversations", "write_generations"]

IGNORE = -100
ROLES = ("system", "user", "assistant")


def conversation_layout(split: datasets.Dataset, name: str) -> tuple[str, ...]:
    """The columns conversations come from: ``("messages",)`` (lists of ``{role, content}``), or ``("prompt",
    "completion")`` (each a string or a list of messages).

    Raises:
        UserError: neither layout.
    """
    columns = split.column_names
    if "messages" in columns:
        return ("messages",)
    if "prompt" in columns and "completion" in columns:
        return ("prompt", "completion")
    raise UserError(f"{name} data has no 'messages' column and no 'prompt' and 'completion' columns (columns: "
                    f"{', '.join(columns)}); give conversations as a list of {{role, content}} messages")


def read_conversations(batch: dict, rows: list[int], layout: tuple[str, ...], name: str) -> list[list[dict]]:
    """A batch's rows as lists of ``{role, content}`` messages (``layout`` from ``conversation_layout``).

    Raises:
        UserError: an unknown role, content that is not text, an empty conversation or one with no assistant
            turn; the message names the row.
    """
    if layout == ("messages",):
        conversations = list(batch["messages"])
    else:
        conversations = [_as_messages(prompt, "user") + _as_messages(completion, "assistant")
                         for prompt, completion in zip(batch["prompt"], batch["completion"], strict=True)]
    for row, messages in zip(rows, conversations, strict=True):
        check_conversation(messages, f"{name} row {row + 1}")
    return [[{"role": m["role"], "content": m["content"]} for m in messages] for messages in conversations]


def _as_messages(value, role: str) -> list[dict]:
    return [{"role": role, "content": value}] if isinstance(value, str) else list(value or [])


def check_conversation(messages, where: str) -> None:
    """Raise ``UserError`` (prefixed by ``where``) for anything but a non-empty list of ``{role, content}``
    messages with known roles, text contents and at least one assistant turn."""
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


def tokenize_conversations(split: datasets.Dataset, tokenizer: PreTrainedTokenizerBase, max_length: int, name: str,
                           tokenizing: Tokenizing, generation_prompts: bool = False) -> datasets.Dataset:
    """Input ids cut to ``max_length``, labels on assistant tokens only, and the trained tokens of each row
    as its loss units.

    With ``generation_prompts`` each row also keeps what asks a model for its last reply: ``prompt_ids`` (the
    conversation before it rendered with the generation prompt), ``prompt_messages`` (those messages, as JSON),
    ``reference`` (the reply) and ``index`` (the row).

    Raises:
        UserError: a bad row (see ``read_conversations``), a template that does not render turn by turn, or rows
            with no trained token left after the cut.
    """
    layout = conversation_layout(split, name)

    def encode(batch, rows):
        conversations = read_conversations(batch, rows, layout, name)
        rendered = render_reply_spans(conversations, tokenizer, [f"{name} row {row + 1}" for row in rows])
        texts = fitting_prefixes([text for text, _ in rendered], tokenizer, max_length)[0]
        encoded = tokenizer(texts, add_special_tokens=False, return_offsets_mapping=True, return_attention_mask=False)
        out = {"input_ids": [], "labels": []}
        for ids, offsets, (_, spans) in zip(encoded["input_ids"], encoded["offset_mapping"], rendered, strict=True):
            starts = [begin for begin, _ in offsets]  # tokens come in text order: their starts never decrease
            labels = [IGNORE] * len(ids)
            for start, end in spans:  # the tokens that start within a reply train
                first, last = bisect.bisect_left(starts, start), bisect.bisect_left(starts, end)
                labels[first:last] = ids[first:last]
            labels[0] = IGNORE  # the first token has nothing before it to predict it from
            out["input_ids"].append(ids[:max_length])
            out["labels"].append(labels[:max_length])
        if generation_prompts:
            # The last reply's prompt is the text before its span: the conversation so far, with the generation prompt.
            prompts = [text[:spans[-1][0]] for text, spans in rendered]
            out["prompt_ids"] = tokenizer(prompts, add_special_tokens=False, return_attention_mask=False)["input_ids"]
            last = [max(i for i, m in enumerate(messages) if m["role"] == "assistant") for messages in conversations]
            out["prompt_messages"] = [json.dumps(messages[:i]) for messages, i in zip(conversations, last, strict=True)]
            out["reference"] = [messages[i]["content"] for messages, i in zip(conversations, last, strict=True)]
            out["index"] = rows
        return out

    features = {"input_ids": TOKEN_IDS, "labels": TOKEN_IDS}
    if generation_prompts:
        features.update(prompt_ids=TOKEN_IDS, prompt_messages=datasets.Value("string"),
                        reference=datasets.Value("string"), index=datasets.Value("int32"))
    tokenized = tokenizing.map(split, encode, name, features)
    empty = (np.flatnonzero(tokenized.data.column(LOSS_UNITS).to_numpy() == 0) + 1).tolist()
    if empty:
        shown = ", ".join(map(str, empty[:10])) + (f" and {len(empty) - 10} more" if len(empty) > 10 else "")
        raise UserError(f"{name} row(s) {shown}: no reply token is left within --max_seq_length {max_length}; "
                        "raise --max_seq_length or shorten those prompts")
    return tokenized


def render_reply_spans(conversations: list[list[dict]], tokenizer,
                       where: list[str]) -> list[tuple[str, list[tuple[int, int]]]]:
    """Each conversation's text and the character span of every assistant turn in it.

    Rendered in three template calls for all the conversations (the conversations; each reply's prefix with the
    generation prompt; each reply but the last with what precedes it), not several per conversation: the
    template's per-call cost is a large share of tokenizing a chat."""
    texts = _render_each(conversations, tokenizer)
    replies = [(row, turn) for row, messages in enumerate(conversations)
               for turn, message in enumerate(messages) if message["role"] == "assistant"]
    befores = _render_each([conversations[row][:turn] for row, turn in replies], tokenizer, add_generation_prompt=True)
    # Through the final message is the whole conversation, rendered already.
    inner = [(row, turn) for row, turn in replies if turn + 1 < len(conversations[row])]
    throughs = dict(zip(inner, _render_each([conversations[row][:turn + 1] for row, turn in inner], tokenizer),
                        strict=True))
    spans = [[] for _ in conversations]
    for (row, turn), before in zip(replies, befores, strict=True):
        text, through = texts[row], throughs.get((row, turn), texts[row])
        if not (text.startswith(through) and through.startswith(before)):
            raise UserError(f"{where[row]}: the chat template renders earlier turns differently once later ones "
                            "follow, so replies cannot be located by position; give --chat_template a template that "
                            "renders a conversation turn by turn")
        spans[row].append((len(before), len(through)))
    return list(zip(texts, spans, strict=True))


def _render_each(conversations: list[list[dict]], tokenizer, **options) -> list[str]:
    return tokenizer.apply_chat_template(conversations, tokenize=False, **options) if conversations else []


def write_generations(path: str, rows: datasets.Dataset, generations: list[str]) -> None:
    """``eval_generations.jsonl``: each prompt's messages, its reference reply and the generated one, in order
    (``rows`` tokenized with ``generation_prompts``)."""
    with open(path, "w") as f:
        for messages, reference, generation in zip(rows["prompt_messages"], rows["reference"], generations,
                                                   strict=True):
            f.write(json.dumps({"messages": json.loads(messages), "reference": reference,
                                "generation": generation}) + "\n")
