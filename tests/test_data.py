import random
from collections import Counter

import pytest

from finetune.config import parse_config
from finetune.data import GlobalBatchSampler, load_classification_data
from finetune.default_dataset import LABEL_NAMES, make_support_tickets
from finetune.errors import UserError


def lengths_with_a_long_tail(count=203, seed=0):
    rng = random.Random(seed)
    return [min(int(rng.expovariate(1 / 20)) + 4, 128) for _ in range(count)]


def shares(lengths, batch, world, epoch=0, group=True, accumulation=1):
    """Each rank's list of batches, through the sampler as Accelerate sees it (all ranks interleaved)."""
    sampler = GlobalBatchSampler(lengths, batch, world, seed=3, group_by_length=group,
                                 accumulation_steps=accumulation)
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


def test_the_rank_view_equals_the_interleaved_view():
    lengths = lengths_with_a_long_tail()
    interleaved = shares(lengths, 4, 3)
    for rank in range(3):
        sampler = GlobalBatchSampler(lengths, 4, 3, seed=3, group_by_length=True, rank=rank)
        assert [list(b) for b in sampler] == [list(b) for b in interleaved[rank]]


def test_global_batches_do_not_depend_on_the_world_size():
    lengths = lengths_with_a_long_tail()
    one = shares(lengths, 8, 1)[0]
    two = shares(lengths, 4, 2)
    for step, batch in enumerate(one):
        assert sorted(batch) == sorted(two[0][step] + two[1][step])


def test_loss_weights_average_to_the_window_mean():
    lengths = lengths_with_a_long_tail(count=50)
    world, accumulation = 2, 3
    per_rank = shares(lengths, 4, world, accumulation=accumulation)
    steps = len(per_rank[0])
    for start in range(0, steps, accumulation):
        window = [b for rank in per_rank for b in rank[start:start + accumulation]]
        # DDP averages over ranks: the summed weights divided by the world size must be 1.
        assert sum(b.loss_scale * b.num_real for b in window) / world == pytest.approx(1.0)


def test_a_global_batch_smaller_than_the_world_gives_fillers_with_zero_weight():
    # 9 examples, global batch 2 x 4 = 8: the second global batch holds 1 example for 4 ranks.
    last = [rank[-1] for rank in shares([5] * 9, 2, 4)]
    assert [b.num_real for b in last] == [1, 0, 0, 0]
    assert all(len(b) == 1 for b in last), "every rank still steps, on a filler"
    assert last[0].loss_scale == pytest.approx(4 / 1)


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


def test_string_labels_become_sorted_ids(tmp_path):
    (tmp_path / "train.jsonl").write_text('{"text": "a", "label": "pos"}\n{"text": "b", "label": "neg"}\n')
    (tmp_path / "validation.jsonl").write_text('{"text": "c", "label": "neg"}\n')
    data = load_classification_data(parse_config(["--train_file", str(tmp_path / "train.jsonl"),
                                                  "--validation_file", str(tmp_path / "validation.jsonl")]))
    assert data.label_names == ["neg", "pos"]
    assert data.train["labels"] == [1, 0] and data.validation["labels"] == [0]


@pytest.mark.parametrize("suffix", [".tsv", ".parquet", ".json"])
def test_other_file_types_load(tmp_path, suffix):
    import pandas as pd

    frame = pd.DataFrame({"text": ["x", "y", "z"], "label": [0, 1, 1]})
    for split in ("train", "validation"):
        path = tmp_path / f"{split}{suffix}"
        if suffix == ".tsv":
            frame.to_csv(path, sep="\t", index=False)
        elif suffix == ".parquet":
            frame.to_parquet(path)
        else:
            frame.to_json(path, orient="records")
    data = load_classification_data(parse_config(["--train_file", str(tmp_path / f"train{suffix}"),
                                                  "--validation_file", str(tmp_path / f"validation{suffix}")]))
    assert data.label_names == ["0", "1"] and len(data.train) == 3


def test_a_single_class_is_refused(tmp_path):
    (tmp_path / "t.csv").write_text("text,label\na,x\nb,x\n")
    with pytest.raises(UserError, match="single class"):
        load_classification_data(parse_config(["--train_file", str(tmp_path / "t.csv"),
                                               "--validation_file", str(tmp_path / "t.csv")]))
