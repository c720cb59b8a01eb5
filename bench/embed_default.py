"""The embedding recipe's default run beside its base model, the README's quickstart figures.

    python bench/embed_default.py     # about 2 minutes on 2 CPU cores: bench/results/embed-default.json

The run is launched as the README launches it (`accelerate launch recipes/embed.py`, no flags), its
``all_results.json``, the metrics it printed for the model before training and its wall time recorded. The base
model is also scored apart, through sentence-transformers' own ``encode`` on the same held-out tickets and answers,
with the recipe's metric function: the recipe's before-training figures must be these.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from finetune.data.embedded.support_answers import make_support_answers  # noqa: E402
from finetune.models.loading import default_model_path  # noqa: E402
from finetune.tasks.embedding import corpus_ids  # noqa: E402
from finetune.tasks.metrics import retrieval_metrics  # noqa: E402


def held_out_retrieval(model, anchors: list[str], positives: list[str]) -> dict[str, float]:
    """Each anchor's positive ranked among the distinct positives, embedded by a ``SentenceTransformer``'s own
    ``encode``, scored by the recipe's metric function."""
    relevant = corpus_ids(positives)
    queries = model.encode(anchors, convert_to_tensor=True).cpu()
    corpus = model.encode(list(dict.fromkeys(positives)), convert_to_tensor=True).cpu()
    return retrieval_metrics(queries, corpus, torch.tensor(relevant))


def sentence_transformers_scores(model_path: str) -> dict[str, float]:
    """The held-out tickets' answers retrieved by the model in ``model_path``, through sentence-transformers."""
    from sentence_transformers import SentenceTransformer

    validation = make_support_answers()["validation"]
    return held_out_retrieval(SentenceTransformer(model_path, device="cpu"), validation["anchor"],
                              validation["positive"])


def main() -> None:
    with tempfile.TemporaryDirectory() as out:
        start = time.perf_counter()
        run = subprocess.run([sys.executable, "-m", "accelerate.commands.launch", "--num_processes", "1",
                              str(REPO / "recipes" / "embed.py"), "--output_dir", out], cwd=REPO, check=True,
                             capture_output=True, text=True)
        wall = time.perf_counter() - start
        before = re.search(r"^before training: (.*)$", run.stdout, re.MULTILINE).group(1)
        results = {
            "command": "accelerate launch recipes/embed.py",
            "wall_seconds": wall,
            "before_training": {name: float(value) for name, value in
                                (item.rsplit(" ", 1) for item in before.split(", "))},
            "all_results": json.loads(Path(out, "all_results.json").read_text()),
            "base_model_through_sentence_transformers": sentence_transformers_scores(default_model_path()),
            "trained_model_through_sentence_transformers": sentence_transformers_scores(out),
            "threads": torch.get_num_threads(),
        }
    path = REPO / "bench" / "results" / "embed-default.json"
    path.write_text(json.dumps(results, indent=2) + "\n")
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
