"""Fixtures: small data files, tiny models made for the session, runs shared between tests, a loopback Hub.

Every training run here is a real run of a recipe, offline: in this process where the launcher is not the point
(``helpers.train_here``), else started the way a user starts it (python, torchrun, accelerate launch, sbatch).
The plain helpers are in ``helpers.py``.
"""

from __future__ import annotations

import copy
import os
import shutil
import tempfile
from pathlib import Path

import pytest
from helpers import launch_cmd, parity_flags, run, save_tiny_bert, serving_hub, write_csv

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Tokenized data is cached per session: runs of the same data share a cache, and none outlives the tests.
os.environ["HF_DATASETS_CACHE"] = tempfile.mkdtemp(prefix="finetune-tests-datasets-")


def pytest_sessionfinish(session, exitstatus):
    shutil.rmtree(os.environ["HF_DATASETS_CACHE"], ignore_errors=True)


def pytest_collection_modifyitems(config, items):
    """GPU checks run only when a -m expression names them (`pytest -m gpu`): deselected, never skipped."""
    if "gpu" in (config.getoption("markexpr") or ""):
        return
    gpu = [item for item in items if item.get_closest_marker("gpu")]
    if gpu:
        config.hook.pytest_deselected(items=gpu)
        items[:] = [item for item in items if not item.get_closest_marker("gpu")]


@pytest.fixture
def hub(tmp_path):
    """A loopback Hub for one test (``helpers.serving_hub``)."""
    with serving_hub(tmp_path / "hub-cache") as server:
        yield server


@pytest.fixture(scope="session")
def small_data(tmp_path_factory) -> dict[str, Path]:
    """Support-ticket rows with string labels: 42 for training, 23 (a prime) for evaluation."""
    from finetune.data.embedded.support_tickets import LABEL_NAMES, make_support_tickets

    folder = tmp_path_factory.mktemp("data")
    dataset = make_support_tickets()

    def rows(split, count):
        short = [r for r in dataset[split] if len(r["text"]) < 160][:count]
        return [{"text": r["text"], "label": LABEL_NAMES[r["label"]]} for r in short]

    return {
        "train": write_csv(folder / "train.csv", rows("train", 42)),
        "validation": write_csv(folder / "validation.csv", rows("validation", 23)),
    }


@pytest.fixture(scope="session")
def tiny_bert(tmp_path_factory) -> Path:
    """A random 2-layer BERT with the default MiniLM's tokenizer and its dropout (0.1)."""
    return save_tiny_bert(tmp_path_factory.mktemp("tiny_bert"), dropout=True)


@pytest.fixture(scope="session")
def tiny_bert_without_dropout(tmp_path_factory) -> Path:
    """The same with dropout off, for comparisons that must not depend on dropout masks."""
    return save_tiny_bert(tmp_path_factory.mktemp("tiny_bert_without_dropout"), dropout=False)


@pytest.fixture(scope="session")
def parity_runs(small_data, tiny_bert, tiny_bert_without_dropout, tmp_path_factory):
    """Training runs for comparisons, each made once per session and shared.

    ``parity_runs(launcher, processes, per_device_batch, group_by_length=True, dropout=False)`` returns the
    output folder. Every run: 42 examples in global batches of 8 (the last of each epoch short), accumulation
    of 2, 3 epochs, checkpoints every 4 steps, the tiny BERT with dropout off unless ``dropout``.
    """
    made: dict[tuple, Path] = {}

    def get(launcher: str, processes: int, per_device_batch: int, group_by_length: bool = True,
            dropout: bool = False) -> Path:
        key = (launcher, processes, per_device_batch, group_by_length) + (("dropout",) if dropout else ())
        if key not in made:
            out = tmp_path_factory.mktemp("_".join(map(str, key))) / "out"
            model = tiny_bert if dropout else tiny_bert_without_dropout
            flags = [*parity_flags(small_data, model, per_device_batch, group_by_length), "--output_dir", str(out)]
            run(launch_cmd(launcher, *flags, processes=processes))
            made[key] = out
        return made[key]

    return get


@pytest.fixture(scope="session")
def chat_tokenizer():
    """SmolLM2-135M-Instruct's tokenizer and chat template."""
    from transformers import AutoTokenizer

    from finetune.models.loading import default_chat_model_path

    return AutoTokenizer.from_pretrained(default_chat_model_path())


@pytest.fixture(scope="session")
def tiny_chat_model(tmp_path_factory, chat_tokenizer) -> Path:
    """A random 2-layer Llama with SmolLM2's tokenizer and chat template: fast to train. Its greedy replies are the
    same for every conversation."""
    from helpers import save_tiny_llama

    return save_tiny_llama(tmp_path_factory.mktemp("tiny_chat_model"), chat_tokenizer)


@pytest.fixture(scope="session")
def tiny_chat_model_without_pad_token(tmp_path_factory, chat_tokenizer) -> Path:
    """The tiny Llama with a tokenizer that has no pad token, as Llama 3.x's and Mistral v0.3's."""
    from helpers import save_tiny_llama

    tokenizer = copy.deepcopy(chat_tokenizer)
    tokenizer.pad_token = None
    return save_tiny_llama(tmp_path_factory.mktemp("tiny_chat_model_no_pad"), tokenizer)


@pytest.fixture(scope="session")
def tiny_chat_model_with_distinct_replies(tmp_path_factory, chat_tokenizer) -> Path:
    """The same with weights drawn wider: its greedy replies differ from one conversation to the next, so a reply
    gathered to the wrong one would show."""
    from helpers import save_tiny_llama

    return save_tiny_llama(tmp_path_factory.mktemp("tiny_chat_model_wide"), chat_tokenizer, initializer_range=0.05)
