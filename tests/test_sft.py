"""The chat fine-tuning recipe: trained tokens, packing, LoRA saving, exact multi-process training and resume."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest
import torch
from datasets import Dataset
from helpers import (
    HUB_TOKEN,
    assert_adapter_replies_as_generated,
    assert_refused,
    assert_same_steps,
    log_history,
    max_weight_diff,
    note_longest_texts,
    read_jsonl,
    read_results,
    run_on,
    save_tiny_llama,
    timeless_history,
    tiny_llama,
    tokenizing,
    train_here,
    write_jsonl,
)
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer, DataCollatorWithFlattening
from transformers.modeling_layers import GradientCheckpointingLayer

from finetune.data.batching import TokenizedDataset
from finetune.data.embedded.support_chats import make_support_conversations, routed_team
from finetune.models.memory import checkpoint_activations
from finetune.tasks.causal_lm import label_log_probs, language_model_collators
from finetune.tasks.chat import IGNORE, tokenize_conversations

TWO_TURNS = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Refund order 42?"},
             {"role": "assistant", "content": "Team: billing\nDone."}, {"role": "user", "content": "Thanks!"},
             {"role": "assistant", "content": "You are welcome."}]


@pytest.fixture
def tokenizer(chat_tokenizer):
    return chat_tokenizer


@pytest.fixture(scope="session")
def chat_files(tmp_path_factory) -> list[str]:
    """22 training conversations (two of them with two assistant turns) and 11 for validation, as flags."""
    folder = tmp_path_factory.mktemp("chat_data")
    data = make_support_conversations()
    train = [{"messages": m} for m in data["train"]["messages"][:20]] + [{"messages": TWO_TURNS}] * 2
    validation = [{"messages": m} for m in data["validation"]["messages"][:11]]
    return ["--train_file", write_jsonl(folder / "train.jsonl", train),
            "--validation_file", write_jsonl(folder / "validation.jsonl", validation),
            "--per_device_eval_batch_size", "3", "--logging_steps", "1", "--max_new_tokens", "8"]


def tokenize_chats(rows, tokenizer, tmp_path: Path, max_length: int = 1024) -> TokenizedDataset:
    """Conversations (a list of message lists, or a ``Dataset``) tokenized as the recipe does."""
    split = rows if isinstance(rows, Dataset) else Dataset.from_dict({"messages": rows})
    return TokenizedDataset(tokenize_conversations(split, tokenizer, max_length, "train", tokenizing(tmp_path)))


def trained_text(tokenizer, row: dict) -> list[str]:
    """The labelled stretches of a tokenized row, decoded."""
    stretches, current = [], []
    for label in row["labels"]:
        if label == IGNORE and current:
            stretches.append(current)
            current = []
        elif label != IGNORE:
            current.append(label)
    return [tokenizer.decode(s) for s in stretches + ([current] if current else [])]


def test_every_assistant_turn_trains_and_nothing_else(tokenizer, tmp_path):
    dataset = tokenize_chats([TWO_TURNS], tokenizer, tmp_path)
    ids, labels = dataset[0]["input_ids"], dataset[0]["labels"]
    assert trained_text(tokenizer, dataset[0]) == ["Team: billing\nDone.<|im_end|>\n", "You are welcome.<|im_end|>\n"]
    assert dataset.loss_units.tolist() == [sum(label != IGNORE for label in labels)]
    assert len(labels) == len(ids) and all(label in (IGNORE, token) for token, label in zip(ids, labels, strict=True))
    untrained = tokenizer.decode([token for token, label in zip(ids, labels, strict=True) if label == IGNORE])
    assert all(text in untrained for text in ("Be brief.", "Refund order 42?", "Thanks!"))
    assert "Team: billing" not in untrained and "welcome" not in untrained


def labels_rendering_each_turn_twice(messages, tokenizer) -> tuple[list[int], list[int]]:
    """Input ids and labels as the recipe first found them: the conversation rendered through its last assistant turn
    (what follows trains nothing, and is left out), and each assistant turn's span between its prefix rendered with
    and without it, tokens inside a span trained."""
    last = max(turn for turn, message in enumerate(messages) if message["role"] == "assistant")
    text = tokenizer.apply_chat_template(messages[:last + 1], tokenize=False)
    spans = []
    for turn, message in enumerate(messages):
        if message["role"] == "assistant":
            before = tokenizer.apply_chat_template(messages[:turn], tokenize=False, add_generation_prompt=True)
            spans.append((len(before), len(tokenizer.apply_chat_template(messages[:turn + 1], tokenize=False))))
    encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    labels = [token if any(start <= begin < end for start, end in spans) else IGNORE
              for token, (begin, _) in zip(encoded["input_ids"], encoded["offset_mapping"], strict=True)]
    return encoded["input_ids"], [IGNORE, *labels[1:]]


def test_trained_tokens_are_where_rendering_every_turn_puts_them(tokenizer, tmp_path):
    """Rendering is done once less per conversation (the last turn's rendering is the whole conversation's):
    the trained positions stay exactly where they were."""
    follow_up = [*TWO_TURNS, {"role": "user", "content": "One more: order 43? ünïcödé ✓ 日本"}]
    emoji = [{"role": "user", "content": "Hi 👋"}, {"role": "assistant", "content": "Hello! 👋 How can I help?"}]
    spaces = [{"role": "user", "content": "  \n\n "}, {"role": "assistant", "content": "\n  ok \t\n\n  "}]
    conversations = [*make_support_conversations()["train"]["messages"], TWO_TURNS, follow_up, emoji, spaces]
    dataset = tokenize_chats(conversations, tokenizer, tmp_path)
    for row, messages in enumerate(conversations):
        ids, labels = labels_rendering_each_turn_twice(messages, tokenizer)
        assert (dataset[row]["input_ids"], dataset[row]["labels"]) == (ids, labels), row


def test_prompt_and_completion_columns_train_like_messages(tokenizer, tmp_path):
    pairs = Dataset.from_dict({"prompt": ["Refund order 42?"], "completion": ["Team: billing\nDone."]})
    messages = Dataset.from_dict({"messages": [[{"role": "user", "content": "Refund order 42?"},
                                                {"role": "assistant", "content": "Team: billing\nDone."}]]})
    a, b = tokenize_chats(pairs, tokenizer, tmp_path), tokenize_chats(messages, tokenizer, tmp_path)
    assert a[0] == b[0] and trained_text(tokenizer, a[0]) == ["Team: billing\nDone.<|im_end|>\n"]


def test_a_packed_batch_gives_each_token_the_loss_it_has_alone(tokenizer, tmp_path):
    """The recipe's packed batches (its collator, its log-probabilities): attention never crosses from one packed
    example into the next, so every trained token's loss is its loss alone (float32). A tiny Llama drawn with wide
    weights, so that attention across examples would change losses by far."""
    model = tiny_llama(tokenizer, initializer_range=0.2).eval()
    conversations = [TWO_TURNS, *make_support_conversations()["validation"]["messages"][:3]]
    dataset = tokenize_chats(conversations, tokenizer, tmp_path)
    rows = [dataset[i] for i in range(len(dataset))]
    collate, _, packed, _ = language_model_collators(tokenizer, packing=True)
    assert packed

    def token_losses(batch):
        log_probs, labels = label_log_probs(model, dict(batch))
        return -log_probs[labels != IGNORE]

    with torch.no_grad():
        together = token_losses(collate(rows))
        alone = torch.cat([token_losses({k: torch.tensor([v]) for k, v in row.items()}) for row in rows])
        # Without the restarted position ids, the same row attends across examples and the losses differ.
        crossing = token_losses(DataCollatorWithFlattening(return_position_ids=False)(rows))
    assert together.shape == alone.shape == (sum(dataset.loss_units),)
    torch.testing.assert_close(together, alone, atol=1e-4, rtol=0)
    assert (crossing - alone).abs().max() > 0.1


PARITY_FLAGS = ["--gradient_accumulation_steps", "2", "--num_train_epochs", "2", "--lora_dropout", "0",
                "--learning_rate", "1e-2", "--checkpointing_steps", "2", "--eval_generate", "11"]


@pytest.mark.multiprocess
@pytest.mark.slow
# Each launcher once, each way of batching once (the batches are made alike under both launchers).
@pytest.mark.parametrize(("batches", "launcher"), [("--packing", "accelerate"), ("--no_packing", "torchrun")])
def test_one_process_and_two_train_alike_under_both_launchers(tiny_chat_model_with_distinct_replies, chat_files,
                                                              tmp_path, batches, launcher):
    """The loss is the mean over the trained tokens of a whole window on all ranks: 1 x 4 equals 2 x 2."""
    model = tiny_chat_model_with_distinct_replies
    outs = {"one": tmp_path / "one", launcher: tmp_path / launcher}
    run_on("sft", model, chat_files, outs["one"], *PARITY_FLAGS, batches, "--per_device_train_batch_size", "4")
    run_on("sft", model, chat_files, outs[launcher], *PARITY_FLAGS, batches, "--per_device_train_batch_size", "2",
           launcher=launcher, processes=2)
    reference = log_history(outs["one"])
    assert [h["step"] for h in reference] == list(range(1, 7))  # 22 conversations, windows of 8, 2 epochs
    adapter = load_file(outs["one"] / "adapter_model.safetensors")
    ours = log_history(outs[launcher])
    assert [h["step"] for h in ours] == [h["step"] for h in reference]
    for a, b in zip(ours, reference, strict=True):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5) and a["grad_norm"] == pytest.approx(
            b["grad_norm"], rel=1e-4)
    other = load_file(outs[launcher] / "adapter_model.safetensors")
    assert other.keys() == adapter.keys()
    # AdamW moves a weight by about the learning rate (1e-2) a step, less where its gradient is near zero, and
    # there summing in another order can flip the update: a hundredth of one step (the losses and gradient
    # norms above are the exact comparison).
    assert max((other[k] - adapter[k]).abs().max().item() for k in adapter) < 1e-4
    results, expected = read_results(outs[launcher]), read_results(outs["one"])
    assert (results["world_size"], expected["world_size"]) == (2, 1)
    assert results["eval_loss"] == pytest.approx(expected["eval_loss"], rel=1e-5)
    assert (results["padding_efficiency"] == 1.0) == (batches == "--packing")
    # Replies are generated in shards on every process and gathered: each must stay with its conversation.
    generations = read_jsonl(outs[launcher] / "eval_generations.jsonl")
    alone = read_jsonl(outs["one"] / "eval_generations.jsonl")
    assert len(generations) == 11 and generations == alone
    assert len({g["generation"] for g in alone}) > 1, "the replies differ, so a mix-up would show"
    # Checkpoints hold the adapter and its optimizer state only.
    checkpoint = load_file(outs[launcher] / "checkpoints" / "step_4" / "model.safetensors")
    assert checkpoint.keys() == {k.replace(".weight", ".default.weight") for k in adapter}


@pytest.mark.parametrize("batches", ["--no_packing", "--packing"])
def test_gradient_checkpointing_trains_exactly_as_keeping_the_activations(tiny_chat_model, chat_files, tmp_path,
                                                                         batches):
    """LoRA dropout on (0.05), accumulation of 2: the recompute draws the masks the forward pass drew."""
    flags = ["--max_train_steps", "3", "--per_device_train_batch_size", "2", "--gradient_accumulation_steps", "2",
             "--learning_rate", "1e-2", "--eval_generate", "0", batches]
    run_on("sft", tiny_chat_model, chat_files, tmp_path / "kept", *flags)
    run_on("sft", tiny_chat_model, chat_files, tmp_path / "recomputed", *flags, "--gradient_checkpointing")
    assert_same_steps(log_history(tmp_path / "recomputed"), log_history(tmp_path / "kept"), rel=1e-6)
    assert max_weight_diff(tmp_path / "recomputed", tmp_path / "kept", "adapter_model.safetensors") <= 1e-6


def test_unset_the_flag_recomputes_the_layers_where_the_estimate_says_every_activation_kept_would_not_fit(
        tiny_chat_model, chat_files, tmp_path, monkeypatch):
    """The rule itself is tests/test_memory.py's; here the loop acts on it, and --no_gradient_checkpointing wins."""
    import finetune.startup
    from finetune.models.estimate import MemoryEstimate

    turned_on = []

    def checkpointing(model):
        checkpoint_activations(model)
        layers = [module for module in model.modules() if isinstance(module, GradientCheckpointingLayer)]
        turned_on.append(len(layers) == 2 and all(layer.gradient_checkpointing for layer in layers))

    flags = ["--max_train_steps", "2", "--per_device_train_batch_size", "2", "--learning_rate", "1e-2",
             "--eval_generate", "0"]
    assert "layers recomputed" not in run_on("sft", tiny_chat_model, chat_files, tmp_path / "fits", *flags).stdout
    monkeypatch.setattr(finetune.startup, "checkpoint_activations", checkpointing)
    monkeypatch.setattr(MemoryEstimate, "needs_recompute", lambda estimate: not estimate.checkpointing)
    kept = run_on("sft", tiny_chat_model, chat_files, tmp_path / "kept", *flags, "--no_gradient_checkpointing")
    assert "layers recomputed" not in kept.stdout and turned_on == []
    chosen = run_on("sft", tiny_chat_model, chat_files, tmp_path / "chosen", *flags)
    assert "layers recomputed in the backward pass (every activation kept would not fit)" in chosen.stdout
    assert turned_on == [True]
    assert re.search(r"activations of the longest micro-batch \(\d+ x \d+ tokens; \d+ MiB without", chosen.stdout)
    assert_same_steps(log_history(tmp_path / "chosen"), log_history(tmp_path / "kept"), rel=1e-6)


