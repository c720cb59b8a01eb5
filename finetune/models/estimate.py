"""A process's peak memory predicted before its first step: what is in use once the model is loaded, the gradients
and AdamW's states of the trained weights, and what the backward pass of the longest micro-batch keeps, counted on
it or on its rows cut short; or, before the model loads, counted on its first layer and its first two and
extrapolated."""

from __future__ import annotations

import contextlib
import contextvars
import gc
import itertools
import math
import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace
from typing import NamedTuple

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from transformers.modeling_layers import GradientCheckpointingLayer

from finetune.data.batching import padded_tokens
from finetune.models.memory import checkpoint_activations, tiles_as_if_cut
from finetune.task import CountedBatch

__all__ = ["MemoryEstimate", "extrapolated", "kept_for_backward", "longest_planned", "note_logits", "predict_memory",
           "weights_alive"]

COUNTED_TOKENS = 2048
"""The longest micro-batch counted as it is; a longer one is counted at about a half and a quarter of this."""
TENSORS_OF_A_LOGITS_CHUNK = 3
"""What a chunk of logits recomputed in the backward pass holds at its peak, in float32 tensors of its size: the
log-probabilities its recompute keeps for the loss, their gradient, and the logits' gradient."""

_noted_logits: contextvars.ContextVar[list[tuple[int, int, int, int]] | None] = contextvars.ContextVar(
    "noted_logits", default=None)


def note_logits(positions: int, per_chunk: int, vocabulary: int, cast_weight: int = 0) -> None:
    """Said by an output layer that computes the float32 logits of ``positions`` positions ``per_chunk`` at a time,
    each chunk recomputed in the backward pass (the chat recipes'): the count of what the backward pass keeps cannot
    see them, since none is kept. ``cast_weight``: the bytes of its weight cast for autocast, which each chunk's
    recompute casts again and holds through its backward."""
    noted = _noted_logits.get()
    if noted is not None:
        noted.append((positions, per_chunk, vocabulary, cast_weight))


def kept_for_backward(forward: Callable[[], object], model: torch.nn.Module, layer_calls: list | None = None,
                      held: Iterable[torch.Tensor] = ()) -> int:
    """The bytes ``forward()`` would leave kept for a backward pass: every tensor autograd saves (each storage once,
    neither the weights nor the tensors ``held`` anyway counted), and the input of each checkpointed layer, which
    the recompute holds outside autograd. ``layer_calls`` gets ``LayerCall`` for each call with gradients of a
    layer that can be checkpointed, checkpointed or not, in the order the calls end.

    Counted, not kept: each saved tensor is dropped as it is counted, so the count needs no more memory than a
    forward pass without gradients, and its graph can run no backward pass."""
    weights = {tensor.untyped_storage().data_ptr() for tensor in itertools.chain(model.parameters(), held)}
    alive: dict[int, StorageWeakRef] = {}  # counted storages by address, while they live (an address is reused)
    kept = 0
    entered: list[tuple[bool, int]] = []

    def count(tensor: torch.Tensor) -> None:
        nonlocal kept
        storage = tensor.untyped_storage()
        address = storage.data_ptr()
        if address not in weights and (address not in alive or alive[address].expired()):
            alive[address] = StorageWeakRef(storage)
            kept += storage.nbytes()

    def before_layer(module: torch.nn.Module, args: tuple) -> None:
        # a pass without gradients (a live reference's) holds no input for a recompute
        entered.append((torch.is_grad_enabled(), kept))
        if torch.is_grad_enabled() and module.gradient_checkpointing:
            count(args[0])

    def after_layer(module: torch.nn.Module, args: tuple, output) -> None:
        with_gradients, at_entry = entered.pop()
        if with_gradients and layer_calls is not None:
            layer_calls.append(LayerCall(module, args[0].shape[:-1].numel(), args[0].untyped_storage().nbytes(),
                                         kept - at_entry))

    layers = [module for module in model.modules() if isinstance(module, GradientCheckpointingLayer)]
    hooks = [hook for layer in layers for hook in (layer.register_forward_pre_hook(before_layer),
                                                   layer.register_forward_hook(after_layer, always_call=True))]
    try:
        with torch.autograd.graph.saved_tensors_hooks(count, lambda nothing: nothing):
            forward()
    finally:
        for hook in hooks:
            hook.remove()
    return kept


