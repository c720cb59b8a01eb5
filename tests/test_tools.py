"""GRPO with tools: the tool pool (results, and each failure returned to the model and counted by kind), episodes
token in and token out on every family whose template parses tool calls, the refusals before the model loads, and
(slow) every layout samples, scores and trains the same episodes."""

from __future__ import annotations

import copy
import json
import re
import sys
from pathlib import Path

import datasets
import pytest
import trl
from helpers import (
    free_port,
    load_recipe,
    log_history,
    one_error_line,
    read_jsonl,
    read_results,
    recipe_path,
    refused_here,
    run,
    run_on,
    train_here,
)
from safetensors.torch import load_file

from finetune.errors import UserError
from finetune.tasks.chat import end_of_turn_ids
from finetune.tasks.episodes import Episodes, score_episodes
from finetune.tasks.rewards import RewardPool
from finetune.tasks.scoring import check_rewards_on
from finetune.tasks.tools import ERROR_KINDS, ToolCall, ToolPool

TEMPLATES = Path(trl.__file__).parent / "chat_templates"
SHOP = '''
import os
import time

STATUS = {"A0": "shipped", "A1": "delayed", "A2": "delivered", "A3": "shipped", "A4": "lost", "A5": "shipped",
          "A6": "delivered", "A7": "delayed"}


def lookup_order(order_id: str) -> str:
    """The status of an order.

    Args:
        order_id: The order's id, such as A3.
    """
    return STATUS[order_id]


def hangs(seconds: int) -> str:
    """Sleeps.

    Args:
        seconds: How long.
    """
    time.sleep(seconds)


def exits(code: int) -> str:
    """Ends its process.

    Args:
        code: The exit status.
    """
    os._exit(code)


def no_hints(order_id):
    """Looks.

    Args:
        order_id: The order.
    """


class Orders:
    """lookup_order as an environment's method, with nothing to say at the start."""

    def reset(self, **row):
        pass

    def lookup_order(self, order_id: str) -> str:
        """The status of an order.

        Args:
            order_id: The order's id, such as A3.
        """
        return STATUS[order_id]


class Shop(Orders):
    """Knows the episode's order, says it at the start, and keeps what was looked up."""

    def reset(self, order_id, **row):
        self.order, self.looked_up = order_id, []
        return f" (order {order_id})"

    def lookup_order(self, order_id: str) -> str:
        """The status of an order.

        Args:
            order_id: The order's id, such as A3.
        """
        self.looked_up.append(order_id)
        return STATUS[order_id]


def imported(module: str) -> str:
    """Whether this worker process has imported a module.

    Args:
        module: The module's name.
    """
    import sys

    return str(module in sys.modules)


class NoReset:
    def lookup_order(self, order_id: str) -> str:
        """The status of an order.

        Args:
            order_id: The order's id.
        """


def looked_up_its_own_order(prompts, completions, environments, **columns):
    return [float(env.looked_up == [env.order]) for env in environments]


def states_the_status(prompts, completions, order_id, **columns):
    return [float(STATUS[order] in completion[-1]["content"]) for completion, order in zip(completions, order_id)]
'''


