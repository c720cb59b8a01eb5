"""Metrics as ``evaluate`` modules, built here rather than fetched from the Hub.

``evaluate.load("accuracy")`` downloads the module's script from the Hub, unpinned, and runs it, on every
process. The modules built here compute the same numbers (accuracy and F1 call scikit-learn, as the Hub's do;
seqeval's entity scores are ``finetune.tasks.tagging.entity_scores``, tested against seqeval), need no network, and run
only this package's code. ``evaluate`` and scikit-learn load with the first metric (about 2 s), not with this
module, so that a recipe's flags are checked before they load.
"""

from __future__ import annotations

import functools

__all__ = ["classification_metrics", "correlations", "load_metric", "retrieval_metrics"]


@functools.cache
def load_metric(name: str):
    """The ``evaluate`` module ``name`` (accuracy, f1 or seqeval), built here; loaded once per process."""
    return _offline_modules()[name](keep_in_memory=True)


@functools.cache
def _offline_modules() -> dict[str, type]:
    import datasets
    import evaluate
    from sklearn.metrics import accuracy_score, f1_score

    from finetune.tasks.tagging import entity_scores

    features = datasets.Features({"predictions": datasets.Value("int64"), "references": datasets.Value("int64")})

    class OfflineAccuracy(evaluate.Metric):
        """Fraction of predictions equal to their reference."""

        def _info(self):
            return evaluate.MetricInfo(description="Accuracy: correct predictions / all predictions.", citation="",
                                       inputs_description="predictions and references: class ids",
                                       features=features)

        def _compute(self, predictions, references, normalize=True, sample_weight=None):
            return {"accuracy": float(accuracy_score(references, predictions, normalize=normalize,
                                                     sample_weight=sample_weight))}

    class OfflineF1(evaluate.Metric):
        """Harmonic mean of precision and recall (``average`` as in scikit-learn)."""

        def _info(self):
            return evaluate.MetricInfo(
                description="F1 = 2 * precision * recall / (precision + recall).", citation="",
                inputs_description="predictions and references: class ids; average: binary, macro, micro, weighted",
                features=features)

        def _compute(self, predictions, references, labels=None, pos_label=1, average="binary", sample_weight=None):
            return {"f1": float(f1_score(references, predictions, labels=labels, pos_label=pos_label,
                                         average=average, sample_weight=sample_weight))}

    class OfflineSeqeval(evaluate.Metric):
        """Entity-level precision, recall and F1 (overall and per type) and word accuracy, as seqeval."""

        def _info(self):
            tags = datasets.Sequence(datasets.Value("string"))
            return evaluate.MetricInfo(description="seqeval's entity-level scores for BIO tags.", citation="",
                                       inputs_description="predictions and references: a list of tags per sentence",
                                       features=datasets.Features({"predictions": tags, "references": tags}))

        def _compute(self, predictions, references):
            return entity_scores(references, predictions)

    return {"accuracy": OfflineAccuracy, "f1": OfflineF1, "seqeval": OfflineSeqeval}


def classification_metrics(predictions, references, num_labels: int) -> dict[str, float]:
    """Accuracy and F1 (binary for two classes, macro-averaged for more), as plain floats."""
    average = "binary" if num_labels == 2 else "macro"
    return {
        **load_metric("accuracy").compute(predictions=predictions, references=references),
        **load_metric("f1").compute(predictions=predictions, references=references, average=average),
    }


def retrieval_metrics(queries, corpus, relevant) -> dict[str, float]:
    """Each query's one relevant document (``relevant``: its row in ``corpus``) ranked among all of ``corpus`` by
    cosine similarity: MRR@10, recall@1/5/10 and NDCG@10, as sentence-transformers' InformationRetrievalEvaluator
    reports them for one relevant document a query (a tie ranks the relevant document first)."""
    import torch

    scores = (torch.nn.functional.normalize(queries.double(), dim=-1)
              @ torch.nn.functional.normalize(corpus.double(), dim=-1).T)
    ranks = (scores > scores.gather(1, relevant[:, None].long())).sum(1).double() + 1
    top10 = ranks <= 10
    return {"mrr@10": torch.where(top10, 1 / ranks, 0).mean().item(),
            **{f"recall@{k}": (ranks <= k).double().mean().item() for k in (1, 5, 10)},
            "ndcg@10": torch.where(top10, 1 / torch.log2(ranks + 1), 0).mean().item()}


def correlations(predicted, reference) -> dict[str, float]:
    """Pearson's and Spearman's correlation (ties ranked by their average rank) of two 1-D sequences."""
    import numpy as np

    predicted, reference = np.asarray(predicted, dtype=np.float64), np.asarray(reference, dtype=np.float64)

    def ranks(values):
        _, inverse, counts = np.unique(values, return_inverse=True, return_counts=True)
        ends = counts.cumsum()
        return ((ends - counts + ends - 1) / 2)[inverse]

    return {"pearson": float(np.corrcoef(predicted, reference)[0, 1]),
            "spearman": float(np.corrcoef(ranks(predicted), ranks(reference))[0, 1])}
