"""recipes/embed.py: the global batch's contrastive loss and gradient whichever way the batch is cut (GradCache), at
any world size and under each launcher; retrieval and correlation metrics; the sentence-transformers folder."""

from __future__ import annotations

import json
import math
import shutil
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from helpers import (
    HUB_TOKEN,
    assert_refused,
    log_history,
    max_weight_diff,
    python_cmd,
    read_jsonl,
    read_results,
    recipe_path,
    run,
    run_on,
    train_here,
    write_jsonl,
)

from finetune.data.batching import PlannedBatch
from finetune.data.embedded.support_answers import make_support_answers
from finetune.errors import UserError, run_main
from finetune.models.loading import default_model_path
from finetune.models.sentence_folder import Pooling
from finetune.predict.__main__ import main as predict
from finetune.tasks.embedding import CachedGradients, Objective, collate_texts, row_embeddings
from finetune.tasks.metrics import correlations, retrieval_metrics

OBJECTIVES = {
    "ranking, a hard negative, symmetric": (Objective("multiple_negatives_ranking", symmetric=True), 3),
    "ranking, copies of answers, symmetric": (Objective("multiple_negatives_ranking", symmetric=True), 3),
    "ranking": (Objective("multiple_negatives_ranking", scale=7.0), 2),
    "cosent": (Objective("cosent"), 2),
    "triplet": (Objective("triplet", margin=0.5), 3),
}


def tiny_float64_bert(dropout: bool):
    from transformers import BertConfig, BertModel

    torch.manual_seed(0)
    config = BertConfig(vocab_size=60, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                        intermediate_size=32, hidden_dropout_prob=0.1 if dropout else 0.0,
                        attention_probs_dropout_prob=0.1 if dropout else 0.0)
    return BertModel(config, add_pooling_layer=False).double().train()


def random_rows(count: int, texts: int, copies: bool = False) -> list[dict]:
    """Rows of random texts; with ``copies``, text ids saying that rows 4 and 7 ask as rows 0 and 1 do (with other
    answers), rows 2 and 6 share an answer and row 5's hard negative is row 3's answer."""
    generator = torch.Generator().manual_seed(1)
    rows = []
    for row in range(count):
        lengths = torch.randint(2, 9, (texts,), generator=generator).tolist()
        rows.append({**{f"text_{i}": torch.randint(1, 60, (n,), generator=generator).tolist()
                        for i, n in enumerate(lengths)}, "score": (row % 4) / 3 - 0.5})
        if copies:
            rows[-1].update({f"text_id_{i}": 100 * row + i for i in range(texts)})
    if copies:
        rows[4]["text_id_0"], rows[7]["text_id_0"] = rows[0]["text_id_0"], rows[1]["text_id_0"]
        rows[6]["text_id_1"], rows[5]["text_id_2"] = rows[2]["text_id_1"], rows[3]["text_id_1"]
    return rows


def cached_gradients(model, objective, texts, rows, cuts, pooling) -> tuple[list[torch.Tensor], float]:
    """The gradient and loss of one optimizer step over ``rows`` cut into micro-batches of ``cuts`` rows, as the loop
    takes them on one process: the window rolled out, each micro-batch's loss backpropagated at scale 1 / rows."""
    collate, cached = collate_texts(0), CachedGradients(objective, pooling, texts)
    window, start = [], 0
    for size in cuts:
        window.append((collate(rows[start:start + size]), PlannedBatch(list(range(size)), size, size, 1 / len(rows))))
        start += size
    model.zero_grad()
    logged = 0.0
    for batch, planned in cached.rollout(model, window):
        loss = cached.loss(model, batch)
        (loss * planned.loss_scale).backward()
        logged += loss.item()
    return [p.grad.clone() for p in model.parameters()], logged / len(rows)


