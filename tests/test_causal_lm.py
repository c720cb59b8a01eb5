"""Label log-probabilities in chunks of positions, evaluation and replies within a token budget."""

from __future__ import annotations

import functools

import pytest
import torch
from helpers import VOCAB, padded_batch, tiny_causal_lm, whole_rows_batch
from transformers import CohereConfig, Gemma2Config, GraniteConfig, LlamaConfig

from finetune.errors import UserError
from finetune.models.lora import add_lora
from finetune.tasks.causal_lm import (
    check_output_layer,
    greedy_replies,
    label_log_probs,
    reply_log_probs,
    shared_prompt_log_probs,
    split_by_tokens,
    summed_log_probs,
)
from finetune.tasks.chat import IGNORE

CONFIGS = [LlamaConfig, Gemma2Config, functools.partial(Gemma2Config, sliding_window=4)]
"""Llama's layers attend to every column before; Gemma 2's alternate with a sliding window (4,096 columns; then 4,
which the padding after a short prompt would fill: the replies to a prompt run once must run on from their own)."""


def whole_batch_log_probs(model, batch: dict) -> torch.Tensor:
    """The log-probabilities from the model's own logits over the whole batch (what the chunks replace)."""
    labels = batch["labels"][:, 1:]
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits[:, :-1]
    log_probs = -torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), reduction="none",
                                                   ignore_index=IGNORE)
    return log_probs.view_as(labels)


@pytest.mark.parametrize("kind", ["tied embeddings, every weight trains", "separate output layer", "LoRA"])
def test_chunked_log_probs_and_their_gradients_equal_the_whole_batch_s(kind):
    model = tiny_causal_lm(tie_word_embeddings=kind != "separate output layer")
    if kind == "LoRA":
        model = add_lora(model, 4, 8, 0.0, "all-linear")
        for name, weight in model.named_parameters():  # adapters that change the model, as after some training
            if "lora_B" in name:
                torch.nn.init.normal_(weight, std=0.02)
    batch = padded_batch()
    # Weighted per token and per row, as a preference loss weighs replies: any weighting is exact.
    weights = torch.rand(batch["labels"][:, 1:].shape, generator=torch.Generator().manual_seed(2)) - 0.5

    expected = whole_batch_log_probs(model, batch)
    (expected * weights).sum().backward()
    expected_grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    log_probs, labels = label_log_probs(model, dict(batch), chunk_size=7)  # 4 chunks of the 26 labelled positions
    (log_probs * weights).sum().backward()

    assert torch.equal(labels, batch["labels"][:, 1:]) and log_probs.dtype == torch.float32
    assert (labels != IGNORE).sum() == 26 and torch.all(log_probs[labels == IGNORE] == 0)
    torch.testing.assert_close(log_probs, expected, rtol=0, atol=1e-6)
    grads = {name: p.grad for name, p in model.named_parameters() if p.grad is not None}
    assert grads.keys() == expected_grads.keys() and len(grads) > 4
    for name, grad in grads.items():
        torch.testing.assert_close(grad, expected_grads[name], rtol=0, atol=1e-6,
                                   msg=lambda message, name=name: f"{name}: {message}")


def test_no_tensor_of_vocabulary_width_is_kept_for_the_backward_pass():
    """Each chunk's logits are recomputed in the backward pass: only the whole-batch way keeps logits."""
    model = tiny_causal_lm()
    parameters = {p.data_ptr() for p in model.parameters()}

    def kept_widths(compute) -> set:
        widths = set()

        def pack(tensor):
            if tensor.data_ptr() not in parameters:
                widths.add(tensor.shape[-1] if tensor.dim() else 0)
            return tensor

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
            compute(model, padded_batch())
        return widths

    assert VOCAB not in kept_widths(lambda m, b: label_log_probs(m, b, chunk_size=7))
    assert VOCAB in kept_widths(whole_batch_log_probs)


