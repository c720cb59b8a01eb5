"""Measurement hooks for one benchmark process, and the wrapper that runs the recipe under them.

    accelerate launch ... bench/probe.py recipes/classify.py --flag value ...
    torchrun ... bench/probe.py recipes/classify.py --flag value ...

The recipe runs unchanged; the hooks only observe. Every process writes ``rank<R>.json`` into
``$BENCH_REPORT_DIR`` at exit with:

- the wall-clock time of every optimizer step (a global optimizer post-step hook; on CUDA, events
  recorded on the stream, so no synchronisation is added to the loop),
- the examples (a preference pair is one), real tokens and padded tokens of every training batch, and when it
  was built, in order,
- how many gradient all-reduces DDP launched by the end of each optimizer step (a counting comm hook),
- the process's peak resident memory, and on CUDA the peak of memory allocated on the GPU,
- the peak the recipe's start-up line predicted, unrounded,
- the bytes of the weights that train, their gradients and the optimizer's state that this process holds at its
  first optimizer step (its own shards only, under FSDP),
- for reinforcement learning, when each call that samples completions or scores them began and ended; the
  completions a training call samples are its batch (``time_phase``).
"""

from __future__ import annotations

import atexit
import json
import os
import resource
import runpy
import sys
import time

import torch
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel
from torch.optim.optimizer import register_optimizer_step_post_hook

_steps: list[float] = []
_cuda_events: list = []
_batches: list[tuple[int, int, int, float]] = []
_all_reduces = [0]
_all_reduces_at_step: list[int] = []
_state_bytes: dict[str, int] = {}
_phases: list[tuple[str, float, float]] = []
_predicted_peaks: list[int] = []


def record_batch(batch: dict, num_real: int, rows_per_example: int = 1) -> None:
    """Count one training batch whose first ``num_real`` examples are real (the rest fillers).

    An example is ``rows_per_example`` rows, each in its own block of the batch (TRL's preference pairs: every
    chosen row, then every rejected row), or, in a batch of prompts run once for their replies (the preference
    recipe's), one prompt and the ``rows_per_example`` replies after it. A batch without an attention mask is packed
    (padding-free): every token in it is real."""
    if "prompt_mask" in batch:
        prompts, replies = batch["prompt_mask"], batch["reply_mask"]
        real = prompts[:num_real].sum() + replies[:rows_per_example * num_real].sum()
        _batches.append((num_real, int(real), int(prompts.numel() + replies.numel()), time.time()))
    elif "attention_mask" in batch:
        mask = batch["attention_mask"]
        real = mask.view(rows_per_example, -1, mask.shape[-1])[:, :num_real]
        _batches.append((num_real, int(real.sum()), int(mask.numel()), time.time()))
    else:
        _batches.append((num_real, int(batch["input_ids"].numel()), int(batch["input_ids"].numel()), time.time()))


def record_counts(examples: int, real_tokens: int, padded_tokens: int) -> None:
    """Count one training batch from its figures (a baseline whose batches ``record_batch`` does not read)."""
    _batches.append((examples, real_tokens, padded_tokens, time.time()))


def time_phase(owner, name: str, phase: str, sampled=None) -> None:
    """Time every call of ``owner.name`` as ``phase``. ``sampled(args, result)`` gives the completions (token id
    lists) a call sampled for training, None for others (evaluation's): they are counted as a batch that began
    when the call did, each completion an example and its tokens real ones."""
    original = getattr(owner, name)

    def timed(*args, **kwargs):
        start = time.time()
        result = original(*args, **kwargs)
        _phases.append((phase, start, time.time()))
        completions = sampled(args, result) if sampled else None
        if completions is not None:
            tokens = sum(map(len, completions))
            _batches.append((len(completions), tokens, tokens, start))
        return result

    setattr(owner, name, timed)


def _held_bytes(tensor) -> int:
    """Bytes of ``tensor`` in this process: a DTensor's local shard only."""
    local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
    return local.numel() * local.element_size()


def _after_optimizer_step(optimizer, args, kwargs) -> None:
    if not _state_bytes:  # before zero_grad, with the state the first step allocated
        params = [p for group in optimizer.param_groups for p in group["params"]]
        _state_bytes.update(
            weights=sum(_held_bytes(p) for p in params),
            gradients=sum(_held_bytes(p.grad) for p in params if p.grad is not None),
            optimizer=sum(_held_bytes(t) for p in params for t in optimizer.state[p].values()
                          if isinstance(t, torch.Tensor)))
    _steps.append(time.time())
    _all_reduces_at_step.append(_all_reduces[0])
    if torch.cuda.is_available():
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        _cuda_events.append(event)


def _counting_all_reduce(state, bucket):
    _all_reduces[0] += 1
    return default_hooks.allreduce_hook(state, bucket)