@pytest.mark.parametrize("name", OBJECTIVES)
def test_the_global_batch_trains_the_same_loss_and_gradient_however_its_micro_batches_are_cut(name):
    """GradCache is exact: the embeddings' gradient taken once over the whole batch and backpropagated a micro-batch
    at a time equals the gradient of the loss taken over all rows at once (float64, to 1e-10)."""
    objective, texts = OBJECTIVES[name]
    pooling = Pooling("mean", normalize=name != "triplet")
    model, rows = tiny_float64_bert(dropout=False), random_rows(8, texts, copies="copies" in name)
    batch = collate_texts(0)(rows)
    model.zero_grad()
    loss = objective(row_embeddings(model, batch, pooling, texts).double(), batch["score"].double(),
                     batch.get("text_ids"))
    loss.backward()
    expected = [p.grad.clone() for p in model.parameters()]
    assert loss.item() > 0.01
    for cuts in ([8], [4, 4], [2, 2, 2, 2], [3, 5]):
        gradients, logged = cached_gradients(model, objective, texts, rows, cuts, pooling)
        assert logged == pytest.approx(loss.item(), rel=1e-12)
        for ours, theirs in zip(gradients, expected, strict=True):
            torch.testing.assert_close(ours, theirs, rtol=1e-10, atol=1e-12)


def test_no_copy_of_a_rows_answer_and_no_answer_to_its_question_is_its_negative():
    """Rows 0 and 1 share their answer, row 2's hard negative is that answer too and row 3 asks what row 0 asks:
    each anchor's loss is over the batch's answers and negatives less the texts a row pairs with that anchor
    (and, symmetric, each answer's over the anchors less those a row pairs with that answer); without the text ids,
    over all of them."""
    torch.manual_seed(0)
    embeddings = torch.randn(4, 3, 8, dtype=torch.float64)
    text_ids = torch.tensor([[0, 1, 2], [3, 1, 4], [5, 6, 1], [0, 7, 8]])
    unit = F.normalize(embeddings, dim=-1)
    candidates = [(row, text) for text in (1, 2) for row in range(4)]
    left_out = {0: {(1, 1), (2, 2), (3, 1)}, 1: {(0, 1), (2, 2)}, 2: set(), 3: {(0, 1), (1, 1), (2, 2)}}
    reverse_left_out = {0: {1, 3}, 1: {0, 3}, 2: set(), 3: {0}}

    def loss(scores: list[torch.Tensor], own: int) -> torch.Tensor:
        return -torch.log_softmax(5.0 * torch.stack(scores), 0)[own]

    forward = [loss([unit[i, 0] @ unit[c] for c in candidates if c not in left_out[i]],
                    [c for c in candidates if c not in left_out[i]].index((i, 1))) for i in range(4)]
    reverse = [loss([unit[i, 1] @ unit[j, 0] for j in range(4) if j not in reverse_left_out[i]],
                    [j for j in range(4) if j not in reverse_left_out[i]].index(i)) for i in range(4)]
    one_way, both_ways = (Objective("multiple_negatives_ranking", scale=5.0, symmetric=s) for s in (False, True))
    assert one_way(embeddings, text_ids=text_ids).item() == pytest.approx(torch.stack(forward).mean().item(),
                                                                         rel=1e-12)
    expected = (torch.stack(forward).mean() + torch.stack(reverse).mean()).item() / 2
    assert both_ways(embeddings, text_ids=text_ids).item() == pytest.approx(expected, rel=1e-12)
    everything = [loss([unit[i, 0] @ unit[c] for c in candidates], i) for i in range(4)]
    assert one_way(embeddings).item() == pytest.approx(torch.stack(everything).mean().item(), rel=1e-12)
    assert one_way(embeddings).item() > one_way(embeddings, text_ids=text_ids).item() + 0.05


