"""Every text chat template TRL ships (its copies of the families' own templates), on the conversation shapes
people fine-tune: each reply trains exactly as the model would generate it, or the row is refused for a reason the
template itself forces.

The definition, computed here independently of the package: for the assistant turn k the model sees
``render(messages[:k], add_generation_prompt=True)`` and produces the rest of ``render(messages[:k + 1])``.
"""

from __future__ import annotations

import copy
import json
import os
from pathlib import Path

import jinja2
import pytest
import trl
from transformers.utils.chat_template_utils import render_jinja_template

from finetune.errors import UserError
from finetune.tasks.chat import end_of_turn_ids, read_tools, render_last_reply, render_rows

TEMPLATES = Path(trl.__file__).parent / "chat_templates"
"""Read from the installed TRL (the test extra), not copied into the repository."""
VISION = {"idefics3", "llava_next", "qwen2_5_vl", "qwen3_vl", "smolvlm", "lfm2_2_5_vl"}
"""Image-and-text models' templates: the chat recipes train text models."""
TEXT_TEMPLATES = sorted(path.stem for path in TEMPLATES.glob("*.jinja")
                        if not path.stem.endswith("_training") and path.stem not in VISION)
TRAINING_TEMPLATES = sorted(path.stem.removesuffix("_training") for path in TEMPLATES.glob("*_training.jinja")
                            if path.stem.removesuffix("_training") not in VISION)
"""The families whose template TRL also ships as a ``*_training`` variant with ``{% generation %}`` markers."""

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
SHAPES = {
    "one turn": [{"role": "user", "content": "Where is my parcel?"},
                 {"role": "assistant", "content": "Team: shipping\nWe will track it today."}],
    "system and three turns": [
        {"role": "system", "content": "Route the ticket."},
        {"role": "user", "content": "I was charged twice."}, {"role": "assistant", "content": "Team: billing"},
        {"role": "user", "content": "And the app crashes."}, {"role": "assistant", "content": "Team: technical"},
        {"role": "user", "content": "Thanks."}, {"role": "assistant", "content": "You are welcome."}],
    "reasoning in think tags": [
        {"role": "user", "content": "2 + 2?"}, {"role": "assistant", "content": "<think>Add them.</think>4"},
        {"role": "user", "content": "And 3 + 3?"}, {"role": "assistant", "content": "<think>Add again.</think>6"}],
    "reasoning in reasoning_content": [
        {"role": "user", "content": "2 + 2?"},
        {"role": "assistant", "content": "4", "reasoning_content": "Add them."},
        {"role": "user", "content": "And 3 + 3?"},
        {"role": "assistant", "content": "6", "reasoning_content": "Add again."}],
    "a tool call and its result": [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "tool_calls": [{"type": "function", "function": {
            "name": "get_weather", "arguments": {"city": "Paris"}}}]},
        {"role": "tool", "name": "get_weather", "content": "Sunny, 21 C"},
        {"role": "assistant", "content": "It is sunny in Paris, 21 C."}],
}


@pytest.fixture(scope="module")
def tokenizers(chat_tokenizer):
    """The default chat model's tokenizer under each template (the templates' own special tokens are text to it,
    which changes no position)."""
    made = {}
    for name in TEXT_TEMPLATES:
        made[name] = copy.deepcopy(chat_tokenizer)
        made[name].chat_template = (TEMPLATES / f"{name}.jinja").read_text()
    return made


def render(tokenizer, messages, tools=None, **options):
    return tokenizer.apply_chat_template(messages, tools=tools, tokenize=False, **options)


