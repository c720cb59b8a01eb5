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

from finetune.distributed.ddp import all_reduce_max, unwrap
from finetune.distributed.fsdp import is_sharded
from finetune.errors import UserError
from finetune.tasks.chat import IGNORE, end_of_turn_ids, without_nulls, write_generations
from finetune.tasks.rewards import RewardPool
from finetune.tasks.scoring import failed_table, reward_figures, reward_names, score_replies
from finetune.tasks.tools import ERROR_KINDS, ToolCall, ToolPool

__all__ = ["EvalEpisodes", "Episode", "Episodes", "prompt_messages", "response_template", "row_columns",
           "score_episodes", "tool_figures", "tool_table", "tool_turn_ids"]

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


def tool_table(episodes: list[Episode]) -> np.ndarray:
    """``[episodes, 2 + len(ERROR_KINDS)]``: each episode's tool calls, turns, and failed calls of each kind."""
    return np.array([[e.tool_calls, e.turns, *(e.errors[kind] for kind in ERROR_KINDS)] for e in episodes],
                    dtype=np.float64).reshape(len(episodes), 2 + len(ERROR_KINDS))


def tool_figures(table: np.ndarray) -> dict[str, float]:
    """What is logged of ``tool_table``'s rows: calls per episode (mean, max), turns (mean), failures by kind
    (summed)."""
    return {"tools/calls/mean": float(table[:, 0].mean()), "tools/calls/max": float(table[:, 0].max()),
            "tools/turns/mean": float(table[:, 1].mean()),
            **{f"tools/errors/{kind}": float(table[:, 2 + k].sum()) for k, kind in enumerate(ERROR_KINDS)}}


def context_length(model) -> int | None:
    """The most positions ``model`` reads (its config's ``max_position_embeddings``), None where it does not say."""
    config = getattr(unwrap(model), "config", None) if model is not None else None
    text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
    return getattr(text_config, "max_position_embeddings", None)


