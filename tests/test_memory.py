"""What a model keeps for the backward pass: activation checkpointing keeps each layer's input only, and recomputes
the rest to the same values and gradients."""

from __future__ import annotations

import copy

import pytest
import torch
from helpers import padded_batch, tiny_causal_lm
from test_lora import adapted
from transformers.modeling_layers import GradientCheckpointingLayer

from finetune.errors import UserError
from finetune.models.memory import checkpoint_activations


def forward_backward(model, checkpointed: bool) -> tuple[int, torch.Tensor, dict[str, torch.Tensor]]:
    """The bytes kept between a forward pass over ``padded_batch`` and its backward pass (what autograd saves, and
    each checkpointed layer's input, which the recompute holds outside autograd), the loss, and the gradients; the
    random state seeded the same for every call."""
    model = copy.deepcopy(model)
    if checkpointed:
        checkpoint_activations(model)
    kept = 0

    def keep(tensor: torch.Tensor) -> torch.Tensor:
        nonlocal kept
        kept += tensor.numel() * tensor.element_size()
        return tensor

    layers = [module for module in model.modules()
              if isinstance(module, GradientCheckpointingLayer) and module.gradient_checkpointing]
    assert len(layers) == (2 if checkpointed else 0)  # the tiny model's two decoder layers

    def keep_input(module, args):
        keep(args[0])

    hooks = [layer.register_forward_pre_hook(keep_input) for layer in layers]
    torch.manual_seed(0)
    with torch.autograd.graph.saved_tensors_hooks(keep, lambda tensor: tensor):
        loss = model(**padded_batch()).loss
    for hook in hooks:
        hook.remove()
    loss.backward()
    return kept, loss.detach(), {name: p.grad for name, p in model.named_parameters() if p.requires_grad}


@pytest.mark.parametrize("lora_dropout", [None, 0.1], ids=["full", "lora-with-dropout"])
def test_checkpointed_layers_keep_a_fraction_and_recompute_the_same_loss_and_gradients(lora_dropout):
    """A frozen base under LoRA passes its layers inputs that need no gradient, where reentrant checkpointing
    would train nothing; the recompute draws dropout's masks again from the state the forward pass had."""
    model = tiny_causal_lm().train() if lora_dropout is None else adapted(lora_dropout)
    kept, loss, gradients = forward_backward(model, checkpointed=False)
    kept_checkpointed, loss_checkpointed, gradients_checkpointed = forward_backward(model, checkpointed=True)
    assert kept_checkpointed < 0.5 * kept, (kept_checkpointed, kept)
    assert torch.equal(loss_checkpointed, loss)
    assert gradients_checkpointed.keys() == gradients.keys() and len(gradients) > 0
    for name, gradient in gradients.items():
        torch.testing.assert_close(gradients_checkpointed[name], gradient, rtol=1e-6, atol=0, msg=name)


def test_a_model_that_cannot_recompute_its_layers_is_refused():
    class Plain(torch.nn.Module):
        supports_gradient_checkpointing = False

    with pytest.raises(UserError, match=r"--gradient_checkpointing: Plain cannot recompute its layers"):
        checkpoint_activations(Plain())
