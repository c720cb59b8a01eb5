import random

import datasets
import pytest
from helpers import tokenizing
from transformers import AutoTokenizer

from finetune.data.batching import TokenizedDataset
from finetune.data.embedded.tagged_tickets import ENTITY_TYPES, TAG_NAMES, make_tagged_tickets
from finetune.errors import UserError
from finetune.models.loading import default_model_path
from finetune.tasks.metrics import load_metric
from finetune.tasks.tagging import IGNORE, align_labels, count_cut, encode_tags, entity_scores, first_pieces, read_conll


def random_tags(rng, length):
    # Every kind of sequence a model can predict, BIO-consistent or not.
    return [rng.choice(["O", "O", "B-ORDER", "I-ORDER", "B-DATE", "I-DATE", "I-EMAIL"]) for _ in range(length)]


@pytest.mark.parametrize("seed", range(5))
def test_entity_scores_equal_seqeval_itself(seed):
    from seqeval.metrics import accuracy_score, classification_report

    rng = random.Random(seed)
    references = [random_tags(rng, rng.randint(1, 12)) for _ in range(60)]
    predictions = [[tag if rng.random() < 0.7 else rng.choice(["O", "B-ORDER", "I-DATE"]) for tag in sentence]
                   for sentence in references]
    ours = entity_scores(references, predictions)
    report = classification_report(references, predictions, output_dict=True, zero_division=0)
    assert ours["overall_accuracy"] == pytest.approx(accuracy_score(references, predictions), abs=1e-12)
    for kind in ("ORDER", "DATE", "EMAIL"):
        for measure in ("precision", "recall", "f1-score"):
            assert ours[kind][measure.replace("-score", "")] == pytest.approx(report[kind][measure], abs=1e-12)
        assert ours[kind]["number"] == report[kind]["support"]
    for measure in ("precision", "recall", "f1-score"):
        assert ours[f"overall_{measure.replace('-score', '')}"] == pytest.approx(report["micro avg"][measure],
                                                                                   abs=1e-12)


def test_the_offline_seqeval_module_gives_the_same_keys_and_numbers():
    references, predictions = [["B-ORDER", "I-ORDER", "O"], ["B-DATE"]], [["B-ORDER", "O", "O"], ["B-DATE"]]
    scores = load_metric("seqeval").compute(predictions=predictions, references=references)
    assert type(load_metric("seqeval")).__name__ == "OfflineSeqeval"
    assert scores == entity_scores(references, predictions)
    assert scores["overall_f1"] == pytest.approx(0.5) and scores["DATE"]["f1"] == 1.0


def test_conll_files_are_read_by_sentence(tmp_path):
    path = tmp_path / "data.conll"
    path.write_text("-DOCSTART- -X- O O\n\nRefund NN O\n$5 CD B-AMOUNT\n\n\nto TO O\nanna@x.io NN B-EMAIL\n")
    rows = read_conll(str(path))
    assert rows["tokens"] == [["Refund", "$5"], ["to", "anna@x.io"]]
    assert rows["ner_tags"] == [["O", "B-AMOUNT"], ["O", "B-EMAIL"]]
    path.write_text("Refund NN O\n$5 B-AMOUNT\n")
    with pytest.raises(UserError, match="line 2 has 2 column"):
        read_conll(str(path))


def split(tokens, tags, class_label=False):
    feature = datasets.Sequence(datasets.ClassLabel(names=["O", "B-X", "I-X"])) if class_label else None
    features = datasets.Features({"tokens": datasets.Sequence(datasets.Value("string")),
                                  "ner_tags": feature}) if class_label else None
    return datasets.Dataset.from_dict({"tokens": tokens, "ner_tags": tags}, features=features)


GOOD = split([["a", "b"], ["c"]], [["B-X", "I-X"], ["O"]])


@pytest.mark.parametrize(("train", "validation", "message"), [
    (split([["a", "b"]], [["O"]]), GOOD, "train data row 1 has 2 words and 1 tags"),
    (split([["a"], []], [["O"], []]), GOOD, "train data row 2 is an empty sentence"),
    (split([["a"], ["b"]], [["O"], ["I-X"]]), GOOD, "row 2, word 1: I-X follows O"),
    (split([["a", "b"]], [["B-X", "I-Y"]]), GOOD, "I-Y follows B-X"),
    (split([["a"]], [["PER"]]), GOOD, "tag 'PER' is not BIO"),
    (GOOD, split([["a"]], [["B-Y"]]), "tag(s) B-Y that training data never has"),
    (split([["a"]], [[-1]], class_label=True), split([["a"]], [[0]], class_label=True), "unlabelled (tag -1)"),
])
def test_bad_tags_are_refused_by_row(train, validation, message):
    with pytest.raises(UserError, match=message.replace("(", r"\(").replace(")", r"\)")):
        encode_tags(train, validation, "tokens", "ner_tags")


