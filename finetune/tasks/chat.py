"""Conversations for chat fine-tuning: checking rows, rendering them with the model's chat template, and
marking which tokens train: each reply exactly as the model would generate it, nothing else.

What trains for the assistant turn k is what the model produces at inference: it sees the history rendered with
the generation prompt, ``render(messages[:k], add_generation_prompt=True)``, and produces the rest of
``render(messages[:k + 1])``. Trained tokens are found by these positions, not by searching the text for a
response marker. A template that renders turn by turn (each rendering a prefix of the next) keeps a conversation
one row; one that rewrites the history (Qwen3 drops earlier reasoning) gives the fewest rows that keep every
reply in its inference context. Every key of a message reaches the template unchanged (``reasoning_content``,
``tool_calls``, ...), and a row's ``tools`` go to it as ``tools=``.
"""

from __future__ import annotations

import bisect
import importlib.util
import json
import os
import re
from collections import defaultdict

import datasets
import jinja2
import numpy as np
from transformers import PreTrainedTokenizerBase

from finetune.data.batching import LOSS_UNITS
from finetune.data.cache import TOKEN_IDS, Tokenizing, fitting_prefixes
from finetune.errors import UserError

__all__ = ["IGNORE", "ROLES", "TEMPLATE_ERRORS", "check_conversation", "conversation_layout", "end_of_turn_ids",
           "preview_rows", "read_conversations", "read_tools", "render_last_reply", "render_prompts", "render_rows",
           "require_chat_template", "rows_tools", "split_conversations", "template_with_defaults",
           "tokenize_conversations", "without_nulls", "write_generations"]

IGNORE = -100
ROLES = ("system", "developer", "user", "assistant", "tool")
TEMPLATE_ERRORS = (jinja2.TemplateError, TypeError, ValueError, KeyError, IndexError)
"""What a template raises on data it does not take: its own raise_exception, and its filters' errors (tojson of a
missing content is a TypeError)."""


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


def read_conversations(batch: dict, rows: list[int], layout: tuple[str, ...], name: str
                       ) -> tuple[list[list[dict]], list[str | None]]:
    """A batch's rows as lists of messages (``layout`` from ``conversation_layout``), each message with every key
    it was given, and each row's ``tools`` (a JSON list of function schemas; None without a ``tools`` column).

    Raises:
        UserError: an unknown role, content that is not text, an empty conversation or one with no assistant
            turn, tools that are not a list of schemas; the message names the row.
    """
    if layout == ("messages",):
        conversations = list(batch["messages"])
    else:
        conversations = [_as_messages(prompt, "user") + _as_messages(completion, "assistant")
                         for prompt, completion in zip(batch["prompt"], batch["completion"], strict=True)]
    conversations = [[without_nulls(message) for message in messages] if isinstance(messages, list) else messages
                     for messages in conversations]
    tools = rows_tools(batch, rows, name)
    for row, messages in zip(rows, conversations, strict=True):
        check_conversation(messages, f"{name} row {row + 1}")
    return conversations, tools


def without_nulls(value):
    """A message as its row gave it: Arrow gives every message of a column every key any of them has, the missing
    ones as None, and a template reads ``'reasoning_content' in message`` as given."""
    if isinstance(value, dict):
        return {key: without_nulls(item) for key, item in value.items() if item is not None}
    if isinstance(value, list):
        return [without_nulls(item) for item in value]
    return value


def rows_tools(batch: dict, rows: list[int], name: str) -> list[str | None]:
    """Each row's ``tools`` (``read_tools``); None for every row of data without a ``tools`` column."""
    return [read_tools(value, f"{name} row {row + 1}")
            for row, value in zip(rows, batch.get("tools") or [None] * len(rows), strict=True)]


def read_tools(value, where: str) -> str | None:
    """A row's ``tools`` value as JSON text in its given order (rows with equal lists render together), None
    without one."""
    if value is None:
        return None
    try:
        tools = json.loads(value) if isinstance(value, str) else without_nulls(value)
    except json.JSONDecodeError as err:
        raise UserError(f"{where}: tools is not JSON ({err}); give a list of JSON function schemas") from None
    if not isinstance(tools, list) or not all(isinstance(tool, dict) for tool in tools):
        raise UserError(f"{where}: tools is {type(tools).__name__}; give a list of JSON function schemas")
    return json.dumps(tools)