def test_the_pass_with_gradients_draws_the_dropout_masks_of_the_pass_without():
    """Each micro-batch's second pass replays the random state of its first, so the gradient is of the loss the
    embeddings were taken at: the same as embedding each micro-batch with gradients in the first pass's order."""
    objective, pooling = Objective("multiple_negatives_ranking"), Pooling("mean", True)
    model, rows = tiny_float64_bert(dropout=True), random_rows(8, 2)
    collate = collate_texts(0)
    torch.manual_seed(5)
    model.zero_grad()
    embeddings = torch.cat([row_embeddings(model, collate(rows[:4]), pooling, 2),
                            row_embeddings(model, collate(rows[4:]), pooling, 2)])
    objective(embeddings.double()).backward()
    expected = [p.grad.clone() for p in model.parameters()]
    torch.manual_seed(5)
    gradients, _ = cached_gradients(model, objective, 2, rows, [4, 4], pooling)
    for ours, theirs in zip(gradients, expected, strict=True):
        torch.testing.assert_close(ours, theirs, rtol=1e-10, atol=1e-12)
    torch.manual_seed(6)  # and another draw would have given another gradient
    other, _ = cached_gradients(model, objective, 2, rows, [4, 4], pooling)
    assert max((a - b).abs().max().item() for a, b in zip(other, expected, strict=True)) > 1e-4


def test_each_pooling_takes_the_tokens_it_names_and_never_a_pad():
    model = tiny_float64_bert(dropout=False).eval()
    rows = random_rows(3, 1)
    batch = collate_texts(0)(rows)
    with torch.no_grad():
        hidden = [model(input_ids=torch.tensor([row["text_0"]])).last_hidden_state[0] for row in rows]
        for mode, expected in (("mean", [h.mean(0) for h in hidden]), ("cls", [h[0] for h in hidden]),
                               ("lasttoken", [h[-1] for h in hidden])):
            pooled = row_embeddings(model, batch, Pooling(mode, normalize=False), 1)[:, 0]
            torch.testing.assert_close(pooled, torch.stack(expected), rtol=1e-10, atol=1e-12)
        normalised = row_embeddings(model, batch, Pooling("lasttoken", normalize=True), 1)[:, 0]
        torch.testing.assert_close(normalised.norm(dim=-1), torch.ones(3, dtype=torch.float64))
    assert len({len(row["text_0"]) for row in rows}) > 1, "rows of different lengths: some are padded"


def test_retrieval_metrics_rank_each_querys_document_among_the_whole_corpus():
    corpus = torch.eye(12, dtype=torch.float64)
    # query 0 finds its document first; query 1's is third; query 2's is twelfth
    queries = torch.zeros(3, 12, dtype=torch.float64)
    queries[0, 0] = 1
    queries[1, 1], queries[1, 4], queries[1, 5] = 0.5, 0.7, 0.6
    queries[2] = torch.linspace(1.0, 0.1, 12)
    metrics = retrieval_metrics(queries, corpus, torch.tensor([0, 2, 11]))
    # query 1's document 2 scores 0, tied with eight others behind the three it scores above 0: a tie ranks it first
    assert metrics["mrr@10"] == pytest.approx((1 + 1 / 4 + 0) / 3)
    metrics = retrieval_metrics(queries, corpus, torch.tensor([0, 1, 11]))
    assert metrics["mrr@10"] == pytest.approx((1 + 1 / 3) / 3)
    assert (metrics["recall@1"], metrics["recall@5"], metrics["recall@10"]) == pytest.approx((1 / 3, 2 / 3, 2 / 3))
    assert metrics["ndcg@10"] == pytest.approx((1 + 1 / math.log2(4)) / 3)


def test_correlations_are_scipys():
    from scipy import stats

    generator = torch.Generator().manual_seed(0)
    predicted = torch.rand(50, generator=generator).tolist()
    reference = [round(p * 4 + torch.rand(1, generator=generator).item()) / 5 for p in predicted]  # with ties
    ours = correlations(predicted, reference)
    assert ours["spearman"] == pytest.approx(stats.spearmanr(predicted, reference).statistic, rel=1e-12)
    assert ours["pearson"] == pytest.approx(stats.pearsonr(predicted, reference).statistic, rel=1e-12)


# -- the recipe

def pairs(count: int, start: int = 0, negatives: bool = False) -> list[dict]:
    data = make_support_answers()["train"]
    rows = [{"anchor": data[i]["anchor"], "positive": data[i]["positive"]} for i in range(start, start + count)]
    if negatives:  # the next row's answer, unless it is the same
        for i, row in enumerate(rows):
            row["negative"] = next(r["positive"] for r in rows[i + 1:] + rows if r["positive"] != row["positive"])
    return rows


