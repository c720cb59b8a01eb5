"""LoRA adapters through peft: their options, adding them to a model, and saving the adapter (and, if asked, a
merged model)."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

import torch

from finetune.checkpointing.checkpoint import save_model
from finetune.config import arg
from finetune.distributed.fsdp import is_sharded
from finetune.errors import UserError
from finetune.models.memory import FOUR_BIT_BASE_FILE, dequantize_into, is_four_bit, random_state, replaying

__all__ = ["DropoutLinear", "LoraArguments", "add_lora", "save_adapter"]


@dataclass
class LoraArguments:
    """The adapters' options, for a recipe's dataclass to inherit (with its own ``use_lora``) and check in its
    ``__post_init__`` (``check_lora``)."""

    lora_r: int = arg(16, "LoRA rank.")
    lora_alpha: int = arg(32, "LoRA scaling numerator (the update is scaled by alpha / r).")
    lora_dropout: float = arg(0.05, "Dropout on the LoRA input.")
    lora_target_modules: str = arg("all-linear", "Comma-separated module names to adapt, or all-linear.")

    def check_lora(self) -> None:
        """Raises ``UserError`` for an option no adapter can train with."""
        if self.lora_r < 1:
            raise UserError(f"--lora_r is {self.lora_r}; the rank of an adapter is a positive whole number")
        if self.lora_alpha <= 0:
            raise UserError(f"--lora_alpha is {self.lora_alpha}; it scales the adapter's update by alpha / r, so "
                            "give a positive number (an alpha of 0 trains an adapter that changes nothing)")
        if not 0 <= self.lora_dropout < 1:
            raise UserError(f"--lora_dropout is {self.lora_dropout}; give the share of inputs dropped, in [0, 1)")


class _DroppedProjection(torch.autograd.Function):
    """``linear(dropout(x), weight)`` keeping ``x`` and the random state the dropout drew its mask from (a few KB)
    for the backward pass, which draws the same mask again and rebuilds the dropped input, instead of keeping the
    dropped copy or the mask."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, p: float) -> torch.Tensor:
        ctx.rng, ctx.p, ctx.scale = random_state(x.device), p, 1.0 / (1.0 - p)
        dropped, _ = torch.ops.aten.native_dropout(x, p, True)  # F.dropout's kernel: the same random draws
        ctx.save_for_backward(x, weight)
        return torch.nn.functional.linear(dropped, weight)

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        x, weight = ctx.saved_tensors
        with replaying(ctx.rng, x.device):
            dropped, mask = torch.ops.aten.native_dropout(x, ctx.p, True)
        dtype = grad_output.dtype  # under autocast, the forward's matmul ran in it
        grad_x = grad_weight = None
        if ctx.needs_input_grad[1]:
            grad_weight = grad_output.flatten(0, -2).T @ dropped.to(dtype).flatten(0, -2)
        del dropped  # before the input's gradient, which takes as much
        if ctx.needs_input_grad[0]:
            grad_x = (grad_output @ weight.to(dtype)).to(x.dtype)  # the dropout ran in x's dtype
            grad_x.mul_(mask).mul_(ctx.scale)  # native_dropout_backward's own steps, in place
        return grad_x, grad_weight, None


class DropoutLinear(torch.nn.Linear):
    """LoRA's A projection of its input after dropout, the dropped input rebuilt in the backward pass.

    peft applies dropout and then A, so autograd keeps a dropped copy of every adapted layer's input for the
    backward pass, beside the input itself where another layer keeps it: q, k and v keep three copies of one
    input. Here each layer keeps the input and the random state the mask was drawn from, and draws the mask again
    when its gradient is computed: what no dropout keeps (4,741 MiB instead of 8,134 for SmolLM2-135M at 8 x 512
    tokens and dropout 0.05, bench/kept_activations.py). Masks and values are peft's (the same kernel draws
    them)."""

    def __init__(self, projection: torch.nn.Linear, p: float):
        super().__init__(projection.in_features, projection.out_features, bias=False, device="meta")
        self.weight, self.p = projection.weight, p

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training:
            return super().forward(x)
        return _DroppedProjection.apply(x, self.weight, self.p)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, dropout={self.p}"


