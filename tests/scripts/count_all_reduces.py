"""Run a recipe unchanged while recording when DDP all-reduces gradients.

    torchrun ... tests/scripts/count_all_reduces.py OUT recipes/classify.py [flags]

Writes OUT/rank_R.json: the micro-step (training forward count) at which each gradient all-reduce
fired, and the micro-step at which each optimizer step ran.
"""

import json
import os
import runpy
import sys
from pathlib import Path

import torch
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel
from torch.optim.optimizer import register_optimizer_step_post_hook

out, script = Path(sys.argv[1]), sys.argv[2]
sys.argv = sys.argv[2:]
forwards, all_reduces, optimizer_steps = [0], [], []
original_init, original_forward = DistributedDataParallel.__init__, DistributedDataParallel.forward


def counting_all_reduce(state, bucket):
    all_reduces.append(forwards[0])
    return default_hooks.allreduce_hook(state, bucket)


def init_with_counter(self, *args, **kwargs):
    original_init(self, *args, **kwargs)
    self.register_comm_hook(self.process_group, counting_all_reduce)


def counted_forward(self, *args, **kwargs):
    if self.training:
        forwards[0] += 1
    return original_forward(self, *args, **kwargs)


DistributedDataParallel.__init__ = init_with_counter
DistributedDataParallel.forward = counted_forward
register_optimizer_step_post_hook(lambda optimizer, args, kwargs: optimizer_steps.append(forwards[0]))
try:
    runpy.run_path(script, run_name="__main__")
finally:
    rank = os.environ.get("RANK", "0")
    (out / f"rank_{rank}.json").write_text(json.dumps({"all_reduces": all_reduces, "optimizer_steps": optimizer_steps,
                                                       "forwards": forwards[0], "threads": torch.get_num_threads()}))
