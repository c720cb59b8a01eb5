"""Sentence classification's data: label ids and checked, tokenized texts."""

from __future__ import annotations

import math

import datasets
from transformers import PreTrainedTokenizerBase

from finetune.data.cache import TOKEN_IDS, Tokenizing, fitting_prefixes
from finetune.errors import UserError

__all__ = ["encode_labels", "tokenize_texts"]


def encode_labels(train: datasets.Dataset, validation: datasets.Dataset, column: str):
    """``(label names, train, validation)`` with ``column`` replaced by ``labels``: ids into the names.

    String labels map to ids in sorted order; a ``ClassLabel`` keeps its names.

    Raises:
        UserError: a missing, fractional or unlabelled (-1) label, a single class, or validation labels training
            never has.
    """
    feature = train.features[column]
    if isinstance(feature, datasets.ClassLabel):
        names = list(feature.names)
        encode = None
    else:
        names = [str(v) for v in sorted(set(_label_values(train, column, "train")))]
        encode = {name: i for i, name in enumerate(names)}
    if len(names) < 2:
        raise UserError(f"training labels have a single class ({names[0]!r}); classification needs at least two")
    if encode is None:
        for name, split in (("train", train), ("validation", validation)):
            unlabelled = next((row for row, value in enumerate(split[column], start=1) if value < 0), None)
            if unlabelled:
                raise UserError(f"{name} data row {unlabelled} is unlabelled (label -1 in column {column!r}); use a "
                                "split with labels (a Hub dataset's test split often has none), or drop such rows")
        eval_feature = validation.features[column]
        if not isinstance(eval_feature, datasets.ClassLabel) or list(eval_feature.names) != names:
            raise UserError("validation labels are not the same classes as training labels; use one label set")
        if column != "labels":
            train, validation = train.rename_column(column, "labels"), validation.rename_column(column, "labels")
        return names, train, validation

    unseen = sorted({str(v) for v in _label_values(validation, column, "validation")} - set(encode))
    if unseen:
        raise UserError(f"validation data has label(s) {', '.join(unseen[:5])} that training data never has; "
                        "add examples of them to training or remove them")

    def to_ids(batch):
        return {"labels": [encode[str(v)] for v in batch[column]]}

    return (names, train.map(to_ids, batched=True, remove_columns=[column], keep_in_memory=True),
            validation.map(to_ids, batched=True, remove_columns=[column], keep_in_memory=True))


def _label_values(split: datasets.Dataset, column: str, name: str) -> list:
    values = split[column]
    first_of_kind = {}  # text or number: the row of the first label of each kind
    for row, value in enumerate(values):
        if value is None or (isinstance(value, float) and math.isnan(value)):
            raise UserError(f"{name} data row {row + 1} has no label in column {column!r}; fill it in or drop the row")
        if isinstance(value, float) and not value.is_integer():
            raise UserError(
                f"{name} data row {row + 1} has label {value} in column {column!r}; labels must be class names or ids")
        first_of_kind.setdefault(isinstance(value, str), row)
    if len(first_of_kind) > 1:
        text, number = first_of_kind[True], first_of_kind[False]
        raise UserError(f"{name} data mixes class names and ids in column {column!r} (row {text + 1}: "
                        f"{values[text]!r}, row {number + 1}: {values[number]!r}); give every label the same way")
    return [int(v) if isinstance(v, float) else v for v in values]


def tokenize_texts(split: datasets.Dataset, tokenizer: PreTrainedTokenizerBase, columns: list[str],
                   max_length: int, name: str, tokenizing: Tokenizing) -> datasets.Dataset:
    """Token ids of ``columns`` (a text, or a text pair), truncated to ``max_length``, unpadded, with the labels.

    Raises:
        UserError: ``max_length`` leaves no room for a token of each text beside the special tokens, or a text that
            is missing, empty or not a string, with its row in split ``name``.
    """
    special = tokenizer.num_special_tokens_to_add(pair=len(columns) > 1)
    if max_length < special + len(columns):  # the tokenizer would keep only its own tokens, or ignore the limit
        raise UserError(f"--max_seq_length {max_length} leaves no room for the text: the tokenizer adds {special} "
                        f"special tokens to each example; give at least {special + len(columns)}")
    # Attention masks are all ones before padding, which makes them; type ids matter for pairs only.
    type_ids = len(columns) > 1 and "token_type_ids" in tokenizer.model_input_names

    def encode(batch, rows):
        for position, row in enumerate(rows):
            for column in columns:
                value = batch[column][position]
                if not isinstance(value, str):
                    raise UserError(f"{name} data row {row + 1}: column {column!r} holds {value!r}, not text; "
                                    "fix the data or pick the right --text_column")
                if not value.strip():
                    raise UserError(f"{name} data row {row + 1}: column {column!r} is empty; fill it in or drop "
                                    "the row")
        encoded = tokenizer(*_fitting(tokenizer, [batch[column] for column in columns], max_length),
                            truncation=True, max_length=max_length, return_attention_mask=False,
                            return_token_type_ids=type_ids)
        return {**encoded, "labels": batch["labels"]}

    features = {"input_ids": TOKEN_IDS, "labels": datasets.Value("int32")}
    if type_ids:
        features["token_type_ids"] = datasets.Sequence(datasets.Value("int8"))
    return tokenizing.map(split, encode, name, features)


def _fitting(tokenizer, columns: list[list[str]], max_length: int) -> list[list[str]]:
    """Each column's texts cut before they are tokenized where that keeps the tokens kept (``fitting_prefixes``).

    A pair is cut on one side only, where the cut side keeps more tokens than the other has: truncating the
    longest first gives the longer text the odd token, so the order of their lengths must not change.
    """
    cut = [fitting_prefixes(texts, tokenizer, max_length) for texts in columns]
    if len(cut) == 1:
        return [cut[0][0]]
    (first, first_lengths), (second, second_lengths) = cut
    for row, lengths in enumerate(zip(first_lengths, second_lengths, strict=True)):
        if lengths == (None, None):
            continue
        side = 0 if lengths[0] is not None else 1
        other = (second, first)[side][row]
        if None not in lengths or lengths[side] <= len(tokenizer(other, add_special_tokens=False)["input_ids"]):
            first[row], second[row] = columns[0][row], columns[1][row]
    return [first, second]