@pytest.mark.parametrize("launcher", [None, pytest.param("torchrun", marks=[pytest.mark.slow,
                                                                          pytest.mark.multiprocess])])
def test_tiled_mlps_train_as_the_whole_mlps(tiny_chat_model, chat_files, tmp_path, launcher):
    """Micro-batches of 2 conversations (a few hundred positions: several tiles of the tiny model's 64), layers
    recomputed too; on 2 processes, as 1 process trains the same global batches."""
    flags = ["--max_train_steps", "3", "--gradient_accumulation_steps", "2", "--learning_rate", "1e-2",
             "--eval_generate", "0", "--lora_dropout", "0"]
    run_on("sft", tiny_chat_model, chat_files, tmp_path / "whole", *flags, "--per_device_train_batch_size", "2")
    tiled = run_on("sft", tiny_chat_model, chat_files, tmp_path / "tiled", *flags, "--tiled_mlp",
                   "--gradient_checkpointing", "--per_device_train_batch_size", "1" if launcher else "2",
                   launcher=launcher, processes=2)
    assert "layers recomputed in the backward pass, MLPs run in tiles of positions" in tiled.stdout
    rel = 1e-5 if launcher else 1e-6  # another world size sums in another order
    assert_same_steps(log_history(tmp_path / "tiled"), log_history(tmp_path / "whole"), rel=rel)
    # AdamW moves a weight by about the learning rate (1e-2) a step, whatever its gradient's size: where that is
    # near zero, summing tile by tile can flip an update; a hundredth of a step at most
    assert max_weight_diff(tmp_path / "tiled", tmp_path / "whole", "adapter_model.safetensors") <= 1e-4
    if not launcher:  # rows cut to 64 tokens, one a micro-batch: no MLP input is longer than a tile (64 positions)
        short = run_on("sft", tiny_chat_model, chat_files, tmp_path / "short", *flags, "--tiled_mlp",
                       "--max_seq_length", "64", "--per_device_train_batch_size", "1")
        assert "MLPs whole (no micro-batch is longer than a tile)" in short.stdout