def test_a_packed_row_gives_the_log_probs_of_its_examples_alone():
    model = tiny_causal_lm()
    batch = padded_batch(lengths=(7, 5))
    rows = [{k: v[i:i + 1, :n] for k, v in batch.items()} for i, n in enumerate((7, 5))]
    labels = torch.cat([rows[0]["labels"], rows[1]["labels"]], 1)
    labels[0, 7] = IGNORE  # the collator's separator: no example predicts another's first token
    packed = {"input_ids": torch.cat([r["input_ids"] for r in rows], 1), "labels": labels,
              "position_ids": torch.cat([torch.arange(7), torch.arange(5)])[None]}
    with torch.no_grad():
        ours = label_log_probs(model, packed)[0]
        alone = [label_log_probs(model, dict(row))[0] for row in rows]
    torch.testing.assert_close(ours[0, :6], alone[0][0], rtol=0, atol=1e-5)
    torch.testing.assert_close(ours[0, 7:], alone[1][0], rtol=0, atol=1e-5)
    assert ours[0, 6] == 0


@pytest.mark.parametrize("config_class, field", [(Gemma2Config, "final_logit_softcapping"),
                                                 (CohereConfig, "logit_scale")])
def test_models_that_change_their_logits_get_their_own_log_probs(config_class, field):
    model = tiny_causal_lm(config_class, **{field: 0.5})
    check_output_layer(model)
    batch = padded_batch()
    with torch.no_grad():
        torch.testing.assert_close(label_log_probs(model, dict(batch), chunk_size=7)[0],
                                   whole_batch_log_probs(model, batch), rtol=0, atol=1e-6)


def test_a_model_that_scales_its_logits_otherwise_is_refused():
    with pytest.raises(UserError, match="granite models scale their logits by logits_scaling"):
        check_output_layer(tiny_causal_lm(GraniteConfig, logits_scaling=4.0))


def test_evaluation_is_the_same_whatever_the_token_budget():
    model = tiny_causal_lm()
    batch = padded_batch()
    lengths = batch["attention_mask"].sum(1).tolist()
    for budget in (1, 24, 40, 10_000):
        parts = list(split_by_tokens(batch, budget))
        assert sum(len(p["input_ids"]) for p in parts) == len(lengths)
        for part in parts:  # within the budget, or one row alone, and no column that only pads
            assert part["input_ids"].numel() <= budget or len(part["input_ids"]) == 1
            assert part["attention_mask"][:, -1].any()
    assert [len(p["input_ids"]) for p in split_by_tokens(batch, 24)] == [2, 2, 1]  # 2 x 11, 2 x 12, 1 x 6
    with torch.no_grad():
        expected = whole_batch_log_probs(model, batch)
        for budget in (1, 24, 10_000):
            sums, counts = summed_log_probs(model, batch, budget)
            torch.testing.assert_close(sums, expected.sum(1), rtol=0, atol=1e-6)
            assert counts.tolist() == [n - 3 for n in lengths]


@pytest.mark.parametrize("config_class", CONFIGS, ids=["llama", "gemma2", "gemma2-window-4"])
def test_a_prompt_run_once_for_its_replies_scores_them_as_whole_rows_do(config_class):
    model = tiny_causal_lm(config_class)
    generator = torch.Generator().manual_seed(2)

    def tokens(n):
        return torch.randint(1, VOCAB, (n,), generator=generator).tolist()

    prompts = [tokens(n) for n in (9, 3, 14, 6)]
    replies = [[tokens(a), tokens(b), tokens(c)] for a, b, c in ((4, 1, 7), (10, 2, 2), (1, 1, 5), (3, 8, 6))]
    rows = [(prompt, reply) for prompt, options in zip(prompts, replies, strict=True) for reply in options]
    batch = whole_rows_batch(rows)
    prompt_ids, prompt_mask = right_padded(prompts)
    reply_ids, reply_mask = right_padded([reply for options in replies for reply in options])
    shared = {"prompt_ids": prompt_ids, "prompt_mask": prompt_mask, "reply_ids": reply_ids, "reply_mask": reply_mask}
    with torch.no_grad():
        whole_rows = whole_batch_log_probs(model, batch).sum(1).view(len(prompts), 3)
        for budget in (1, 60, 10_000):  # a prompt a pass, two, all
            torch.testing.assert_close(shared_prompt_log_probs(model, shared, budget), whole_rows, rtol=0, atol=2e-5)