def add_lora(model, r: int, alpha: int, dropout: float, target_modules: str, task_type: str = "CAUSAL_LM"):
    """``model`` with LoRA adapters on ``target_modules`` (comma-separated module names, or ``all-linear``:
    every linear layer but the output head); only the adapters train. ``task_type`` is peft's wrapper:
    ``FEATURE_EXTRACTION`` for an encoder that returns hidden states. With ``dropout``, each adapter keeps its
    dropout's mask for the backward pass, not a dropped copy of its input (``DropoutLinear``).

    Raises:
        UserError: the names match no layer of the model.
    """
    from peft import LoraConfig, get_peft_model
    from peft.tuners.lora import LoraLayer

    targets = target_modules if target_modules == "all-linear" else [n.strip() for n in target_modules.split(",")]
    config = LoraConfig(r=r, lora_alpha=alpha, lora_dropout=dropout, target_modules=targets, task_type=task_type)
    try:
        model = get_peft_model(model, config)
    except ValueError as err:
        linear = sorted({name.rsplit(".", 1)[-1] for name, module in model.named_modules()
                         if type(module).__name__ == "Linear"})
        raise UserError(f"--lora_target_modules {target_modules}: {str(err).splitlines()[0][:160]}; this model's "
                        f"linear layers are {', '.join(linear)} (or use all-linear)") from None
    if dropout > 0:
        for layer in list(model.modules()):
            if isinstance(layer, LoraLayer):
                for name, projection in list(layer.lora_A.items()):
                    layer.lora_A[name] = DropoutLinear(projection, dropout)
                    layer.lora_dropout[name] = torch.nn.Identity()
    return model


def save_base_quantization(model, output_dir: str | os.PathLike) -> list[str]:
    """Beside the adapter of ``model``, where its base is held in 4 bits, the base's quantization
    (``FOUR_BIT_BASE_FILE``, which what merges the adapter later needs); returns the names of the files written."""
    if not is_four_bit(model):
        return []
    # the dtype its weights were quantized from (--dtype) changes their 4-bit codes
    weight = next(parameter for parameter in model.parameters() if hasattr(parameter, "quant_state"))
    quantization = {"dtype": str(weight.quant_state.dtype).removeprefix("torch."),
                    "quantization_config": model.get_base_model().config.quantization_config.to_dict()}
    with open(os.path.join(output_dir, FOUR_BIT_BASE_FILE), "w") as f:
        f.write(json.dumps(quantization, indent=2) + "\n")
    return [FOUR_BIT_BASE_FILE]


def save_adapter(model, state_dict: dict, tokenizer, output_dir: str, merge: bool) -> None:
    """Write the adapter (``adapter_config.json``, ``adapter_model.safetensors``; over a 4-bit base, its
    quantization too: ``FOUR_BIT_BASE_FILE``) and the tokenizer with its chat template; with ``merge``, also
    ``output_dir/merged``: the base model with the adapter folded in, which plain transformers loads (in float32
    where the base was held in 4 bits)."""
    had_card = os.path.exists(os.path.join(output_dir, "README.md"))
    model.save_pretrained(output_dir, state_dict=state_dict)  # peft keeps only the adapter's weights
    save_base_quantization(model, output_dir)
    if not had_card:  # peft writes a placeholder card; the loop writes the real one when pushing
        os.remove(os.path.join(output_dir, "README.md"))
    tokenizer.save_pretrained(output_dir)
    if merge:
        # Sharded weights are split across processes, and peft folds an adapter into 4-bit weights by quantizing
        # the sum again: merge into a full-precision copy on this process, holding the 4-bit weights dequantized
        # (the model that trained) where there are any.
        four_bit = is_four_bit(model)
        if is_sharded(model) or four_bit:
            from peft import PeftModel

            base = type(model.get_base_model()).from_pretrained(model.peft_config["default"].base_model_name_or_path,
                                                                dtype=torch.float32)
            if four_bit:
                dequantize_into(model, base)
            model = PeftModel.from_pretrained(base, output_dir)
        merged = model.merge_and_unload()
        save_model(merged, merged.state_dict(), tokenizer, os.path.join(output_dir, "merged"))