RANK_ONE_WOULD_NOT_FIT = """\
import os

if "RANK" in os.environ:  # a training process, not the launcher
    import finetune.startup
    from finetune.models.estimate import MemoryEstimate

    turn_on = finetune.startup.checkpoint_activations

    def recording(model):
        turn_on(model)
        open(os.path.join(os.environ["TURNED_ON"], "rank" + os.environ["RANK"]), "w").close()

    finetune.startup.checkpoint_activations = recording
    if os.environ["RANK"] == "1":
        MemoryEstimate.needs_recompute = lambda estimate: not estimate.checkpointing
"""


@pytest.mark.multiprocess
@pytest.mark.slow
def test_where_one_process_s_estimate_would_not_fit_every_process_recomputes_its_layers(tiny_chat_model, chat_files,
                                                                                        tmp_path):
    """Rank 1 alone predicts that keeping every activation would not fit (a sitecustomize says so in it): rank 0,
    whose own prediction fits, recomputes too, and the run trains as one that keeps every activation."""
    (tmp_path / "site").mkdir()
    (tmp_path / "site" / "sitecustomize.py").write_text(RANK_ONE_WOULD_NOT_FIT)
    (tmp_path / "turned_on").mkdir()
    env = {"PYTHONPATH": f"{tmp_path / 'site'}:{os.environ.get('PYTHONPATH', '')}",
           "TURNED_ON": str(tmp_path / "turned_on")}
    flags = ["--max_train_steps", "2", "--per_device_train_batch_size", "2", "--learning_rate", "1e-2",
             "--eval_generate", "0"]
    chosen = run_on("sft", tiny_chat_model, chat_files, tmp_path / "chosen", *flags, launcher="torchrun",
                    processes=2, env=env)
    assert "layers recomputed in the backward pass (every activation kept would not fit)" in chosen.stdout
    assert sorted(path.name for path in (tmp_path / "turned_on").iterdir()) == ["rank0", "rank1"]
    run_on("sft", tiny_chat_model, chat_files, tmp_path / "kept", *flags, "--no_gradient_checkpointing",
           launcher="torchrun", processes=2)
    assert_same_steps(log_history(tmp_path / "chosen"), log_history(tmp_path / "kept"), rel=1e-6)