class LayerCall(NamedTuple):
    """A call of a layer that can be checkpointed, as ``kept_for_backward`` counted it."""

    layer: torch.nn.Module
    tokens: int
    input_bytes: int
    kept: int
    """Counted from its start to its end: its input if it is checkpointed, else all it saves that was not yet
    counted (its input, where its first operation saves it, among them)."""


@dataclass
class MemoryEstimate:
    """One process's predicted peak, in bytes, and what it is made of."""

    in_use: int
    """Now, before the first step: the libraries, the data and the weights as loaded (on a GPU, its allocation)."""
    gradients: int
    optimizer: int
    activations: int | None
    """Kept for the backward pass of the longest micro-batch, as this run keeps them; None where not counted."""
    other_way: int | None
    """The same with the layers recomputed where this run keeps them, and the other way round."""
    checkpointing: bool
    tokens: str
    """The longest micro-batch, as rows x tokens."""
    capacity: int
    """What this process may use: the GPU's memory, or the machine's shared by the processes on it."""
    device: str
    not_counted: str = ""
    """Why the activations are not counted, where they are not."""
    logits: int = 0
    """The output layer's logits at their backward's peak, where it computes them a chunk at a time
    (``note_logits``)."""
    one_layer: int = 0
    """With the layers recomputed, what the one being recomputed holds besides its input (in those activations)."""
    tile: int = 0
    """Where the MLPs run in tiles (``--tiled_mlp``) on the longest micro-batch, what the backward pass of one tile
    holds besides its input: its intermediate activations, recomputed."""

    @property
    def peak(self) -> int:
        return self.in_use + self.gradients + self.optimizer + self.logits + self.tile + (self.activations or 0)

    def line(self) -> str:
        activations = (f"activations not counted ({self.not_counted})" if self.activations is None
                       else f"{_size(self.activations)} activations of the longest micro-batch ({self.tokens} tokens; "
                            + ("the architecture cannot recompute its layers" if self.other_way is None else
                               f"{_size(self.other_way)} {'without' if self.checkpointing else 'with'} "
                               "--gradient_checkpointing") + ")")
        logits = f", {_size(self.logits)} for the output layer's chunk of logits" if self.logits else ""
        logits += f", {_size(self.tile)} for an MLP tile's backward" if self.tile else ""
        return (f"memory per process, predicted peak {_size(self.peak)}: {_size(self.in_use)} in use at the start "
                f"(libraries, data, weights), {_size(self.gradients)} gradients, {_size(self.optimizer)} optimizer "
                f"states, {activations}{logits}; this {self.device} has {_size(self.capacity)} for it")

    def needs_recompute(self) -> bool:
        """Whether a run that leaves --gradient_checkpointing unset should recompute its layers: where keeping every
        activation would take more than half the memory the rest of the peak leaves. The margin is for what the
        estimate leaves out and what allocators hold beyond what is in use (bench/long.py's 4k row with every
        activation kept: 12.1 GiB resident under glibc's defaults, 6.6 GiB in use)."""
        if self.checkpointing or self.activations is None or self.other_way is None:
            return False
        return self.peak + self.activations > self.capacity

    def recomputed(self) -> MemoryEstimate:
        """This estimate with the layers recomputed."""
        return replace(self, activations=self.other_way, other_way=self.activations, checkpointing=True)

    def advice(self) -> str | None:
        """What would make the run fit, when the predicted peak passes the capacity."""
        if self.peak <= self.capacity:
            return None
        passes = f"the predicted peak, {_size(self.peak)}, passes the {_size(self.capacity)} this process has"
        if not self.checkpointing and self.other_way is not None:
            recomputed = self.peak - self.activations + self.other_way
            if recomputed <= self.capacity:
                return f"{passes}: --gradient_checkpointing would make it about {_size(recomputed)}"
        return (f"{passes}: a smaller --per_device_train_batch_size or --max_seq_length shrinks the activations, "
                "--load_in_4bit (chat recipes, LoRA) the frozen weights")


