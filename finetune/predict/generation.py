"""The replies a chat model gives: prompts through its chat template, batched and left-padded, each reply ending
at the end of turn the run trained (``generation_config.eos_token_id``) or at ``max_new_tokens``."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Sampling", "replies"]


@dataclass(frozen=True)
class Sampling:
    max_new_tokens: int = 256
    temperature: float = 0.0  # 0: greedy
    top_p: float = 1.0

    def options(self) -> dict:
        if self.temperature == 0:
            return {"do_sample": False, "max_new_tokens": self.max_new_tokens}
        return {"do_sample": True, "temperature": self.temperature, "top_p": self.top_p,
                "max_new_tokens": self.max_new_tokens}


def replies(model, tokenizer, prompts: list[list[dict]], sampling: Sampling, streamer=None,
            tools: list[list[dict] | None] | None = None) -> list[str]:
    """Each prompt's reply (the messages before it, rendered with the generation prompt and the prompt's ``tools``,
    function schemas, where it has any)."""
    import torch

    texts = [tokenizer.apply_chat_template(prompt, tools=schemas, tokenize=False, add_generation_prompt=True)
             for prompt, schemas in zip(prompts, tools or [None] * len(prompts), strict=True)]
    side, tokenizer.padding_side = tokenizer.padding_side, "left"
    try:
        batch = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False).to(model.device)
    finally:
        tokenizer.padding_side = side
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else model.generation_config.eos_token_id[0]
    with torch.no_grad():
        out = model.generate(**batch, **sampling.options(), pad_token_id=pad, streamer=streamer)
    stops = set(model.generation_config.eos_token_id)
    results = []
    for row in out[:, batch.input_ids.shape[1]:].tolist():
        end = next((i for i, token in enumerate(row) if token in stops), len(row))
        results.append(tokenizer.decode(row[:end], skip_special_tokens=True))
    return results