def expected_replies(tokenizer, messages, tools=None):
    """Per assistant turn, (what the model sees, what it produces), or why the template forces a refusal."""
    replies = []
    for turn, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        try:
            before = render(tokenizer, messages[:turn], tools, add_generation_prompt=True)
            through = render(tokenizer, messages[:turn + 1], tools)
        except (jinja2.TemplateError, TypeError) as err:  # a filter's TypeError: tojson of a missing content
            return f"the template raises: {err}"
        if not through.startswith(before):
            return "the template renders the reply otherwise than it prompts for it"
        replies.append((before, through[len(before):]))
    return replies


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("template", TEXT_TEMPLATES)
def test_each_reply_trains_as_generated_or_the_template_forces_a_refusal(tokenizers, template, shape):
    tokenizer, messages = tokenizers[template], SHAPES[shape]
    tools = [WEATHER] if shape == "a tool call and its result" else None
    expected = expected_replies(tokenizer, messages, tools)
    try:
        rows = render_rows([messages], tokenizer, ["train row 1"], [read_tools(tools, "train row 1")])[0]
    except UserError as err:
        assert isinstance(expected, str), f"refused, though every reply continues its prompt: {err}"
        reason = ("the chat template refuses it" if expected.startswith("the template raises")
                  else "renders this reply otherwise than it prompts for it")
        assert str(err).startswith("train row 1") and reason in str(err), str(err)
        return
    assert not isinstance(expected, str), f"trained, though {expected}"
    trained = [(text[:start], text[start:end]) for text, spans, _ in rows for start, end in spans]
    assert trained == expected, "each reply's tokens, after exactly the context the model sees"
    # The fewest rows: a new row starts only where the rendering through a reply does not go on from the last.
    throughs = [before + reply for before, reply in expected]
    breaks = sum(not later.startswith(earlier) for earlier, later in zip(throughs, throughs[1:], strict=False))
    assert len(rows) == 1 + breaks


@pytest.mark.parametrize("template", TEXT_TEMPLATES)
def test_a_preference_reply_is_what_the_model_produces_after_the_prompt(tokenizers, template):
    tokenizer, messages = tokenizers[template], SHAPES["system and three turns"]
    expected = expected_replies(tokenizer, messages)
    try:
        (prompt, reply), = render_last_reply([messages], tokenizer, ["train row 1"])
    except UserError:
        assert isinstance(expected, str) and "raises" in expected or (
            not render(tokenizer, messages).startswith(render(tokenizer, messages[:-1], add_generation_prompt=True)))
        return
    before = render(tokenizer, messages[:-1], add_generation_prompt=True)
    assert (prompt, reply) == (before, render(tokenizer, messages)[len(before):])


def test_history_rewritten_by_the_template_splits_a_conversation_into_rows(tokenizers):
    """Qwen3 keeps a reply's reasoning only after the last user turn: the first reply, rendered with its reasoning
    where the model produced it, is in a row of its own; the second reply's row holds the first without it."""
    rows = render_rows([SHAPES["reasoning in reasoning_content"]], tokenizers["qwen3"], ["train row 1"])[0]
    assert len(rows) == 2
    (first_text, (first,), first_turn), (second_text, (second,), second_turn) = rows
    assert "Add them." in first_text[first[0]:first[1]] and (first_turn, second_turn) == (1, 3)
    assert "Add them." not in second_text and "Add again." in second_text[second[0]:second[1]]


def test_a_template_that_ends_replies_with_a_special_token_stops_generation_there(chat_tokenizer):
    """SmolLM2's template ends a reply with <|im_end|>, its end of sequence; a template ending them with another of
    the tokenizer's special tokens adds that one."""
    assert end_of_turn_ids(chat_tokenizer) == [chat_tokenizer.eos_token_id]
    tokenizer = copy.deepcopy(chat_tokenizer)
    tokenizer.chat_template = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
                               "{% if m['role'] == 'assistant' %}<|endoftext|>{% endif %}\n{% endfor %}")
    end = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    assert end != tokenizer.eos_token_id and end_of_turn_ids(tokenizer) == [tokenizer.eos_token_id, end]


def test_a_tools_column_reaches_the_template(tokenizers):
    messages = SHAPES["a tool call and its result"]
    listed = read_tools(json.dumps([WEATHER]), "train row 1")
    rows = render_rows([messages], tokenizers["qwen3"], ["train row 1"], [listed])[0]
    assert rows and all("get_weather" in text and "The weather in a city." in text for text, _, _ in rows)
    with pytest.raises(UserError, match="^train row 2: tools is dict; give a list of JSON function schemas"):
        read_tools(json.dumps(WEATHER), "train row 2")


def test_reasoning_given_in_the_data_trains_and_a_row_without_it_gets_no_stray_key(tokenizers, tmp_path):
    """Through the recipe's tokenizing (Arrow gives every message every key any has, missing ones as None): the
    reasoning of the row that has it trains, and the row that has none renders as it would alone."""
    from datasets import Dataset
    from helpers import tokenizing

    from finetune.tasks.chat import IGNORE, tokenize_conversations

    tokenizer = tokenizers["qwen3"]
    plain = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."}]
    rows = Dataset.from_dict({"messages": [SHAPES["reasoning in reasoning_content"], plain]})
    tokenized = tokenize_conversations(rows, tokenizer, 512, "train", tokenizing(tmp_path))
    assert tokenized["conversation"] == [0, 0, 1]
    trained = [tokenizer.decode([label for label in row if label != IGNORE]) for row in tokenized["labels"]]
    assert "Add them." in trained[0] and "Add again." in trained[1]
    assert tokenizer.decode(tokenized["input_ids"][2]) == render(tokenizer, plain)