def _as_messages(value, role: str) -> list[dict]:
    return [{"role": role, "content": value}] if isinstance(value, str) else list(value or [])


def check_conversation(messages, where: str) -> None:
    """Raise ``UserError`` (prefixed by ``where``) for anything but a non-empty list of messages with known roles,
    text contents (an assistant's may be absent when it calls tools) and at least one assistant turn."""
    if not isinstance(messages, list) or not messages:
        raise UserError(f"{where}: the conversation is empty; give at least a user and an assistant message")
    for turn, message in enumerate(messages, start=1):
        if not isinstance(message, dict) or "role" not in message:
            raise UserError(f"{where}, message {turn}: not a {{role, content}} object")
        if message["role"] not in ROLES:
            raise UserError(f"{where}, message {turn}: unknown role {message['role']!r}; use one of "
                            f"{', '.join(ROLES)}")
        content = message.get("content")
        if isinstance(content, list):
            kinds = sorted({part.get("type", "?") for part in content if isinstance(part, dict)} - {"text"})
            if kinds or not all(isinstance(part, dict) for part in content):
                raise UserError(f"{where}, message {turn}: content holds {', '.join(kinds) or 'parts'} besides "
                                "text; the chat recipes train text models, so give each message's content as text")
        elif content is None and not (message["role"] == "assistant" and message.get("tool_calls")):
            raise UserError(f"{where}, message {turn}: no content; give each message's content as text (only an "
                            "assistant turn that calls tools may leave it out)")
        elif content is not None and not isinstance(content, str):
            raise UserError(f"{where}, message {turn}: content is {type(content).__name__}, not text; "
                            "give each message's content as a string")
    if not any(m["role"] == "assistant" for m in messages):
        raise UserError(f"{where}: no assistant message, so nothing to train; add the reply or drop the row")


def require_chat_template(tokenizer: PreTrainedTokenizerBase, template_file: str | None, model: str) -> None:
    """Give ``tokenizer`` the template in ``template_file`` (``--chat_template``), if any.

    Raises:
        UserError: the file is missing, or the tokenizer still has no template.
    """
    if template_file:
        with open(_template_path(template_file), encoding="utf-8") as f:
            tokenizer.chat_template = f.read()
    if not tokenizer.chat_template:
        raise UserError(f"{model} has no chat template; give one with --chat_template FILE")


def _template_path(template: str) -> str:
    """``--chat_template``'s file: the path given, or the template TRL ships by that name (``qwen2_5``, ...)."""
    if os.path.isfile(template):
        return template
    if re.fullmatch(r"[a-z0-9_]+", template):
        spec = importlib.util.find_spec("trl")
        if spec is None:
            raise UserError(f"--chat_template {template}: no such file, and TRL, which ships templates by that name, "
                            "is not installed; give a Jinja template file, or pip install trl")
        bundled = os.path.join(os.path.dirname(spec.origin), "chat_templates", f"{template}.jinja")
        if os.path.isfile(bundled):
            return bundled
        names = sorted(name.removesuffix(".jinja") for name in os.listdir(os.path.dirname(bundled)))
        raise UserError(f"--chat_template {template}: no such file, nor a template TRL ships (it ships "
                        f"{', '.join(names)}); give a Jinja template file or one of those names")
    raise UserError(f"--chat_template {template}: no such file; give a Jinja template file, or the name of a "
                    "template TRL ships (qwen2_5, ...)")