def test_generations_are_the_saved_model_s_greedy_replies(tiny_chat_model, chat_files, tmp_path):
    out = tmp_path / "out"
    run_on("sft", tiny_chat_model, chat_files, out, "--max_train_steps", "3", "--learning_rate", "1e-2",
           "--eval_generate", "4", "--merge_lora")
    assert assert_adapter_replies_as_generated(out, tiny_chat_model, max_new_tokens=8, merged_atol=1e-4) == 4


def test_evaluation_is_the_same_one_row_per_pass_as_with_the_default_batching(tiny_chat_model, chat_files, tmp_path):
    flags = ["--max_train_steps", "1", "--eval_generate", "4"]
    run_on("sft", tiny_chat_model, chat_files, tmp_path / "default", *flags, "--per_device_eval_batch_size", "64")
    run_on("sft", tiny_chat_model, chat_files, tmp_path / "one", *flags, "--per_device_eval_max_tokens", "1")
    default, one = read_results(tmp_path / "default"), read_results(tmp_path / "one")
    assert one["eval_loss"] == pytest.approx(default["eval_loss"], rel=0, abs=1e-6)
    generations = [read_jsonl(tmp_path / name / "eval_generations.jsonl") for name in ("default", "one")]
    assert len(generations[0]) == 4 and generations[0] == generations[1]


def test_without_lora_every_weight_trains_and_a_plain_model_is_saved(tiny_chat_model, chat_files, tmp_path):
    out = tmp_path / "out"
    result = run_on("sft", tiny_chat_model, chat_files, out, "--no_use_lora", "--no_packing", "--max_train_steps", "2",
                    "--eval_generate", "0", "--checkpointing_steps", "2")
    assert "padded batches" in result.stdout and "LoRA" not in result.stdout
    assert not (out / "adapter_config.json").exists()
    model, info = AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    base = AutoModelForCausalLM.from_pretrained(tiny_chat_model)
    changed = [name for name, weight in model.state_dict().items() if not torch.equal(weight, base.state_dict()[name])]
    assert "model.embed_tokens.weight" in changed and any("mlp" in name for name in changed)
    checkpoint = load_file(out / "checkpoints" / "step_2" / "model.safetensors")
    assert checkpoint.keys() == {name for name, _ in base.named_parameters()}
    assert read_results(out)["padding_efficiency"] < 1.0


