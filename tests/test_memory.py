"""What a model keeps for the backward pass: activation checkpointing keeps each layer's input only, and recomputes
the rest to the same values and gradients."""

from __future__ import annotations

import contextlib
import copy
import types
import weakref

import pytest
import torch
from helpers import padded_batch, tiny_causal_lm
from test_lora import adapted
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from transformers import AutoModelForCausalLM, PretrainedConfig, PreTrainedModel
from transformers.modeling_layers import GradientCheckpointingLayer

from finetune.data.batching import TokenizedDataset
from finetune.errors import UserError
from finetune.models import estimate as estimate_module
from finetune.models import memory as memory_module
from finetune.models.estimate import (
    MemoryEstimate,
    extrapolated,
    kept_for_backward,
    longest_planned,
    predict_memory,
    weights_alive,
)
from finetune.models.loading import first_layers_only, load_model
from finetune.models.lora import add_lora
from finetune.models.memory import check_tiling, checkpoint_activations, keep_less, tile_mlps
from finetune.tasks import causal_lm
from finetune.tasks.causal_lm import label_log_probs
from finetune.tasks.chat import IGNORE


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


def test_a_backward_pass_replays_the_random_state_of_the_accelerator_it_draws_on_any_kind(monkeypatch):
    """LoRA's dropout and the tiled MLP draw their masks again in the backward pass from the state the forward had:
    on an accelerator other than CUDA (MPS, XPU) that is its own device module's state, which the block sets and
    then leaves as it found it (read as torch.mps and torch.xpu give it; here a stand-in for one, with no such
    device on this machine)."""

    class Accelerator:  # torch.mps's and torch.xpu's random-state functions, over a CPU generator
        def __init__(self):
            self.generator = torch.Generator().manual_seed(7)

        def get_rng_state(self, device):
            assert device == torch.device("mps")
            return self.generator.get_state()

        def set_rng_state(self, state, device):
            assert device == torch.device("mps")
            self.generator.set_state(state)

    accelerator, device_module = Accelerator(), torch.get_device_module
    monkeypatch.setattr(torch, "get_device_module", lambda kind: accelerator if kind == "mps" else device_module(kind))
    mps = torch.device("mps")
    state = memory_module.random_state(mps)
    forward_draws = torch.rand(4, generator=accelerator.generator), torch.rand(4)
    after = accelerator.generator.get_state(), torch.get_rng_state()
    with memory_module.replaying(state, mps):
        replayed = torch.rand(4, generator=accelerator.generator), torch.rand(4)
        torch.rand(4, generator=accelerator.generator)
    assert all(torch.equal(a, b) for a, b in zip(replayed, forward_draws, strict=True))
    assert torch.equal(accelerator.generator.get_state(), after[0]) and torch.equal(torch.get_rng_state(), after[1])


def test_a_model_that_cannot_recompute_its_layers_is_refused():
    class Plain(torch.nn.Module):
        supports_gradient_checkpointing = False

    with pytest.raises(UserError, match=r"--gradient_checkpointing: Plain cannot recompute its layers"):
        checkpoint_activations(Plain())


def collate_padded(rows: list[dict]) -> dict:
    longest = max(len(row["input_ids"]) for row in rows)
    ids = torch.tensor([row["input_ids"] + [0] * (longest - len(row["input_ids"])) for row in rows])
    labels = torch.tensor([row["labels"] + [IGNORE] * (longest - len(row["labels"])) for row in rows])
    return {"input_ids": ids, "attention_mask": (labels != IGNORE).long() | (ids != 0).long(), "labels": labels}


def chat_loss(model, batch):
    return -label_log_probs(model, batch)[0].sum()


