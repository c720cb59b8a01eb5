"""What a model keeps in memory while it trains: activation checkpointing of its layers."""

from __future__ import annotations

import torch

from finetune.errors import UserError

__all__ = ["checkpoint_activations"]


def checkpoint_activations(model: torch.nn.Module) -> None:
    """Keep only each transformer layer's input in the forward pass and recompute the layer in the backward pass.

    Non-reentrant, through transformers' own layer wrapper: exact (dropout draws the same numbers again), works
    where the layer's input needs no gradient (a frozen base under LoRA), leaves passes without gradients (the
    reference, the sampling) as they were, and keeps FSDP2's hooks outside the recompute.

    Raises:
        UserError: the model's architecture cannot recompute its layers.
    """
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    if not getattr(base, "supports_gradient_checkpointing", False):
        raise UserError(f"--gradient_checkpointing: {type(base).__name__} cannot recompute its layers "
                        "(transformers has no activation checkpointing for it); leave the flag off")
    base.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
