"""Tagging words (named entities): CoNLL files, checked BIO tags, sub-token alignment, entity-level scores.

Scores follow seqeval's default semantics: an entity is a maximal run of one type that starts at ``B-X``, or at
``I-X`` when the tag before is not of type X, and continues while ``I-X`` follows. Precision, recall and F1
count whole entities (type and span must both match); accuracy counts words.
"""

from __future__ import annotations

import datasets
from transformers import PreTrainedTokenizerBase

from finetune.data.cache import TOKEN_IDS, Tokenizing
from finetune.errors import UserError

__all__ = ["align_labels", "count_cut", "encode_tags", "entities", "entity_scores", "first_pieces", "read_conll"]

IGNORE = -100
"""The label of sub-tokens that are neither trained nor scored (special tokens, later pieces of a word)."""


def read_conll(path: str) -> datasets.Dataset:
    """Sentences of a CoNLL-style file: one word per line with its tag in the last column, a blank line
    between sentences, ``-DOCSTART-`` lines skipped.

    Raises:
        UserError: a line whose number of columns differs from the file's first line, or a line of one column.
    """
    sentences, tokens, tags, columns = [], [], [], None
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, start=1):
            fields = line.split()
            if not fields or fields[0] == "-DOCSTART-":
                if tokens:
                    sentences.append((tokens, tags))
                tokens, tags = [], []
                continue
            columns = columns or len(fields)
            if len(fields) != columns or columns < 2:
                raise UserError(f"{path} line {number} has {len(fields)} column(s) where the file has {columns}; "
                                "each line is a word and its tag (other columns between them), the same count on "
                                "every line")
            tokens.append(fields[0])
            tags.append(fields[-1])
    if tokens:
        sentences.append((tokens, tags))
    return datasets.Dataset.from_dict({"tokens": [s[0] for s in sentences], "ner_tags": [s[1] for s in sentences]})


def encode_tags(train: datasets.Dataset, validation: datasets.Dataset, words: str, tags: str):
    """``(tag names, train, validation)``, each split with ``tokens`` (words) and ``labels`` (tag ids).

    Tags may be strings (``O`` first, then sorted) or ids with names from a ``ClassLabel`` feature.

    Raises:
        UserError: naming the split and row: words and tags of different lengths, an empty sentence, a word
            that is not a string, an unlabelled (-1) or unknown tag, a tag BIO does not allow where it stands
            (``I-X`` after ``O`` or after another type), a validation tag that training never has.
    """
    feature = train.features[tags]
    names = list(feature.feature.names) if isinstance(getattr(feature, "feature", None), datasets.ClassLabel) else None
    rows = {name: _checked_rows(split, words, tags, name, names)
            for name, split in (("train", train), ("validation", validation))}
    if names is None:
        seen = {tag for _, sentence_tags in rows["train"] for tag in sentence_tags}
        names = ["O", *sorted(seen - {"O"})]
    unseen = sorted({tag for _, sentence_tags in rows["validation"] for tag in sentence_tags} - set(names))
    if unseen:
        raise UserError(f"validation data has tag(s) {', '.join(unseen[:5])} that training data never has; add "
                        "sentences with them to training or remove them")
    ids = {name: i for i, name in enumerate(names)}
    encoded = [datasets.Dataset.from_dict({"tokens": [w for w, _ in split_rows],
                                           "labels": [[ids[t] for t in sentence] for _, sentence in split_rows]})
               for split_rows in rows.values()]
    return names, *encoded


def _checked_rows(split: datasets.Dataset, words: str, tags: str, name: str, names: list[str] | None):
    rows = []
    for row, (sentence, labels) in enumerate(zip(split[words], split[tags], strict=True), start=1):
        where = f"{name} data row {row}"
        if not sentence:
            raise UserError(f"{where} is an empty sentence; drop it")
        if not all(isinstance(word, str) for word in sentence):
            bad = next(word for word in sentence if not isinstance(word, str))
            raise UserError(f"{where}: column {words!r} holds {bad!r}, not a word; give a list of strings per row")
        if labels is None or len(labels) != len(sentence):
            raise UserError(f"{where} has {len(sentence)} words and {len(labels or [])} tags; give one tag per word")
        if names is not None:
            if any(label is None or label < 0 for label in labels):
                raise UserError(f"{where} is unlabelled (tag -1); use a split with tags, or drop such rows")
            labels = [names[label] for label in labels]
        for position, tag in enumerate(labels):
            if not isinstance(tag, str) or (tag != "O" and not tag.startswith(("B-", "I-"))):
                raise UserError(f"{where}, word {position + 1}: tag {tag!r} is not BIO (O, B-TYPE or I-TYPE)")
            before = labels[position - 1] if position else "O"
            if tag.startswith("I-") and before[2:] != tag[2:]:
                raise UserError(f"{where}, word {position + 1}: {tag} follows {before}, which BIO does not allow; "
                                f"start the entity with B-{tag[2:]}")
        rows.append((list(sentence), list(labels)))
    return rows