@pytest.mark.parametrize("checkpointing", [False, True])
def test_the_activations_predicted_for_the_longest_micro_batch_are_what_it_keeps(checkpointing):
    """The longest micro-batch (2 padded rows of 1,800 and 2,000 tokens, whose attention keeps its scores) counted
    with its rows cut to a quarter and a half of their lengths, fitted: within 10% of what it keeps, counted
    exactly, both ways (a fit linear in the tokens gives 0.43x); the model's mode, layers and random state as they
    were."""
    generator = torch.Generator().manual_seed(0)
    lengths = [40, 60, 250, 300, 1800, 2000]
    rows = {"input_ids": [torch.randint(1, 500, (n,), generator=generator).tolist() for n in lengths]}
    rows["labels"] = [[IGNORE] * 10 + ids[10:] for ids in rows["input_ids"]]
    train_set = TokenizedDataset.from_dict(rows)
    model = adapted(0.05).eval()
    if checkpointing:
        checkpoint_activations(model)
    torch.manual_seed(5)
    estimate = predict_memory(model, longest_planned(train_set, [[0, 1], [2, 3], [4, 5]], collate_padded, chat_loss),
                              torch.device("cpu"), 1, checkpointing)
    drawn_after = torch.rand(1)
    torch.manual_seed(5)
    assert torch.equal(torch.rand(1), drawn_after) and not model.training
    assert model.get_base_model().is_activation_checkpointing == checkpointing
    longest = collate_padded([train_set[4], train_set[5]])
    plain, recomputing = adapted(0.05).train(), adapted(0.05).train()
    checkpoint_activations(recomputing)
    kept = kept_for_backward(lambda: chat_loss(plain, dict(longest)), plain)
    recomputed = kept_for_backward(lambda: chat_loss(recomputing, dict(longest)), recomputing)
    recomputed += kept / 2  # one of the 2 layers recomputed at a time, holding what it keeps
    predicted = (estimate.other_way, estimate.activations) if checkpointing else (
        estimate.activations, estimate.other_way)
    assert estimate.tokens == "2 x 2000"
    assert predicted[0] == pytest.approx(kept, rel=0.1) and predicted[1] == pytest.approx(recomputed, rel=0.1)
    assert recomputed < 0.6 * kept  # the two ways differ by more than the tolerance
    trained = sum(p.numel() * 4 for p in model.parameters() if p.requires_grad)
    assert (estimate.gradients, estimate.optimizer) == (trained, 2 * trained)


class LiveBytes(TorchDispatchMode):
    """Every tensor torch makes while on, each storage counted from its making until it is freed: ``now`` and
    ``peak`` bytes."""

    def __init__(self):
        super().__init__()
        self.now = self.peak = 0
        self.alive: set[int] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for tensor in (t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)):
            storage = tensor.untyped_storage()
            if storage.data_ptr() and storage.data_ptr() not in self.alive:
                self.alive.add(storage.data_ptr())
                self.now += storage.nbytes()
                self.peak = max(self.peak, self.now)
                weakref.finalize(storage, self._freed, storage.data_ptr(), storage.nbytes())
        return out

    def _freed(self, address: int, size: int) -> None:
        self.now -= size
        self.alive.discard(address)


