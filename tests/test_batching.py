import random
from collections import Counter

import pytest
import torch

from finetune.data.batching import GlobalBatchSampler
from finetune.data.embedded.support_tickets import LABEL_NAMES, make_support_tickets


def lengths_with_a_long_tail(count=203, seed=0):
    rng = random.Random(seed)
    return [min(int(rng.expovariate(1 / 20)) + 4, 128) for _ in range(count)]


def shares(lengths, batch, world, epoch=0, group=True, accumulation=1, units=None):
    """Each rank's list of batches, through the sampler as Accelerate sees it (all ranks interleaved)."""
    sampler = GlobalBatchSampler(lengths, batch, world, seed=3, group_by_length=group,
                                 accumulation_steps=accumulation, loss_units=units)
    sampler.set_epoch(epoch)
    batches = list(sampler)
    return [batches[rank::world] for rank in range(world)]


@pytest.mark.parametrize("world", [1, 2, 3])
@pytest.mark.parametrize("group", [True, False])
def test_every_example_once_per_epoch_and_equal_batch_counts(world, group):
    lengths = lengths_with_a_long_tail()
    per_rank = shares(lengths, 4, world, group=group)
    assert len({len(batches) for batches in per_rank}) == 1, "no rank waits on a collective the others skip"
    real = [i for batches in per_rank for b in batches for i in b[:b.num_real]]
    assert sorted(real) == list(range(len(lengths)))


def test_the_rank_view_and_the_plan_equal_the_interleaved_view():
    lengths = lengths_with_a_long_tail()
    interleaved = shares(lengths, 4, 3)
    sampler = GlobalBatchSampler(lengths, 4, 3, seed=3, group_by_length=True)
    for rank in range(3):
        assert [list(b) for b in sampler.for_rank(rank)] == [list(b) for b in interleaved[rank]]
        assert [list(b) for b in sampler.plan(0, rank)] == [list(b) for b in interleaved[rank]]


def test_global_batches_do_not_depend_on_the_world_size():
    lengths = lengths_with_a_long_tail()
    one = shares(lengths, 8, 1)[0]
    two = shares(lengths, 4, 2)
    for step, batch in enumerate(one):
        assert sorted(batch) == sorted(two[0][step] + two[1][step])


def effective_weights(per_rank, world, accumulation, units):
    """Each real example's weight in the averaged gradient of its window: DDP averages the ranks' gradients
    of ``loss_scale x summed loss``, so a unit's weight is ``loss_scale / world``."""
    steps = len(per_rank[0])
    windows = []
    for start in range(0, steps, accumulation):
        weights = {}
        for rank in per_rank:
            for batch in rank[start:start + accumulation]:
                for i in batch[:batch.num_real]:
                    weights[i] = batch.loss_scale / world * units[i]
        windows.append(weights)
    return windows