def test_a_bfloat16_checkpoint_trains_float32_weights(tiny_chat_model, chat_files, tmp_path):
    """Released LLMs are saved in bfloat16, where Adam's steps of about the learning rate (1e-5) round away on
    weights near 0.02 (bfloat16's spacing there is 1.2e-4): the recipe trains float32 weights whatever the
    checkpoint's dtype, and says so."""
    bf16 = tmp_path / "bf16"
    AutoModelForCausalLM.from_pretrained(tiny_chat_model).to(torch.bfloat16).save_pretrained(bf16)
    AutoTokenizer.from_pretrained(tiny_chat_model).save_pretrained(bf16)
    out = tmp_path / "out"
    result = run_on("sft", bf16, chat_files, out, "--no_use_lora", "--max_train_steps", "2", "--learning_rate", "1e-5",
                    "--eval_generate", "0")
    assert "weights trained in float32" in result.stdout
    start, end = load_file(bf16 / "model.safetensors"), load_file(out / "model.safetensors")
    mlp = [name for name in start if ".mlp." in name]
    assert mlp and all(start[name].dtype == torch.bfloat16 and end[name].dtype == torch.float32 for name in mlp)
    before, after = torch.cat([start[n].float().flatten() for n in mlp]), torch.cat([end[n].flatten() for n in mlp])
    moved_below_bfloat16 = (after != before) & (after.to(torch.bfloat16).float() == before)
    assert moved_below_bfloat16.float().mean() > 0.5


def test_under_lora_the_base_loads_in_the_dtype_asked_and_the_adapter_trains_in_float32(tiny_chat_model, chat_files,
                                                                                        tmp_path):
    out = tmp_path / "out"
    result = run_on("sft", tiny_chat_model, chat_files, out, "--dtype", "bfloat16", "--max_train_steps", "2",
                    "--eval_generate", "2")
    assert "weights trained in float32, frozen in bfloat16" in result.stdout
    adapter = load_file(out / "adapter_model.safetensors")
    assert adapter and all(weight.dtype == torch.float32 for weight in adapter.values())
    assert len(read_jsonl(out / "eval_generations.jsonl")) == 2
    assert_refused("sft", [*chat_files, "--model_name_or_path", str(tiny_chat_model), "--output_dir",
                           str(tmp_path / "full"), "--no_use_lora", "--dtype", "bfloat16"],
                   tmp_path, "--dtype bfloat16 with --no_use_lora", "--mixed_precision bf16")


def test_a_resumed_run_ends_where_an_uninterrupted_one_does(tiny_chat_model, chat_files, tmp_path):
    """LoRA dropout on (the default 0.05): the resume restores the random state that draws its masks."""
    flags = ["--num_train_epochs", "2", "--per_device_train_batch_size", "4", "--learning_rate", "1e-2",
             "--checkpointing_steps", "4", "--eval_generate", "0"]
    run_on("sft", tiny_chat_model, chat_files, tmp_path / "full", *flags)
    run_on("sft", tiny_chat_model, chat_files, tmp_path / "resumed", *flags, "--resume_from_checkpoint",
           str(tmp_path / "full" / "checkpoints" / "step_4"))
    full = load_file(tmp_path / "full" / "adapter_model.safetensors")
    resumed = load_file(tmp_path / "resumed" / "adapter_model.safetensors")
    assert all(torch.equal(full[k], resumed[k]) for k in full)
    assert timeless_history(tmp_path / "resumed") == timeless_history(tmp_path / "full")[4:]


@pytest.mark.slow
def test_the_default_data_reports_routing_accuracy_from_its_generations(tokenizer, tmp_path):
    """The default model and data, two steps."""
    out = tmp_path / "out"
    result = train_here("sft", "--max_train_steps", "2", "--eval_generate", "6", "--max_seq_length", "64",
                        "--output_dir", str(out))
    full = tokenize_chats(make_support_conversations()["train"], tokenizer, tmp_path)
    cut = int((full.lengths >= 64).sum())
    assert 0 < cut < 160 and f"160 examples ({cut} cut to --max_seq_length 64)" in result.stdout
    assert "padded batches" in result.stdout, "without flash-attention, padded batches are the default"
    results = read_results(out)
    generations = read_jsonl(out / "eval_generations.jsonl")
    teams = make_support_conversations()["validation"]["team"][:6]
    right = [routed_team(g["generation"]) == team for g, team in zip(generations, teams, strict=True)]
    assert results["eval_routing_accuracy"] == sum(right) / 6
    assert [g["reference"].split("\n")[0] for g in generations] == [f"Team: {t}" for t in teams]
    assert results["eval_perplexity"] == pytest.approx(2.718281828 ** results["eval_loss"], rel=1e-6)
    config = json.loads((out / "adapter_config.json").read_text())
    assert config["r"] == 16 and config["lora_alpha"] == 32 and config["target_modules"]


def conversation(*turns) -> dict:
    return {"messages": [{"role": role, "content": content} for role, content in turns]}