@pytest.mark.parametrize(("per_chunk", "autocast", "counted_tokens"), [
    (None, False, None), (16, False, None), (None, True, None), (None, False, 64),
], ids=["the-batch-bounds-it", "the-chunk-limit-bounds-it", "bf16-autocast-casts-the-head", "counted-cut-short"])
def test_the_output_layer_s_chunk_of_logits_is_predicted_as_its_backward_holds_it(per_chunk, autocast, counted_tokens,
                                                                                 monkeypatch):
    """The chat recipes' output layer computes its logits a chunk at a time and recomputes each in the backward
    pass, so the count of what is kept never sees one: the prediction adds a chunk at its backward's peak, as
    measured (every tensor torch makes, alive until freed): the chunk as long as the batch's labelled positions or
    the chunk limit allow, plus the head's weight cast again for each chunk under autocast; counted on rows cut
    short (their labels at their ends, as a reply's), the same."""
    model = adapted(0.0).eval()  # the output layer frozen, as with LoRA
    vocabulary = model.get_output_embeddings().weight.shape[0]
    if per_chunk:
        monkeypatch.setattr(causal_lm, "LOGITS_PER_CHUNK", per_chunk * vocabulary)
    if counted_tokens:
        monkeypatch.setattr(estimate_module, "COUNTED_TOKENS", counted_tokens)
    generator = torch.Generator().manual_seed(0)
    rows = {"input_ids": [torch.randint(1, 500, (n,), generator=generator).tolist() for n in (60, 80)]}
    rows["labels"] = [[IGNORE] * (len(ids) - 30) + ids[-30:] for ids in rows["input_ids"]]
    train_set = TokenizedDataset.from_dict(rows)
    labelled = int((collate_padded([train_set[0], train_set[1]])["labels"][:, 1:] != IGNORE).sum())
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        estimate = predict_memory(model, longest_planned(train_set, [[0, 1]], collate_padded, chat_loss),
                                  torch.device("cpu"), 1, checkpointing=False)
    chunk = min(labelled, per_chunk or labelled) * vocabulary * 4
    cast = model.get_output_embeddings().weight.numel() * 2 if autocast else 0
    assert estimate.logits == pytest.approx(3 * chunk + cast, rel=0.05 if counted_tokens else 0)
    assert f"{estimate.logits / 2**20:.0f} MiB for the output layer's chunk" in estimate.line()

    hidden = torch.randn(labelled, model.config.hidden_size, requires_grad=True)
    targets = torch.randint(0, vocabulary, (labelled,), generator=generator)
    with LiveBytes() as live:
        log_probs = causal_lm._head_log_probs(model, {"autocast": ("cpu", torch.bfloat16, autocast)}, hidden, targets)
        live.peak = before = live.now
        log_probs.sum().backward()
    assert live.peak - before - hidden.grad.nbytes == pytest.approx(estimate.logits, rel=0.05)


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_the_prediction_from_the_first_layer_and_the_first_two_is_the_whole_model_s(tmp_path, lora):
    """--prepare_only predicts before the model loads: counted on the model cut to its first layer and to its first
    two, extrapolated to its 6 layers, the weights, gradients, optimizer states and activations both ways are what
    the whole model's count says."""
    tiny_causal_lm(num_hidden_layers=6).save_pretrained(tmp_path)
    generator = torch.Generator().manual_seed(0)
    rows = {"input_ids": [torch.randint(1, 500, (n,), generator=generator).tolist() for n in (30, 50, 70)]}
    rows["labels"] = [[IGNORE] * 5 + ids[5:] for ids in rows["input_ids"]]
    train_set = TokenizedDataset.from_dict(rows)

    def counted(layers: int | None) -> tuple[MemoryEstimate, int, int | None]:
        with first_layers_only(layers or 0) if layers else contextlib.nullcontext() as cut:
            model = load_model(AutoModelForCausalLM, str(tmp_path))
        model = add_lora(model, 4, 8, 0.0, "all-linear") if lora else model
        estimate = predict_memory(model, longest_planned(train_set, [[0, 1], [2]], collate_padded, chat_loss),
                                  torch.device("cpu"), 1, checkpointing=False)
        return estimate, weights_alive(torch.device("cpu")), cut and cut.full

    (first, in_first, full), (first_two, in_first_two, _) = counted(1), counted(2)
    assert full == 6
    whole, in_whole, _ = counted(None)
    predicted = extrapolated(first, first_two, (in_first, in_first_two), full)
    assert predicted.in_use - first.in_use == in_whole - in_first  # the weights the other 5 layers add
    assert (predicted.gradients, predicted.optimizer) == (whole.gradients, whole.optimizer)
    assert (predicted.activations, predicted.other_way) == (whole.activations, whole.other_way)
    assert whole.gradients > first.gradients and whole.other_way < 0.6 * whole.activations


def test_a_peak_past_the_capacity_names_the_flag_that_would_make_it_fit():
    def estimate(capacity: int, checkpointing: bool = False) -> MemoryEstimate:
        return MemoryEstimate(in_use=2 * 2**30, gradients=2**20, optimizer=2**21, activations=20 * 2**30,
                              other_way=2**30, checkpointing=checkpointing, tokens="1 x 32768", capacity=capacity,
                              device="machine")
    assert estimate(24 * 2**30).advice() is None
    assert estimate(16 * 2**30).advice() == ("the predicted peak, 22.0 GiB, passes the 16.0 GiB this process has: "
                                             "--gradient_checkpointing would make it about 3.0 GiB")
    assert "a smaller --per_device_train_batch_size or --max_seq_length" in estimate(2 * 2**30).advice()
    assert "--gradient_checkpointing" not in estimate(16 * 2**30, checkpointing=True).advice()