MARKERS_LEAVE_OUT = {("diffusion_gemma", "a tool call and its result"): ["<|tool_response>", "<|turn>model\n"]}
"""Text the model produces that a training variant's ``{% generation %}`` blocks leave unmarked: Gemma 4's tool-call
turn ends with ``<|tool_response>``, and after a tool's result the model opens its next turn itself (the template's
generation prompt there adds nothing)."""

NOTHING_TO_COMPARE = {"glm4moe": "its variant renders every shape otherwise than its own template",
                      "deepseek_r1_distill": "every shape is refused", "deepseekv3": "every shape is refused"}


def characters(spans) -> set[int]:
    return {at for start, end in spans for at in range(start, end)}


def runs(text: str, positions: set[int]) -> list[str]:
    """The maximal runs of ``positions`` in ``text``, in order."""
    found: list[list[int]] = []
    for at in sorted(positions):
        if found and found[-1][1] == at:
            found[-1][1] = at + 1
        else:
            found.append([at, at + 1])
    return [text[start:end] for start, end in found]


@pytest.mark.parametrize("template", TRAINING_TEMPLATES)
def test_the_trained_spans_are_what_the_training_variants_generation_markers_mark_minus_the_prompt(tokenizers,
                                                                                                template):
    """Per row the package makes with the family's own template, where the ``*_training`` variant renders the same
    text: within each reply the row trains, the marked characters less the generation prompt (which the model is
    given, not produces; Qwen2.5's marker opens before the prompt's last newline, gpt-oss's before
    ``<|start|>assistant``) are the trained ones. Earlier replies a row holds as context stay untrained, though the
    markers mark them."""
    tokenizer = tokenizers[template]
    marked_template = (TEMPLATES / f"{template}_training.jinja").read_text()
    compared = 0
    for shape, messages in SHAPES.items():
        tools = [WEATHER] if shape == "a tool call and its result" else None
        try:
            rows = render_rows([messages], tokenizer, ["train row 1"], [read_tools(tools, "train row 1")])[0]
        except UserError:
            continue  # refused (the test above says why); nothing trains
        for text, spans, last in rows:
            (marked_text,), (marked,) = render_jinja_template(
                [messages[:last + 1]], tools=tools, chat_template=marked_template, return_assistant_tokens_mask=True,
                **tokenizer.special_tokens_map)
            if marked_text != text:
                continue  # the variant renders this history otherwise (Qwen3's keeps earlier reasoning)
            prompt, replies = set(), set()
            turns = [k for k, m in enumerate(messages[:last + 1]) if m["role"] == "assistant"][-len(spans):]
            for turn in turns:
                through = render(tokenizer, messages[:turn + 1], tools)
                opens = len(os.path.commonprefix([render(tokenizer, messages[:turn], tools), through]))
                prompt |= set(range(opens, len(render(tokenizer, messages[:turn], tools, add_generation_prompt=True))))
                replies |= set(range(opens, len(through)))
            expected = (characters(marked) & replies) - prompt
            trained = characters(spans)
            assert runs(text, trained - expected) == MARKERS_LEAVE_OUT.get((template, shape), []), shape
            assert trained >= expected, shape
            compared += 1
    assert compared > 0 or template in NOTHING_TO_COMPARE


def test_a_template_saved_with_the_run_s_options_renders_them_where_a_caller_gives_none(chat_tokenizer):
    """Every JSON value a ``--chat_template_kwargs`` option takes reaches the template as that value, and a
    caller's own option wins over the saved one."""
    from finetune.tasks.chat import template_with_defaults

    options = {"a": [1, 'x\n"\\ é 😀', {"k": True, "n": None}], "b": 2.5, "c": None, "d": False}
    template = template_with_defaults("\n{{ a|tojson }} {{ b }} {{ c is none }} {{ d }}", options)
    assert render_jinja_template([[{"role": "user", "content": "hi"}]], chat_template=template)[0][0] == \
        '\n[1, "x\\n\\"\\\\ é 😀", {"k": true, "n": null}] 2.5 True False'
    assert render_jinja_template([[{"role": "user", "content": "hi"}]], chat_template=template, b=3, d=True)[0][0] \
        .endswith(" 3 True True")
