"""Sentence embeddings: rows of texts tokenized, pooled embeddings, the losses of a whole global batch, the
cached-gradient rollout that makes them exact at any world size and accumulation, and evaluation's metrics.

Each anchor is scored against every positive of the global batch, so a micro-batch cannot take a loss of its own.
Each window (an optimizer step's micro-batches) is embedded first without gradients on every process; the
embeddings are gathered, the global batch's loss and its gradient with respect to every embedding taken once; then
each micro-batch runs again with gradients, dropout drawing what it drew the first time, and backpropagates its
rows' share of that gradient (GradCache: Gao et al. 2021). Memory is one micro-batch's activations.
"""

from __future__ import annotations

from dataclasses import dataclass

import datasets
import numpy as np
import torch
import torch.nn.functional as F
import transformers
import xxhash

from finetune.data.batching import LENGTH, LOSS_UNITS, PlannedBatch, padded_tokens
from finetune.data.cache import TOKEN_IDS, Tokenizing, fitting_prefixes
from finetune.data.sources import check_columns
from finetune.distributed.ddp import all_gather_rows, world_size
from finetune.errors import UserError
from finetune.models.loading import load_model
from finetune.models.lora import LoraArguments, add_lora
from finetune.models.memory import random_state, replaying
from finetune.models.sentence_folder import Pooling
from finetune.tasks.metrics import correlations, retrieval_metrics

__all__ = ["CachedGradients", "Objective", "collate_texts", "corpus_ids", "embed", "load_encoder", "merged_encoder",
           "pair_metrics", "pair_predictions", "row_embeddings", "tokenize_pairs", "tokenize_text_rows"]

ROW_VALUES = ("score", "text_ids")
"""What a training batch holds of each row besides its texts, and the loss reads: ``text_ids`` gathers each row's
``text_id_i`` (a number each, which a cut of the token lists, the memory estimate's, leaves whole)."""


@dataclass(frozen=True)
class Objective:
    """A loss over a global batch's embeddings ``[rows, texts, dim]`` (and its scores, for ``cosent``), the mean
    over its rows for the row-wise losses, as sentence-transformers defines each; given each text's id (equal
    texts, equal ids), ``multiple_negatives_ranking`` counts no answer to a row's question as its negative
    (``in_batch_copies``: what sentence-transformers' no-duplicates batch sampler keeps out of a batch instead)."""

    loss: str
    scale: float = 20.0
    symmetric: bool = False
    margin: float = 5.0

    def __call__(self, embeddings: torch.Tensor, scores: torch.Tensor | None = None,
                 text_ids: torch.Tensor | None = None) -> torch.Tensor:
        rows = len(embeddings)
        if self.loss == "cosent":  # every pair scored lower than another is pushed below it
            similarity = self.scale * F.cosine_similarity(embeddings[:, 0], embeddings[:, 1], dim=-1)
            below = scores[:, None] < scores[None, :]
            differences = (similarity[:, None] - similarity[None, :])[below]
            return torch.logsumexp(torch.cat([differences.new_zeros(1), differences]), dim=0)
        if self.loss == "triplet":
            anchor, positive, negative = embeddings.unbind(1)
            return F.relu((anchor - positive).norm(dim=-1) - (anchor - negative).norm(dim=-1) + self.margin).mean()
        unit = F.normalize(embeddings, dim=-1)
        anchors, candidates = unit[:, 0], unit[:, 1:].transpose(0, 1).reshape(-1, unit.shape[-1])
        targets = torch.arange(rows, device=embeddings.device)
        copies, same_pair = in_batch_copies(text_ids) if text_ids is not None else (None, None)
        loss = F.cross_entropy(_without(self.scale * anchors @ candidates.T, copies), targets)
        if self.symmetric:  # and each positive against every anchor
            loss = (loss + F.cross_entropy(_without(self.scale * unit[:, 1] @ anchors.T, same_pair), targets)) / 2
        return loss