def extrapolated(first: MemoryEstimate, first_two: MemoryEstimate, weights: tuple[int, int], layers: int
                 ) -> MemoryEstimate:
    """The estimate for the model of ``layers`` layers from those for its first layer and its first two
    (``weights``: the bytes of every weight alive with each, ``weights_alive``): each layer more adds what the
    second added, in weights, trained weights and what the backward pass keeps; with the layers recomputed, one
    layer's activations at a time are recomputed on top of the layers' inputs."""
    def grown(one: int, two: int) -> int:
        return one + (layers - 1) * (two - one)

    trained = grown(first.gradients, first_two.gradients)
    activations = other_way = None
    if first.activations is not None:
        def kept(estimate: MemoryEstimate) -> int:
            return estimate.other_way if estimate.checkpointing else estimate.activations

        def inputs(estimate: MemoryEstimate) -> int | None:  # recomputed, less the one recomputed layer's own
            value = estimate.activations if estimate.checkpointing else estimate.other_way
            return None if value is None else value - estimate.one_layer

        all_kept = grown(kept(first), kept(first_two))
        recomputed = (None if inputs(first) is None else
                      grown(inputs(first), inputs(first_two)) + first_two.one_layer)
        activations, other_way = (recomputed, all_kept) if first.checkpointing else (all_kept, recomputed)
    return replace(first, in_use=first.in_use + grown(*weights) - weights[0], gradients=trained,
                   optimizer=2 * trained, activations=activations, other_way=other_way, one_layer=first_two.one_layer)


def weights_alive(device: torch.device) -> int:
    """The bytes of the weights and buffers of every module in this process, on ``device`` (each storage once)."""
    gc.collect()
    storages = {}
    for module in (thing for thing in gc.get_objects() if issubclass(type(thing), torch.nn.Module)):
        for tensor in itertools.chain(module.parameters(recurse=False), module.buffers(recurse=False)):
            if tensor.device.type == device.type:
                storage = tensor.untyped_storage()
                storages[(tensor.device, storage.data_ptr())] = storage.nbytes()
    return sum(storages.values())


def _size(size: int) -> str:
    return f"{size / 2**20:.0f} MiB" if size < 2**30 else f"{size / 2**30:.1f} GiB"


def longest_planned(train_set, micro_batches: Iterable[list[int]], collate: Callable, loss: Callable
                    ) -> CountedBatch:
    """The longest of ``micro_batches`` (lists of ``train_set`` indices: a process's plan of an epoch), in rows
    times its longest row."""
    lengths = train_set.lengths
    longest = max(micro_batches, key=lambda batch: len(batch) * int(lengths[list(batch)].max()))
    return CountedBatch([train_set[i] for i in longest], collate, loss,
                        tokens=f"{len(longest)} x {int(lengths[list(longest)].max())}")


def predict_memory(model: torch.nn.Module, counted: CountedBatch | None, device: torch.device, local_processes: int,
                   checkpointing: bool, not_counted: str = "") -> MemoryEstimate:
    """The peak of a process training ``model`` (unwrapped, on ``device``) whose largest micro-batch is
    ``counted`` (None, saying why in ``not_counted``, where the activations cannot be counted), its activations
    counted both ways, with and without recomputed layers (``_longest_kept``); the random state and the model's
    mode and layers are left as they were."""
    in_use = _in_use(device)  # before the count, whose freed memory the C allocator may keep
    trained = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    activations = other_way = None
    count = _Count(0, None, 0, 0, 0)
    if counted is not None:
        count = _longest_kept(model, counted.loss, counted.collate, counted.rows, device, checkpointing)
        recomputed = None if count.recomputed is None else count.recomputed + count.one_layer
        activations, other_way = (recomputed, count.kept) if checkpointing else (count.kept, recomputed)
    return MemoryEstimate(in_use=in_use, gradients=trained, optimizer=2 * trained, activations=activations,
                          other_way=other_way, checkpointing=checkpointing, tokens=counted.tokens if counted else "",
                          capacity=_capacity(device, local_processes),
                          device="GPU" if device.type == "cuda" else "machine",
                          not_counted=not_counted, logits=count.logits, one_layer=count.one_layer, tile=count.tile)