@pytest.fixture(scope="module")
def pair_files(tmp_path_factory) -> list[str]:
    folder = tmp_path_factory.mktemp("pairs")
    return ["--train_file", write_jsonl(folder / "train.jsonl", pairs(44, negatives=True)),
            "--validation_file", write_jsonl(folder / "validation.jsonl", pairs(24, start=100))]


FLAGS = ["--max_seq_length", "32", "--logging_steps", "1", "--learning_rate", "1e-3", "--per_device_eval_batch_size",
         "8"]


def test_the_saved_folder_is_a_sentence_transformer_that_embeds_as_the_recipe_did(pair_files, tiny_bert, tmp_path):
    from sentence_transformers import SentenceTransformer
    from transformers import AutoModel, AutoTokenizer

    base, out = tmp_path / "base", tmp_path / "out"  # the tiny BERT with the default MiniLM's pooling modules
    shutil.copytree(tiny_bert, base)
    shutil.copy(Path(default_model_path()) / "modules.json", base)
    shutil.copytree(Path(default_model_path()) / "1_Pooling", base / "1_Pooling")
    result = run_on("embed", base, pair_files, out, *FLAGS, "--per_device_train_batch_size", "8",
                    "--max_train_steps", "3")
    before = next(line for line in result.stdout.splitlines() if line.startswith("before training: "))
    assert "eval_mrr@10" in before
    results = read_results(out)
    assert 0 < results["eval_mrr@10"] <= 1 and results["eval_recall@1"] <= results["eval_recall@5"]
    assert json.loads((out / "1_Pooling" / "config.json").read_text())["pooling_mode_mean_tokens"] is True
    assert [m["type"].rsplit(".", 1)[1] for m in json.loads((out / "modules.json").read_text())] == [
        "Transformer", "Pooling", "Normalize"]  # the base MiniLM's pooling, kept
    texts = [row["anchor"] for row in pairs(6, start=300)] + ["a long one " * 40]
    theirs = SentenceTransformer(str(out), device="cpu").encode(texts, convert_to_tensor=True)
    tokenizer, model = AutoTokenizer.from_pretrained(out), AutoModel.from_pretrained(out).eval()
    ids = tokenizer(texts, truncation=True, max_length=32)["input_ids"]
    with torch.no_grad():
        ours = row_embeddings(model, collate_texts(tokenizer.pad_token_id)([{"text_0": i} for i in ids]),
                              Pooling("mean", True), 1)[:, 0]  # (the texts padded to the longest, as theirs are)
    torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-6)
    assert (ours.norm(dim=-1) - 1).abs().max() < 1e-6
    assert len((out / "eval_predictions.jsonl").read_text().splitlines()) == 24
    # python -m finetune.predict embeds a file's texts as the folder does
    run_main(predict, [str(out), "--input", write_jsonl(tmp_path / "texts.jsonl", [{"text": t} for t in texts])])
    predicted = torch.tensor([row["embedding"] for row in read_jsonl(out / "predictions.jsonl")])
    torch.testing.assert_close(predicted, theirs, rtol=0, atol=1e-6)


