"""Preference pairs: TRL's formats, the same prompt tokens before both replies, the cut, the DPO losses, the
reference (adapters off, or a frozen copy), log-probabilities against TRL's, and the precomputed reference."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from datasets import Dataset
from helpers import note_longest_texts, tiny_llama, tokenizing, whole_rows_batch
from transformers import AutoModelForCausalLM

from finetune.data.batching import TokenizedDataset
from finetune.errors import UserError
from finetune.models.lora import add_lora
from finetune.tasks.causal_lm import load_causal_lm
from finetune.tasks.preference import (
    PromptRepliesCollator,
    Reference,
    dpo_loss,
    pair_figures,
    pair_log_probs,
    pair_metrics,
    precomputed_reference,
    reference_key,
    tokenize_pairs,
    write_pair_predictions,
)

SYSTEM = {"role": "system", "content": "Route the ticket."}
USER = {"role": "user", "content": "I was charged twice for order 42."}
CHOSEN = "Team: billing\nWe will refund the second charge."
REJECTED = "Team: shipping\nWe will refund the second charge."
COLUMNS = ["prompt_ids", "chosen_ids", "rejected_ids", "index"]


def assistant(text: str) -> dict:
    return {"role": "assistant", "content": text}


@pytest.fixture
def tokenizer(chat_tokenizer):
    return chat_tokenizer


def tiny_model(tokenizer, seed: int = 0):
    return tiny_llama(tokenizer, initializer_range=0.05, seed=seed)


def tokenize(rows: dict, tokenizer, tmp_path: Path, max_length: int = 512, **kwargs):
    return tokenize_pairs(Dataset.from_dict(rows), tokenizer, max_length, "train", tokenizing(tmp_path), **kwargs)


def pairs_dataset(tokenizer, tmp_path: Path, count: int = 6) -> TokenizedDataset:
    """``count`` pairs of different prompt and reply lengths."""
    prompts = [[SYSTEM, {"role": "user", "content": f"Order {i}: " + "charged twice " * (i + 1)}] for i in range(count)]
    rows = {"prompt": prompts, "chosen": [[assistant(CHOSEN + " Sorry." * i)] for i in range(count)],
            "rejected": [[assistant(f"Noted {i}.")] for i in range(count)]}
    return TokenizedDataset(tokenize(rows, tokenizer, tmp_path), COLUMNS)


def test_every_format_gives_the_same_tokens_and_both_replies_follow_the_same_prompt_ids(tokenizer, tmp_path):
    explicit = {"prompt": [[SYSTEM, USER]], "chosen": [[assistant(CHOSEN)]], "rejected": [[assistant(REJECTED)]]}
    implicit = {"chosen": [[SYSTEM, USER, assistant(CHOSEN)]], "rejected": [[SYSTEM, USER, assistant(REJECTED)]]}
    text = {"prompt": [USER["content"]], "chosen": [CHOSEN], "rejected": [REJECTED]}
    rows = [tokenize(data, tokenizer, tmp_path)[0] for data in (explicit, implicit)]
    assert rows[0] == rows[1]
    row = rows[0]
    # The prompt is what a model is given to reply: the template's rendering with the generation prompt.
    assert row["prompt_ids"] == tokenizer.apply_chat_template([SYSTEM, USER], add_generation_prompt=True,
                                                              tokenize=True, return_dict=True)["input_ids"]
    for reply, ids in ((CHOSEN, row["chosen_ids"]), (REJECTED, row["rejected_ids"])):
        assert tokenizer.decode(ids) == reply + "<|im_end|>\n"
        rendered = tokenizer.apply_chat_template([SYSTEM, USER, assistant(reply)], tokenize=False)
        assert tokenizer.decode(row["prompt_ids"] + ids) == rendered
    assert tokenizer.decode(row["prompt_ids"]).count("<|im_start|>") == 3, "no doubled start token"
    # Text is a user prompt and assistant replies (the template adds its default system line).
    plain = tokenize(text, tokenizer, tmp_path)[0]
    assert plain["chosen_ids"] == row["chosen_ids"] and "You are a helpful AI" in tokenizer.decode(plain["prompt_ids"])


def test_a_prompt_may_hold_earlier_turns_and_the_batch_holds_each_prompt_once_and_its_two_replies(tokenizer,
                                                                                                     tmp_path):
    history = [SYSTEM, USER, assistant("Team: billing\nWhich card?"), {"role": "user", "content": "The Visa one."}]
    tokenized = tokenize({"prompt": [history, [USER]], "chosen": [CHOSEN, CHOSEN], "rejected": [REJECTED, "No."]},
                         tokenizer, tmp_path)
    assert "Which card?" in tokenizer.decode(tokenized[0]["prompt_ids"])
    rows = [tokenized[i] for i in range(2)]
    batch = PromptRepliesCollator(pad_token_id=tokenizer.pad_token_id)(rows)
    assert batch["prompt_ids"].shape[0] == 2 and batch["reply_ids"].shape[0] == 4 and batch["index"].tolist() == [0, 1]
    for row in range(2):
        prompt = rows[row]["prompt_ids"]
        assert batch["prompt_ids"][row, :len(prompt)].tolist() == prompt
        assert batch["prompt_mask"][row].sum() == len(prompt)
    for position, (row, side) in enumerate([(0, "chosen_ids"), (0, "rejected_ids"), (1, "chosen_ids"),
                                            (1, "rejected_ids")]):
        reply = rows[row][side]
        assert batch["reply_ids"][position, :len(reply)].tolist() == reply
        assert batch["reply_mask"][position].sum() == len(reply)


def test_long_pairs_keep_the_prompt_and_the_start_of_both_replies(tokenizer, tmp_path):
    prompt_length = len(tokenize({"prompt": [[USER]], "chosen": ["a"], "rejected": ["b"]}, tokenizer,
                                 tmp_path)[0]["prompt_ids"])
    rows = {"prompt": [[USER]] * 2, "chosen": [CHOSEN, "Ok."], "rejected": ["Fine.", REJECTED * 3]}
    full = tokenize(rows, tokenizer, tmp_path)
    cut = tokenize(rows, tokenizer, tmp_path, max_length=prompt_length + 3)
    for row in range(2):
        assert cut[row]["prompt_ids"] == full[row]["prompt_ids"]
        for side in ("chosen_ids", "rejected_ids"):
            assert cut[row][side] == full[row][side][:3] and len(cut[row][side]) >= 1
        assert cut[row]["length"] == prompt_length + 6 and cut[row]["cut"] and not full[row]["cut"]
    one = tokenize(rows, tokenizer, tmp_path, max_length=prompt_length + 1)
    assert [len(one[0]["chosen_ids"]), len(one[0]["rejected_ids"])] == [1, 1]
    with pytest.raises(UserError, match=rf"train row 1: the prompt takes {prompt_length} tokens, which leaves no room "
                                        rf"for a reply within --max_seq_length {prompt_length}; raise"):
        tokenize(rows, tokenizer, tmp_path, max_length=prompt_length)


BAD = {
    "no chosen column": ({"prompt": ["hi"], "answer": ["a"], "rejected": ["b"]}, "no 'chosen' and 'rejected' columns"),
    "an empty reply": ({"prompt": ["hi", "hi"], "chosen": ["a", "  "], "rejected": ["b", "c"]},
                       "train row 2: the chosen reply is empty"),
    "a reply that is a user turn": ({"prompt": ["hi"], "chosen": [[assistant("a")]],
                                     "rejected": [[{"role": "user", "content": "b"}]]},
                                    "train row 1: the rejected reply must be one assistant turn, not user"),
    "two reply turns": ({"prompt": ["hi"], "chosen": [[assistant("a"), assistant("b")]],
                         "rejected": [[assistant("c")]]},
                        "the chosen reply must be one assistant turn, not assistant, assistant"),
    "prompts that differ": ({"chosen": [[USER, assistant("a")]],
                             "rejected": [[{"role": "user", "content": "other"}, assistant("b")]]},
                            "train row 1: chosen and rejected differ at message 1, before their last turn"),
    "conversations ending in a user turn": ({"chosen": [[USER, assistant("a"), USER]], "rejected": [[USER]]},
                                            "the chosen reply must be one assistant turn, not user"),
    "an empty prompt": ({"prompt": [[]], "chosen": ["a"], "rejected": ["b"]}, "train row 1: the prompt is empty"),
    "an unknown role": ({"prompt": [[{"role": "bot", "content": "hi"}]], "chosen": ["a"], "rejected": ["b"]},
                        "train row 1, message 1: unknown role 'bot'"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_rows_are_refused_naming_the_row(tokenizer, tmp_path, case):
    rows, expected = BAD[case]
    with pytest.raises(UserError, match=expected.replace("(", r"\(").replace(")", r"\)")):
        tokenize(rows, tokenizer, tmp_path)


def test_the_losses_rewards_metrics_and_predictions(tmp_path):
    policy = torch.tensor([[-10.0, -14.0], [-20.0, -18.0]])
    reference = torch.tensor([[-12.0, -12.0], [-19.0, -19.0]])
    counts = torch.tensor([[4, 2], [5, 3]])
    losses, rewards = dpo_loss(policy, reference, counts, "sigmoid", beta=0.5)
    torch.testing.assert_close(rewards, torch.tensor([[1.0, -1.0], [-0.5, 0.5]]))
    torch.testing.assert_close(losses, torch.tensor([math.log1p(math.exp(-2.0)), math.log1p(math.exp(1.0))]))
    robust, _ = dpo_loss(policy, reference, counts, "robust", beta=0.5, label_smoothing=0.1)
    margins = torch.tensor([2.0, -1.0])
    expected = (0.9 * -torch.nn.functional.logsigmoid(margins) + 0.1 * torch.nn.functional.logsigmoid(-margins)) / 0.8
    torch.testing.assert_close(robust, expected)
    assert torch.equal(dpo_loss(policy, reference, counts, "robust", beta=0.5)[0], losses)
    # IPO on means over each reply's tokens: (2/4 - (-2)/2 - 1/(2 x 0.5))^2, ((-1)/5 - 1/3 - 1)^2
    ipo, _ = dpo_loss(policy, reference, counts, "ipo", beta=0.5)
    torch.testing.assert_close(ipo, torch.tensor([(0.5 + 1 - 1) ** 2, (-0.2 - 1 / 3 - 1) ** 2]))
    figures = pair_figures(policy, rewards)
    assert {k: v.item() for k, v in figures.items()} == {
        "rewards_chosen": 0.5, "rewards_rejected": -0.5, "rewards_margin": 1.0, "rewards_accuracy": 1.0,
        "logps_chosen": -30.0, "logps_rejected": -32.0}
    metrics = pair_metrics(policy, reference, counts, "sigmoid", beta=0.5)
    assert metrics == {"loss": pytest.approx(losses.mean().item()), "rewards_chosen": 0.25, "rewards_rejected": -0.25,
                       "rewards_margin": 0.5, "rewards_accuracy": 0.5, "logps_chosen": -15.0, "logps_rejected": -16.0}
    write_pair_predictions(str(tmp_path / "predictions.jsonl"), policy, reference, beta=0.5)
    lines = [json.loads(line) for line in (tmp_path / "predictions.jsonl").read_text().splitlines()]
    assert [(p["index"], p["rewards_margin"], p["reference_logps_rejected"]) for p in lines] == [(0, 2.0, -12.0),
                                                                                               (1, -1.0, -19.0)]


@pytest.mark.parametrize("lora", [True, False])
def test_at_step_0_the_loss_is_ln_2_and_every_reward_0(tokenizer, tmp_path, lora):
    """In training mode, LoRA dropout on: the reference is exactly the policy before its first update."""
    model = tiny_model(tokenizer)
    if lora:
        model = add_lora(model, 8, 16, 0.5, "all-linear")
    model.train()
    data = pairs_dataset(tokenizer, tmp_path)
    batch = PromptRepliesCollator(tokenizer.pad_token_id)(data.__getitems__(range(len(data))))
    batch.pop("index")
    reference = Reference(model).pair_log_probs(model, batch)
    assert model.training and all(m.training for m in model.modules()), "the reference leaves training mode as it was"
    policy, counts = pair_log_probs(model, batch)
    losses, rewards = dpo_loss(policy, reference, counts, "sigmoid", beta=0.1)
    assert torch.equal(rewards, torch.zeros_like(rewards))
    assert losses.tolist() == [pytest.approx(math.log(2), abs=1e-7)] * len(data)
    losses.sum().backward()  # the policy's side has a graph, the reference's none
    assert reference.grad_fn is None


def test_the_reference_is_the_model_before_training_with_lora_or_without(tokenizer, tmp_path):
    data = pairs_dataset(tokenizer, tmp_path)
    batch = PromptRepliesCollator(tokenizer.pad_token_id)(data.__getitems__(range(len(data))))
    batch.pop("index")
    base = tiny_model(tokenizer).eval()
    with torch.no_grad():
        before = pair_log_probs(base, batch)[0]
    for lora in (True, False):
        policy = add_lora(tiny_model(tokenizer), 8, 16, 0.0, "all-linear") if lora else tiny_model(tokenizer)
        reference = Reference(policy)
        with torch.no_grad():  # as if trained: every trainable weight moved
            for parameter in policy.parameters():
                if parameter.requires_grad:
                    parameter.add_(0.05 * torch.randn_like(parameter))
        moved = pair_log_probs(policy.eval(), batch)[0]
        assert (moved - before).abs().min() > 1e-3
        torch.testing.assert_close(reference.pair_log_probs(policy, batch), before, rtol=0, atol=1e-5)
        # a few pairs a pass, as evaluation runs it (sums of about -240: float32 rounds them to 1.5e-5)
        torch.testing.assert_close(reference.shared_prompt_log_probs(policy, batch, max_tokens=200), before,
                                   rtol=2e-7, atol=1e-5)


def test_summed_log_probabilities_and_their_gradient_equal_trl_s_on_whole_rows(tokenizer, tmp_path):
    """Each prompt runs once for both replies; TRL's DPOTrainer runs each reply after its own copy of the prompt.
    The sums agree, and so does the gradient they give the adapters."""
    from trl.trainer.utils import add_fused_lm_head

    data = pairs_dataset(tokenizer, tmp_path)
    pairs = data.__getitems__(range(len(data)))
    batch = PromptRepliesCollator(tokenizer.pad_token_id)(pairs)
    batch.pop("index")
    model = add_lora(tiny_model(tokenizer), 8, 16, 0.0, "all-linear")
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "lora_B" in name:
                parameter.normal_(std=0.05)
    ours, counts = pair_log_probs(model, batch)
    weights = torch.rand(len(data), 2, generator=torch.Generator().manual_seed(0)) - 0.5
    (ours * weights).sum().backward()
    ours_grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    # TRL's DPOTrainer: every chosen row, then every rejected row, each prompt + reply; labels on the reply
    whole = whole_rows_batch([(p["prompt_ids"], p[side]) for side in ("chosen_ids", "rejected_ids") for p in pairs])
    add_fused_lm_head(model.get_base_model())
    log_probs = model(input_ids=whole["input_ids"], attention_mask=whole["attention_mask"], labels=whole["labels"],
                      fused_lm_head=True).log_probs
    theirs = log_probs.sum(1).view(2, -1).T
    (theirs * weights).sum().backward()
    assert ours.shape == (len(data), 2) and torch.equal(counts, (whole["labels"] != -100).sum(1).view(2, -1).T)
    # sums of about -80, added in another order: float32 rounds them by up to 1.5e-5 (a token more would be 1e-1)
    torch.testing.assert_close(ours.detach(), theirs.detach(), rtol=2e-7, atol=1e-5)
    assert len({round(v, 3) for v in ours.flatten().tolist()}) == 2 * len(data), "the pairs differ"
    theirs_grads = {name: p.grad for name, p in model.named_parameters() if p.grad is not None}
    assert ours_grads.keys() == theirs_grads.keys() and len(ours_grads) > 4
    for name, grad in ours_grads.items():
        torch.testing.assert_close(grad, theirs_grads[name], rtol=1e-4, atol=1e-6,
                                   msg=lambda message, name=name: f"{name}: {message}")


def test_a_precomputed_reference_equals_the_live_one_and_is_read_back(tokenizer, tmp_path, monkeypatch):
    data = pairs_dataset(tokenizer, tmp_path, count=7)
    # Each pair longer than the one before: computed longest first, the table must come back in pair order.
    assert list(data.lengths) == sorted(set(data.lengths))
    shared = PromptRepliesCollator(tokenizer.pad_token_id)
    policy = add_lora(tiny_model(tokenizer), 8, 16, 0.0, "all-linear")
    reference = Reference(policy)
    path = tmp_path / "ref.safetensors"
    table = precomputed_reference(reference, policy, data, shared, batch_size=3, max_tokens=200, path=path, key="a")
    batch = shared(data.__getitems__(range(7)))
    batch.pop("index")
    # within 1e-5, and float32's rounding of sums of about -240 (1.5e-5) between batches of other shapes
    torch.testing.assert_close(table, reference.pair_log_probs(policy, batch), rtol=2e-7, atol=1e-5)
    assert path.is_file()

    def not_again(*args, **kwargs):
        raise AssertionError("recomputed")

    monkeypatch.setattr(Reference, "shared_prompt_log_probs", not_again)
    assert torch.equal(precomputed_reference(reference, policy, data, shared, 3, 200, path, key="a"), table)
    with pytest.raises(AssertionError, match="recomputed"):  # another model or data: not reused
        precomputed_reference(reference, policy, data, shared, 3, 200, path, key="b")


def test_an_adapter_folder_loads_as_its_base_with_the_adapter_folded_in(tokenizer, tmp_path):
    base_folder = tmp_path / "base"
    tiny_model(tokenizer).save_pretrained(base_folder)
    adapted = add_lora(AutoModelForCausalLM.from_pretrained(base_folder), 8, 16, 0.0, "all-linear")
    with torch.no_grad():
        for name, parameter in adapted.named_parameters():
            if "lora_B" in name:
                parameter.normal_(std=0.1)
    adapted.save_pretrained(tmp_path / "adapter")
    loaded = load_causal_lm(str(tmp_path / "adapter"))
    assert not hasattr(loaded, "peft_config")
    ids = torch.tensor([[1, 50, 60, 70, 80]])
    with torch.no_grad():
        expected = adapted.eval()(input_ids=ids).logits
        assert (expected - AutoModelForCausalLM.from_pretrained(base_folder)(input_ids=ids).logits).abs().max() > 1e-3
        torch.testing.assert_close(loaded(input_ids=ids).logits, expected, rtol=0, atol=1e-5)


def test_a_ddp_wrapper_does_not_hide_the_adapters_from_the_reference(tokenizer, tmp_path):
    """DDP has no ``disable_adapter``: the reference switches the adapters off on the model inside it."""
    import torch.distributed as dist
    from helpers import free_port
    from torch.nn.parallel import DistributedDataParallel

    data = pairs_dataset(tokenizer, tmp_path)
    batch = PromptRepliesCollator(tokenizer.pad_token_id)(data.__getitems__(range(len(data))))
    batch.pop("index")
    with torch.no_grad():
        base = pair_log_probs(tiny_model(tokenizer).eval(), batch)[0]
    policy = add_lora(tiny_model(tokenizer), 8, 16, 0.1, "all-linear")
    with torch.no_grad():
        for name, parameter in policy.named_parameters():
            if "lora_B" in name:
                parameter.normal_(std=0.1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        wrapped = DistributedDataParallel(policy.train())
        assert not hasattr(wrapped, "disable_adapter")
        reference = Reference(policy).pair_log_probs(wrapped, batch)
        table = precomputed_reference(Reference(policy), wrapped, data, PromptRepliesCollator(tokenizer.pad_token_id),
                                      4, 10**6, tmp_path / "ref.safetensors", key="k")
    finally:
        dist.destroy_process_group()
    torch.testing.assert_close(reference, base, rtol=0, atol=1e-5)
    torch.testing.assert_close(table, base, rtol=2e-7, atol=1e-5)
    assert (pair_log_probs(policy.eval(), batch)[0] - base).abs().min() > 1e-3, "the adapters are on again"


def test_a_reply_of_megabytes_is_cut_before_it_is_tokenized(tokenizer, tmp_path, monkeypatch):
    """The pair's texts are cut before they are tokenized: a chosen reply of megabytes keeps the tokens of one
    short enough to tokenize whole, and no text much longer than what is kept reaches the tokenizer."""

    def rows(reply_repeats):
        return {"prompt": [[USER]], "chosen": [[assistant("Sorry for the wait. " * reply_repeats)]],
                "rejected": [[assistant("Noted.")]]}

    short = tokenize(rows(100), tokenizer, tmp_path, max_length=64)
    longest = note_longest_texts(monkeypatch)
    huge = tokenize(rows(100_000), tokenizer, tmp_path, max_length=64)
    assert short[0]["cut"] and len(short[0]["prompt_ids"]) + len(short[0]["chosen_ids"]) == 64
    for column in ("prompt_ids", "chosen_ids", "rejected_ids"):
        assert huge[0][column] == short[0][column], column
    assert max(longest) <= 16 * 64, "no text longer than 16 characters a kept token reached the tokenizer"


def test_the_reference_key_follows_the_weights_configuration_and_precision_not_the_path(tokenizer, tmp_path):
    """A model retrained in place (the same folder, new weights) or run in another precision gets another key; the
    same folder loaded again gets the same key."""
    folder, data = tmp_path / "model", tmp_path / "cache-abc"
    tiny_model(tokenizer).save_pretrained(folder)
    key = reference_key(AutoModelForCausalLM.from_pretrained(folder), "no", data)
    assert reference_key(AutoModelForCausalLM.from_pretrained(folder), "no", data) == key
    assert reference_key(AutoModelForCausalLM.from_pretrained(folder), "bf16", data) != key
    assert reference_key(AutoModelForCausalLM.from_pretrained(folder), "no", tmp_path / "cache-def") != key
    retrained = AutoModelForCausalLM.from_pretrained(folder)
    with torch.no_grad():
        next(retrained.parameters())[0, 0] += 1e-3
    retrained.save_pretrained(folder)
    assert reference_key(AutoModelForCausalLM.from_pretrained(folder), "no", data) != key, "weights retrained in place"
    reconfigured = AutoModelForCausalLM.from_pretrained(folder)
    before = reference_key(reconfigured, "no", data)
    reconfigured.config.attention_dropout = 0.1
    assert reference_key(reconfigured, "no", data) != before, "the configuration"


def test_a_pair_with_tools_and_a_reasoning_reply_trains_the_reasoning(tokenizer, tmp_path):
    """Every key of a reply reaches the template, and a tools column goes to it: with Qwen3's template the chosen
    reply's tokens hold its reasoning, and the prompt holds the tool list."""
    import copy

    from trl import chat_templates

    qwen3 = copy.deepcopy(tokenizer)
    qwen3.chat_template = (Path(chat_templates.__path__[0]) / "qwen3.jinja").read_text()
    schema = {"type": "function", "function": {"name": "refund", "description": "Refund an order.",
                                               "parameters": {"type": "object", "properties": {}}}}
    rows = {"prompt": [[USER]], "tools": [json.dumps([schema])],
            "chosen": [[{"role": "assistant", "content": CHOSEN, "reasoning_content": "The charge is doubled."}]],
            "rejected": [[assistant(REJECTED)]]}
    pair = tokenize(rows, qwen3, tmp_path)[0]
    assert "Refund an order." in qwen3.decode(pair["prompt_ids"])
    assert "The charge is doubled." in qwen3.decode(pair["chosen_ids"])
    assert "The charge is doubled." not in qwen3.decode(pair["rejected_ids"])
