"""What a model keeps in memory while it trains: activation checkpointing of its layers, and 4-bit frozen base
weights (QLoRA) through bitsandbytes."""

from __future__ import annotations

import torch

from finetune.errors import UserError

__all__ = ["checkpoint_activations", "dequantize_into", "four_bit_loading", "is_four_bit", "keep_four_bit_trainable",
           "require_bitsandbytes"]


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


def require_bitsandbytes() -> None:
    """Raises ``UserError`` naming the extra to install when bitsandbytes is missing."""
    import importlib.util

    if importlib.util.find_spec("bitsandbytes") is None:
        raise UserError('--load_in_4bit needs bitsandbytes: pip install -e ".[qlora]" (or pip install '
                        'bitsandbytes), or leave the flag off')


def four_bit_loading(compute_dtype: torch.dtype) -> dict:
    """``from_pretrained``'s keyword arguments for QLoRA's frozen base: every linear layer but the output head
    in 4-bit NF4 with double quantization, computing in ``compute_dtype``; on a GPU, loaded straight onto this
    process's device (bitsandbytes quantizes as the weights arrive there)."""
    import transformers

    config = transformers.BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                                             bnb_4bit_use_double_quant=True, bnb_4bit_compute_dtype=compute_dtype)
    placement = {"device_map": {"": torch.cuda.current_device()}} if torch.cuda.is_available() else {}
    return {"quantization_config": config, **placement}


def is_four_bit(model: torch.nn.Module) -> bool:
    """Whether ``model`` (or the model under its adapters) holds 4-bit bitsandbytes weights."""
    return any(hasattr(parameter, "quant_state") for parameter in model.parameters())


def keep_four_bit_trainable(model: torch.nn.Module) -> None:
    """Keep every 4-bit layer of ``model`` on the kernels that training differentiates through.

    On a CPU with bfloat16 instructions, bitsandbytes repacks a layer's weight for a faster kernel the first time
    the layer runs in eval mode without gradients (an evaluation, the reference's pass), and computes through that
    kernel from then on, training too: it has no backward, so the gradients through the frozen layers after the
    first evaluation would be silently wrong (and it computes in bfloat16).
    """
    for module in model.modules():
        if hasattr(module, "support_avx512bf16_for_cpu"):
            module.support_avx512bf16_for_cpu = False


def dequantize_into(quantized: torch.nn.Module, model: torch.nn.Module) -> None:
    """Copy each 4-bit weight of ``quantized`` (a model under peft's adapters, or a plain one), dequantized, over the
    same weight of ``model``, the same architecture in full precision: ``model`` then computes what ``quantized``
    does, as its layers compute in float32."""
    import bitsandbytes

    for name, parameter in quantized.named_parameters():
        if hasattr(parameter, "quant_state"):
            target = model.get_parameter(name.replace("base_model.model.", "", 1).replace(".base_layer", ""))
            weight = bitsandbytes.functional.dequantize_4bit(parameter.data, parameter.quant_state)
            with torch.no_grad():
                target.copy_(weight.reshape(target.shape))