@pytest.mark.parametrize(("world", "batch"), [(1, 8), (2, 4), (3, 4)])
@pytest.mark.parametrize("token_units", [False, True], ids=["examples", "tokens"])
def test_each_loss_unit_weighs_the_same_in_a_window_that_mixes_a_short_batch_with_full_ones(world, batch,
                                                                                            token_units):
    # 42 examples in windows of 2 global batches: the last window holds a full batch and a short one.
    lengths = lengths_with_a_long_tail(count=42)
    units = [n // 3 + 1 for n in lengths] if token_units else [1] * 42
    sampler = GlobalBatchSampler(lengths, batch, world, seed=3, group_by_length=True)
    sizes = [len(b) for b in sampler.global_batches(0)]
    assert len(sizes) % 2 == 0 and sizes[-2] > sizes[-1], "the last window mixes a full and a short batch"
    windows = effective_weights(shares(lengths, batch, world, accumulation=2, units=units), world, 2, units)
    for weights in windows:
        total_units = sum(units[i] for i in weights)
        for i, weight in weights.items():
            # A per-micro-batch mean (each batch's weights summing to 1/accumulation) gives the examples of a
            # short batch more weight than those of a full one, and fails here.
            assert weight == pytest.approx(units[i] / total_units, rel=1e-12)
        assert sum(weights.values()) == pytest.approx(1.0)


def test_a_global_batch_smaller_than_the_world_gives_fillers_with_zero_weight():
    # 9 examples, global batch 2 x 4 = 8: the second global batch holds 1 example for 4 ranks.
    last = [rank[-1] for rank in shares([5] * 9, 2, 4)]
    assert [b.num_real for b in last] == [1, 0, 0, 0]
    assert all(len(b) == 1 for b in last), "every rank still steps, on a filler"
    assert [b.loss_scale for b in last] == [pytest.approx(4 / 1), 0.0, 0.0, 0.0]


def test_grouping_by_length_cuts_padding():
    lengths = lengths_with_a_long_tail(count=2000)

    def padding_efficiency(group):
        batches = [b for rank in shares(lengths, 16, 2, group=group) for b in rank]
        return sum(lengths[i] for b in batches for i in b) / sum(max(lengths[i] for i in b) * len(b) for b in batches)

    assert padding_efficiency(True) > 0.9 > padding_efficiency(False)


@pytest.mark.parametrize("epoch", [0, 1, 2])
def test_grouped_epochs_start_with_the_longest_batch(epoch):
    lengths = lengths_with_a_long_tail(count=2000)
    first_steps = [rank[0] for rank in shares(lengths, 16, 2, epoch=epoch)]
    longest_full = max(lengths[i] for rank in shares(lengths, 16, 2, epoch=epoch) for b in rank[:-1] for i in b)
    assert max(lengths[i] for b in first_steps for i in b) == longest_full
    ungrouped = [rank[0] for rank in shares(lengths, 16, 2, epoch=epoch, group=False)]
    assert max(lengths[i] for b in ungrouped for i in b) < longest_full, "random batches stay random"


def test_each_epoch_has_its_own_order_and_the_same_epoch_repeats():
    lengths = lengths_with_a_long_tail()
    assert shares(lengths, 4, 2, epoch=1) == shares(lengths, 4, 2, epoch=1)
    assert shares(lengths, 4, 2, epoch=1) != shares(lengths, 4, 2, epoch=2)


def test_default_dataset_is_deterministic_varied_and_named():
    first, second = make_support_tickets(), make_support_tickets()
    assert first["train"]["text"] == second["train"]["text"]
    assert len(first["train"]) >= 2000 and len(first["validation"]) >= 500
    assert first["train"].features["label"].names == LABEL_NAMES
    words = sorted(len(t.split()) for t in first["train"]["text"])
    assert words[len(words) // 2] < 30 and words[-1] > 80, "mostly short, with a long tail"
    shares_ = Counter(first["validation"]["label"])
    assert max(shares_.values()) / len(first["validation"]) < 0.5


def plan_in_python(lengths, batch, world, seed, epoch, group, accumulation, units):
    """The epoch plan written out in Python lists: every rank's ``(indices, num_real, units, loss_scale)`` per
    micro-batch. With one micro-step per window it is the plan finetune made before numpy; the numpy sampler
    must give exactly this."""
    generator = torch.Generator().manual_seed(seed + epoch)
    order = torch.randperm(len(lengths), generator=generator).tolist()
    size = batch * world * accumulation
    if group:
        mega = size * 50
        order = [i for start in range(0, len(order), mega)
                 for i in sorted(order[start:start + mega], key=lambda i: -lengths[i])]
    windows = [order[start:start + size] for start in range(0, len(order), size)]
    full = [windows[i] for i in torch.randperm(len(windows) - 1, generator=generator).tolist()]
    if group and full:
        longest = max(range(len(full)), key=lambda w: max(lengths[i] for i in full[w]))
        full.insert(0, full.pop(longest))
    plans = [[] for _ in range(world)]
    for window in full + windows[-1:]:
        scale = world / sum(units[i] for i in window)
        for start in range(0, len(window), batch * world):
            by_length = sorted(window[start:start + batch * world], key=lambda i: -lengths[i])
            for rank in range(world):
                share = by_length[rank::world]
                plans[rank].append((share, len(share), sum(units[i] for i in share), scale) if share
                                   else (by_length[:1], 0, 0, 0.0))
    return plans


@pytest.mark.parametrize("seed", range(40))
def test_the_numpy_plan_is_the_python_plan(seed):
    rng = random.Random(seed)
    count = rng.choice([1, 2, 7, rng.randint(1, 400), rng.randint(400, 3000)])
    lengths = [rng.randint(1, rng.choice([8, 60, 512])) for _ in range(count)]
    units = [rng.randint(1, 9) for _ in range(count)] if seed % 2 else [1] * count
    batch, world, accumulation = rng.randint(1, 9), rng.randint(1, 4), rng.randint(1, 4)
    group = seed % 3 != 0
    sampler = GlobalBatchSampler(lengths, batch, world, seed=seed, group_by_length=group,
                                 accumulation_steps=accumulation, loss_units=units)
    for epoch in (0, 1):
        expected = plan_in_python(lengths, batch, world, seed, epoch, group, accumulation, units)
        for rank in range(world):
            planned = [(list(b), b.num_real, b.units, b.loss_scale) for b in sampler.plan(epoch, rank)]
            assert planned == expected[rank]
            # A process resumed half-way through the epoch makes its own sampler and skips what was trained.
            resumed_at = len(planned) // 2
            resumed = sampler.for_rank(rank)
            resumed.set_epoch(epoch, skip_batches=resumed_at)
            assert len(resumed) == len(planned) - resumed_at
            assert [(list(b), b.num_real, b.units, b.loss_scale) for b in resumed] == expected[rank][resumed_at:]


@pytest.mark.parametrize("group", [True, False])
def test_an_optimizer_step_takes_the_same_examples_however_its_global_batch_is_split(group):
    lengths, units = lengths_with_a_long_tail(count=203), [n // 3 + 1 for n in lengths_with_a_long_tail(count=203)]

    def steps(batch, world, accumulation):
        sampler = GlobalBatchSampler(lengths, batch, world, seed=3, group_by_length=group,
                                     accumulation_steps=accumulation, loss_units=units)
        plans = [list(sampler.plan(1, rank)) for rank in range(world)]
        micro = [[i for plan in plans for i in plan[b][:plan[b].num_real]] for b in range(len(plans[0]))]
        scales = [plans[0][b].loss_scale / world for b in range(len(plans[0]))]  # each unit's weight after DDP
        return [(sorted(sum(micro[s:s + accumulation], [])), scales[s])
                for s in range(0, len(micro), accumulation)]

    reference = steps(16, 1, 1)
    for batch, world, accumulation in [(8, 2, 1), (4, 2, 2), (8, 1, 2), (2, 4, 2), (4, 1, 4)]:
        examples, weights = zip(*steps(batch, world, accumulation), strict=True)
        assert list(examples) == [step[0] for step in reference]
        assert list(weights) == pytest.approx([step[1] for step in reference], rel=1e-12)


def test_the_sampler_starts_a_resumed_epoch_where_it_stopped():
    lengths = lengths_with_a_long_tail()
    sampler = GlobalBatchSampler(lengths, 4, 2, seed=3, group_by_length=True)
    whole = list(sampler)
    sampler.set_epoch(0, skip_batches=5)
    assert list(sampler) == whole[5 * 2:] and len(sampler) == len(whole) - 5 * 2