class _Count(NamedTuple):
    kept: int
    """What the backward pass keeps with every activation kept."""
    recomputed: int | None
    """With the layers recomputed, at the peak of the backward: their inputs, and what the forward keeps outside
    them (None where the architecture cannot recompute them)."""
    one_layer: int
    """What the layer being recomputed holds besides its input (0 where none can be)."""
    logits: int
    """The output layer's chunk of logits at their backward's peak (0 where it notes none: ``note_logits``)."""
    tile: int
    """What one tile of a tiled MLP's backward holds besides its input (0 where no MLP runs in tiles)."""


def _longest_kept(model, loss, collate, rows: list[dict], device: torch.device, checkpointing: bool) -> _Count:
    """What the micro-batch of ``rows`` keeps for its backward pass, counted both ways (``_count_both_ways``), and
    its output layer's chunk of logits at their backward's peak.

    A micro-batch of up to ``COUNTED_TOKENS`` is counted itself. A longer one is counted with each row (each of its
    token lists) cut to a fraction f of its length, at f and 2f, and fitted with ``A f + B f^2`` at f = 1: the
    attention's scores grow with the square of a row's length where the kernel keeps them (a mask on a CPU). Cut in
    proportion, the rows keep their padding, which chooses the kernel; cut to evenly spaced tokens, they keep their
    share of labelled positions, whose logits grow as 1 / f; tiled MLPs run in as many tiles as the whole's."""
    def counted(batch: dict, grown: float = 1.0) -> _Count:
        batch = {key: value.to(device) if isinstance(value, torch.Tensor) else value for key, value in batch.items()}
        noted = _noted_logits.set([])
        try:
            kept, recomputed, one_layer = _count_both_ways(model, loss, batch, device, checkpointing)
            logits = max((min(math.ceil(positions * grown), per_chunk) * vocabulary * 4 * TENSORS_OF_A_LOGITS_CHUNK
                          + cast_weight for positions, per_chunk, vocabulary, cast_weight in _noted_logits.get()),
                         default=0)
        finally:
            _noted_logits.reset(noted)
        return _Count(kept, recomputed, one_layer, logits, 0)

    def cut(fraction: float) -> dict:  # evenly spaced tokens: labelled ones (a chat row's last) keep their share
        return collate([{key: [value[int(i / fraction)] for i in range(max(1, math.ceil(len(value) * fraction)))]
                         if isinstance(value, list) else value for key, value in row.items()} for row in rows])

    whole = collate(rows)
    tile = _one_tile(model, device, padded_tokens(whole))
    if padded_tokens(whole) <= COUNTED_TOKENS:
        return counted(whole)._replace(tile=tile)
    fraction = COUNTED_TOKENS / 2 / padded_tokens(whole)
    with tiles_as_if_cut(fraction):
        first = counted(cut(fraction))
    with tiles_as_if_cut(2 * fraction):
        second = counted(cut(2 * fraction), grown=1 / (2 * fraction))

    def fitted(at_f: int | None, at_2f: int | None) -> int | None:
        if at_f is None:
            return None
        squared = max(0.0, (at_2f - 2 * at_f) / 2)  # B f^2
        return int((at_f - squared) / fraction + squared / fraction**2)
    return _Count(fitted(first.kept, second.kept), fitted(first.recomputed, second.recomputed),
                  fitted(first.one_layer, second.one_layer), second.logits, tile)


def _one_tile(model, device: torch.device, positions: int) -> int:
    """What the backward pass of a tiled MLP (``finetune.models.memory.tile_mlps``) over ``positions`` holds for one
    tile besides the MLP's input: what the tile's recompute keeps for its own backward, counted on the first tiled
    MLP in training mode. 0 where no MLP runs in tiles or ``positions`` fit in one (it runs whole, its intermediates
    counted with the rest)."""
    mlp = next((module for module in model.modules() if hasattr(module, "untiled_forward")), None)
    if mlp is None or positions <= mlp.tile:
        return 0
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    part = torch.zeros(math.ceil(positions / math.ceil(positions / mlp.tile)),  # as tensor_split cuts them
                       base.config.get_text_config().hidden_size, dtype=base.get_input_embeddings().weight.dtype,
                       device=device, requires_grad=True)
    training = model.training
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        model.train()
        try:
            return kept_for_backward(lambda: mlp.untiled_forward(part), model, held=[part])
        finally:
            model.train(training)


