"""Run a recipe and record, per process, how often it tokenized the training split and which training batches it
fetched from the dataset.

    python watch_data.py OUT RECIPE [flags]   (under torchrun or accelerate launch)

Writes OUT/rank_R.json: ``builds``, ``fetched`` (each training batch's indices, in order) and ``lengths`` (the
training rows' token counts, to plan the epochs again). ``WATCH_DATA_BUILD_SECONDS`` makes each build take that
much longer.
"""

import atexit
import json
import os
import runpy
import sys
import time
from pathlib import Path

from finetune.data.batching import PlannedBatch, TokenizedDataset
from finetune.data.cache import Tokenizing

out = Path(sys.argv[1])
record = {"builds": 0, "fetched": [], "lengths": None}
tokenize, fetch = Tokenizing.map, TokenizedDataset.__getitems__


def slow_map(self, split, fn, name, features):
    if name == "train":
        record["builds"] += 1
        time.sleep(float(os.environ.get("WATCH_DATA_BUILD_SECONDS", "0")))
    return tokenize(self, split, fn, name, features)


def noted_fetch(self, indices):
    if isinstance(indices, PlannedBatch):  # training batches; evaluation fetches plain lists
        record["fetched"].append(list(indices))
        record["lengths"] = self.lengths.tolist()
    return fetch(self, indices)


def write():
    (out / f"rank_{os.environ.get('RANK', '0')}.json").write_text(json.dumps(record))


Tokenizing.map, TokenizedDataset.__getitems__ = slow_map, noted_fetch
atexit.register(write)
script, sys.argv = sys.argv[2], sys.argv[2:]
sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
runpy.run_path(script, run_name="__main__")
