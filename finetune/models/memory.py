"""What a model keeps in memory while it trains: activation checkpointing of its layers, their MLPs run a tile of
positions at a time, and 4-bit frozen base weights (QLoRA) through bitsandbytes."""

from __future__ import annotations

import contextlib
import contextvars
import functools
import inspect
import math
import re
from collections.abc import Iterator

import torch

from finetune.errors import UserError

__all__ = ["FOUR_BIT_BASE_FILE", "check_tiling", "checkpoint_activations", "dequantize_into", "four_bit_loading",
           "is_four_bit", "keep_four_bit_trainable", "keep_less", "random_state", "replaying",
           "require_bitsandbytes", "tile_mlps", "tiles_as_if_cut"]

FOUR_BIT_BASE_FILE = "base_quantization.json"
"""Beside an adapter that trained on a 4-bit base: the base's quantization (transformers' ``BitsAndBytesConfig``)
and the dtype its weights were quantized from, so that what merges it later folds it into the weights it trained
on, not the original ones."""


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


def check_tiling(tiled_mlp: bool, shards_weights: bool) -> None:
    """Raises ``UserError`` where ``--tiled_mlp`` meets weights sharded across the processes (FSDP, DeepSpeed
    ZeRO-3): a tile's backward pass takes its weights' gradients whole."""
    if tiled_mlp and shards_weights:
        raise UserError("--tiled_mlp with sharded weights (--fsdp, or an accelerate config with FSDP or DeepSpeed "
                        "ZeRO-3) is not supported; leave one of them out")


def keep_less(model: torch.nn.Module, gradient_checkpointing: bool | None, tiled_mlp: bool) -> None:
    """The memory options a run asked for, applied to its model: ``--gradient_checkpointing``, ``--tiled_mlp``."""
    if gradient_checkpointing:
        checkpoint_activations(model)
    if tiled_mlp:
        tile_mlps(model)


def tile_mlps(model: torch.nn.Module) -> None:
    """Run each transformer layer's MLP a tile of positions at a time where gradients are wanted, keeping only its
    input for the backward pass, which runs each tile's MLP again and takes its gradients there (Arctic Long
    Sequence Training's tiled MLP). The MLP's intermediate activations, its widest, are then a tile's at most: on
    long rows the largest share of what a recomputed layer holds, for a third forward of the MLP.

    The norm whose output the MLP alone reads (Llama's post-attention norm) runs inside the tiles too, so its
    output is never whole either. A tile is as many positions as the model's hidden size (so a tile's intermediate
    activations are four tensors each the size of one of the MLP's weights); a micro-batch with no more positions
    runs the MLP whole. The same function of each position, so the same outputs; gradients summed tile by tile
    (float32: within 1e-6).

    Raises:
        UserError: the model's layers (those transformers can wrap) hold no ``mlp``, or route tokens to experts.
    """
    from transformers.modeling_layers import GradientCheckpointingLayer

    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    config = base.config.get_text_config()
    layers = [layer for layer in base.modules()
              if isinstance(layer, GradientCheckpointingLayer) and isinstance(getattr(layer, "mlp", None),
                                                                              torch.nn.Module)]
    mlps = [layer.mlp for layer in layers]
    # a router's logits feed an auxiliary loss, which a tile run without gradients would cut off
    experts = any(getattr(config, name, None) for name in ("num_experts", "num_local_experts", "n_routed_experts",
                                                           "moe_num_experts")) or any(
        hasattr(mlp, name) for mlp in mlps for name in ("experts", "router"))
    if not mlps or experts:
        raise UserError(f"--tiled_mlp: {type(base).__name__}'s layers have "
                        f"{'experts routed per token' if experts else 'no MLP transformers can reach (an mlp module)'};"
                        " leave the flag off")
    for layer in layers:
        mlp = layer.mlp
        if hasattr(mlp, "untiled_forward"):
            continue
        mlp.untiled_forward, mlp.tile, mlp.tiled_modules = mlp.forward, config.hidden_size, (mlp,)
        norm = _norm_before(layer)
        if norm is not None:  # its output, a micro-batch long, is then never whole either
            norm_forward = functools.partial(type(norm).forward, norm)
            mlp.untiled_forward = functools.partial(_normed_forward, norm_forward, mlp.forward)
            mlp.tiled_modules, norm.__class__ = (norm, mlp), _passing_through(type(norm))
            vars(norm).pop("forward", None)  # a hub kernel's, set where the model loaded onto a GPU
        mlp.forward = functools.partial(_tiled_forward, mlp)


def _norm_before(layer: torch.nn.Module) -> torch.nn.Module | None:
    """The norm whose output feeds the layer's MLP and nothing else, where its forward says so: the statement that
    runs it followed by the one that runs the MLP on its output (Llama, Qwen, Mistral, Phi-3: post_attention_layernorm;
    Gemma 2 and 3: pre_feedforward_layernorm; OLMo 2 normalizes the MLP's output instead: none)."""
    try:
        source = inspect.getsource(type(layer).forward)
    except (OSError, TypeError):
        return None
    found = re.search(r"\n(\s*)hidden_states = self\.(\w+)\(hidden_states\)\n"
                      r"\1hidden_states = self\.mlp\(hidden_states\)\n", source)
    if found is None or source.count(f"self.{found[2]}(") != 1:
        return None
    norm = getattr(layer, found[2], None)
    return norm if isinstance(norm, torch.nn.Module) else None