def _count_both_ways(model, loss, batch: dict, device: torch.device, checkpointing: bool
                     ) -> tuple[int, int | None, int]:
    """What one training forward of ``batch`` keeps with every activation kept; with the layers recomputed (None
    where the architecture cannot recompute them); and what the last layer holds besides its input while it is
    recomputed, counted as that one layer keeping its activations (where a task's loss takes another path with
    recomputed layers, GRPO's completions each a row with its prompt, so does the count). Where the loss runs the
    model more than once (the embedding recipe, a pass a text column), the backward pass recomputes one pass's layer
    at a time: the largest pass's share of the last layer's count. The model is left as it was."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    recomputable = getattr(base, "supports_gradient_checkpointing", False)
    training = model.training
    recomputed, one_layer = None, 0

    def count(layer_calls: list | None = None) -> int:
        return kept_for_backward(lambda: loss(model, dict(batch)), model, layer_calls)

    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        model.train()
        _recompute_layers(model, base, False)
        kept = count()
        if recomputable:
            _recompute_layers(model, base, True)
            # The last layer, likely the last that runs, keeps its activations: its own share is counted apart
            # and the other way round, sparing a pass with every layer recomputed.
            guess = _last_recomputed(model)
            with _kept_whole(guess):  # a model whose one recomputed layer it is would take its other path
                guess = guess if base.is_activation_checkpointing else None
            layer_calls: list[LayerCall] = []
            with _kept_whole(guess):
                mixed = count(layer_calls)
            outer = _outermost(layer_calls)
            ran = [call for call in outer if call.layer is guess]
            inside, inputs = sum(call.kept for call in ran), sum(call.input_bytes for call in ran)
            recomputed = mixed - inside + inputs
            if outer and outer[-1].layer is guess:
                passes = [call.tokens for call in ran]
                one_layer = (inside - inputs) * max(passes) // max(1, sum(passes))
            elif outer:  # the last layer that ran is another (a tower registered after the text layers may not run)
                last = outer[-1].layer
                passes = [call.tokens for call in outer if call.layer is last]
                with _kept_whole(last):
                    one_layer = (count() - recomputed) * max(passes) // max(1, sum(passes))
            else:  # its layers recompute their own way (remote code): each taken to keep an equal share
                one_layer = kept // max(1, getattr(base.config.get_text_config(), "num_hidden_layers", 1) or 1)
        _recompute_layers(model, base, checkpointing)
    model.train(training)
    return kept, recomputed, one_layer


def _last_recomputed(model: torch.nn.Module) -> torch.nn.Module | None:
    """The last recomputed layer registered that is inside no other."""
    layers = [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer) and m.gradient_checkpointing]
    inner = _inside(layers)
    return next((layer for layer in reversed(layers) if id(layer) not in inner), None)


@contextlib.contextmanager
def _kept_whole(layer: torch.nn.Module | None):
    """``layer`` (if any) keeps its activations for the time being."""
    if layer is not None:
        layer.gradient_checkpointing = False
    try:
        yield
    finally:
        if layer is not None:
            layer.gradient_checkpointing = True


def _outermost(layer_calls: list[LayerCall]) -> list[LayerCall]:
    """The calls of layers not inside another of the layers called."""
    inner = _inside({id(call.layer): call.layer for call in layer_calls}.values())
    return [call for call in layer_calls if id(call.layer) not in inner]


def _inside(layers: Iterable[torch.nn.Module]) -> set[int]:
    """The ids of the modules inside any of ``layers``."""
    return {id(sub) for layer in layers for sub in layer.modules() if sub is not layer}


def _recompute_layers(model, base, on: bool) -> None:
    if on and not base.is_activation_checkpointing:
        checkpoint_activations(model)
    elif not on and base.is_activation_checkpointing:
        base.activation_checkpointing_disable()
        if getattr(base, "_require_grads_hook", None) is not None:  # set by the enabling, not removed by this
            base.disable_input_require_grads()


def _in_use(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.memory_allocated(device)
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _capacity(device: torch.device, local_processes: int) -> int:
    """The GPU's memory, or this machine's (its container's limit, where lower) over the processes on it."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    try:
        with open("/sys/fs/cgroup/memory.max") as limit:
            text = limit.read().strip()
        total = min(total, int(text)) if text.isdigit() else total
    except OSError:
        pass
    return math.floor(total / local_processes)
