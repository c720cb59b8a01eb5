"""Causal language models in the loop: packed or padded batches, per-token losses, greedy replies."""

from __future__ import annotations

import torch
import transformers

from finetune.chat import IGNORE
from finetune.ddp import all_reduce_max
from finetune.fsdp import is_sharded

__all__ = ["greedy_replies", "language_model_collators", "token_losses"]


def language_model_collators(tokenizer, packing: bool | None) -> tuple:
    """``(train collate, eval collate, packed, flash)`` for tokenized rows with labels.

    ``packing=None`` takes the faster batches for the device: packed where flash-attention's variable-length
    kernels run (a GPU with flash-attn installed), else padded. Without those kernels a packed row's
    attention spans the whole row under a block mask (SDPA's math path on a CPU), slower than padded batches
    grouped by length (``bench/results/sft.md``). ``flash`` says the model should load with
    ``attn_implementation="flash_attention_2"``. Evaluation batches are always padded, one row per example.
    """
    flash_available = torch.cuda.is_available() and transformers.utils.is_flash_attn_2_available()
    packed = flash_available if packing is None else packing
    flash = packed and flash_available
    padded = transformers.DataCollatorForSeq2Seq(tokenizer, label_pad_token_id=IGNORE)
    # Packed rows restart position ids at each example; transformers masks attention from them (with
    # flash-attention, from the sequence lengths the collator adds).
    train = transformers.DataCollatorWithFlattening(return_flash_attn_kwargs=flash) if packed else padded
    return train, padded, packed, flash


def token_losses(model, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """``(losses, labels)``: each position's next-token cross-entropy (float32) and its label, shifted so that
    both are ``[batch, length - 1]``; positions labelled ``IGNORE`` have loss 0. ``batch`` loses its labels."""
    # The labels move one to the left instead of the logits: the cross-entropy then runs over the contiguous
    # vocabulary dimension of the model's own logits (over a strided one it is much slower: bench/levers.py).
    next_labels = torch.nn.functional.pad(batch.pop("labels")[:, 1:], (0, 1), value=IGNORE)
    # No KV cache: with one, transformers skips the mask that keeps packed examples apart.
    logits = model(**batch, use_cache=False).logits
    losses = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), next_labels.flatten(), reduction="none",
                                               ignore_index=IGNORE).view_as(next_labels)
    return losses[:, :-1], next_labels[:, :-1]


def greedy_replies(model, index: torch.Tensor, prompts: list[list[int]], tokenizer, max_new_tokens: int
                   ) -> torch.Tensor:
    """Greedy replies for an evaluation batch whose rows are dataset examples ``index``: ``[len(index), L]``.

    Example ``i`` gets a reply when ``i < len(prompts)`` (``prompts[i]``, token ids); every other row, and each
    reply from its end-of-turn token on, is ``IGNORE``. The prompts are left-padded into one batch.
    """
    examples = index.tolist()
    rows = [row for row, i in enumerate(examples) if i < len(prompts)]
    chosen = [prompts[examples[row]] for row in rows]
    if is_sharded(model) and prompts:
        # Each forward of a sharded model gathers weights from every process, so all must run as many: while
        # any process has prompts in this batch, one with none decodes a stand-in (generate keeps them in step).
        if not int(all_reduce_max(torch.tensor(len(rows), device=index.device))):
            return torch.full((len(index), 1), IGNORE, device=index.device)
        chosen = chosen or prompts[:1]
    elif not rows:
        return torch.full((len(index), 1), IGNORE, device=index.device)
    longest = max(len(prompt) for prompt in chosen)
    pad = tokenizer.pad_token_id
    ids = torch.tensor([[pad] * (longest - len(prompt)) + prompt for prompt in chosen], device=index.device)
    mask = torch.tensor([[0] * (longest - len(prompt)) + [1] * len(prompt) for prompt in chosen], device=index.device)
    generated = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_new_tokens, do_sample=False,
                               pad_token_id=pad)[:len(rows), longest:]
    replies = torch.full((len(index), generated.shape[1]), IGNORE, device=index.device)
    replies[rows] = generated.masked_fill((generated == tokenizer.eos_token_id).cumsum(1) > 0, IGNORE)
    return replies