def _normed_forward(norm_forward, mlp_forward, x: torch.Tensor) -> torch.Tensor:
    return mlp_forward(norm_forward(x))


@functools.cache
def _passing_through(norm_class: type) -> type:
    """``norm_class`` with a forward that returns its input, for a norm that runs inside the MLP's tiles.

    The class, not the instance's ``forward``: transformers sets a hub-kernel layer's (an RMSNorm's) forward back,
    or to a kernel, whenever the model switches between training and evaluation; this one it leaves alone."""
    return type(f"{norm_class.__name__}InMLPTiles", (norm_class,),
                {"forward": lambda self, x: x, "kernel_condition": staticmethod(lambda module: False)})


_cut_to = contextvars.ContextVar("cut_to", default=1.0)


@contextlib.contextmanager
def tiles_as_if_cut(fraction: float):
    """While a micro-batch whose rows are cut to ``fraction`` of their length is counted
    (``finetune.models.estimate``), its MLPs run in as many tiles as the whole micro-batch's would, each that much
    shorter, so that what it keeps grows with the tokens as the whole one's does."""
    token = _cut_to.set(fraction)
    try:
        yield
    finally:
        _cut_to.reset(token)


def _tiled_forward(mlp: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    positions, tile = x.shape[:-1].numel(), mlp.tile * _cut_to.get()
    if not torch.is_grad_enabled() or positions <= tile:
        return mlp.untiled_forward(x)
    weights = [parameter for module in mlp.tiled_modules for parameter in module.parameters()
               if parameter.requires_grad]
    if not (x.requires_grad or weights):  # (a frozen part of the model)
        return mlp.untiled_forward(x)
    return _TiledMLP.apply(mlp, math.ceil(positions / tile), x, *weights)


class _TiledMLP(torch.autograd.Function):
    """``mlp.untiled_forward(x)`` computed ``tiles`` parts of the positions at a time, keeping ``x`` alone; the
    backward pass runs each part again, under the random state (dropout) and autocast the forward had."""

    @staticmethod
    def forward(ctx, mlp: torch.nn.Module, tiles: int, x: torch.Tensor, *weights: torch.Tensor) -> torch.Tensor:
        ctx.mlp, ctx.tiles, ctx.device = mlp, tiles, x.device
        ctx.autocast = (torch.is_autocast_enabled(x.device.type), torch.get_autocast_dtype(x.device.type))
        ctx.rng = random_state(x.device)
        ctx.save_for_backward(x, *weights)
        parts = x.reshape(-1, x.shape[-1]).tensor_split(tiles)
        return torch.cat([mlp.untiled_forward(part) for part in parts]).reshape(*x.shape[:-1], -1)

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        x, *weights = ctx.saved_tensors
        wanted = ctx.needs_input_grad[2]
        grad_x = torch.empty_like(x).reshape(-1, x.shape[-1]) if wanted else None
        grad_weights = [None] * len(weights)
        start = 0
        enabled, dtype = ctx.autocast
        with replaying(ctx.rng, ctx.device), torch.enable_grad(), \
                torch.autocast(ctx.device.type, dtype=dtype, enabled=enabled):
            for part, grad_part in zip(x.reshape(-1, x.shape[-1]).tensor_split(ctx.tiles),
                                       grad_output.reshape(-1, grad_output.shape[-1]).tensor_split(ctx.tiles),
                                       strict=True):
                part = part.detach().requires_grad_(wanted)
                grads = torch.autograd.grad(ctx.mlp.untiled_forward(part), [part] * wanted + weights, grad_part,
                                            allow_unused=True)
                if wanted:
                    grad_x[start:start + len(part)] = grads[0]
                    grads = grads[1:]
                grad_weights = [grad if total is None else total if grad is None else total.add_(grad)
                                for total, grad in zip(grad_weights, grads, strict=True)]
                start += len(part)
        return None, None, grad_x.reshape(x.shape) if wanted else None, *grad_weights


def random_state(device: torch.device) -> tuple:
    """The random state that draws on ``device`` (dropout's masks), for ``replaying``: the CPU's, and an
    accelerator's own (CUDA, MPS, XPU, ...) where ``device`` is one."""
    accelerator = None if device.type == "cpu" else torch.get_device_module(device.type).get_rng_state(device)
    return torch.get_rng_state(), accelerator


@contextlib.contextmanager
def replaying(state: tuple, device: torch.device) -> Iterator[None]:
    """Draws on ``device`` inside the block start from ``state`` (``random_state``), so that a backward pass draws
    what its forward drew; the random state outside the block is left as it was."""
    on_accelerator = device.type != "cpu"
    with torch.random.fork_rng(devices=[device] if on_accelerator else [],
                               device_type=device.type if on_accelerator else None):
        torch.set_rng_state(state[0])
        if on_accelerator:
            torch.get_device_module(device.type).set_rng_state(state[1], device)
        yield


def require_bitsandbytes(needs: str = "--load_in_4bit", otherwise: str = ", or leave the flag off") -> None:
    """Raises ``UserError`` naming the extra to install when bitsandbytes is missing: ``needs`` it, ``otherwise``
    the way round it."""
    import importlib.util

    if importlib.util.find_spec("bitsandbytes") is None:
        raise UserError(f'{needs} needs bitsandbytes: pip install -e ".[qlora]" (or pip install bitsandbytes)'
                        f"{otherwise}")


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