def tokenize_conversations(split: datasets.Dataset, tokenizer: PreTrainedTokenizerBase, max_length: int, name: str,
                           tokenizing: Tokenizing, generation_prompts: bool = False,
                           template_options: dict | None = None, tools: list[dict] | None = None) -> datasets.Dataset:
    """Input ids cut to ``max_length``, labels on the replies' tokens only (``render_rows``), the trained tokens of
    each row as its loss units, and ``conversation``, the row of ``split`` it came from (a conversation whose template
    rewrites its history gives several rows). ``template_options`` go to every rendering (``enable_thinking``, ...);
    ``tools`` (JSON schemas) to the rendering of each row without a ``tools`` column of its own.

    With ``generation_prompts`` each row also keeps what asks a model for its last reply: ``prompt_ids`` (the
    conversation before it rendered with the generation prompt), ``prompt_messages`` (those messages, as JSON) and
    ``reference`` (the reply).

    Raises:
        UserError: a bad row (see ``read_conversations``), a reply the template renders otherwise than it prompts
            for it, a template that raises, or rows with no trained token left after the cut.
    """
    layout = conversation_layout(split, name)

    def encode(batch, rows):
        conversations, listed = read_conversations(batch, rows, layout, name)
        listed = [json.dumps(tools) if given is None and tools else given for given in listed]
        rendered = render_rows(conversations, tokenizer, [f"{name} row {row + 1}" for row in rows], listed,
                               template_options)
        flat = [(row, messages, *made) for row, messages, made_rows in zip(rows, conversations, rendered, strict=True)
                for made in made_rows]
        texts = fitting_prefixes([text for _, _, text, _, _ in flat], tokenizer, max_length)[0]
        encoded = tokenizer(texts, add_special_tokens=False, return_offsets_mapping=True, return_attention_mask=False)
        out = {"input_ids": [], "labels": [], "conversation": [row for row, *_ in flat]}
        for ids, offsets, (_, _, _, spans, _) in zip(encoded["input_ids"], encoded["offset_mapping"], flat,
                                                     strict=True):
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
            prompts = [text[:spans[-1][0]] for _, _, text, spans, _ in flat]
            out["prompt_ids"] = tokenizer(prompts, add_special_tokens=False, return_attention_mask=False)["input_ids"]
            out["prompt_messages"] = [json.dumps(messages[:turn]) for _, messages, _, _, turn in flat]
            out["reference"] = [messages[turn].get("content") or "" for _, messages, _, _, turn in flat]
        return out

    features = {"input_ids": TOKEN_IDS, "labels": TOKEN_IDS, "conversation": datasets.Value("int32")}
    if generation_prompts:
        features.update(prompt_ids=TOKEN_IDS, prompt_messages=datasets.Value("string"),
                        reference=datasets.Value("string"))
    tokenized = tokenizing.map(split, encode, name, features)
    empty = (np.flatnonzero(tokenized.data.column(LOSS_UNITS).to_numpy() == 0) + 1).tolist()
    if empty:
        shown = ", ".join(map(str, empty[:10])) + (f" and {len(empty) - 10} more" if len(empty) > 10 else "")
        raise UserError(f"{name} row(s) {shown}: no reply token is left within --max_seq_length {max_length}; "
                        "raise --max_seq_length or shorten those prompts")
    return tokenized


def preview_rows(rows: datasets.Dataset, tokenizer, count: int) -> list[dict]:
    """The first ``count`` rows of ``tokenize_conversations`` as ``Task.preview`` gives them."""
    previews = []
    for row in rows.select(range(min(count, len(rows)))):
        runs, current = [], []
        for label in [*row["labels"], IGNORE]:
            if label != IGNORE:
                current.append(label)
            elif current:
                runs.append(current)
                current = []
        previews.append({"example": row["conversation"] + 1, "text": tokenizer.decode(row["input_ids"]),
                         "trained": [tokenizer.decode(run) for run in runs]})
    return previews


def split_conversations(tokenized: datasets.Dataset) -> tuple[int, int]:
    """How many conversations ``tokenize_conversations`` made several rows of, and how many rows those are."""
    counts = np.bincount(tokenized.data.column("conversation").to_numpy())
    return int((counts > 1).sum()), int(counts[counts > 1].sum())