class Episodes:
    """Rolls out episodes with the tools of ``pool`` (``finetune.tasks.tools.ToolPool``): ``args`` holds
    ``max_completion_length`` (sampled tokens over all turns) and ``max_turns`` (replies; None: no limit);
    ``options`` are the template's keyword arguments. A reply ends at the template's end of turn
    (``finetune.tasks.chat.end_of_turn_ids``); only a reply that ends there goes on to its tools.

    Raises:
        UserError: the template writes tool calls in no form parsed here (``response_template``).
    """

    def __init__(self, args, tokenizer, pool: ToolPool, options: dict | None = None):
        self.args, self.tokenizer, self.pool, self.options = args, tokenizer, pool, options or {}
        stop_ids = end_of_turn_ids(tokenizer, self.options)
        self.stop_ids, self.end_of_turn = set(stop_ids), stop_ids[-1]
        self.end_text = tokenizer.decode([self.end_of_turn])
        self.template = response_template(tokenizer, self.options)
        self._tool_seconds = 0.0

    def take_tool_seconds(self) -> float:
        """Seconds spent in tool calls (and environments' resets) since the last call."""
        seconds, self._tool_seconds = self._tool_seconds, 0.0
        return seconds

    def roll_rows(self, model, rows, counts: list[int], seeds: Callable[[int], list[int]], sample, *,
                  sharded: bool = False) -> list[Episode]:
        """``roll`` for ``rows`` of ``finetune.tasks.grpo.tokenize_prompts``."""
        messages = [prompt_messages(json.loads(prompt)) for prompt in rows["prompt_messages"]]
        return self.roll(model, rows["prompt_ids"], counts, messages, seeds, sample, rows=row_columns(rows),
                         sharded=sharded)

    def roll(self, model, prompts: list[list[int]], counts: list[int], prompt_messages: list[list[dict]],
             seeds: Callable[[int], list[int]], sample, *, rows: list[dict] | None = None,
             sharded: bool = False) -> list[Episode]:
        """``counts[i]`` episodes of each prompt (``prompts`` ids, ``prompt_messages`` the messages they render,
        ``rows`` its row's columns, which an environment's ``reset`` gets), each turn's replies sampled by
        ``sample(model, prompts, counts, seeds, max_new_tokens=..., past=..., keep=True)`` (seeded per episode with
        ``seeds(turn)``; ``finetune.tasks.rollout.sample_completions``), each turn from the episode's KV cache of
        its last. A sharded model's processes sample together until none has an episode going."""
        owners = [i for i, count in enumerate(counts) for _ in range(count)]
        episodes = [Episode(prompts[i], prompt_messages[i]) for i in owners]
        if self.pool.environment_index is not None:
            self._reset(episodes, [rows[i] for i in owners])
        budget, ceiling = self.args.max_completion_length, context_length(model)
        turn, kept, kept_episodes = 0, None, []
        while True:
            going = [k for k, episode in enumerate(episodes) if not episode.ended]
            left = max((budget - episodes[k].sampled for k in going), default=0)
            if sharded:  # every forward of a sharded model gathers weights from all processes
                left = int(all_reduce_max(torch.tensor(left, device=next(model.parameters()).device)))
            if left == 0:
                break
            turn_seeds = seeds(turn)
            if turn == 0 and all(e.prompt is prompts[i] for e, i in zip(episodes, owners, strict=True)):
                # A group's prompt once
                replies, kept = sample(model, prompts, counts, turn_seeds, max_new_tokens=left, keep=True)
            elif going:
                # Each episode's cache from its last turn: only the tokens since (tool results) run again.
                past = kept.select([kept_episodes.index(k) for k in going]) if kept else None
                replies, kept = sample(model, [episodes[k].prompt + episodes[k].ids for k in going],
                                       [1] * len(going), [turn_seeds[k] for k in going], max_new_tokens=left,
                                       past=past, keep=True)
            else:  # nothing left here, but another process samples: keep in step with it
                sample(model, prompts[:1], [1], turn_seeds[:1], max_new_tokens=left)
                replies, kept = [], None
            kept_episodes = going
            calls = [call for k, reply in zip(going, replies, strict=True)
                     for call in self._take_reply(episodes[k], k, reply)]
            self._answer(episodes, calls, ceiling)
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

    def _take_reply(self, episode: Episode, k: int, reply: list[int]) -> list[ToolCall]:
        """Add a turn's reply to episode ``k``; returns its tool calls to make, none where the episode ends here."""
        reply = reply[:self.args.max_completion_length - episode.sampled]
        context = episode.prompt + episode.ids
        episode.ids += reply
        episode.trained += [1] * len(reply)
        episode.turns += 1
        stopped = bool(reply) and reply[-1] in self.stop_ids
        message, unparsed = self._parse(reply, context) if stopped else (self._text(reply), None)
        episode.messages.append(message)
        calls = [ToolCall(call["function"]["name"], call["function"]["arguments"], episode=k, state=episode.state)
                 for call in message.get("tool_calls", [])]
        if unparsed:
            calls.append(ToolCall("", None, episode=k, state=episode.state, unparsed=unparsed))
        if not stopped:  # cut at the budget
            episode.ended = episode.truncated = True
        elif not calls or reply[-1] != self.end_of_turn:  # done, or stopped otherwise than a turn ends
            episode.ended = True
        elif episode.turns == self.args.max_turns or episode.sampled >= self.args.max_completion_length:
            episode.ended = episode.truncated = True  # it called tools it has no turn left to read
        if episode.ended:
            return []
        episode.tool_calls += len(calls)
        return calls

    def _answer(self, episodes: list[Episode], calls: list[ToolCall], ceiling: int | None) -> None:
        """Make a turn's tool calls and add their results, with the template's tokens around them, to their
        episodes; an episode they would take to ``ceiling`` tokens (the model's context) ends there without them,
        truncated."""
        started = time.perf_counter()
        results = self.pool.call(calls) if calls else []
        self._tool_seconds += time.perf_counter() - started
        answers: dict[int, list[dict]] = {}
        for call, result in zip(calls, results, strict=True):
            episode = episodes[call.episode]
            episode.state = result.state
            if result.error:
                episode.errors[result.error] += 1
            answers.setdefault(call.episode, []).append({"role": "tool", "name": call.name, "content": result.text})
        for k, tool_messages in answers.items():
            episode = episodes[k]
            inserted = tool_turn_ids(self.tokenizer, episode.prompt_messages + episode.messages, tool_messages,
                                     self.pool.schemas, self.end_text, self.options)
            if ceiling is not None and len(episode.prompt) + len(episode.ids) + len(inserted) >= ceiling:
                episode.ended = episode.truncated = True
                continue
            episode.ids += inserted
            episode.trained += [0] * len(inserted)
            episode.messages += tool_messages

    def _text(self, reply: list[int]) -> dict:
        return {"role": "assistant", "content": self.tokenizer.decode(reply, skip_special_tokens=True)}

    def _parse(self, reply: list[int], context: list[int]) -> tuple[dict, str | None]:
        """A reply that ended its turn as an assistant message, its tool calls each with a name and arguments (as
        the template renders them again); and why its calls do not parse, if they do not (the message is then
        its text)."""
        try:
            parsed = self.tokenizer.parse_response(reply, schema=self.template, prefix=context,
                                                   tools=self.pool.schemas)
        except ValueError as err:
            return self._text(reply), str(err).strip().splitlines()[-1][:200]
        calls = []
        for call in parsed.pop("tool_calls", None) or []:
            function = call.get("function") if isinstance(call, dict) else None
            if not isinstance(function, dict) or not isinstance(function.get("name"), str):
                return self._text(reply), f"a tool call without a name: {str(call)[:100]}"
            calls.append({"type": "function", "function": {"name": function["name"],
                                                           "arguments": function.get("arguments", {})}})
        message = {**parsed, "role": "assistant", "content": parsed.get("content") or ""}
        return ({**message, "tool_calls": calls} if calls else message), None


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
        episodes = self.episodes.roll_rows(model, rows, [1] * len(rows), lambda turn: [0] * len(rows), self.sample,
                                           sharded=is_sharded(model))
        scores = score_episodes(self.rewards, rows, episodes)
        width = self.episodes.args.max_completion_length
        own = [[t for t, trained in zip(e.ids, e.trained, strict=True) if trained] for e in episodes]
        tokens = torch.tensor([ids + [IGNORE] * (width - len(ids)) for ids in own], device=index.device)
        truncated = np.array([[e.truncated] for e in episodes], dtype=np.float64)
        figures = torch.from_numpy(np.hstack([truncated, tool_table(episodes)])).to(index.device)
        values = torch.from_numpy(scores.values).to(index.device)
        failed = torch.from_numpy(failed_table(scores, self.rewards)).to(index.device)
        return tokens, values, failed, figures

    def metrics(self, outputs: tuple[torch.Tensor, ...]) -> dict[str, float]:
        _, values, failed, figures = (output.cpu().numpy() for output in outputs)
        return {**reward_figures(values, failed, reward_names(self.rewards.names), self.weights),
                **tool_figures(figures[:, 1:]), "completions/truncated_share": float(figures[:, 0].mean())}

    def write(self, tokens: torch.Tensor, output_dir: str) -> None:
        """``eval_generations.jsonl`` with the gathered ``tokens`` (``outputs``' first) as each prompt's text."""
        texts = [self.episodes.tokenizer.decode([t for t in row if t != IGNORE], skip_special_tokens=True)
                 for row in tokens.tolist()]
        write_generations(os.path.join(output_dir, "eval_generations.jsonl"), self.validation, texts)