GOOD = [conversation(("user", "Refund order 42?"), ("assistant", "Team: billing\nDone."))] * 2
BAD = {
    "no messages column": ([{"text": "hello"}], None, "no 'messages' column and no 'prompt' and 'completion'"),
    "an unknown role": ([conversation(("user", "hi"), ("bot", "hello"))], None, "unknown role 'bot'"),
    "content that is not text": ([{"messages": [{"role": "user", "content": "hi"},
                                                {"role": "assistant", "content": 5}]}], None, "content is int"),
    "no assistant turn": ([conversation(("user", "hi"))], None, "train row 1: no assistant message"),
    "an empty conversation": ([*GOOD, {"messages": []}], None, "train row 3: the conversation is empty"),
    "a prompt longer than --max_seq_length": (
        None, [*GOOD, conversation(("user", "word " * 80), ("assistant", "ok"))],
        "validation row(s) 3: no reply token is left within --max_seq_length 64"),
    "target modules naming no layer": (None, None, "--lora_target_modules attn_proj", "--lora_target_modules",
                                       "attn_proj"),
    "a chat template file that is not there": (None, None, "--chat_template nowhere.jinja: no such file",
                                               "--chat_template", "nowhere.jinja"),
    "no evaluation token budget": (None, None, "--per_device_eval_max_tokens is 0; it must be a positive",
                                   "--per_device_eval_max_tokens", "0"),
    "template options that are not JSON": (None, None, "--chat_template_kwargs is not JSON",
                                           "--chat_template_kwargs", "{enable_thinking: false}"),
    "template options that are not an object": (None, None, "--chat_template_kwargs is list; give a JSON object",
                                                "--chat_template_kwargs", "[1]"),
    "a template option no template can read": (None, None, "--chat_template_kwargs names 'enable-thinking'",
                                                "--chat_template_kwargs", '{"enable-thinking": false}'),
    "a template option named as a Jinja word": (None, None, "--chat_template_kwargs names one of Jinja's own words",
                                                "--chat_template_kwargs", '{"true": 1}'),
    "an image part": ([{"messages": [{"role": "user", "content": [{"type": "image", "url": "a.png"}]},
                                     {"role": "assistant", "content": "A cat."}]}] * 2, None,
                      "train row 1, message 1: content holds image besides text; the chat recipes train text models"),
    "a row the template refuses": (
        [{"messages": [{"role": "user", "content": "hi"}, {"role": "user", "content": "again"},
                       {"role": "assistant", "content": "ok"}]}] * 2, None,
        "train row 1: the chat template refuses it", "--chat_template", "ALTERNATING"),
}
ALTERNATING = ("{% for m in messages %}{% if (m['role'] == 'user') != (loop.index0 % 2 == 0) %}"
               "{{ raise_exception('roles must alternate user/assistant') }}{% endif %}"
               "<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
               "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_input_is_one_error_line_and_changes_nothing(tiny_chat_model, tmp_path, case):
    train, validation, expected, *extra_flags = BAD[case]
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "notes.txt").write_text("kept")
    flags = ["--train_file", write_jsonl(tmp_path / "train.jsonl", train or GOOD), "--validation_file",
             write_jsonl(tmp_path / "validation.jsonl", validation or GOOD), "--output_dir", str(tmp_path / "out"),
             "--model_name_or_path", str(tiny_chat_model), "--max_seq_length", "64", *extra_flags]
    if "ALTERNATING" in flags:
        (tmp_path / "alternating.jinja").write_text(ALTERNATING)
        flags[flags.index("ALTERNATING")] = str(tmp_path / "alternating.jinja")
    assert_refused("sft", flags, tmp_path, expected)


def test_a_model_without_a_chat_template_needs_one(tiny_chat_model, tmp_path):
    tokenizer = AutoTokenizer.from_pretrained(tiny_chat_model)
    template = tokenizer.chat_template
    tokenizer.chat_template = None
    model = tmp_path / "model"
    AutoModelForCausalLM.from_pretrained(tiny_chat_model).save_pretrained(model)
    tokenizer.save_pretrained(model)
    (model / "chat_template.jinja").unlink(missing_ok=True)
    flags = ["--train_file", write_jsonl(tmp_path / "t.jsonl", GOOD), "--validation_file",
             write_jsonl(tmp_path / "v.jsonl", GOOD), "--model_name_or_path", str(model), "--output_dir",
             str(tmp_path / "out"), "--max_train_steps", "1"]
    assert_refused("sft", flags, tmp_path, "has no chat template; give one with --chat_template FILE")
    (tmp_path / "template.jinja").write_text(template)
    train_here("sft", *flags, "--chat_template", str(tmp_path / "template.jinja"))
    assert "{% for message in messages %}" in AutoTokenizer.from_pretrained(tmp_path / "out").chat_template


def test_resuming_with_another_lora_configuration_is_refused(tiny_chat_model, chat_files, tmp_path):
    flags = ["--max_train_steps", "2", "--checkpointing_steps", "1", "--eval_generate", "0"]
    run_on("sft", tiny_chat_model, chat_files, tmp_path / "first", *flags)
    checkpoint = tmp_path / "first" / "checkpoints" / "step_1"
    error = assert_refused("sft", [*chat_files, "--model_name_or_path", str(tiny_chat_model), *flags, "--lora_r", "8",
                                   "--resume_from_checkpoint", str(checkpoint), "--output_dir",
                                   str(tmp_path / "second")],
                           tmp_path, "holds other trainable weights than this run")
    assert re.search(r"lora_[AB]\.default\.weight: \((16, \d+|\d+, 16)\) in the checkpoint, \((8, \d+|\d+, 8)\) here",
                     error), error