def test_layers_are_recomputed_by_default_where_every_activation_kept_would_need_over_half_of_what_is_left():
    def estimate(activations: int | None, other_way: int | None = 2**30, checkpointing: bool = False):
        return MemoryEstimate(in_use=4 * 2**30, gradients=2**30, optimizer=2**31, activations=activations,
                              other_way=other_way, checkpointing=checkpointing, tokens="1 x 8192",
                              capacity=24 * 2**30, device="machine")
    assert not estimate(8 * 2**30).needs_recompute()  # 7 GiB of weights and states leave 17: 16 needed
    assert estimate(9 * 2**30).needs_recompute()  # 18 needed
    assert not estimate(9 * 2**30, other_way=None).needs_recompute()  # cannot recompute
    assert not estimate(None, other_way=None).needs_recompute()  # not counted
    assert not estimate(2**30, other_way=9 * 2**30, checkpointing=True).needs_recompute()  # recomputes already
    chosen = estimate(9 * 2**30).recomputed()
    assert (chosen.activations, chosen.other_way, chosen.checkpointing, chosen.peak) == (2**30, 9 * 2**30, True,
                                                                                        8 * 2**30)
    assert "1.0 GiB activations of the longest micro-batch (1 x 8192 tokens; 9.0 GiB without" in chosen.line()


def test_counting_what_a_forward_keeps_keeps_none_of_it():
    """The estimate counts a micro-batch's forward without holding its activations (which would raise the run's
    peak by as much): each saved tensor is freed once the forward no longer uses it."""
    x = torch.randn(1000, 1000, requires_grad=True)
    freed = []

    def forward():
        y = x.exp()  # autograd saves the result
        storage = StorageWeakRef(y.untyped_storage())
        total = y.sum()
        del y
        freed.append(storage.expired())
        return total

    assert kept_for_backward(forward, torch.nn.Linear(1, 1)) == 4_000_000
    assert freed == [True]


def test_a_pass_without_gradients_through_recomputed_layers_counts_nothing():
    """DPO's live reference runs the policy's own layers without gradients before the policy's pass: recomputed
    layers hold no input for it (the count once took each layer's input from every pass: 1.22x DPO's measured
    peak)."""
    model = adapted(0.0)
    checkpoint_activations(model)
    batch = padded_batch()

    def policy():
        return model(**batch).loss

    def reference_then_policy():
        with torch.no_grad(), model.disable_adapter():
            model(**batch)
        return policy()

    assert kept_for_backward(reference_then_policy, model) == kept_for_backward(policy, model) > 0


def test_the_recomputed_layer_is_counted_on_the_path_the_loss_takes_with_recomputed_layers():
    """GRPO's loss runs each prompt once for its completions, but each completion as a row with its prompt where the
    layers are recomputed: the layer being recomputed holds what the rows keep, not what the shared prompt does."""
    from finetune.task import CountedBatch
    from finetune.tasks.causal_lm import reply_log_probs

    model = adapted(0.0)
    prompt, replies = list(range(1, 81)), [[7 + i] * 8 for i in range(4)]

    def collate(rows: list[dict], shared: bool = True) -> dict:
        prompts = [rows[0]["prompt_ids"]] * (1 if shared else len(rows))
        reply_ids = torch.tensor([row["reply_ids"] for row in rows])
        return {"prompt_ids": torch.tensor(prompts), "prompt_mask": torch.ones_like(torch.tensor(prompts)),
                "reply_ids": reply_ids, "reply_mask": torch.ones_like(reply_ids),
                "prompt_of": torch.zeros(len(rows), dtype=torch.long) if shared else torch.arange(len(rows))}

    def loss(model, batch):
        return -reply_log_probs(model, batch).sum()

    rows = [{"prompt_ids": prompt, "reply_ids": reply} for reply in replies]
    estimate = predict_memory(model, CountedBatch(rows, collate, loss, "4 x 88"), torch.device("cpu"), 1, True)
    plain = adapted(0.0)  # every activation kept: each of its 2 layers keeps about half
    each_a_row = kept_for_backward(lambda: loss(plain, collate(rows, shared=False)), plain) / 2
    shared = kept_for_backward(lambda: loss(plain, collate(rows)), plain) / 2
    assert estimate.one_layer == pytest.approx(each_a_row, rel=0.2) and shared < 0.5 * each_a_row


class OwnWayConfig(PretrainedConfig):
    model_type = "recomputes-its-own-way"

    def __init__(self, num_hidden_layers: int = 3, **kwargs):
        super().__init__(**kwargs)
        self.num_hidden_layers = num_hidden_layers


class RecomputesItsOwnWay(PreTrainedModel):
    """A model whose layers recompute as remote code often has them: a flag on the model and its own call of the
    checkpoint function in its loop, no ``GradientCheckpointingLayer``."""

    config_class = OwnWayConfig
    supports_gradient_checkpointing = True

    def __init__(self, config):
        super().__init__(config)
        self.layers = torch.nn.ModuleList(torch.nn.Linear(16, 16) for _ in range(config.num_hidden_layers))
        self.gradient_checkpointing = False
        self.post_init()

    def forward(self, x):
        for layer in self.layers:
            x = (self._gradient_checkpointing_func(layer.__call__, x) if self.gradient_checkpointing
                 and self.training else layer(x)).tanh()
        return x