@pytest.fixture(scope="module")
def shop(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("tools") / "shop.py"
    path.write_text(SHOP)
    return path


def test_a_tool_answers_and_every_failure_comes_back_to_the_model_as_an_error_counted_by_kind(shop):
    with ToolPool([f"{shop}:lookup_order", f"{shop}:hangs", f"{shop}:exits"], timeout=2) as pool:
        assert [s["function"]["name"] for s in pool.schemas] == ["lookup_order", "hangs", "exits"]
        assert pool.schemas[0]["function"]["parameters"]["properties"]["order_id"]["type"] == "string"
        calls = [("lookup_order", {"order_id": "A4"}), ("lookup_order", '{"order_id": "A9"}'),
                 ("lookup_order", {"order": "A1"}), ("refund", {}), ("lookup_order", "{not json"),
                 ("lookup_order", [1]), ("hangs", {"seconds": 60}), ("exits", {"code": 3}),
                 ("lookup_order", {"order_id": "A2"})]
        results = pool.call([ToolCall(name, arguments, episode=k) for k, (name, arguments) in enumerate(calls)])
    assert [r.error for r in results] == [None, "raised", "raised", "unknown_tool", "bad_arguments",
                                          "bad_arguments", "timed_out", "worker_died", None]
    assert results[0].text == "lost" and results[-1].text == "delivered"
    assert results[1].text == "{'error': \"'A9'\"}"  # TRL's form: str({"error": str(exception)})
    assert "unexpected keyword argument 'order'" in results[2].text
    assert results[3].text == "{'error': 'Tool refund not found. The tools are: lookup_order, hangs, exits.'}"
    assert "timed out after 2 s" in results[6].text and "exit status 3" in results[7].text
    assert set(ERROR_KINDS) >= {r.error for r in results if r.error}


def test_only_the_first_worker_describes_the_tools_the_others_never_import_torch(shop):
    """transformers' get_json_schema imports torch (a second or more a worker); the description is the same in
    every worker, so one makes it."""
    with ToolPool([f"{shop}:imported"], workers=3) as pool:
        assert [s["function"]["name"] for s in pool.schemas] == ["imported"]
        described, torch = ([r.text for r in pool.call([ToolCall("imported", {"module": module}, episode=k)
                                                        for k in range(3)])]  # a call per worker, in order
                            for module in ("transformers.utils.chat_template_utils", "torch"))
    assert sorted(described) == ["False", "False", "True"] and torch == described


def test_an_environment_starts_per_episode_keeps_its_state_across_calls_and_rewards_read_it(chat_tokenizer, shop):
    tokenizer = copy.deepcopy(chat_tokenizer)
    tokenizer.chat_template = (TEMPLATES / "qwen2_5.jinja").read_text()

    class Args:
        max_completion_length, max_turns = 200, None

    def reply(text):
        return tokenizer(text + "<|im_end|>", add_special_tokens=False)["input_ids"]

    own = reply('<tool_call>\n{"name": "lookup_order", "arguments": {"order_id": "A1"}}\n</tool_call>')
    other = reply('<tool_call>\n{"name": "lookup_order", "arguments": {"order_id": "A2"}}\n</tool_call>')
    rows = [{"prompt": "Where is my order?", "order_id": "A1"}]
    messages = [[{"role": "user", "content": "Where is my order?"}]]
    with ToolPool([], environment=f"{shop}:Shop") as tools, RewardPool(
            [f"{shop}:looked_up_its_own_order"], environment=f"{shop}:Shop") as rewards:
        assert [s["function"]["name"] for s in tools.schemas] == ["lookup_order"]
        episodes = Episodes(Args, tokenizer, tools)
        prompt = tokenizer(tokenizer.apply_chat_template(messages[0], tools=tools.schemas, tokenize=False,
                                                         add_generation_prompt=True), add_special_tokens=False)
        rolled = [episodes.roll(None, [prompt["input_ids"]], [1], messages, lambda turn: [turn],
                                Scripted([script, reply("Delayed.")]), rows=rows)[0] for script in (own, other)]
        table = datasets.Dataset.from_list([{"prompt_messages": json.dumps(rows[0]["prompt"]),
                                             "columns": json.dumps({"order_id": "A1"})}] * 2)
        scores = score_episodes(rewards, table, rolled)
        # the check before training calls a function that reads environments with a started one
        check_rewards_on(rewards, table[0], environment=tools.reset(rows)[0][1])
    for episode in rolled:
        assert episode.prompt_messages == [{"role": "user", "content": "Where is my order? (order A1)"}]
        assert tokenizer.decode(episode.prompt).endswith("Where is my order? (order A1)<|im_end|>\n"
                                                         "<|im_start|>assistant\n")
    assert [e.messages[1]["content"] for e in rolled] == ["delayed", "delivered"]
    assert scores.values.tolist() == [[1.0], [0.0]] and not scores.failures


def test_a_tool_transformers_cannot_describe_or_a_name_given_twice_is_refused(shop, tmp_path):
    with pytest.raises(UserError, match=r"tool .*shop.py:no_hints: Argument order_id is missing a type hint"):
        ToolPool([f"{shop}:no_hints"])
    other = tmp_path / "other.py"
    other.write_text(SHOP)
    with pytest.raises(UserError, match="two --tools are named 'lookup_order'"):
        ToolPool([f"{shop}:lookup_order", f"{other}:lookup_order"])
    with pytest.raises(UserError, match=r"environment .*:NoReset has no reset method"):
        ToolPool([], environment=f"{shop}:NoReset")
    with pytest.raises(UserError, match="two of the --tools and --environment's methods share a name"):
        ToolPool([f"{shop}:lookup_order"], environment=f"{shop}:Orders")


# -- episodes, token in and token out

CONVERSATION = [
    {"role": "user", "content": "Where is order A3?"},
    {"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "function": {"name": "lookup_order", "arguments": {"order_id": "A3"}}}]},
    {"role": "tool", "name": "lookup_order", "content": "shipped"},
    {"role": "assistant", "content": "Order A3 has shipped."}]
PARSED = ["qwen2_5", "qwen3", "qwen3_instruct_2507"]
"""The text families whose template TRL ships that write tool calls as <tool_call> JSON blocks."""
PREFIX_CHANGING = ["qwen3"]
"""Qwen3 renders an empty reasoning block in a reply's generation and drops it from the history once a tool has
answered: the ids trained (as sampled) differ from the final conversation's rendering there."""


class Scripted:
    """A model's replies as its template renders them, turn after turn (the sampler of ``Episodes.roll``)."""

    def __init__(self, replies: list[list[int]]):
        self.replies, self.turn = replies, 0

    def __call__(self, model, prompts, counts, seeds, max_new_tokens, past=None, keep=False):
        reply = self.replies[self.turn]
        self.turn += 1
        replies = [reply[:max_new_tokens] for count in counts for _ in range(count)]
        return (replies, None) if keep else replies


def rendered_reply(tokenizer, messages, turn, tools, stop_text) -> list[int]:
    before = tokenizer.apply_chat_template(messages[:turn], tools=tools, tokenize=False, add_generation_prompt=True)
    through = tokenizer.apply_chat_template(messages[:turn + 1], tools=tools, tokenize=False)
    assert through.startswith(before)
    reply = through[len(before):]
    return tokenizer(reply[:reply.index(stop_text) + len(stop_text)], add_special_tokens=False)["input_ids"]


@pytest.fixture(scope="module")
def lookup(shop):
    with ToolPool([f"{shop}:lookup_order"]) as pool:
        yield pool


@pytest.mark.parametrize("family", sorted(p.stem for p in TEMPLATES.glob("*.jinja")
                                          if not p.stem.endswith("_training") and "vl" not in p.stem))
def test_an_episode_is_the_ids_sampled_and_the_templates_tool_turns_between_them(chat_tokenizer, lookup, family):
    tokenizer = copy.deepcopy(chat_tokenizer)
    tokenizer.chat_template = (TEMPLATES / f"{family}.jinja").read_text()

    class Args:
        max_completion_length, max_turns = 200, None

    try:
        episodes = Episodes(Args, tokenizer, lookup)
    except UserError as err:
        assert family not in PARSED and "--tools: the chat template" in str(err)
        return
    assert family in PARSED
    tools = lookup.schemas
    stop_text = tokenizer.decode(end_of_turn_ids(tokenizer)[-1:])
    script = Scripted([rendered_reply(tokenizer, CONVERSATION, turn, tools, stop_text) for turn in (1, 3)])
    prompt = tokenizer.apply_chat_template(CONVERSATION[:1], tools=tools, add_generation_prompt=True, tokenize=False)
    prompt_ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    (episode,) = episodes.roll(None, [prompt_ids], [1], [CONVERSATION[:1]], lambda turn: [turn], script)
    assert (episode.turns, episode.tool_calls, episode.truncated, sum(episode.errors.values())) == (2, 1, False, 0)
    assert episode.messages[1:] == CONVERSATION[2:]  # the tool's result, and the reply
    assert episode.messages[0]["tool_calls"][0]["function"] == CONVERSATION[1]["tool_calls"][0]["function"]
    sampled = [t for t, trained in zip(episode.ids, episode.trained, strict=True) if trained]
    assert sampled == script.replies[0] + script.replies[1]  # token in, token out
    assert episode.ids[:len(script.replies[0])] == script.replies[0]
    assert episode.ids[-len(script.replies[1]):] == script.replies[1]
    final = tokenizer.apply_chat_template(CONVERSATION, tools=tools, tokenize=False)
    final_ids = tokenizer(final[:final.rindex(stop_text) + len(stop_text)], add_special_tokens=False)["input_ids"]
    assert (prompt_ids + episode.ids == final_ids) == (family not in PREFIX_CHANGING)


def test_a_call_without_arguments_or_that_does_not_parse_gets_an_error_to_read_and_no_turn_left_truncates(
        chat_tokenizer, lookup):
    tokenizer = copy.deepcopy(chat_tokenizer)
    tokenizer.chat_template = (TEMPLATES / "qwen2_5.jinja").read_text()

    def ids(text):
        return tokenizer(text, add_special_tokens=False)["input_ids"]

    class Args:
        max_completion_length, max_turns = 200, 3

    bare = ids('<tool_call>\n{"name": "lookup_order"}\n</tool_call><|im_end|>')
    broken = ids('<tool_call>\n{"name": lookup_order}\n</tool_call><|im_end|>')
    unknown = ids('<tool_call>\n{"name": "refund", "arguments": {}}\n</tool_call><|im_end|>')
    episodes = Episodes(Args, tokenizer, lookup)
    prompt = ids(tokenizer.apply_chat_template(CONVERSATION[:1], tools=lookup.schemas, add_generation_prompt=True,
                                               tokenize=False))
    (episode,) = episodes.roll(None, [prompt], [1], [CONVERSATION[:1]], lambda turn: [turn],
                               Scripted([bare, broken, unknown]))
    assert (episode.turns, episode.tool_calls, episode.truncated) == (3, 2, True)
    assert dict(episode.errors) == {"raised": 1, "unparsed": 1}
    assert episode.messages[0]["tool_calls"][0]["function"] == {"name": "lookup_order", "arguments": {}}
    assert "missing 1 required positional argument: 'order_id'" in episode.messages[1]["content"]
    assert episode.messages[3]["role"] == "tool" and "does not parse" in episode.messages[3]["content"]
    assert episode.messages[4]["tool_calls"][0]["function"]["name"] == "refund"  # no turn left to read its error
    assert sum(episode.trained) == len(bare) + len(broken) + len(unknown)


def test_a_tool_result_that_would_take_an_episode_to_the_model_s_context_ends_it_without_the_result(
        chat_tokenizer, lookup):
    """TRL's ceiling: an episode whose tool turn would reach the model's max_position_embeddings ends at the reply
    that called the tool, truncated, without the result; one position more and the result and the next reply come."""
    from types import SimpleNamespace

    from transformers import PretrainedConfig

    tokenizer = copy.deepcopy(chat_tokenizer)
    tokenizer.chat_template = (TEMPLATES / "qwen2_5.jinja").read_text()

    class Args:
        max_completion_length, max_turns = 200, None

    episodes, tools = Episodes(Args, tokenizer, lookup), lookup.schemas
    stop_text = tokenizer.decode(end_of_turn_ids(tokenizer)[-1:])
    call, answer = (rendered_reply(tokenizer, CONVERSATION, turn, tools, stop_text) for turn in (1, 3))
    prompt = tokenizer(tokenizer.apply_chat_template(CONVERSATION[:1], tools=tools, add_generation_prompt=True,
                                                     tokenize=False), add_special_tokens=False)["input_ids"]

    def rolled(context: int | None):
        model = None if context is None else SimpleNamespace(config=PretrainedConfig(max_position_embeddings=context))
        return episodes.roll(model, [prompt], [1], [CONVERSATION[:1]], lambda turn: [turn],
                             Scripted([call, answer]))[0]

    whole = rolled(None)
    assert whole.ids[:len(call)] == call and whole.ids[-len(answer):] == answer and not whole.truncated
    reaching = len(prompt) + len(whole.ids) - len(answer)  # the context once the tool's result is in
    cut = rolled(reaching)
    assert (cut.ids, cut.turns, cut.tool_calls, cut.truncated) == (call, 1, 1, True)
    assert [m["role"] for m in cut.messages] == ["assistant"]
    fits = rolled(reaching + 1)
    assert (fits.ids, fits.truncated, fits.messages) == (whole.ids, False, whole.messages)


def test_the_chat_recipe_gives_the_tools_schemas_to_rows_without_their_own(tiny_chat_model, chat_tokenizer, shop,
                                                                          tmp_path):
    """The conversations an SFT step before GRPO trains on render with the tools GRPO will prompt with."""
    data = tmp_path / "calls.jsonl"
    data.write_text(json.dumps({"messages": CONVERSATION}) + "\n")
    out = tmp_path / "out"
    train_here("sft", "--model_name_or_path", str(tiny_chat_model), "--chat_template", "qwen2_5", "--tools",
               f"{shop}:lookup_order", "--train_file", str(data), "--validation_file", str(data), "--output_dir",
               str(out), "--prepare_only", "--preview_rows", "1")
    (preview,) = read_jsonl(out / "data_preview.jsonl")
    with ToolPool([f"{shop}:lookup_order"]) as pool:
        tokenizer = copy.deepcopy(chat_tokenizer)
        tokenizer.chat_template = (TEMPLATES / "qwen2_5.jinja").read_text()
        expected = tokenizer.apply_chat_template(CONVERSATION, tools=pool.schemas, tokenize=False)
    assert preview["text"] == expected
    assert '"name": "lookup_order"' in preview["text"] and preview["trained"][0].startswith("<tool_call>")


# -- refusals, before the model loads

@pytest.fixture(scope="module")
def orders(tmp_path_factory) -> list[str]:
    """Data flags: 16 prompts that ask for an order's status, each order twice, for train and validation."""
    path = tmp_path_factory.mktemp("orders") / "orders.jsonl"
    path.write_text("".join(json.dumps({"prompt": [{"role": "user", "content": f"Where is order A{k % 8}?"}],
                                        "order_id": f"A{k % 8}"}) + "\n" for k in range(16)))
    return ["--train_file", str(path), "--validation_file", str(path)]


def test_bad_tools_and_turns_are_refused_before_the_model_loads(tiny_chat_model, shop, orders, tmp_path, capsys):
    main = load_recipe("grpo").main
    base = [*orders, "--model_name_or_path", str(tiny_chat_model), "--output_dir", str(tmp_path / "out"),
            "--reward_funcs", f"{shop}:states_the_status"]
    qwen = ["--chat_template", "qwen2_5"]  # TRL's, by name
    refused_here(main, [*base, *qwen, "--tools", f"{shop}:refund"], capsys, "tool", "has no 'refund'",
                 "lookup_order")
    refused_here(main, [*base, *qwen, "--tools", f"{shop}:no_hints"], capsys, "missing a type hint")
    refused_here(main, [*base, *qwen, "--tools", f"{shop}:lookup_order", "--max_turns", "0"], capsys,
                 "--max_turns is 0")
    # SmolLM2's own template has no tools
    refused_here(main, [*base, "--tools", f"{shop}:lookup_order"], capsys,
                 "writes tool calls in a form not parsed here", "--chat_template a template of that form")
    refused_here(main, [*base, "--chat_template", "qwen9", "--tools", f"{shop}:lookup_order"], capsys,
                 "--chat_template qwen9: no such file, nor a template TRL ships", "qwen2_5")
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
@pytest.mark.multiprocess
def test_under_torchrun_a_tools_file_without_the_function_is_one_line_and_status_2(tiny_chat_model, shop, orders,
                                                                                    tmp_path):
    """The tools are checked in a worker before the model loads, and the launched recipe reports it as every
    refusal (``finetune torchrun``: one line for the two processes)."""
    result = run([sys.executable, "-m", "finetune.cli", "torchrun", "--nproc_per_node", "2", "--master_port",
                  str(free_port()), recipe_path("grpo"), *orders, "--model_name_or_path", str(tiny_chat_model),
                  "--output_dir", str(tmp_path / "out"), "--reward_funcs", f"{shop}:states_the_status",
                  "--chat_template", "qwen2_5", "--tools", f"{shop}:refund"], check=False)
    line = one_error_line(result.returncode, result.stderr, "has no 'refund'")
    assert result.stderr.strip().splitlines()[-1] == line and not (tmp_path / "out").exists()


# -- every layout samples, scores and trains the same episodes

@pytest.fixture(scope="module")
def tool_model(tmp_path_factory, chat_tokenizer, shop) -> Path:
    """A tiny Llama taught (150 Adam steps of 4 of 8 conversations) to call lookup_order under Qwen2.5's template and to
    state the status the tool returns. It does not copy the order's id (its calls name orders at random, some do not
    parse): rewards differ within groups."""
    import torch
    from helpers import tiny_llama

    tokenizer = copy.deepcopy(chat_tokenizer)
    tokenizer.chat_template = (TEMPLATES / "qwen2_5.jinja").read_text()
    status = {}
    exec(SHOP, status)
    with ToolPool([f"{shop}:lookup_order"]) as pool:
        tools = pool.schemas
    rows = []
    for order, said in status["STATUS"].items():
        messages = [{"role": "user", "content": f"Where is order {order}?"},
                    {"role": "assistant", "content": "", "tool_calls": [
                        {"type": "function", "function": {"name": "lookup_order", "arguments": {"order_id": order}}}]},
                    {"role": "tool", "name": "lookup_order", "content": said},
                    {"role": "assistant", "content": f"It is {said}."}]
        spans = [(len(tokenizer.apply_chat_template(messages[:turn], tools=tools, tokenize=False,
                                                    add_generation_prompt=True)),
                  len(tokenizer.apply_chat_template(messages[:turn + 1], tools=tools, tokenize=False).rstrip()))
                 for turn in (1, 3)]
        encoded = tokenizer(tokenizer.apply_chat_template(messages, tools=tools, tokenize=False),
                            add_special_tokens=False, return_offsets_mapping=True)
        labels = [token if any(start <= at < end for start, end in spans) else -100
                  for token, (at, _) in zip(encoded["input_ids"], encoded["offset_mapping"], strict=True)]
        rows.append((encoded["input_ids"], labels))
    width = max(len(ids) for ids, _ in rows)
    ids = torch.tensor([row + [2] * (width - len(row)) for row, _ in rows])
    labels = torch.tensor([row + [-100] * (width - len(row)) for _, row in rows])[:, 1:]
    model = tiny_llama(tokenizer)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    for step in range(150):  # the head only where a reply's tokens are predicted: the vocabulary is most of the cost
        rows = slice(4 * (step % 2), 4 * (step % 2) + 4)
        hidden = model.model(input_ids=ids[rows]).last_hidden_state[:, :-1]
        wanted = labels[rows]
        loss = torch.nn.functional.cross_entropy(model.lm_head(hidden[wanted != -100]), wanted[wanted != -100])
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    folder = tmp_path_factory.mktemp("tool_model")
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


@pytest.mark.slow
def test_episodes_run_on_from_their_kept_caches_as_episodes_that_run_each_turn_whole(tool_model, lookup):
    """The tool-calling model's episodes, sampled: each turn from the episode's cache of its last, and each turn's
    whole context run again, are the same ids."""
    import functools

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from finetune.tasks.rollout import sample_completions

    class Args:
        max_completion_length, max_turns = 48, None

    model = AutoModelForCausalLM.from_pretrained(tool_model)
    model.generation_config.eos_token_id = [2]
    tokenizer = AutoTokenizer.from_pretrained(tool_model)
    sample = functools.partial(sample_completions, temperature=1.0, top_p=1.0, pad_token_id=2)

    def whole(*args, past=None, **kwargs):
        return sample(*args, **kwargs)

    messages = [[{"role": "user", "content": f"Where is order A{k}?"}] for k in range(4)]
    prompts = [tokenizer(tokenizer.apply_chat_template(m, tools=lookup.schemas, tokenize=False,
                                                       add_generation_prompt=True), add_special_tokens=False)
               ["input_ids"] for m in messages]
    episodes = Episodes(Args, tokenizer, lookup)
    def seeds(turn):
        return list(range(16 * turn, 16 * turn + 16))

    run_on, again = (episodes.roll(model, prompts, [4] * 4, messages, seeds, sampler) for sampler in (sample, whole))
    assert [e.ids for e in run_on] == [e.ids for e in again]
    tool_turns = {e.trained.count(0) for e in run_on}
    assert max(e.turns for e in run_on) >= 2 and len(tool_turns) > 1, "turns ran on after tool turns of every length"


TOOL_FLAGS = ["--max_completion_length", "48", "--num_generations", "4", "--logging_steps", "1",
              "--per_device_eval_batch_size", "16", "--learning_rate", "1e-2", "--num_iterations", "2",
              "--beta", "0.04", "--max_train_steps", "4", "--checkpointing_steps", "2"]


@pytest.fixture(scope="module")
def tool_runs(tool_model, shop, orders, tmp_path_factory) -> dict[str, Path]:
    """4 steps of 8 episodes (2 prompts x 4), two passes over each rollout and a KL term: on 1 process, on 1 with
    accumulation 2, on 2 processes under accelerate launch and torchrun, and sharded (``--fsdp``); checkpoints
    every 2 steps. Under torchrun the tool is an environment's method (``Orders``), elsewhere the function."""
    tools = ["--tools", f"{shop}:lookup_order"]
    environment = ["--environment", f"{shop}:Orders"]
    outs = {name: tmp_path_factory.mktemp("tools") / name
            for name in ("one", "accumulation", "accelerate", "torchrun", "fsdp")}
    flags = [*TOOL_FLAGS, "--reward_funcs", f"{shop}:states_the_status"]
    runs = {"one": run_on("grpo", tool_model, orders, outs["one"], *flags, *tools,
                          "--per_device_train_batch_size", "8"),
            "accumulation": run_on("grpo", tool_model, orders, outs["accumulation"], *flags, *tools,
                                   "--per_device_train_batch_size", "4", "--gradient_accumulation_steps", "2"),
            "accelerate": run_on("grpo", tool_model, orders, outs["accelerate"], *flags, *tools,
                                 "--per_device_train_batch_size", "4", launcher="accelerate", processes=2)}
    for name, sharded in (("torchrun", []), ("fsdp", ["--fsdp"])):
        runs[name] = run_on("grpo", tool_model, orders, outs[name], *flags, *environment, *sharded,
                            "--per_device_train_batch_size", "4", launcher="torchrun", processes=2)
    for name, launched in runs.items():  # the evaluation before training, which the trackers get as step 0
        (outs[name] / "before_training.txt").write_text(
            next(line for line in launched.stdout.splitlines() if line.startswith("before training:")))
    return outs


TOOL_FIGURES = ["reward", "reward_std", "completions/mean_length", "completions/truncated_share", "tools/calls/mean",
                "tools/calls/max", "tools/turns/mean", *(f"tools/errors/{kind}" for kind in ERROR_KINDS), "kl",
                "clip_ratio/region"]


@pytest.mark.multiprocess
@pytest.mark.slow
def test_every_layout_samples_the_same_episodes_calls_the_same_tools_and_trains_alike(tool_runs):
    reference = log_history(tool_runs["one"])
    assert [h["step"] for h in reference] == [1, 2, 3, 4]
    before = (tool_runs["one"] / "before_training.txt").read_text()
    figures = dict(re.findall(r"(\S+) (-?[0-9.]+)(?:,|$)", before.removeprefix("before training:")))
    assert float(figures["eval_tools/calls/mean"]) > 0.5 and "eval_reward" in figures, before
    first = reference[0]
    assert first["tools/calls/mean"] > 0.5 and first["tools/turns/mean"] > 1.5, "episodes of several turns"
    # which sampled batch first has rewards that differ within a group (a gradient to compare) depends on the
    # CPU's rounding in sampling: the first on some machines, the second (step 3) on an AMD EPYC
    first_trained = next((h["step"] for h in reference if h["grad_norm"] > 0), None)
    assert first_trained is not None and reference[-1]["kl"] > 0, "no batch with rewards that differ within a group"
    adapter = load_file(tool_runs["one"] / "adapter_model.safetensors")
    results = read_results(tool_runs["one"])
    assert results["eval_tools/calls/mean"] > 0.5 and "eval_reward" in results
    # Up to the first step with a gradient every layout holds the same weights and agrees to rounding; that step's
    # AdamW update turns gradient entries of about its eps (1e-8), where the order of the sums is much of their
    # value, into weight differences of up to 1e-4 (the adapters' check below), which the later steps' gradients
    # and KL carry (2e-5 of them seen on an AMD EPYC)
    for name in ("accumulation", "accelerate", "torchrun", "fsdp"):
        history = log_history(tool_runs[name])
        assert [h["step"] for h in history] == [1, 2, 3, 4], name
        assert (tool_runs[name] / "before_training.txt").read_text() == before, name  # the same greedy episodes
        for ours, theirs in zip(history, reference, strict=True):
            assert ours.keys() == theirs.keys(), (name, ours["step"])
            rel = 1e-5 if ours["step"] <= first_trained else 1e-4
            assert ours["grad_norm"] == pytest.approx(theirs["grad_norm"], rel=rel), (name, ours, theirs)
            assert ours["loss"] == pytest.approx(theirs["loss"], rel=rel, abs=1e-7), (name, ours, theirs)
            for key in TOOL_FIGURES:
                if key in theirs:
                    assert ours[key] == pytest.approx(theirs[key], rel=rel, abs=1e-7), (name, key)
        other = load_file(tool_runs[name] / "adapter_model.safetensors")
        assert max((other[k] - adapter[k]).abs().max().item() for k in adapter) < 1e-4, name
        theirs = read_results(tool_runs[name])
        for key in results:
            if key.startswith("eval_"):
                assert theirs[key] == pytest.approx(results[key], rel=1e-6), (name, key)
    assert read_jsonl(tool_runs["torchrun"] / "eval_generations.jsonl") == read_jsonl(
        tool_runs["one"] / "eval_generations.jsonl")


@pytest.mark.multiprocess
@pytest.mark.slow
def test_a_run_with_tools_resumed_from_its_checkpoint_is_the_uninterrupted_one(tool_runs, tool_model, shop, orders,
                                                                               tmp_path):
    out = tmp_path / "resumed"
    run_on("grpo", tool_model, orders, out, *TOOL_FLAGS, "--environment", f"{shop}:Orders", "--reward_funcs",
           f"{shop}:states_the_status", "--per_device_train_batch_size", "4", "--resume_from_checkpoint",
           str(tool_runs["torchrun"] / "checkpoints" / "step_2"), launcher="torchrun", processes=2)
    history = log_history(out)
    assert [h["step"] for h in history] == [3, 4]
    for ours, theirs in zip(history, log_history(tool_runs["torchrun"])[2:], strict=True):
        assert {k: v for k, v in ours.items() if "seconds" not in k and k != "samples_per_second"} == {
            k: v for k, v in theirs.items() if "seconds" not in k and k != "samples_per_second"}
    resumed, uninterrupted = (load_file(run / "adapter_model.safetensors") for run in (out, tool_runs["torchrun"]))
    assert max((resumed[k] - uninterrupted[k]).abs().max().item() for k in resumed) == 0


# -- the embedded agent task

def test_the_agent_tasks_tickets_need_the_tool_and_its_conversations_train_as_an_agent_would(chat_tokenizer, tmp_path):
    from finetune.data.embedded import order_tickets
    from finetune.tasks.chat import render_rows, without_nulls
    from finetune.tasks.episodes import response_template

    conversations, prompts = order_tickets.make_order_conversations(), order_tickets.make_order_prompts()
    orders = {split: set(rows["order_id"]) for split, rows in conversations.items()}
    assert not orders["train"] & orders["validation"], "held-out tickets name orders training never saw"
    assert orders == {split: set(rows["order_id"]) for split, rows in prompts.items()}
    assert not ({m[1]["content"] for m in conversations["train"]["messages"]}
                & {p[1]["content"] for p in prompts["train"]["prompt"]})
    named = [re.findall(r"\d{5}", p[1]["content"]) for p in prompts["validation"]["prompt"]]
    assert [len(n) for n in named] == [2] * 40, "every held-out ticket names another order before the asked one"
    assert [n[1] for n in named] == prompts["validation"]["order_id"]
    tokenizer = copy.deepcopy(chat_tokenizer)
    tokenizer.chat_template = (TEMPLATES / "qwen2_5.jinja").read_text()
    with ToolPool(["finetune.data.embedded.order_tickets:lookup_order"]) as pool:
        tools = pool.schemas
        result = pool.call([ToolCall("lookup_order", {"order_id": conversations["train"][0]["order_id"]})])[0]
    assert result.error is None and result.text == conversations["train"][0]["messages"][3]["content"]
    messages = [[without_nulls(m) for m in row] for row in conversations["train"]["messages"]]
    rows = render_rows(messages, tokenizer, [f"row {k}" for k in range(len(messages))], [json.dumps(tools)] * 60)
    assert all(len(made) == 1 and len(made[0][1]) == 2 for made in rows), "both replies train, as generated"
    template = response_template(tokenizer)
    for conversation, row in zip(messages, conversations["train"], strict=True):
        before = tokenizer.apply_chat_template(conversation[:2], tools=tools, tokenize=False,
                                               add_generation_prompt=True)
        through = tokenizer.apply_chat_template(conversation[:3], tools=tools, tokenize=False)
        call = tokenizer.parse_response(through[len(before):].rstrip(), schema=template, prefix=before, tools=tools)
        assert call["tool_calls"][0]["function"] == {"name": "lookup_order",
                                                     "arguments": {"order_id": row["order_id"]}}
    finals = [[conversation[-1]] for conversation in messages]
    status, team = conversations["train"]["status"], conversations["train"]["team"]
    assert order_tickets.resolved(None, finals, status, team) == [1.0] * 60
    wrong_status = [s if s != "lost" else "delayed" for s in status]
    assert order_tickets.resolved(None, finals, wrong_status, team) == [float(s != "lost") for s in status]
    assert order_tickets.resolved(None, ["Your order is lost.\nTeam: shipping or billing"], ["lost"],
                                  ["shipping"]) == [0.0]
    order_tickets.write_files(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "conversations_train.jsonl", "conversations_validation.jsonl", "prompts_train.jsonl",
        "prompts_validation.jsonl"]
    assert len(read_jsonl(tmp_path / "prompts_train.jsonl")) == 120