def test_words_that_are_not_strings_are_refused():
    bad = datasets.Dataset.from_dict({"tokens": [[1, 2]], "ner_tags": [["O", "O"]]})
    with pytest.raises(UserError, match="holds 1, not a word"):
        encode_tags(bad, GOOD, "tokens", "ner_tags")


def test_class_label_ids_take_their_names():
    names, train, _ = encode_tags(split([["a", "b"]], [[1, 2]], True), split([["c"]], [[0]], True), "tokens",
                                  "ner_tags")
    assert names == ["O", "B-X", "I-X"] and train["labels"] == [[1, 2]]


@pytest.mark.parametrize("label_all_tokens", [False, True])
def test_labels_go_to_the_first_piece_of_each_word_unless_all(label_all_tokens, tmp_path):
    tokenizer = AutoTokenizer.from_pretrained(default_model_path())
    words = ["Refund", "$49.99", "to", "lee_99@example.co.uk", "today"]
    names, train, _ = encode_tags(split([words, ["a", "b"]], [["O", "B-AMOUNT", "O", "B-EMAIL", "O"],
                                                              ["B-EMAIL", "I-EMAIL"]]),
                                  split([["x"]], [["O"]]), "tokens", "ner_tags")
    dataset = align_labels(train, tokenizer, 128, label_all_tokens, names, "train", tokenizing(tmp_path),
                           keep_words=True)
    labels, word_ids = dataset[0]["labels"], [dataset[0]["word_ids"]]
    assert count_cut(dataset) == 0 and labels[0] == labels[-1] == IGNORE  # [CLS], [SEP]
    assert word_ids[0][0] == word_ids[0][-1] == -1
    pieces_of_email = [i for i, w in enumerate(word_ids[0]) if w == 3]
    assert len(pieces_of_email) > 1
    assert labels[pieces_of_email[0]] == names.index("B-EMAIL")
    later = {labels[i] for i in pieces_of_email[1:]}
    assert later == ({names.index("I-EMAIL")} if label_all_tokens else {IGNORE})
    assert TokenizedDataset(dataset).loss_units[0] == sum(label != IGNORE for label in labels)
    assert [word_ids[0][p] for p in first_pieces(word_ids[0])] == [0, 1, 2, 3, 4]
    cut = align_labels(train, tokenizer, 6, label_all_tokens, names, "train", tokenizing(tmp_path), keep_words=True)
    assert count_cut(cut) == 1


def test_the_default_data_is_deterministic_and_covers_every_entity_type():
    first, second = make_tagged_tickets(), make_tagged_tickets()
    assert first["train"]["tokens"] == second["train"]["tokens"]
    tags = {TAG_NAMES[t] for sentence in first["validation"]["ner_tags"] for t in sentence}
    assert {f"B-{kind}" for kind in ENTITY_TYPES} <= tags and "I-PRODUCT" in tags
    no_entity = [s for s in first["train"]["ner_tags"] if not any(s)]
    assert 0.02 < len(no_entity) / len(first["train"]) < 0.3, "some sentences hold no entity at all"


def test_a_sentence_far_over_the_limit_is_cut_to_its_first_words_before_tokenizing(tmp_path, monkeypatch):
    """Its sub-tokens, labels, word ids and the count of cut sentences are those the whole sentence tokenized
    gives; the tokenizer never sees more than --max_seq_length words of it."""
    import transformers

    from finetune.tasks import tagging

    tokenizer = AutoTokenizer.from_pretrained(default_model_path())
    long = ["Refund", "$49.99", "to", "lee_99@example.co.uk"] * 5000
    tags = ["O", "B-AMOUNT", "O", "B-EMAIL"] * 5000
    names, train, _ = encode_tags(split([long, ["a"] * 20, ["\u200b"] * 40 + ["b"] * 20],
                                        [tags, ["O"] * 20, ["O"] * 60]),
                                  split([["x"]], [["O"]]), "tokens", "ner_tags")
    longest = []
    call = transformers.PreTrainedTokenizerBase.__call__

    def noting_the_longest(self, text=None, *args, **kwargs):
        longest.append(max(map(len, text)))
        return call(self, text, *args, **kwargs)

    monkeypatch.setattr(transformers.PreTrainedTokenizerBase, "__call__", noting_the_longest)
    cut = align_labels(train, tokenizer, 16, True, names, "train", tokenizing(tmp_path), keep_words=True).to_dict()
    assert max(longest) == 60, "the 20,000 words went as 16; the 60 words that make too few tokens went whole"
    monkeypatch.setattr(tagging, "_fitting_words", lambda sentences, *_: sentences)
    whole = align_labels(train, tokenizer, 16, True, names, "train", tokenizing(tmp_path), keep_words=True).to_dict()
    assert cut == whole and count_cut(datasets.Dataset.from_dict(cut)) == 3