def _without(logits: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    return logits if mask is None else logits.masked_fill(mask, -torch.inf)


def in_batch_copies(text_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """From each row's text ids ``[rows, texts]`` (anchor, positive, negatives), the candidates that are no negative
    of a row's anchor, ``[rows, (texts - 1) * rows]`` in ``Objective``'s order (every positive, then every first
    negative, ...): wherever they are, the texts some row of the batch pairs with that anchor as its positive; and
    ``[rows, rows]``, the anchors that are no negative of a row's positive: those some row pairs with it. A row's
    own pair is never masked."""
    anchors, positives, candidates = text_ids[:, 0], text_ids[:, 1], text_ids[:, 1:].T.reshape(-1)
    same_anchor = (anchors[:, None] == anchors[None, :]).float()
    paired = same_anchor @ (positives[:, None] == candidates[None, :]).float() > 0
    paired[:, :len(text_ids)].fill_diagonal_(False)
    reverse = (positives[:, None] == positives[None, :]).float() @ same_anchor > 0
    return paired, reverse.fill_diagonal_(False)


def load_encoder(path: str, trust_remote_code: bool, lora: LoraArguments | None) -> torch.nn.Module:
    """The encoder at ``path`` (``finetune.models.loading.load_model`` of an ``AutoModel``), with LoRA adapters
    (``lora``'s rank, alpha, dropout and target modules) unless ``lora`` is None; BERT's pooler, which feeds no
    embedding, frozen."""
    model = load_model(transformers.AutoModel, path, trust_remote_code=trust_remote_code)
    if lora is not None:
        model = add_lora(model, lora.lora_r, lora.lora_alpha, lora.lora_dropout, lora.lora_target_modules,
                         task_type="FEATURE_EXTRACTION")
    for name, parameter in model.named_parameters():
        if ".pooler." in f".{name}":
            parameter.requires_grad_(False)
    return model


def merged_encoder(path: str, trust_remote_code: bool, lora: LoraArguments, state_dict: dict) -> torch.nn.Module:
    """The encoder at ``path`` with the trained ``state_dict`` of its LoRA adapters (``lora``'s settings, on a copy
    ``load_encoder`` makes) folded into its weights."""
    adapted = load_encoder(path, trust_remote_code, lora)
    adapted.load_state_dict(state_dict)
    return adapted.merge_and_unload()


def embed(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, pooling: Pooling) -> torch.Tensor:
    """The pooled embeddings ``[texts, dim]`` (float32, or the model's wider dtype) of padded texts."""
    hidden = model(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
    if pooling.mode == "cls":
        pooled = hidden[:, 0]
    elif pooling.mode == "lasttoken":  # the last position the mask keeps, whichever side is padded
        pooled = hidden[torch.arange(len(hidden), device=hidden.device), attention_mask.cumsum(-1).argmax(-1)]
    else:
        weights = attention_mask.unsqueeze(-1).to(hidden.dtype)
        pooled = (hidden * weights).sum(1) / weights.sum(1).clamp(min=1e-9)
    pooled = pooled.to(torch.promote_types(pooled.dtype, torch.float32))
    return F.normalize(pooled, p=2, dim=-1) if pooling.normalize else pooled


def row_embeddings(model, batch: dict, pooling: Pooling, texts: int) -> torch.Tensor:
    """``[rows, texts, dim]``: the embeddings of each row's ``texts`` texts, each text column run apart (padded to
    its own longest: answers are not padded to the length of the questions they answer)."""
    return torch.stack([embed(model, batch[f"input_ids_{i}"], batch[f"attention_mask_{i}"], pooling)
                        for i in range(texts)], dim=1)


def collate_texts(pad_token_id: int, keys: tuple[str, ...] = ()):
    """Rows (``text_0``, ``text_1``, ... token lists, ``score``, ``text_id_0``, ...) to a batch: ``input_ids_i`` and
    ``attention_mask_i`` for each text column, right-padded to its longest, and ``ROW_VALUES``; ``keys`` are further
    per-row values to keep (evaluation's ``corpus_id``)."""
    def collate(rows: list[dict]) -> dict:
        batch = {}
        columns = sum(key.removeprefix("text_").isdigit() for key in rows[0])
        for i in range(columns):
            texts = [row[f"text_{i}"] for row in rows]
            input_ids = torch.full((len(texts), max(map(len, texts))), pad_token_id, dtype=torch.long)
            attention_mask = torch.zeros_like(input_ids)
            for position, ids in enumerate(texts):
                input_ids[position, :len(ids)] = torch.tensor(ids)
                attention_mask[position, :len(ids)] = 1
            batch[f"input_ids_{i}"], batch[f"attention_mask_{i}"] = input_ids, attention_mask
        if "text_id_0" in rows[0]:
            batch["text_ids"] = torch.tensor([[row[f"text_id_{i}"] for i in range(columns)] for row in rows])
        for key in ("score", *keys):
            if key in rows[0]:
                batch[key] = torch.tensor([row[key] for row in rows])
        return batch
    return collate


def tokenize_pairs(raw: datasets.DatasetDict, tokenizer, loss: str, columns: list[str], score_column: str,
                   max_length: int, tokenizing: Tokenizing) -> list[str]:
    """Both splits' rows tokenized for ``loss`` (``tokenize_text_rows``), the validation split's first two texts
    only with each row's corpus id (scored pairs: their score); returns the text columns, by default ``anchor``,
    ``positive`` and every ``negative*`` column (``sentence1``, ``sentence2`` for ``cosent``).

    Raises:
        UserError: a missing column, a triplet loss without three texts, fewer than 2 training rows, or a bad row.
    """
    scored = loss == "cosent"
    columns = columns or (["sentence1", "sentence2"] if scored else ["anchor", "positive"] + sorted(
        c for c in raw["train"].column_names if c.startswith("negative")))
    if loss == "triplet" and len(columns) != 3:
        raise UserError(f"--loss triplet needs an anchor, a positive and a negative column; the data has "
                        f"{', '.join(raw['train'].column_names)} (name them with --columns)")
    score = score_column if scored else None
    scores = [score] if score else []  # evaluation reads the first two texts only
    raw = check_columns(raw, columns + scores, "--columns/--score_column", columns[:2] + scores)
    if len(raw["train"]) < 2:
        raise UserError(f"the training data has {len(raw['train'])} row; a contrastive loss needs at least 2")
    tokenize_text_rows(raw["train"], tokenizer, columns, score, max_length, "train", tokenizing,
                       text_ids=loss == "multiple_negatives_ranking")
    tokenize_text_rows(raw["validation"], tokenizer, columns[:2], score, max_length, "validation", tokenizing,
                       None if scored else corpus_ids(raw["validation"][columns[1]]))
    return columns


def corpus_ids(positives: list[str]) -> list[int]:
    """Each positive's document in the retrieval corpus: the distinct texts, numbered in order of first appearance."""
    documents: dict[str, int] = {}
    return [documents.setdefault(text, len(documents)) for text in positives]


def tokenize_text_rows(split: datasets.Dataset, tokenizer, columns: list[str], score_column: str | None,
                       max_length: int, name: str, tokenizing: Tokenizing, corpus_ids: list[int] | None = None,
                       text_ids: bool = False) -> datasets.Dataset:
    """Each row's ``columns`` (anchor, positive, negatives; or a scored pair) as ``text_0``, ``text_1``, ... token
    lists cut to ``max_length``, its ``score``, for evaluation each row's ``corpus_id``, and with ``text_ids`` (an
    in-batch loss) ``text_id_0``, ``text_id_1``, ...: a 63-bit hash of each token list, equal where the tokens the
    model reads are.

    Raises:
        UserError: a text that is missing, empty or not a string, or a score that is missing or outside [-1, 1],
            with its row.
    """
    def encode(batch, rows):
        for position, row in enumerate(rows):
            for column in columns:
                value = batch[column][position]
                if not isinstance(value, str) or not value.strip():
                    problem = "is empty" if isinstance(value, str) else f"holds {value!r}, not text"
                    raise UserError(f"{name} data row {row + 1}: column {column!r} {problem}; fill it in or drop "
                                    "the row")
            if score_column is not None:
                score = batch[score_column][position]
                if not isinstance(score, int | float) or not -1 <= score <= 1:
                    raise UserError(f"{name} data row {row + 1}: {score_column!r} is {score!r}; scores are cosine "
                                    "similarities in [-1, 1] (divide a 0-5 rating by 5)")
        out = {}
        for i, column in enumerate(columns):
            out[f"text_{i}"] = tokenizer(fitting_prefixes(batch[column], tokenizer, max_length)[0], truncation=True,
                                         max_length=max_length, return_attention_mask=False,
                                         return_token_type_ids=False)["input_ids"]
        out[LENGTH] = [sum(len(out[f"text_{i}"][r]) for i in range(len(columns))) for r in range(len(rows))]
        out[LOSS_UNITS] = [1] * len(rows)
        if score_column is not None:
            out["score"] = [float(s) for s in batch[score_column]]
        if corpus_ids is not None:
            out["corpus_id"] = [corpus_ids[row] for row in rows]
        for i in range(len(columns) if text_ids else 0):
            out[f"text_id_{i}"] = [xxhash.xxh3_64_intdigest(np.asarray(ids, np.int64).tobytes()) >> 1
                                   for ids in out[f"text_{i}"]]
        return out

    features = {f"text_{i}": TOKEN_IDS for i in range(len(columns))}
    if score_column is not None:
        features["score"] = datasets.Value("float32")
    if corpus_ids is not None:
        features["corpus_id"] = datasets.Value("int32")
    if text_ids:
        features.update({f"text_id_{i}": datasets.Value("int64") for i in range(len(columns))})
    return tokenizing.map(split, encode, name, features)


def pair_metrics(outputs: tuple, scored: bool) -> dict[str, float]:
    """Evaluation's metrics from every validation pair's embeddings and its score (``scored``) or corpus id:
    Pearson's and Spearman's correlations of cosine similarity with the score, or each anchor's positive retrieved
    among the distinct positives."""
    first, second, third = outputs
    if scored:
        return correlations(F.cosine_similarity(first, second, dim=-1).tolist(), third.tolist())
    return retrieval_metrics(first, *_corpus(second, third))


def pair_predictions(outputs: tuple, scored: bool) -> list[dict]:
    """Each validation pair's cosine similarity, or the corpus id its anchor retrieves beside the relevant one."""
    first, second, third = outputs
    if scored:
        return [{"cosine": value} for value in F.cosine_similarity(first, second, dim=-1).tolist()]
    corpus, relevant = _corpus(second, third)
    retrieved = (F.normalize(first, dim=-1) @ F.normalize(corpus, dim=-1).T).argmax(-1)
    return [{"retrieved": best, "relevant": right} for best, right in zip(retrieved.tolist(), relevant.tolist(),
                                                                          strict=True)]


def _corpus(positives: torch.Tensor, corpus_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The distinct positives (the retrieval corpus, in corpus id order) and each row's document in it."""
    first_rows: dict[int, int] = {}
    for row, document in enumerate(corpus_ids.tolist()):
        first_rows.setdefault(document, row)
    return positives[[first_rows[d] for d in sorted(first_rows)]], corpus_ids


class CachedGradients:
    """``Task.rollout`` and ``Task.loss`` of a loss over the whole global batch (see the module's docstring)."""

    def __init__(self, objective: Objective, pooling: Pooling, texts: int):
        self.objective, self.pooling, self.texts = objective, pooling, texts

    def rollout(self, model, window: list[tuple[dict, PlannedBatch]]) -> list[tuple[dict, PlannedBatch]]:
        """Each micro-batch of ``window`` with its rows' gradient of the global batch's summed loss, its share of
        that loss and the random state of its first pass; a window that is the whole global batch (one micro-batch
        on one process) as it is, to take its loss directly."""
        if len(window) == 1 and world_size() == 1:
            return window
        states, local, given = [], [], {key: [] for key in ROW_VALUES if key in window[0][0]}
        with torch.no_grad():
            for batch, planned in window:
                states.append(random_state(batch["input_ids_0"].device))
                embeddings = row_embeddings(model, batch, self.pooling, self.texts)
                local.append(embeddings[:planned.num_real])  # a filler row keeps its rank stepping, nothing more
                for key, values in given.items():
                    values.append(batch[key][:planned.num_real])
        embeddings, first = all_gather_rows(torch.cat(local))
        gathered = {key: all_gather_rows(torch.cat(values))[0] for key, values in given.items()}
        embeddings.requires_grad_(True)
        # Summed over the rows, as the loop's loss is: it scales each process's share by world size / rows.
        total = self.objective(embeddings, gathered.get("score"), gathered.get("text_ids")) * len(embeddings)
        gradients = torch.autograd.grad(total, embeddings)[0]
        rolled = []
        for (batch, planned), state, rows in zip(window, states, local, strict=True):
            padded = gradients.new_zeros((len(batch["input_ids_0"]), *gradients.shape[1:]))
            padded[:len(rows)] = gradients[first:first + len(rows)]
            first += len(rows)
            share = total.detach() * len(rows) / len(embeddings)
            tokens = (sum(int(batch[f"attention_mask_{i}"].sum()) for i in range(self.texts)), padded_tokens(batch))
            rolled.append(({**batch, "embedding_gradients": padded, "random_state": state, "loss_share": share},
                           PlannedBatch(list(planned), planned.num_real, planned.units, planned.loss_scale,
                                        planned.window, tokens)))
        return rolled

    def loss(self, model, batch: dict) -> torch.Tensor:
        """The micro-batch's rows' part of the global batch's summed loss: its value their share, its gradient
        theirs (``rollout``); a batch that is the whole global batch, or the memory estimate's, takes its own."""
        if "embedding_gradients" not in batch:
            embeddings = row_embeddings(model, batch, self.pooling, self.texts)
            return self.objective(embeddings, batch.get("score"), batch.get("text_ids")) * len(embeddings)
        with replaying(batch["random_state"], batch["input_ids_0"].device):
            embeddings = row_embeddings(model, batch, self.pooling, self.texts)
        surrogate = (embeddings * batch["embedding_gradients"]).sum()
        return surrogate - surrogate.detach() + batch["loss_share"]