def render_rows(conversations: list[list[dict]], tokenizer, where: list[str], tools: list[str | None] | None = None,
                options: dict | None = None) -> list[list[tuple[str, list[tuple[int, int]], int]]]:
    """Each conversation as the fewest rows that keep every reply in its inference context: per row, its text, the
    character span of each reply that trains in it, and the index of its last reply's message.

    A reply's span is what ``render(messages[:k + 1])`` adds to ``render(messages[:k], add_generation_prompt=True)``.
    Replies share a row while each rendering through a reply starts with the one through the reply before; where
    the template rewrites what came before (earlier reasoning dropped), a new row starts. Two template calls for all
    the conversations (rendering one at a time costs most of a chat's tokenizing).

    Raises:
        UserError: a reply whose rendering does not continue its own generation prompt (the template renders a
            stored reply otherwise than the model produces it), or a template that raises; naming the row.
    """
    tools = tools or [None] * len(conversations)
    replies = [(row, turn) for row, messages in enumerate(conversations)
               for turn, message in enumerate(messages) if message["role"] == "assistant"]
    befores = _render([conversations[row][:turn] for row, turn in replies], [tools[row] for row, _ in replies],
                      tokenizer, [where[row] for row, _ in replies], options, add_generation_prompt=True)
    throughs = _render([conversations[row][:turn + 1] for row, turn in replies], [tools[row] for row, _ in replies],
                       tokenizer, [where[row] for row, _ in replies], options)
    made: list[list[tuple[str, list[tuple[int, int]], int]]] = [[] for _ in conversations]
    for (row, turn), before, through in zip(replies, befores, throughs, strict=True):
        _check_continues(before, through, where[row], turn)
        rows = made[row]
        if rows and through.startswith(rows[-1][0]):
            rows[-1] = (through, [*rows[-1][1], (len(before), len(through))], turn)
        else:
            rows.append((through, [(len(before), len(through))], turn))
    return made


def render_last_reply(conversations: list[list[dict]], tokenizer, where: list[str],
                      tools: list[str | None] | None = None, options: dict | None = None) -> list[tuple[str, str]]:
    """Each conversation's last message, an assistant's reply, as ``(the prompt the model sees, the text it
    produces)``: the history rendered with the generation prompt, and what rendering the reply adds to it.

    Raises:
        UserError: as ``render_rows``.
    """
    tools = tools or [None] * len(conversations)
    befores = _render([messages[:-1] for messages in conversations], tools, tokenizer, where, options,
                      add_generation_prompt=True)
    throughs = _render(conversations, tools, tokenizer, where, options)
    for before, through, messages, place in zip(befores, throughs, conversations, where, strict=True):
        _check_continues(before, through, place, len(messages) - 1)
    return [(before, through[len(before):]) for before, through in zip(befores, throughs, strict=True)]


def render_prompts(prompts: list[list[dict]], tokenizer, where: list[str], tools: list[str | None] | None = None,
                   options: dict | None = None) -> list[str]:
    """Each prompt (the messages before a reply) rendered with the generation prompt: what a model reads before it
    replies.

    Raises:
        UserError: the template refuses a prompt, naming its row (``where``).
    """
    return _render(prompts, tools or [None] * len(prompts), tokenizer, where, options, add_generation_prompt=True)


def _check_continues(before: str, through: str, where: str, turn: int) -> None:
    if through.startswith(before):
        return
    at = len(os.path.commonprefix([before, through]))
    raise UserError(
        f"{where}, message {turn + 1}: the chat template renders this reply otherwise than it prompts for it (the "
        f"generation prompt goes on {before[at:at + 40]!r} where the stored reply has {through[at:at + 40]!r}), so "
        "the model would be trained on tokens it does not generate; give the reply in the form the template prompts "
        "for (its reasoning in reasoning_content, where the template renders it), or give --chat_template a "
        "template that renders stored replies as it prompts for them")