def test_the_hub_gets_the_adapter_the_merged_model_and_a_peft_card(hub, tiny_chat_model, chat_files, tmp_path):
    out = tmp_path / "out"
    result = run_on("sft", tiny_chat_model, chat_files, out, "--max_train_steps", "2", "--eval_generate", "2",
                    "--merge_lora", "--push_to_hub", "--hub_model_id", "alice/support-chat", "--hub_token", HUB_TOKEN,
                    launcher="python", env=hub.env)
    files = hub.files("alice/support-chat")
    assert {"adapter_config.json", "adapter_model.safetensors", "tokenizer.json", "chat_template.jinja",
            "merged/model.safetensors", "merged/config.json", "README.md"} <= files.keys()
    assert files["adapter_model.safetensors"] == (out / "adapter_model.safetensors").read_bytes()
    card = files["README.md"].decode()
    assert "library_name: peft" in card and "AutoPeftModelForCausalLM.from_pretrained(\"alice/support-chat\")" in card
    assert "eval_loss" in card and HUB_TOKEN not in card + result.stdout + result.stderr


def test_each_push_of_a_lora_run_is_the_adapter_alone_and_loads(hub, tiny_chat_model, chat_files, tmp_path,
                                                                 monkeypatch):
    """A checkpoint's model.safetensors holds the adapter under peft's internal names: pushed as a model beside a
    config.json, from_pretrained builds a randomly initialised model. Each push is the adapter as peft saves it
    with the tokenizer, and replaces what the repository held before (here an earlier run's whole model)."""
    from huggingface_hub import CommitOperationAdd, HfApi, constants
    from peft import AutoPeftModelForCausalLM

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    api = HfApi(endpoint=hub.url, token=HUB_TOKEN)
    api.create_repo("alice/lora")
    api.create_commit("alice/lora", [CommitOperationAdd(name, b"{}") for name in
                                     ("config.json", "model.safetensors", "notes.txt")], commit_message="another run")
    out = tmp_path / "out"
    run_on("sft", tiny_chat_model, chat_files, out, "--max_train_steps", "2", "--checkpointing_steps", "2",
           "--eval_generate", "0", "--push_to_hub", "--hub_model_id", "alice/lora", "--hub_token", HUB_TOKEN,
           launcher="python", env=hub.env)
    commits = hub.commits("alice/lora")
    assert [c["summary"] for c in commits] == ["another run", "Training in progress, step 2", "Final model, step 2"]
    trained = {name.replace(".default", ""): weight
               for name, weight in load_file(out / "checkpoints" / "step_2" / "model.safetensors").items()}
    for commit in commits[1:]:
        files = hub.repos["alice/lora"].commits[commit["sha"]]
        assert {"adapter_config.json", "adapter_model.safetensors", "tokenizer.json", "chat_template.jinja"} <= (
            files.keys()) and not {"config.json", "model.safetensors", "notes.txt"} & files.keys(), commit
        folder = tmp_path / commit["sha"]
        for name, data in files.items():
            (folder / name).parent.mkdir(parents=True, exist_ok=True)
            (folder / name).write_bytes(data)
        loaded = {name.replace(".default", ""): weight for name, weight in
                  AutoPeftModelForCausalLM.from_pretrained(folder).state_dict().items() if "lora_" in name}
        assert loaded.keys() == trained.keys() and all(torch.equal(loaded[k], trained[k]) for k in trained), commit


def test_a_tokenizer_without_a_pad_token_pads_and_replies_with_its_end_of_text(tiny_chat_model_without_pad_token,
                                                                               chat_files, tmp_path):
    out = tmp_path / "out"
    run_on("sft", tiny_chat_model_without_pad_token, chat_files, out, "--max_train_steps", "1", "--no_packing",
           "--eval_generate", "4")
    assert len(read_jsonl(out / "eval_generations.jsonl")) == 4 and read_results(out)["padding_efficiency"] < 1.0


def test_a_full_model_saved_over_an_adapter_loads_as_itself(tiny_chat_model, chat_files, tmp_path):
    """A LoRA run with its merged model, then a full fine-tune into the same folder: no adapter, card or merged/ of
    the first is left, so from_pretrained gives exactly the saved weights (the old adapter would be attached)."""
    out = tmp_path / "out"
    flags = ["--max_train_steps", "1", "--eval_generate", "0", "--learning_rate", "1e-2"]
    run_on("sft", tiny_chat_model, chat_files, out, *flags, "--merge_lora")
    assert (out / "adapter_model.safetensors").is_file() and (out / "merged").is_dir()
    run_on("sft", tiny_chat_model, chat_files, out, *flags, "--no_use_lora", "--overwrite_output_dir")
    assert sorted(p.name for p in out.iterdir() if not p.name.startswith(".")) == [
        "all_results.json", "chat_template.jinja", "config.json", "generation_config.json", "log_history.jsonl",
        "model.safetensors", "tokenizer.json", "tokenizer_config.json"]
    loaded = AutoModelForCausalLM.from_pretrained(out).eval()
    saved = AutoModelForCausalLM.from_pretrained(tiny_chat_model).eval()
    saved.load_state_dict(load_file(out / "model.safetensors"), strict=False)  # the tied head is the embedding
    ids = torch.tensor([[1, 400, 2000, 35, 7]])
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, saved(ids).logits)


