import pytest

from finetune.config import TrainConfig
from finetune.data.embedded.support_tickets import SUPPORT_TICKETS
from finetune.data.sources import load_splits
from finetune.errors import UserError
from finetune.tasks.classification import encode_labels


def read(train, validation):
    return load_splits(TrainConfig(train_file=str(train), validation_file=str(validation)), SUPPORT_TICKETS)[0]


def load(train, validation):
    raw = read(train, validation)
    return encode_labels(raw["train"], raw["validation"], "label")


def test_string_labels_become_sorted_ids(tmp_path):
    (tmp_path / "train.jsonl").write_text('{"text": "a", "label": "pos"}\n{"text": "b", "label": "neg"}\n')
    (tmp_path / "validation.jsonl").write_text('{"text": "c", "label": "neg"}\n')
    names, train, validation = load(tmp_path / "train.jsonl", tmp_path / "validation.jsonl")
    assert names == ["neg", "pos"]
    assert train["labels"] == [1, 0] and validation["labels"] == [0]


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
    names, train, _ = load(tmp_path / f"train{suffix}", tmp_path / f"validation{suffix}")
    assert names == ["0", "1"] and len(train) == 3


def test_a_single_class_is_refused(tmp_path):
    (tmp_path / "t.csv").write_text("text,label\na,x\nb,x\n")
    with pytest.raises(UserError, match="single class"):
        load(tmp_path / "t.csv", tmp_path / "t.csv")


def test_a_tsv_text_that_starts_with_a_quote_stays_one_row(tmp_path):
    rows = ['"Quoted" praise for the app\tpos', "the refund never came\tneg", '"half-open quote\tneg', "fine\tpos"]
    for split in ("train", "validation"):
        (tmp_path / f"{split}.tsv").write_text("text\tlabel\n" + "\n".join(rows) + "\n")
    raw = read(tmp_path / "train.tsv", tmp_path / "validation.tsv")
    assert list(raw["train"]["text"]) == ['"Quoted" praise for the app', "the refund never came",
                                          '"half-open quote', "fine"]


def test_unlabelled_rows_of_a_class_label_column_are_refused(tmp_path):
    import datasets

    features = datasets.Features({"text": datasets.Value("string"), "label": datasets.ClassLabel(names=["a", "b"])})
    datasets.Dataset.from_dict({"text": ["x", "y"], "label": [0, 1]}, features=features).to_parquet(
        tmp_path / "train.parquet")
    datasets.Dataset.from_dict({"text": ["x", "y"], "label": [1, -1]}, features=features).to_parquet(
        tmp_path / "validation.parquet")
    with pytest.raises(UserError, match=r"validation data row 2 is unlabelled \(label -1"):
        load(tmp_path / "train.parquet", tmp_path / "validation.parquet")