def test_a_model_that_recomputes_its_own_way_or_has_a_layer_that_never_runs_is_counted():
    """Where no layer wrapper recomputes (the model's own loop does), each layer is taken to keep an equal share; a
    recomputing layer the micro-batch never runs (a tower registered after the text layers) is not the one
    counted."""
    from finetune.task import CountedBatch

    def collate(rows):
        return {"x": torch.tensor([row["x"] for row in rows], dtype=torch.float32)}

    def counted(model) -> MemoryEstimate:
        return predict_memory(model, CountedBatch([{"x": [0.5] * 16}] * 64, collate, lambda m, b: m(**b).sum(),
                                                  "64 x 16"), torch.device("cpu"), 1, checkpointing=False)

    own_way = counted(RecomputesItsOwnWay(OwnWayConfig()))
    assert own_way.one_layer == own_way.activations // 3 > 0

    model = tiny_causal_lm()
    alone = predict_memory(model, longest_planned(TokenizedDataset.from_dict(
        {"input_ids": [list(range(1, 41))], "labels": [list(range(1, 41))]}), [[0]], collate_padded, chat_loss),
        torch.device("cpu"), 1, checkpointing=False)
    model.never_run = type(model.model.layers[0])(model.config, 0)  # registered after the text layers
    beside = predict_memory(model, longest_planned(TokenizedDataset.from_dict(
        {"input_ids": [list(range(1, 41))], "labels": [list(range(1, 41))]}), [[0]], collate_padded, chat_loss),
        torch.device("cpu"), 1, checkpointing=False)
    assert beside.one_layer == alone.one_layer > 0


def test_a_loss_that_runs_the_model_once_a_column_counts_one_column_s_layer_being_recomputed():
    """The embedding recipe's loss runs the model once for each text column; the backward pass recomputes one
    column's layer at a time, so the layer being recomputed holds the longest column's activations, not every
    column's."""
    from finetune.task import CountedBatch

    model = tiny_causal_lm()

    def collate(rows):
        return {f"ids_{i}": torch.tensor([row[f"ids_{i}"] for row in rows]) for i in range(len(rows[0]))}

    def loss(model, batch):
        return sum(model(input_ids=ids).logits.float().logsumexp(-1).sum() for ids in batch.values())

    def one_layer(row: dict) -> int:
        return predict_memory(model, CountedBatch([row] * 2, collate, loss, "2 x 48"), torch.device("cpu"), 1,
                              checkpointing=True).one_layer

    longest = one_layer({"ids_0": list(range(1, 49))})
    assert 0 < one_layer({"ids_0": list(range(1, 49)), "ids_1": list(range(1, 25))}) == pytest.approx(longest, rel=0.1)


def tiled_step(model, checkpointed: bool, tiled: bool) -> tuple[int, torch.Tensor, dict[str, torch.Tensor]]:
    """What a forward pass over ``padded_batch`` (60 positions: 2 tiles of the tiny model's 32) keeps for the
    backward pass (``kept_for_backward``), its loss and its gradients, the random state seeded alike."""
    model = copy.deepcopy(model)
    keep_less(model, checkpointed, tiled)
    torch.manual_seed(0)
    kept = kept_for_backward(lambda: model(**padded_batch()).loss, model)
    torch.manual_seed(0)
    loss = model(**padded_batch()).loss
    loss.backward()
    return kept, loss.detach(), {name: p.grad for name, p in model.named_parameters() if p.requires_grad}


