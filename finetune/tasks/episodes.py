"""Multi-turn episodes for GRPO with tools, token in and token out: the model samples a reply; when the reply calls
tools, the calls run in the tool pool, their results come back as ``tool`` messages, and sampling goes on after
them, until a reply calls none, ``--max_turns`` replies, or ``--max_completion_length`` sampled tokens.

An episode's ids are exactly the ids the model sampled, never decoded and encoded again, with the tokens between
turns inserted: the template's rendering of the tool messages and the next generation prompt, taken as what
``render(history + tool messages, add_generation_prompt=True)`` adds after the end of the history's last turn.
Only the sampled ids train; the inserted ones are context.

Tool calls are parsed with transformers' ``tokenizer.parse_response``: by the tokenizer's own ``response_template``
where it has one, else where the chat template writes calls as ``<tool_call>{"name": ..., "arguments": ...}
</tool_call>`` (Qwen2.5's and Qwen3's form, Hermes'), by a response template made from the chat template's own
markers.
"""

from __future__ import annotations

import json
import os
import re
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

import jinja2
import numpy as np
import torch

from finetune.distributed.ddp import all_reduce_max
from finetune.distributed.fsdp import is_sharded
from finetune.errors import UserError
from finetune.tasks.chat import IGNORE, end_of_turn_ids, without_nulls, write_generations
from finetune.tasks.rewards import RewardPool
from finetune.tasks.scoring import failed_table, reward_figures, reward_names, score_replies
from finetune.tasks.tools import ERROR_KINDS, ToolCall, ToolPool

__all__ = ["EvalEpisodes", "Episode", "Episodes", "prompt_messages", "response_template", "row_columns",
           "score_episodes", "tool_turn_ids"]