@pytest.mark.parametrize("config_class", CONFIGS, ids=["llama", "gemma2", "gemma2-window-4"])
def test_replies_trained_from_their_prompt_s_shared_pass_get_the_whole_rows_log_probs_and_gradients(config_class):
    """GRPO's layout: a prompt run once for its completions, 1 to 3 of them, of lengths 1 to 7, in training mode
    with LoRA; per-token log-probabilities and the gradient of any weighting of them equal whole rows'."""
    model = add_lora(tiny_causal_lm(config_class), 4, 8, 0.0, "all-linear").train()
    for name, weight in model.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(weight, std=0.02)
    generator = torch.Generator().manual_seed(3)

    def tokens(n):
        return torch.randint(1, VOCAB, (n,), generator=generator).tolist()

    prompts = [tokens(n) for n in (9, 3, 14, 6)]
    replies = [[tokens(n) for n in lengths] for lengths in ((4, 1, 7), (2,), (1, 5), (3, 6, 6))]
    prompt_of = torch.tensor([p for p, options in enumerate(replies) for _ in options])
    rows = [(prompts[p], reply) for p, options in enumerate(replies) for reply in options]
    whole = whole_rows_batch(rows)
    weights = torch.rand(len(rows), 7, generator=generator) - 0.5

    expected_rows, labels = label_log_probs(model, dict(whole), temperature=0.7)
    starts = [len(prompt) - 1 for prompt, _ in rows]  # the position predicting each reply's first token
    expected = torch.stack([torch.nn.functional.pad(row[start:start + len(reply)], (0, 7 - len(reply)))
                            for row, start, (_, reply) in zip(expected_rows, starts, rows, strict=True)])
    (expected * weights).sum().backward()
    expected_grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    prompt_ids, prompt_mask = right_padded(prompts)
    reply_ids, reply_mask = right_padded([reply for _, reply in rows])
    reply_ids, reply_mask = (torch.nn.functional.pad(t, (0, 7 - t.shape[1])) for t in (reply_ids, reply_mask))
    log_probs = reply_log_probs(model, {"prompt_ids": prompt_ids, "prompt_mask": prompt_mask, "reply_ids": reply_ids,
                                        "reply_mask": reply_mask, "prompt_of": prompt_of}, temperature=0.7)
    (log_probs * weights).sum().backward()

    assert log_probs.shape == (9, 7) and torch.all(log_probs[reply_mask == 0] == 0)
    assert torch.all(log_probs[reply_mask == 1] < 0)
    torch.testing.assert_close(log_probs, expected, rtol=0, atol=2e-5)
    grads = {name: p.grad for name, p in model.named_parameters() if p.grad is not None}
    assert grads.keys() == expected_grads.keys() and len(grads) > 4
    for name, grad in grads.items():
        torch.testing.assert_close(grad, expected_grads[name], rtol=1e-4, atol=1e-6,
                                   msg=lambda message, name=name: f"{name}: {message}")


def right_padded(rows: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(map(len, rows))
    return (torch.tensor([row + [0] * (width - len(row)) for row in rows]),
            torch.tensor([[1] * len(row) + [0] * (width - len(row)) for row in rows]))


class Tokenizer:
    pad_token_id, eos_token_id = 0, 7


def test_greedy_replies_are_the_same_whatever_the_token_budget():
    model = tiny_causal_lm(initializer_range=0.2)  # weights far from 0 keep the greedy choice clear of near-ties
    generator = torch.Generator().manual_seed(3)
    prompts = [torch.randint(8, VOCAB, (n,), generator=generator).tolist() for n in (5, 9, 3, 6)]
    index = torch.tensor([2, 0, 4, 1, 3])  # example 4 has no prompt: no reply
    with torch.no_grad():
        alone = [model.generate(torch.tensor([p]), max_new_tokens=6, do_sample=False, pad_token_id=0)[0, len(p):]
                 for p in prompts]
        for budget in (1, 24, 10_000):
            replies = greedy_replies(model, index, prompts, Tokenizer(), 6, budget)
            assert replies.shape == (5, 6) and torch.all(replies[2] == IGNORE)
            for row, i in ((0, 2), (1, 0), (3, 1), (4, 3)):
                reply = alone[i].masked_fill((alone[i] == Tokenizer.eos_token_id).cumsum(0) > 0, IGNORE).tolist()
                assert replies[row].tolist() == reply + [IGNORE] * (6 - len(reply)), (budget, row)
