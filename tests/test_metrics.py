import pytest
from sklearn.metrics import f1_score

from finetune.tasks.metrics import classification_metrics, load_metric


def test_the_package_s_own_modules_compute_sklearn_numbers_and_nothing_is_fetched_even_online(monkeypatch):
    """``evaluate.load`` would download and run the Hub's current metric code on every process."""
    import evaluate
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(evaluate, "load", lambda *args, **kwargs: pytest.fail("evaluate.load was called"))
    load_metric.cache_clear()
    assert type(load_metric("accuracy")).__name__ == "OfflineAccuracy"
    assert type(load_metric("f1")).__name__ == "OfflineF1"
    assert type(load_metric("seqeval")).__name__ == "OfflineSeqeval"
    predictions, references = [0, 1, 2, 2, 1, 0, 2], [0, 2, 2, 2, 1, 1, 0]
    metrics = classification_metrics(predictions, references, num_labels=3)
    assert metrics["accuracy"] == pytest.approx(4 / 7)
    assert metrics["f1"] == pytest.approx(f1_score(references, predictions, average="macro"))


def test_two_classes_use_binary_f1():
    # precision 1/2, recall 1/1 for class 1.
    assert classification_metrics([1, 1, 0, 0], [1, 0, 0, 0], num_labels=2)["f1"] == pytest.approx(2 / 3)