_PROBE_CALL = {"name": "probe_tool", "arguments": {"city": "Paris"}}
_PROBE = [{"role": "user", "content": "Hi"},
          {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": _PROBE_CALL}]}]
_HERMES_CALL = re.compile(r"<tool_call>\s*(\{.*?\})\s*</tool_call>", re.DOTALL)


def prompt_messages(prompt) -> list[dict]:
    """A ``prompt`` as the data gives it (text, or messages) as messages."""
    return [{"role": "user", "content": prompt}] if isinstance(prompt, str) else [without_nulls(m) for m in prompt]


def row_columns(rows) -> list[dict]:
    """Each of ``rows`` (of ``finetune.tasks.grpo.tokenize_prompts``) as its columns, ``prompt`` as the data has it:
    what an environment's ``reset(**row)`` gets, as TRL gives it."""
    return [{**json.loads(columns), "prompt": json.loads(prompt)}
            for columns, prompt in zip(rows["columns"], rows["prompt_messages"], strict=True)]


def score_episodes(rewards: RewardPool, rows, episodes: list[Episode]):
    """The reward functions' scores of ``episodes`` of ``rows``: each completion its messages; with an environment
    the prompts with its first observation, and the environments (TRL's ``environments=``)."""
    with_environment = bool(episodes) and episodes[0].state is not None
    return score_replies(rewards, rows, [episode.messages for episode in episodes],
                         prompts=[e.prompt_messages for e in episodes] if with_environment else None,
                         environments=[e.state for e in episodes] if with_environment else None)


def response_template(tokenizer, options: dict | None = None) -> dict:
    """How ``tokenizer.parse_response`` reads this template's replies: the tokenizer's ``response_template``, else
    one for ``<tool_call>`` JSON blocks, with the template's generation prompt as the start and its end of turn as
    the end of a reply's text.

    Raises:
        UserError: the template writes tool calls in no form parsed here, or none at all.
    """
    own = getattr(tokenizer, "response_template", None)
    if own:
        return own
    options = options or {}
    try:
        rendered = tokenizer.apply_chat_template(_PROBE, tokenize=False, **options)
        prompt = tokenizer.apply_chat_template(_PROBE[:1], tokenize=False, add_generation_prompt=True, **options)
        plain = tokenizer.apply_chat_template(_PROBE[:1], tokenize=False, **options)
    except (jinja2.TemplateError, TypeError, ValueError) as err:
        raise UserError(f"--tools: the chat template cannot render a tool call ({type(err).__name__}: "
                        f"{str(err)[:200]}); give --chat_template a template with tools, such as "
                        "qwen2_5 (TRL's Qwen2.5 template, by name)") from None
    calls = [_json_or_none(found) for found in _HERMES_CALL.findall(rendered)]
    if not any(call is not None and call.get("name") == _PROBE_CALL["name"] for call in calls):
        raise UserError("--tools: the chat template writes tool calls in a form not parsed here (only <tool_call> "
                        "JSON blocks, Qwen2.5's and Qwen3's form, and tokenizers with a response_template are); give "
                        "--chat_template a template of that form, such as qwen2_5 (TRL's Qwen2.5 template, by name); "
                        "see docs/grpo.md")
    stop_text = tokenizer.decode(end_of_turn_ids(tokenizer, options)[-1:])
    start = prompt[len(plain):] if prompt.startswith(plain) else prompt[len(prompt.rstrip().rpartition("\n")[0]):]
    return {"defaults": {"role": "assistant"},
            "start_anchor": start,
            "fields": {
                "reasoning_content": {"open": "<think>", "close_pattern": r"</think>\s*", "content": "text"},
                "tool_calls": {"open": "<tool_call>", "close_pattern": r"</tool_call>\s*", "repeats": True,
                               "content": "json", "transform": {"type": "function", "function": "{content}"}},
                "content": {"close_pattern": re.escape(stop_text) + r"\s*", "content": "text"}}}


def _json_or_none(text: str):
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return None


def tool_turn_ids(tokenizer, history: list[dict], tool_messages: list[dict], tools: list[dict], stop_text: str,
                  options: dict | None = None) -> list[int]:
    """The ids between a reply that called tools and the next reply: what rendering ``tool_messages`` and the
    generation prompt adds after the end (``stop_text``) of the last turn of ``history`` (which ends with the
    reply). Cut at the end of that turn, not at the history's whole rendering, so that a template which renders
    earlier turns anew once a tool answers (Qwen3 drops an empty reasoning block) still gives what follows."""
    options = options or {}
    before = tokenizer.apply_chat_template(history, tools=tools, tokenize=False, **options)
    after = tokenizer.apply_chat_template(history + tool_messages, tools=tools, tokenize=False,
                                          add_generation_prompt=True, **options)
    cut = -1
    for _ in range(before.count(stop_text)):
        cut = after.index(stop_text, cut + 1)
    return tokenizer(after[cut + len(stop_text):], add_special_tokens=False)["input_ids"]


@dataclass
class Episode:
    """A completion that may span turns: its prompt (ids and messages: the row's, with an environment's first
    observation added), its ids after the prompt, which of them the model sampled (``trained``), its messages as
    TRL gives completions to reward functions (assistant, tool, ..., assistant), and its environment's state."""

    prompt: list[int]
    prompt_messages: list[dict]
    ids: list[int] = field(default_factory=list)
    trained: list[int] = field(default_factory=list)
    messages: list[dict] = field(default_factory=list)
    state: bytes | None = None
    turns: int = 0
    tool_calls: int = 0
    errors: Counter = field(default_factory=Counter)
    truncated: bool = False
    ended: bool = False

    @property
    def sampled(self) -> int:
        return sum(self.trained)


class Episodes:
    """Rolls out episodes with the tools of ``pool`` (``finetune.tasks.tools.ToolPool``): ``args`` holds
    ``max_completion_length`` (sampled tokens over all turns), ``max_turns`` (replies; None: no limit),
    ``temperature`` and ``top_p``; ``options`` are the template's keyword arguments. A reply ends at the template's
    end of turn (``finetune.tasks.chat.end_of_turn_ids``).

    Raises:
        UserError: the template writes tool calls in no form parsed here (``response_template``).
    """

    def __init__(self, args, tokenizer, pool: ToolPool, options: dict | None = None):
        self.args, self.tokenizer, self.pool, self.options = args, tokenizer, pool, options or {}
        stop_ids = end_of_turn_ids(tokenizer, self.options)
        self.stop_ids = set(stop_ids)
        self.stop_texts = {stop: tokenizer.decode([stop]) for stop in stop_ids}
        self.template = response_template(tokenizer, self.options)
        self._tool_seconds = 0.0

    def take_tool_seconds(self) -> float:
        """Seconds spent in tool calls (and environments' resets) since the last call."""
        seconds, self._tool_seconds = self._tool_seconds, 0.0
        return seconds

    def roll(self, model, prompts: list[list[int]], counts: list[int], prompt_messages: list[list[dict]],
             seeds: Callable[[int], list[int]], sample, *, rows: list[dict] | None = None,
             sharded: bool = False) -> list[Episode]:
        """``counts[i]`` episodes of each prompt (``prompts`` ids, ``prompt_messages`` the messages they render,
        ``rows`` its row's columns, which an environment's ``reset`` gets), each turn's replies sampled by
        ``sample(model, prompts, counts, seeds, max_new_tokens=...)`` (seeded per episode with ``seeds(turn)``). A
        sharded model's processes sample together until none has an episode going."""
        owners = [i for i, count in enumerate(counts) for _ in range(count)]
        episodes = [Episode(prompts[i], prompt_messages[i]) for i in owners]
        if self.pool.environment is not None:
            self._reset(episodes, [rows[i] for i in owners])
        budget = self.args.max_completion_length
        turn = 0
        while True:
            going = [k for k, episode in enumerate(episodes) if not episode.ended]
            left = max((budget - episodes[k].sampled for k in going), default=0)
            if sharded:  # every forward of a sharded model gathers weights from all processes
                left = int(all_reduce_max(torch.tensor(left, device=next(model.parameters()).device)))
            if left == 0:
                break
            turn_seeds = seeds(turn)
            if turn == 0 and all(e.prompt is prompts[i] for e, i in zip(episodes, owners, strict=True)):
                replies = sample(model, prompts, counts, turn_seeds, max_new_tokens=left)  # a group's prompt once
            elif going:
                replies = sample(model, [episodes[k].prompt + episodes[k].ids for k in going], [1] * len(going),
                                 [turn_seeds[k] for k in going], max_new_tokens=left)
            else:  # nothing left here, but another process samples: keep in step with it
                sample(model, prompts[:1], [1], turn_seeds[:1], max_new_tokens=left)
                replies = []
            self._take_replies(episodes, going, replies)
            turn += 1
        return episodes

    def _reset(self, episodes: list[Episode], rows: list[dict]) -> None:
        """A new environment per episode; a first observation is added to the prompt's last message (TRL's way),
        and the prompt rendered again."""
        started = time.perf_counter()
        states = self.pool.reset(rows)
        self._tool_seconds += time.perf_counter() - started
        for episode, (observation, state) in zip(episodes, states, strict=True):
            episode.state = state
            if observation:
                last = episode.prompt_messages[-1]
                episode.prompt_messages = [*episode.prompt_messages[:-1],
                                           {**last, "content": (last.get("content") or "") + observation}]
                text = self.tokenizer.apply_chat_template(episode.prompt_messages, tools=self.pool.schemas,
                                                          tokenize=False, add_generation_prompt=True, **self.options)
                episode.prompt = self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def _take_replies(self, episodes: list[Episode], going: list[int], replies: list[list[int]]) -> None:
        calls, unparsed_calls = [], {}
        for k, reply in zip(going, replies, strict=True):
            episode = episodes[k]
            reply = reply[:self.args.max_completion_length - episode.sampled]
            context = episode.prompt + episode.ids
            episode.ids += reply
            episode.trained += [1] * len(reply)
            episode.turns += 1
            stopped = bool(reply) and reply[-1] in self.stop_ids
            message, unparsed = self._parse(reply, context, stopped)
            episode.messages.append(message)
            wanted = message.get("tool_calls") or ([] if unparsed is None else [None])
            if not stopped or not wanted:
                episode.ended, episode.truncated = True, not stopped
                continue
            if episode.turns == self.args.max_turns or episode.sampled >= self.args.max_completion_length:
                episode.ended = episode.truncated = True  # it called tools it has no turn left to read
                continue
            episode.tool_calls += len(wanted)
            for call in wanted:
                if call is None:
                    unparsed_calls[len(calls)] = unparsed
                calls.append(ToolCall(*_name_and_arguments(call or {}), episode=k, state=episode.state))
        started = time.perf_counter()
        made = iter(self.pool.call([c for n, c in enumerate(calls) if n not in unparsed_calls]) if calls else [])
        self._tool_seconds += time.perf_counter() - started
        answers: dict[int, list[dict]] = {}
        for n, call in enumerate(calls):
            episode = episodes[call.episode]
            if n in unparsed_calls:
                text, error = str({"error": f"the tool call does not parse: {unparsed_calls[n]}"}), "unparsed"
            else:
                result = next(made)
                text, error, episode.state = result.text, result.error, result.state
            if error:
                episode.errors[error] += 1
            answers.setdefault(call.episode, []).append({"role": "tool", "name": call.name, "content": text})
        for k, tool_messages in answers.items():
            episode = episodes[k]
            inserted = tool_turn_ids(self.tokenizer, episode.prompt_messages + episode.messages, tool_messages,
                                     self.pool.schemas, self.stop_texts[episode.ids[-1]], self.options)
            episode.ids += inserted
            episode.trained += [0] * len(inserted)
            episode.messages += tool_messages

    def _parse(self, reply: list[int], context: list[int], stopped: bool) -> tuple[dict, str | None]:
        """The reply as an assistant message, and why its tool calls do not parse (None where they do). A reply
        cut short is its text."""
        text = {"role": "assistant", "content": self.tokenizer.decode(reply, skip_special_tokens=True)}
        if not stopped:
            return text, None
        try:
            message = self.tokenizer.parse_response(reply, schema=self.template, prefix=context,
                                                    tools=self.pool.schemas)
        except ValueError as err:
            return text, str(err).strip().splitlines()[-1][:200]
        message.setdefault("content", "")
        return message, None


def _name_and_arguments(call: dict) -> tuple[str, object]:
    function = call.get("function", call) if isinstance(call, dict) else {}
    if not isinstance(function, dict):
        return "", None
    return str(function.get("name", "")), function.get("arguments", {})


class EvalEpisodes:
    """The evaluation's episodes: each validation prompt's greedy episode (``sample`` at temperature 0), scored
    by the reward functions of ``rewards`` where it is rolled out (its messages and the tools' state stay on that
    process). The outputs gathered are the model's own tokens over all turns (``IGNORE``-padded to
    ``max_completion_length``), the rewards, the failures, and the tool figures."""

    def __init__(self, episodes: Episodes, validation, rewards: RewardPool, weights: np.ndarray, sample):
        self.episodes, self.validation, self.rewards, self.weights, self.sample = (episodes, validation, rewards,
                                                                                  weights, sample)

    def outputs(self, model, index: torch.Tensor) -> tuple[torch.Tensor, ...]:
        rows = self.validation.select(index.tolist())
        messages = [prompt_messages(json.loads(prompt)) for prompt in rows["prompt_messages"]]
        episodes = self.episodes.roll(model, rows["prompt_ids"], [1] * len(rows), messages,
                                      lambda turn: [0] * len(rows), self.sample, rows=row_columns(rows),
                                      sharded=is_sharded(model))
        scores = score_episodes(self.rewards, rows, episodes)
        width = self.episodes.args.max_completion_length
        own = [[t for t, trained in zip(e.ids, e.trained, strict=True) if trained] for e in episodes]
        tokens = torch.tensor([ids + [IGNORE] * (width - len(ids)) for ids in own], device=index.device)
        figures = torch.tensor([[e.tool_calls, e.turns, e.truncated, *(e.errors[kind] for kind in ERROR_KINDS)]
                                for e in episodes], dtype=torch.float64, device=index.device)
        values = torch.from_numpy(scores.values).to(index.device)
        failed = torch.from_numpy(failed_table(scores, self.rewards)).to(index.device)
        return tokens, values, failed, figures

    def metrics(self, outputs: tuple[torch.Tensor, ...]) -> dict[str, float]:
        _, values, failed, figures = (output.cpu().numpy() for output in outputs)
        tools = {"tools/calls/mean": figures[:, 0].mean(), "tools/calls/max": figures[:, 0].max(),
                 "tools/turns/mean": figures[:, 1].mean(), "completions/truncated_share": figures[:, 2].mean(),
                 **{f"tools/errors/{kind}": figures[:, 3 + k].sum() for k, kind in enumerate(ERROR_KINDS)}}
        return {**reward_figures(values, failed, reward_names(self.rewards.names), self.weights),
                **{name: float(value) for name, value in tools.items()}}

    def write(self, outputs: tuple[torch.Tensor, ...], output_dir: str) -> None:
        texts = [self.episodes.tokenizer.decode([t for t in row if t != IGNORE], skip_special_tokens=True)
                 for row in outputs[0].tolist()]
        write_generations(os.path.join(output_dir, "eval_generations.jsonl"), self.validation, texts)