@pytest.mark.parametrize("checkpointed", [False, True], ids=["kept", "recomputed"])
@pytest.mark.parametrize("lora_dropout", [None, 0.0, 0.1], ids=["full", "lora", "lora-with-dropout"])
def test_tiled_mlps_keep_their_input_alone_and_train_as_the_whole_mlp(lora_dropout, checkpointed, monkeypatch):
    """Against the same tiles run with every activation kept (the dropout's masks drawn tile by tile alike, which
    the backward pass must draw again), and without dropout against the MLP and the norm before it run whole: the
    same loss, gradients within 1e-6 (of the largest, against the whole: the norm's sums over positions now add
    tile by tile), and none of the MLP's intermediate activations kept, nor the norm's output."""
    model = tiny_causal_lm().train() if lora_dropout is None else adapted(lora_dropout)
    kept, loss, gradients = tiled_step(model, checkpointed, tiled=True)

    def kept_tiles(mlp, tiles, x, *weights):
        parts = x.reshape(-1, x.shape[-1]).tensor_split(tiles)
        return torch.cat([mlp.untiled_forward(part) for part in parts]).reshape(*x.shape[:-1], -1)

    with monkeypatch.context() as patched:
        patched.setattr(memory_module._TiledMLP, "apply", kept_tiles)
        kept_by_tiles, loss_by_tiles, gradients_by_tiles = tiled_step(model, checkpointed, tiled=True)
    references = [(loss_by_tiles, gradients_by_tiles, 0.0)]
    if not lora_dropout:
        references.append((*tiled_step(model, checkpointed, tiled=False)[1:], 1e-6))
    for reference_loss, reference_gradients, of_largest in references:
        torch.testing.assert_close(loss, reference_loss, rtol=1e-6, atol=0)
        assert gradients.keys() == reference_gradients.keys() and len(gradients) > 0
        for name, gradient in gradients.items():
            reference = reference_gradients[name]
            torch.testing.assert_close(gradient, reference, rtol=1e-6, atol=1e-9 + of_largest * reference.abs().max(),
                                       msg=name)
    if not checkpointed:
        # each layer's gate, up, their product and the activation (60 positions x 64 x 4 bytes), and its
        # post-attention norm's output (60 x 32 x 4 bytes)
        assert kept <= kept_by_tiles - 2 * (4 * 60 * 64 * 4 + 60 * 32 * 4), (kept, kept_by_tiles)


@pytest.mark.parametrize(("family", "folded"), [("qwen3", "post_attention_layernorm"),
                                                ("gemma2", "pre_feedforward_layernorm"), ("olmo2", None)])
def test_only_a_norm_whose_output_the_mlp_alone_reads_runs_inside_the_tiles(family, folded, tmp_path):
    """Gemma 2's post-attention norm normalizes the attention's output before the residual sum, and OLMo 2's MLP
    reads the sum itself: tiled, each model computes what it computes whole (the same loss, gradients within 1e-6
    of the largest), with the norm that feeds its MLP alone, where there is one, run a tile at a time."""
    from transformers import AutoConfig

    config = AutoConfig.for_model(family, vocab_size=100, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                  num_attention_heads=2, num_key_value_heads=1, head_dim=16)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path)
    # loaded as a recipe loads it: transformers then sets a hub-kernel layer's forward (an RMSNorm's) back, or to a
    # kernel, at each switch between training and evaluation
    model, tiled = (AutoModelForCausalLM.from_pretrained(tmp_path).train() for _ in range(2))
    for norm in tiled.modules():  # as a hub kernel's forward is set on a GPU at load: here the class's own
        if hasattr(type(norm), "kernel_layer_name"):
            norm.forward = types.MethodType(type(norm).forward, norm)
    tile_mlps(tiled)
    tiled.eval().train()
    layer = tiled.model.layers[0]
    assert [name for name, module in layer.named_children()
            if module is not layer.mlp and any(module is part for part in layer.mlp.tiled_modules)] == [
        *([folded] if folded else [])]
    ids = torch.randint(1, 100, (1, 70), generator=torch.Generator().manual_seed(0))  # 3 tiles of 32
    losses, gradients = [], []
    for each in (model, tiled):
        loss = each(input_ids=ids, labels=ids).loss
        loss.backward()
        losses.append(loss.detach())
        gradients.append({name: parameter.grad for name, parameter in each.named_parameters()})
    torch.testing.assert_close(losses[1], losses[0], rtol=1e-6, atol=0)
    for name, reference in gradients[0].items():
        torch.testing.assert_close(gradients[1][name], reference, rtol=1e-6, atol=1e-6 * reference.abs().max(),
                                   msg=name)