def align_labels(split: datasets.Dataset, tokenizer: PreTrainedTokenizerBase, max_length: int,
                 label_all_tokens: bool, tag_names: list[str], name: str, tokenizing: Tokenizing,
                 keep_words: bool = False) -> datasets.Dataset:
    """Sub-tokens of each sentence with a label on the first piece of every word (on every piece with
    ``label_all_tokens``), cut to ``max_length``; a row's loss units are its labelled sub-tokens.

    With ``label_all_tokens`` a word's later pieces continue its entity (``I-X`` after a ``B-X`` word), as in
    transformers' run_ner.py, so that grouping sub-tokens into entities keeps a word whole.

    With ``keep_words`` each row also keeps its ``words`` and the ``word_ids`` of its sub-tokens (-1 for special
    tokens), to turn predictions back into one tag per word.
    """
    ids = {tag: i for i, tag in enumerate(tag_names)}
    continuation = [ids.get("I-" + tag[2:], i) if tag.startswith("B-") else i for i, tag in enumerate(tag_names)]

    def align(batch, rows):
        encoded = tokenizer(_fitting_words(batch["tokens"], tokenizer, max_length), is_split_into_words=True,
                            truncation=True, max_length=max_length, return_attention_mask=False,
                            return_token_type_ids=False)
        all_labels, all_word_ids = [], []
        for row, word_labels in enumerate(batch["labels"]):
            word_ids = encoded.word_ids(row)
            labels, previous = [], None
            for word in word_ids:
                if word is None or (word == previous and not label_all_tokens):
                    labels.append(IGNORE)
                elif word == previous:  # a later piece of a word continues its entity: B-X becomes I-X
                    labels.append(continuation[word_labels[word]])
                else:
                    labels.append(word_labels[word])
                previous = word
            all_labels.append(labels)
            all_word_ids.append([-1 if word is None else word for word in word_ids])
        out = {"input_ids": encoded["input_ids"], "labels": all_labels}
        return {**out, "words": batch["tokens"], "word_ids": all_word_ids} if keep_words else out

    features = {"input_ids": TOKEN_IDS, "labels": TOKEN_IDS}
    if keep_words:
        features.update(words=datasets.Sequence(datasets.Value("string")), word_ids=TOKEN_IDS)
    return tokenizing.map(split, align, name, features)


def _fitting_words(sentences: list[list[str]], tokenizer, max_length: int) -> list[list[str]]:
    """Each sentence, or its first ``max_length`` words where they make at least ``max_length`` tokens: words are
    tokenized one by one, so the tokens kept are the whole sentence's, and a sentence of a million words is not
    tokenized whole to keep its start."""
    long = [i for i, words in enumerate(sentences) if len(words) > max_length]
    if not long:
        return sentences
    counts = tokenizer([sentences[i][:max_length] for i in long], is_split_into_words=True, add_special_tokens=False,
                       return_attention_mask=False)["input_ids"]
    fitting = list(sentences)
    for i, ids in zip(long, counts, strict=True):
        if len(ids) >= max_length:
            fitting[i] = sentences[i][:max_length]
    return fitting


def count_cut(rows: datasets.Dataset) -> int:
    """Sentences of ``rows`` (aligned with ``keep_words``) whose last words were cut off by the length limit."""
    return sum(max(word_ids, default=-1) + 1 < len(words) for word_ids, words in zip(rows["word_ids"], rows["words"],
                                                                                     strict=True))


def first_pieces(word_ids: list[int]) -> list[int]:
    """Positions of the first sub-token of each word (word ids, -1 for special tokens): where a word's tag is read
    and scored."""
    return [position for position, word in enumerate(word_ids)
            if word >= 0 and (position == 0 or word_ids[position - 1] != word)]


def entities(tags: list[str]) -> set[tuple[str, int, int]]:
    """The ``(type, first word, last word)`` of every entity in one sentence's tags (seqeval's reading)."""
    found, start = set(), None
    for position, tag in enumerate([*tags, "O"]):
        kind = tag[2:] if tag != "O" else None
        continues = tag.startswith("I-") and start is not None and kind == tags[start][2:]
        if start is not None and not continues:
            found.add((tags[start][2:], start, position - 1))
            start = None
        if kind is not None and not continues:
            start = position
    return found


def entity_scores(references: list[list[str]], predictions: list[list[str]]) -> dict:
    """``overall_precision``, ``overall_recall``, ``overall_f1``, ``overall_accuracy`` and, per entity type,
    ``{precision, recall, f1, number}``: the numbers and keys of ``evaluate``'s seqeval module."""
    true = [{(i, *e) for e in entities(tags)} for i, tags in enumerate(references)]
    predicted = [{(i, *e) for e in entities(tags)} for i, tags in enumerate(predictions)]
    true, predicted = set().union(*true), set().union(*predicted)
    scores = {}
    for kind in sorted({e[1] for e in true | predicted}):
        scores[kind] = {**_prf(true, predicted, kind), "number": sum(e[1] == kind for e in true)}
    overall = _prf(true, predicted, None)
    words = [(r, p) for ref, pred in zip(references, predictions, strict=True) for r, p in zip(ref, pred, strict=True)]
    return {**scores, **{f"overall_{k}": v for k, v in overall.items()},
            "overall_accuracy": sum(r == p for r, p in words) / max(len(words), 1)}


def _prf(true: set, predicted: set, kind: str | None) -> dict[str, float]:
    true = {e for e in true if kind is None or e[1] == kind}
    predicted = {e for e in predicted if kind is None or e[1] == kind}
    correct = len(true & predicted)
    precision = correct / len(predicted) if predicted else 0.0
    recall = correct / len(true) if true else 0.0
    f1 = 2 * precision * recall / (precision + recall) if precision + recall else 0.0
    return {"precision": precision, "recall": recall, "f1": f1}
