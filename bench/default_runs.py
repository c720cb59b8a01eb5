"""The classify and tagging recipes' default runs beside trivial baselines, the README's quickstart figures.

    python bench/default_runs.py     # about 4 minutes on 2 CPU cores: bench/results/default-runs.json

Each run is launched as the README launches it (`accelerate launch recipes/X.py`, no flags; the tagging
recipe once more with `--label_all_tokens`), its ``all_results.json`` and wall time recorded; for the tagging
runs also how often the pipeline's "simple" grouping gives the entities the model's per-word tags hold. The
baselines score the same validation sets through the same metric modules: the majority training class for
sentence classification; each word's most frequent training tag, and every word ``O``, for tagging.
"""

from __future__ import annotations

import collections
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from finetune.data.embedded.support_tickets import make_support_tickets  # noqa: E402
from finetune.data.embedded.tagged_tickets import TAG_NAMES, make_tagged_tickets  # noqa: E402
from finetune.tasks.metrics import load_metric  # noqa: E402
from finetune.tasks.tagging import entities  # noqa: E402

RUNS = {"classify": ("classify", []), "token_classify": ("token_classify", []),
        "token_classify_label_all_tokens": ("token_classify", ["--label_all_tokens"])}
"""name in the results: (recipe, flags)"""


def launch(recipe: str, flags: list[str], output_dir: str) -> dict:
    start = time.perf_counter()
    subprocess.run([sys.executable, "-m", "accelerate.commands.launch", "--num_processes", "1",
                    str(REPO / "recipes" / f"{recipe}.py"), *flags, "--output_dir", output_dir], cwd=REPO, check=True)
    wall = time.perf_counter() - start
    return {"flags": flags, "wall_seconds": wall, **json.loads(Path(output_dir, "all_results.json").read_text())}


def pipeline_agreement(output_dir: str) -> dict:
    """Validation sentences with a predicted entity where ``pipeline(aggregation_strategy="simple")`` on the
    joined words finds exactly the entities of ``eval_predictions.jsonl``."""
    from transformers import pipeline

    tag = pipeline("token-classification", model=output_dir, aggregation_strategy="simple")
    rows = [json.loads(line) for line in Path(output_dir, "eval_predictions.jsonl").read_text().splitlines()]
    rows = [row for row in rows if any(t != "O" for t in row["predicted"])]
    agree = 0
    for row in rows:
        words = row["tokens"]
        grouped = [(g["entity_group"], g["word"].replace(" ", "").lower()) for g in tag(" ".join(words))]
        expected = [(kind, "".join(words[start:end + 1]).lower())
                    for kind, start, end in sorted(entities(row["predicted"]), key=lambda e: e[1])]
        agree += grouped == expected
    return {"sentences": len(rows), "simple_grouping_matches": agree}


def classify_baseline() -> dict:
    data = make_support_tickets()
    majority = collections.Counter(data["train"]["label"]).most_common(1)[0][0]
    references = data["validation"]["label"]
    predictions = [majority] * len(references)
    accuracy = load_metric("accuracy").compute(predictions=predictions, references=references)["accuracy"]
    macro_f1 = load_metric("f1").compute(predictions=predictions, references=references, average="macro")["f1"]
    return {"majority_class": data["train"].features["label"].names[majority], "eval_accuracy": accuracy,
            "eval_f1": macro_f1}


def tagging_baselines() -> dict:
    data = make_tagged_tickets()
    counts = collections.defaultdict(collections.Counter)
    for words, tags in zip(data["train"]["tokens"], data["train"]["ner_tags"], strict=True):
        for word, tag in zip(words, tags, strict=True):
            counts[word][TAG_NAMES[tag]] += 1
    references = [[TAG_NAMES[t] for t in tags] for tags in data["validation"]["ner_tags"]]
    guesses = {"most_frequent_training_tag": [[counts[w].most_common(1)[0][0] if w in counts else "O" for w in words]
                                              for words in data["validation"]["tokens"]],
               "every_word_o": [["O"] * len(tags) for tags in references]}
    seqeval = load_metric("seqeval")
    results = {}
    for name, predictions in guesses.items():
        scores = seqeval.compute(predictions=predictions, references=references)
        results[name] = {f"eval_{measure}": scores[f"overall_{measure}"]
                         for measure in ("f1", "precision", "recall", "accuracy")}
    return results


def main() -> None:
    torch.set_num_threads(2)
    results = {"device": f"cpu ({torch.get_num_threads()} threads)", "torch": torch.__version__,
               "classify_baseline": classify_baseline(), "token_classify_baselines": tagging_baselines()}
    with tempfile.TemporaryDirectory() as scratch:
        for name, (recipe, flags) in RUNS.items():
            results[name] = launch(recipe, flags, f"{scratch}/{name}")
            if recipe == "token_classify":
                results[name]["pipeline"] = pipeline_agreement(f"{scratch}/{name}")
    out = REPO / "bench" / "results" / "default-runs.json"
    out.write_text(json.dumps(results, indent=2) + "\n")
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