def test_a_tiled_mlp_s_backward_is_counted_one_tile_at_a_time():
    """The backward pass of --tiled_mlp runs each tile's MLP again and holds what that keeps until the tile's
    gradients are taken: the prediction adds as many bytes as each tile's recompute keeps in a real backward pass
    (counted as it runs: 2 layers x 12 tiles of 32 positions, LoRA's dropout masks included), once."""
    generator = torch.Generator().manual_seed(0)
    rows = {"input_ids": [torch.randint(1, 500, (192,), generator=generator).tolist() for _ in range(2)]}
    rows["labels"] = [[IGNORE] * 10 + ids[10:] for ids in rows["input_ids"]]
    train_set = TokenizedDataset.from_dict(rows)
    model = adapted(0.1)
    tile_mlps(model)

    def loss(model, batch):  # transformers' own, which recomputes nothing in the backward pass but the tiles
        return model(**batch).loss

    estimate = predict_memory(model, longest_planned(train_set, [[0, 1]], collate_padded, loss), torch.device("cpu"),
                              1, checkpointing=False)
    held = {p.untyped_storage().data_ptr() for p in model.parameters()}
    hooks = [mlp.register_forward_pre_hook(lambda mlp, args: held.add(args[0].untyped_storage().data_ptr()))
             for mlp in model.modules() if hasattr(mlp, "untiled_forward")]
    backward = loss(model, collate_padded([train_set[0], train_set[1]]))
    for hook in hooks:
        hook.remove()
    alive, kept_by_tiles = {}, 0

    def count(tensor):
        nonlocal kept_by_tiles
        address = tensor.untyped_storage().data_ptr()
        if address not in held and (address not in alive or alive[address].expired()):
            alive[address] = StorageWeakRef(tensor.untyped_storage())
            kept_by_tiles += tensor.untyped_storage().nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(count, lambda tensor: tensor):
        backward.backward()
    # at least each tile's gate, up, their product and the activation: 32 positions x 64 x 4 bytes
    assert estimate.tile * 2 * 12 == kept_by_tiles and estimate.tile >= 4 * 32 * 64 * 4, (estimate.tile, kept_by_tiles)
    assert estimate.peak == (estimate.in_use + estimate.gradients + estimate.optimizer + estimate.logits
                             + estimate.activations + estimate.tile)
    assert ", 0 MiB for an MLP tile's backward" in estimate.line()  # (the tiny model's: tens of kB)


def test_a_model_without_mlps_in_its_layers_is_refused_tiling():
    from transformers import BertConfig, BertModel

    bert = BertModel(BertConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64))
    with pytest.raises(UserError, match=r"--tiled_mlp: BertModel's layers have no MLP transformers can reach"):
        keep_less(bert, False, tiled_mlp=True)
    with pytest.raises(UserError, match=r"--tiled_mlp with sharded weights \(--fsdp, or an accelerate config"):
        check_tiling(True, shards_weights=True)
    check_tiling(True, shards_weights=False)


def test_tiled_mlps_are_counted_as_the_whole_micro_batch_tiles_them(monkeypatch):
    """A micro-batch longer than the count takes is counted on its rows cut short, whose MLPs would run whole or in
    fewer, longer tiles: counted with as many tiles as the whole micro-batch's, each as much shorter, the fit keeps
    what the whole one does (counted exactly), none of its MLPs' intermediate activations."""
    monkeypatch.setattr(estimate_module, "COUNTED_TOKENS", 64)  # rows cut to 32 and 64 positions: tiles of 32
    generator = torch.Generator().manual_seed(0)
    rows = {"input_ids": [torch.randint(1, 500, (n,), generator=generator).tolist() for n in (180, 200)]}
    rows["labels"] = [[IGNORE] * 10 + ids[10:] for ids in rows["input_ids"]]
    train_set = TokenizedDataset.from_dict(rows)
    model = adapted(0.0).eval()
    tile_mlps(model)
    estimate = predict_memory(model, longest_planned(train_set, [[0, 1]], collate_padded, chat_loss),
                              torch.device("cpu"), 1, checkpointing=False)
    whole = collate_padded([train_set[0], train_set[1]])
    tiled, untiled = adapted(0.0).train(), adapted(0.0).train()
    tile_mlps(tiled)
    kept = kept_for_backward(lambda: chat_loss(tiled, dict(whole)), tiled)
    kept_untiled = kept_for_backward(lambda: chat_loss(untiled, dict(whole)), untiled)
    assert estimate.activations == pytest.approx(kept, rel=0.05)
    # each layer's gate, up, their product and the activation: 400 positions x 64 x 4 bytes
    assert kept <= kept_untiled - 2 * 4 * 400 * 64 * 4, (kept, kept_untiled)