def _count_ddp_all_reduces() -> None:
    original_init = DistributedDataParallel.__init__

    def init_with_counter(self, *args, **kwargs):
        original_init(self, *args, **kwargs)
        self.register_comm_hook(self.process_group, _counting_all_reduce)

    DistributedDataParallel.__init__ = init_with_counter


def _write_report() -> None:
    if _cuda_events:
        torch.cuda.synchronize()
        # Step times relative to the first step, from GPU events: the real end of each step's work.
        first = _cuda_events[0]
        _steps[:] = [_steps[0] + first.elapsed_time(event) / 1000 for event in _cuda_events]
    report = {
        "rank": int(os.environ.get("RANK", "0")),
        "launched_at": float(os.environ["BENCH_LAUNCHED_AT"]),
        "step_times": _steps,
        "batches": _batches,
        "all_reduces_at_step": _all_reduces_at_step,
        "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "peak_gpu_memory_gib": torch.cuda.max_memory_allocated() / 2**30 if _cuda_events else float("nan"),
        "threads": torch.get_num_threads(),
        "state_bytes": _state_bytes,
        "phases": _phases,
        "predicted_peak_mib": _predicted_peaks[-1] / 2**20 if _predicted_peaks else None,
    }
    path = os.path.join(os.environ["BENCH_REPORT_DIR"], f"rank{report['rank']}.json")
    with open(path, "w") as f:
        json.dump(report, f)


def install() -> None:
    """Start observing this process; the report is written when it exits."""
    register_optimizer_step_post_hook(_after_optimizer_step)
    _count_ddp_all_reduces()
    atexit.register(_write_report)


def _count_recipe_batches() -> None:
    """Count the recipe's training batches as its collator builds them.

    Training batches are fetched by the sampler's planned index lists, which say how many examples are
    real; evaluation batches are fetched by plain lists.
    """
    from transformers import (
        DataCollatorForSeq2Seq,
        DataCollatorForTokenClassification,
        DataCollatorWithFlattening,
        DataCollatorWithPadding,
    )

    from finetune.data.batching import PlannedBatch, TokenizedDataset
    from finetune.tasks import embedding
    from finetune.tasks.preference import PromptRepliesCollator

    planned_real: list[int | None] = [None]
    original_fetch = TokenizedDataset.__getitems__

    def fetch_and_note(self, indices):
        planned_real[0] = indices.num_real if isinstance(indices, PlannedBatch) else None
        return original_fetch(self, indices)

    def counting(original_call, rows_per_example: int = 1):
        def call_and_count(self, features):
            batch = original_call(self, features)
            if planned_real[0] is not None:
                record_batch(batch, planned_real[0], rows_per_example)
            return batch
        return call_and_count

    TokenizedDataset.__getitems__ = fetch_and_note
    original_texts = embedding.collate_texts

    def counting_texts(*args, **kwargs):  # the embedding recipe's collator: each text column padded apart
        collate = original_texts(*args, **kwargs)

        def call_and_count(rows):
            batch = collate(rows)
            if planned_real[0] is not None:
                masks = [value for key, value in batch.items() if key.startswith("attention_mask_")]
                record_counts(planned_real[0], sum(int(m[:planned_real[0]].sum()) for m in masks),
                              sum(m.numel() for m in masks))
            return batch
        return call_and_count

    embedding.collate_texts = counting_texts
    for collator in (DataCollatorWithPadding, DataCollatorForTokenClassification, DataCollatorForSeq2Seq,
                     DataCollatorWithFlattening):
        collator.__call__ = counting(collator.__call__)
    PromptRepliesCollator.__call__ = counting(PromptRepliesCollator.__call__, rows_per_example=2)


def _note_predicted_peak() -> None:
    """The peak the recipe's start-up line predicts (``finetune.models.estimate``), in bytes, not as printed."""
    from finetune import startup

    printed = startup._print_estimate

    def noted(runtime, estimate):
        _predicted_peaks.append(estimate.peak)
        printed(runtime, estimate)
    startup._print_estimate = noted


def _time_recipe_rollouts() -> None:
    """The GRPO recipe's sampling of its training completions (with tools, whole episodes: every turn's sampling
    and the tool calls between, as TRL's ``_generate`` holds its tool loop) and scoring."""
    from finetune.tasks import episodes, rollout

    time_phase(rollout.Rollouts, "_sample", "generation", lambda args, result: [e.ids for e in result])
    time_phase(rollout, "score_replies", "scoring")
    time_phase(episodes, "score_replies", "scoring")


if __name__ == "__main__":
    install()
    _count_recipe_batches()
    _time_recipe_rollouts()
    _note_predicted_peak()
    script, sys.argv = sys.argv[1], sys.argv[1:]
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
    runpy.run_path(script, run_name="__main__")