def test_resuming_a_lora_checkpoint_on_another_base_model_is_refused(tiny_chat_model, tokenizer, chat_files,
                                                                     tmp_path):
    """Of the same shapes, so the adapter loads; the checkpoint records a hash of the frozen weights it was trained
    on."""
    other_base = save_tiny_llama(tmp_path / "other_base", tokenizer, initializer_range=0.05)
    flags = ["--max_train_steps", "2", "--checkpointing_steps", "1", "--eval_generate", "0"]
    run_on("sft", tiny_chat_model, chat_files, tmp_path / "first", *flags)
    checkpoint = tmp_path / "first" / "checkpoints" / "step_1"
    assert_refused("sft", [*chat_files, *flags, "--model_name_or_path", str(other_base), "--output_dir",
                           str(tmp_path / "second"), "--resume_from_checkpoint", str(checkpoint)],
                   tmp_path, f"{checkpoint} was trained on other frozen weights than this run's model")


def test_a_reply_of_megabytes_is_cut_before_it_is_tokenized(tokenizer, tmp_path, monkeypatch):
    """What can never fit is cut from the rendered text first: the tokens kept equal those of a reply short
    enough to tokenize whole, and no text much longer than what is kept reaches the tokenizer."""

    def conversation(reply_repeats):
        return [{"role": "user", "content": "Where is my parcel?"},
                {"role": "assistant", "content": "Sorry for the wait. " * reply_repeats}]

    short = tokenize_chats([conversation(100)], tokenizer, tmp_path, max_length=64)
    longest = note_longest_texts(monkeypatch)
    huge = tokenize_chats([conversation(100_000)], tokenizer, tmp_path, max_length=64)
    assert len(short[0]["input_ids"]) == 64
    assert huge[0]["input_ids"] == short[0]["input_ids"] and huge[0]["labels"] == short[0]["labels"]
    assert max(longest) <= 16 * 64, "no text longer than 16 characters a kept token reached the tokenizer"


def test_prepare_only_previews_the_rows_with_what_trains_in_them(tokenizer, tiny_chat_model, tmp_path):
    """--prepare_only --preview_rows N: the first N training rows, each run of trained tokens decoded, printed with
    the trained text marked and written to data_preview.jsonl; no model is saved."""
    conversations = [{"messages": TWO_TURNS}, *({"messages": m} for m in make_support_conversations()["train"]
                                                ["messages"][:3])]
    train = write_jsonl(tmp_path / "train.jsonl", conversations)
    out = tmp_path / "out"
    result = train_here("sft", "--train_file", train, "--validation_file", train, "--model_name_or_path",
                        str(tiny_chat_model), "--output_dir", str(out), "--prepare_only", "--preview_rows", "3",
                        "--dataset_cache_dir", str(tmp_path / "cache"))
    previews = read_jsonl(out / "data_preview.jsonl")
    rows = tokenize_chats([c["messages"] for c in conversations], tokenizer, tmp_path)
    assert [p["example"] for p in previews] == [1, 2, 3]
    assert [p["trained"] for p in previews] == [trained_text(tokenizer, rows[i]) for i in range(3)]
    assert previews[0]["trained"] == ["Team: billing\nDone.<|im_end|>\n", "You are welcome.<|im_end|>\n"]
    assert [p["text"] for p in previews] == [tokenizer.decode(rows[i]["input_ids"]) for i in range(3)]
    assert "\u00abTeam: billing\nDone.<|im_end|>\n\u00bb" in result.stdout
    assert sorted(p.name for p in out.iterdir()) == ["data_preview.jsonl"]


def test_generation_stops_at_the_token_the_template_ends_a_reply_with(tokenizer, tiny_chat_model, chat_files, tmp_path):
    """A template that ends replies with a special token other than the end of sequence (Gemma's <end_of_turn>, here
    <|endoftext|>): the generation_config.json saved with the adapter and with the merged model stops there too, so
    a user's generate does."""
    template = tmp_path / "template.jinja"
    template.write_text("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
                        "{% if m['role'] == 'assistant' %}<|endoftext|>{% else %}<|im_end|>{% endif %}\n{% endfor %}"
                        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    out = tmp_path / "out"
    run_on("sft", tiny_chat_model, chat_files, out, "--merge_lora", "--max_train_steps", "1", "--chat_template",
           str(template))
    end = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    for folder in (out, out / "merged"):
        assert json.loads((folder / "generation_config.json").read_text())["eos_token_id"] == [
            tokenizer.eos_token_id, end]
    trained = trained_text(tokenizer, tokenize_chats([TWO_TURNS], AutoTokenizer.from_pretrained(out), tmp_path)[0])
    # (<|endoftext|> takes the white space after it into its token)
    assert trained == ["Team: billing\nDone.<|endoftext|>", "You are welcome.<|endoftext|>"]