def _render(conversations: list[list[dict]], tools: list[str | None], tokenizer, where: list[str],
            options: dict | None, add_generation_prompt: bool = False) -> list[str]:
    """``conversations`` rendered in one template call per distinct tool list.

    Raises:
        UserError: the template raised (it refuses a role, an order of turns, ...), naming the first row it refuses.
    """
    texts: list[str] = [""] * len(conversations)
    groups: dict[str | None, list[int]] = defaultdict(list)
    for index, listed in enumerate(tools):
        groups[listed].append(index)
    for listed, members in groups.items():
        kwargs = {**(options or {}), "add_generation_prompt": add_generation_prompt, "tokenize": False}
        if listed is not None:
            kwargs["tools"] = json.loads(listed)
        try:
            rendered = tokenizer.apply_chat_template([conversations[i] for i in members], **kwargs)
        except TEMPLATE_ERRORS:
            for i in members:  # one at a time, to name the row the template refuses
                try:
                    tokenizer.apply_chat_template(conversations[i], **kwargs)
                except TEMPLATE_ERRORS as err:
                    raise UserError(f"{where[i]}: the chat template refuses it ({type(err).__name__}: "
                                    f"{str(err).strip()[:200]}); change the row to a form the template takes (a "
                                    "template without a system role: fold the system message into the first user "
                                    "turn), or give --chat_template another template") from None
            raise
        for i, text in zip(members, rendered, strict=True):
            texts[i] = text
    return texts


def end_of_turn_ids(tokenizer, options: dict | None = None) -> list[int]:
    """The tokens that end a reply as the template renders one (``<|im_end|>``, ``<end_of_turn>``, ``<|eot_id|>``,
    ...), found from its own rendering of an assistant turn, with the tokenizer's end of sequence: where generation
    stops. A template that ends a reply with nothing special gives the end of sequence alone."""
    marker = "FINETUNE_REPLY_END"
    stops = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    try:
        text = tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}, {"role": "assistant",
                                                                                  "content": marker}],
                                             tokenize=False, **(options or {}))
    except jinja2.TemplateError:
        return stops
    after = text[text.rfind(marker) + len(marker):].lstrip()
    special = set(tokenizer.all_special_ids) | set(tokenizer.get_added_vocab().values())
    ids = tokenizer(after, add_special_tokens=False)["input_ids"] if after else []
    if ids and ids[0] in special and ids[0] not in stops:
        stops.append(ids[0])
    return stops


def template_with_defaults(template: str | dict, options: dict) -> str | dict:
    """``template`` (or each of a tokenizer's named ones) rendering as if given ``options`` (the run's
    ``--chat_template_kwargs``) wherever its caller leaves them out: saved so, the model is prompted as it trained by
    transformers, vLLM, llama.cpp and Ollama alike, and a caller's own options still win."""
    if isinstance(template, dict):
        return {name: template_with_defaults(text, options) for name, text in template.items()}
    defaults = "".join(f"{{%- if {name} is not defined %}}{{%- set {name} = {_jinja_literal(value)} %}}{{%- endif %}}"
                       for name, value in options.items())
    return defaults + "\n" * template.startswith("\n") + template  # (a block's end takes the newline after it)


def _jinja_literal(value) -> str:
    """A JSON value as a Jinja expression (which spells JSON's true, false and null as true, false and none)."""
    if value is None or isinstance(value, bool):
        return {None: "none", True: "true", False: "false"}[value]
    if isinstance(value, list):
        return f"[{', '.join(map(_jinja_literal, value))}]"
    if isinstance(value, dict):
        return f"{{{', '.join(f'{_jinja_literal(key)}: {_jinja_literal(item)}' for key, item in value.items())}}}"
    return json.dumps(value, ensure_ascii=False)  # Jinja reads an escaped pair of surrogates as two characters


def write_generations(path: str, rows: datasets.Dataset, generations: list[str]) -> None:
    """``eval_generations.jsonl``: each prompt's messages, its reference reply and the generated one, in order
    (``rows`` tokenized with ``generation_prompts``)."""
    with open(path, "w") as f:
        for messages, reference, generation in zip(rows["prompt_messages"], rows["reference"], generations,
                                                   strict=True):
            f.write(json.dumps({"messages": json.loads(messages), "reference": reference,
                                "generation": generation}) + "\n")