def test_the_base_pooling_is_read_from_a_folder_under_home_and_from_the_hub(hub, tmp_path, monkeypatch):
    """A sentence-transformers base named by ``~/...`` or by its Hub id keeps its pooling and normalisation (the
    default MiniLM's: mean, normalised); a plain model and a Hub id that is no repository have none; where the Hub
    cannot say (offline, nothing cached) or the file is no JSON, one error naming the fix, not a guess."""
    from finetune.models.sentence_folder import base_pooling

    monkeypatch.setenv("HOME", str(tmp_path))
    shutil.copytree(default_model_path(), tmp_path / "minilm")
    assert base_pooling("~/minilm") == Pooling("mean", True)
    (tmp_path / "minilm" / "modules.json").write_text('[{"type": "sentence_transformers.models.Pooling"')
    with pytest.raises(UserError, match=r"minilm/modules.json is no JSON .*; fix or remove it"):
        base_pooling("~/minilm")
    (tmp_path / "minilm" / "modules.json").unlink()
    assert base_pooling("~/minilm") is None
    upload_and_read = (
        "from huggingface_hub import HfApi; from finetune.models.sentence_folder import base_pooling; "
        f"api = HfApi(token={HUB_TOKEN!r}); api.create_repo('alice/minilm'); "
        f"api.upload_folder(repo_id='alice/minilm', folder_path={default_model_path()!r}, "
        "allow_patterns=['modules.json', '1_Pooling/*']); "
        "print(base_pooling('alice/minilm'), base_pooling('alice/no-such-model'))")
    printed = run([sys.executable, "-c", upload_and_read], env=hub.env).stdout.strip().splitlines()[-1]
    assert printed == "Pooling(mode='mean', normalize=True) None"
    read_offline = ("from finetune.models.sentence_folder import base_pooling\n"
                    "try:\n    print(base_pooling('alice/minilm'))\nexcept Exception as error:\n    print(repr(error))")
    offline = {**hub.env, "HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(tmp_path / "nothing-cached")}
    printed = run([sys.executable, "-c", read_offline], env=offline).stdout.strip().splitlines()[-1]
    assert printed.startswith("UserError('alice/minilm: its modules.json, which says how it pools, could not be read")
    assert "give --pooling and --normalize true/false" in printed


def test_scored_pairs_train_with_cosent_and_report_correlations(tiny_bert, tmp_path):
    rows = [{"sentence1": a["anchor"], "sentence2": (a if i % 2 else b)["positive"], "score": 0.9 if i % 2 else 0.1}
            for i, (a, b) in enumerate(zip(pairs(32), pairs(32, start=50), strict=True))]
    data = ["--train_file", write_jsonl(tmp_path / "train.jsonl", rows[:24]),
            "--validation_file", write_jsonl(tmp_path / "validation.jsonl", rows[24:])]
    run_on("embed", tiny_bert, data, tmp_path / "out", *FLAGS, "--loss", "cosent", "--max_train_steps", "2",
           "--pooling", "cls", "--normalize", "false")
    results = read_results(tmp_path / "out")
    assert -1 <= results["eval_spearman"] <= 1 and -1 <= results["eval_pearson"] <= 1
    assert "2_Normalize" not in (tmp_path / "out" / "modules.json").read_text()
    assert json.loads((tmp_path / "out" / "1_Pooling" / "config.json").read_text())["pooling_mode_cls_token"]


@pytest.mark.parametrize(("rows", "flags", "expected"), [
    ([{"anchor": "a", "answer": "b"}] * 4, [], ["no column 'positive'", "--columns"]),
    ([{"anchor": "a", "positive": " "}] * 4, [], ["train data row 1", "'positive' is empty"]),
    ([{"anchor": "a", "positive": "b", "negatives": ["c", "d"]}] * 4, [],
     ["train data row 1", "'negatives' holds ['c', 'd'], not text"]),
    ([{"anchor": "a", "positive": "b"}], [], ["1 row", "at least 2"]),
    ([{"sentence1": "a", "sentence2": "b", "score": 4.0}] * 4, ["--loss", "cosent"], ["'score' is 4.0", "[-1, 1]"]),
    ([{"anchor": "a", "positive": "b"}] * 4, ["--loss", "triplet"], ["triplet needs", "negative"]),
    ([{"anchor": "a", "positive": "b"}] * 4, ["--columns", "anchor"], ["takes at least 2 text columns"]),
    ([{"sentence1": "a", "sentence2": "b", "score": 0.5}] * 4, ["--loss", "cosent", "--symmetric"],
     ["--symmetric with --loss cosent", "multiple_negatives_ranking"]),
])
def test_bad_pairs_are_refused_in_one_line_before_training(rows, flags, expected, tiny_bert, tmp_path):
    data = write_jsonl(tmp_path / "train.jsonl", rows)
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("earlier work")
    assert_refused("embed", ["--train_file", data, "--validation_file", data, "--model_name_or_path",
                             str(tiny_bert), "--output_dir", str(out), *flags], tmp_path, *expected)


# -- every layout trains the same global batches

@pytest.fixture(scope="module")
def parity_runs(pair_files, tiny_bert_without_dropout, tmp_path_factory) -> dict:
    """An epoch of 44 rows (anchor, positive, a hard negative) in global batches of 8, the sixth of 4 rows, a single
    micro-batch where 2 are accumulated: on 1 process, on 1 with accumulation 2, on 2 processes under each launcher,
    sharded, and with accumulation under torchrun; checkpoints every 2 steps."""
    flags = [*FLAGS, "--symmetric", "--num_train_epochs", "1", "--checkpointing_steps", "2"]
    outs = {name: tmp_path_factory.mktemp("embed") / name
            for name in ("one", "accumulation", "accelerate", "torchrun", "fsdp", "torchrun_accumulation")}
    model = tiny_bert_without_dropout
    run_on("embed", model, pair_files, outs["one"], *flags, "--per_device_train_batch_size", "8")
    run_on("embed", model, pair_files, outs["accumulation"], *flags, "--per_device_train_batch_size", "4",
           "--gradient_accumulation_steps", "2")
    for name, launcher, sharded in (("accelerate", "accelerate", []), ("torchrun", "torchrun", []),
                                    ("fsdp", "torchrun", ["--fsdp"])):
        run_on("embed", model, pair_files, outs[name], *flags, *sharded, "--per_device_train_batch_size", "4",
               launcher=launcher, processes=2)
    run_on("embed", model, pair_files, outs["torchrun_accumulation"], *flags, "--per_device_train_batch_size", "2",
           "--gradient_accumulation_steps", "2", launcher="torchrun", processes=2)
    return outs


@pytest.mark.multiprocess
@pytest.mark.slow
def test_one_process_two_and_accumulation_train_the_same_global_batch_loss_under_both_launchers_and_sharded(
        parity_runs):
    reference = log_history(parity_runs["one"])
    assert [h["step"] for h in reference] == [1, 2, 3, 4, 5, 6] and reference[0]["loss"] > 0.1
    for name in ("accumulation", "accelerate", "torchrun", "fsdp", "torchrun_accumulation"):
        history = log_history(parity_runs[name])
        assert [h["step"] for h in history] == [1, 2, 3, 4, 5, 6], name
        for ours, theirs in zip(history, reference, strict=True):
            assert ours["loss"] == pytest.approx(theirs["loss"], rel=1e-5), (name, ours, theirs)
            assert ours["grad_norm"] == pytest.approx(theirs["grad_norm"], rel=1e-5), (name, ours, theirs)
        # (AdamW's steps are about the learning rate, 1e-3, nearly its sign where a gradient is near 0: a twentieth
        # of a step is float rounding in the order of the sums, the cached one's against the direct one's)
        assert max_weight_diff(parity_runs[name], parity_runs["one"]) < 5e-5, name
        for metric in ("eval_mrr@10", "eval_ndcg@10"):
            assert read_results(parity_runs[name])[metric] == pytest.approx(
                read_results(parity_runs["one"])[metric], abs=1e-6), (name, metric)


@pytest.mark.multiprocess
@pytest.mark.slow
def test_a_run_resumed_from_its_checkpoint_trains_as_the_uninterrupted_one(parity_runs, pair_files,
                                                                           tiny_bert_without_dropout, tmp_path):
    out = tmp_path / "resumed"
    run_on("embed", tiny_bert_without_dropout, pair_files, out, *FLAGS, "--symmetric", "--num_train_epochs", "1",
           "--per_device_train_batch_size", "4", "--checkpointing_steps", "2",
           "--resume_from_checkpoint", str(parity_runs["torchrun"] / "checkpoints" / "step_2"),
           launcher="torchrun", processes=2)
    history = log_history(out)
    assert [h["step"] for h in history] == [3, 4, 5, 6]
    for ours, theirs in zip(history, log_history(parity_runs["torchrun"])[2:], strict=True):
        assert (ours["loss"], ours["grad_norm"]) == (theirs["loss"], theirs["grad_norm"])
    assert max_weight_diff(out, parity_runs["torchrun"]) == 0


def test_a_tiny_run_in_this_process(pair_files, tiny_bert, tmp_path):
    """Triplets train (the loss of a margin the embeddings do not yet keep is above 0) with the hard negatives."""
    result = train_here("embed", *pair_files, "--model_name_or_path", str(tiny_bert), "--output_dir",
                        str(tmp_path / "out"), *FLAGS, "--loss", "triplet", "--max_train_steps", "2")
    assert "triplet loss over anchor + positive + negative" in result.stdout
    assert log_history(tmp_path / "out")[0]["loss"] > 0


def test_a_batch_of_one_pair_twice_has_no_negative_to_rank_so_its_loss_is_0(pair_files, tiny_bert, tmp_path):
    """Each row's copy is the same pair, no negative of it (it would be log 2 if it were, both ways)."""
    row = pairs(1)[0]
    train = write_jsonl(tmp_path / "twice.jsonl", [row, row])
    train_here("embed", "--train_file", train, *pair_files[2:], "--model_name_or_path", str(tiny_bert),
               "--output_dir", str(tmp_path / "out"), *FLAGS, "--per_device_train_batch_size", "2", "--symmetric",
               "--max_train_steps", "1")
    assert log_history(tmp_path / "out")[0]["loss"] == 0


@pytest.mark.multiprocess
@pytest.mark.slow
def test_lora_trains_the_same_on_two_processes_and_saves_its_adapters_merged(pair_files, tiny_bert_without_dropout,
                                                                            tmp_path):
    from safetensors.torch import load_file

    flags = [*FLAGS, "--use_lora", "--lora_dropout", "0", "--lora_target_modules", "query,value",
             "--learning_rate", "1e-2", "--max_train_steps", "2"]
    run_on("embed", tiny_bert_without_dropout, pair_files, tmp_path / "one", *flags,
           "--per_device_train_batch_size", "8")
    run_on("embed", tiny_bert_without_dropout, pair_files, tmp_path / "two", *flags,
           "--per_device_train_batch_size", "4", launcher="torchrun", processes=2)
    for ours, theirs in zip(log_history(tmp_path / "two"), log_history(tmp_path / "one"), strict=True):
        assert ours["loss"] == pytest.approx(theirs["loss"], rel=1e-5)
        assert ours["grad_norm"] == pytest.approx(theirs["grad_norm"], rel=1e-5)
    base, merged = load_file(tiny_bert_without_dropout / "model.safetensors"), load_file(
        tmp_path / "one" / "model.safetensors")
    assert merged.keys() == base.keys(), "a plain model folder: no adapter weights left"
    changed = {name for name in base if not torch.equal(base[name], merged[name])}
    assert changed == {f"encoder.layer.{i}.attention.self.{m}.weight" for i in range(2) for m in ("query", "value")}


@pytest.mark.slow
def test_the_hub_gets_the_sentence_transformers_folder_and_a_card_with_the_retrieval_metrics(hub, pair_files, tiny_bert,
                                                                                            tmp_path):
    run(python_cmd(*pair_files, "--model_name_or_path", str(tiny_bert), "--output_dir", str(tmp_path / "out"), *FLAGS,
                   "--max_train_steps", "2", "--push_to_hub", "--hub_model_id", "alice/embedder", "--hub_token",
                   HUB_TOKEN, script=recipe_path("embed")), env=hub.env)
    files = hub.files("alice/embedder")
    assert {"modules.json", "1_Pooling/config.json", "sentence_bert_config.json", "model.safetensors",
            "tokenizer.json", "README.md"} <= set(files)
    card = files["README.md"].decode()
    assert "library_name: sentence-transformers" in card and "pipeline_tag: sentence-similarity" in card
    assert f"| eval_mrr@10 | {read_results(tmp_path / 'out')['eval_mrr@10']:.4f} |" in card
