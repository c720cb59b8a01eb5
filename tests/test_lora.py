"""LoRA's dropout keeping the random state of its mask, not a dropped copy of the input nor the mask: peft's values
and gradients, less kept."""

from __future__ import annotations

import torch
from helpers import TINY_LM_SIZES, padded_batch, tiny_causal_lm
from peft import LoraConfig, get_peft_model

from finetune.models.estimate import kept_for_backward
from finetune.models.lora import DropoutLinear, add_lora
from finetune.tasks.causal_lm import label_log_probs


def adapted(dropout: float, peft_only: bool = False):
    """The tiny model with LoRA on every linear layer; B made non-zero (as after some training) so that the
    dropout reaches every gradient. ``peft_only``: peft's own layers, as ``get_peft_model`` makes them."""
    model = tiny_causal_lm()
    if peft_only:
        model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, lora_dropout=dropout, target_modules="all-linear"))
    else:
        model = add_lora(model, 4, 8, dropout, "all-linear")
    generator = torch.Generator().manual_seed(3)
    for name, weight in model.named_parameters():
        if "lora_B" in name:
            weight.data.normal_(std=0.02, generator=generator)
    return model.train()


def two_steps(model) -> list:
    """Each of two forward and backward passes' log-probabilities and gradients, the random state seeded once."""
    torch.manual_seed(5)
    steps = []
    for _ in range(2):
        model.zero_grad()
        log_probs = label_log_probs(model, padded_batch())[0]
        log_probs.sum().backward()
        steps.append((log_probs, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}))
    return steps


def kept_bytes(model) -> int:
    """What one training forward keeps for the backward pass, counted as bench/kept_activations.py counts it."""
    return kept_for_backward(lambda: label_log_probs(model, padded_batch()), model)


def test_lora_dropout_gives_peft_s_log_probs_and_gradients_exactly_step_after_step():
    ours, peft_s = adapted(0.3), adapted(0.3, peft_only=True)
    assert sum(isinstance(m, DropoutLinear) for m in ours.modules()) == 14  # 7 layers x 2 blocks
    assert ours.state_dict().keys() == peft_s.state_dict().keys()  # the same adapter files

    for (our_log_probs, our_grads), (log_probs, grads) in zip(two_steps(ours), two_steps(peft_s), strict=True):
        assert torch.equal(our_log_probs, log_probs)
        assert our_grads.keys() == grads.keys() and len(grads) == 28
        for name, grad in grads.items():
            assert torch.equal(our_grads[name], grad), name
    # The masks were drawn: without dropout every adapter weight gets another gradient.
    (_, dropped), (_, undropped) = two_steps(adapted(0.3))[0], two_steps(adapted(0.0))[0]
    assert undropped.keys() == dropped.keys()
    assert not [name for name, grad in undropped.items() if torch.equal(grad, dropped[name])]


def test_dropout_keeps_no_tensor_beyond_what_no_dropout_keeps():
    """The masks are drawn again in the backward pass from the random state (5 KB a layer, no tensor kept)."""
    tokens = padded_batch()["input_ids"].numel()
    elements = 2 * tokens * (6 * TINY_LM_SIZES["hidden_size"] + TINY_LM_SIZES["intermediate_size"])
    ours, without_dropout = kept_bytes(adapted(0.3)), kept_bytes(adapted(0.0))
    assert ours == without_dropout
    # peft's own layers keep a dropped copy of each layer's input (4 bytes an element) and its mask (1 byte).
    assert kept_bytes(adapted(0.3, peft_only=True)) >= ours + 5 * elements


def test_evaluation_drops_nothing():
    with torch.no_grad():
        dropped = label_log_probs(adapted(0.3).eval(), padded_batch())[0]
        whole = label_log_probs(adapted(0.0).eval(), padded_batch())[0]
    assert torch.equal(dropped, whole)


def test_under_bf16_autocast_values_and_gradients_are_peft_s():
    """The GPU path's arithmetic, on a CPU: A runs in bf16 as autocast runs peft's, the dropout in float32."""
    ours, peft_s = adapted(0.3), adapted(0.3, peft_only=True)
    results = []
    for model in (ours, peft_s):
        torch.manual_seed(5)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            log_probs = label_log_probs(model, padded_batch())[0]
        log_probs.sum().backward()
        results.append((log_probs, {n: p.grad for n, p in model.named_parameters() if p.grad is not None}))
    (our_log_probs, our_grads), (log_probs, grads) = results
    assert torch.equal(our_log_probs, log_probs) and our_grads.keys() == grads.keys()
    for name, grad in grads.items():
        assert grad.dtype == torch.float32 and torch.equal(our_grads[name], grad), name
