"""A trained model as a plain Hugging Face folder that vLLM and TGI serve: any adapter merged, the weights in
the dtype asked, ``generation_config.json`` stopping at the end of turn."""

from __future__ import annotations

from pathlib import Path

from finetune.checkpointing.files import replacing

__all__ = ["write_merged"]


def write_merged(trained, folder: Path, dtype: str) -> None:
    """``trained`` (``finetune.models.trained.Trained``) saved in ``folder``, written beside and renamed into
    place so a failed export leaves nothing half-written."""
    import torch

    model = trained.model.to(getattr(torch, dtype))
    model.generation_config.eos_token_id = trained.stops
    with replacing(folder) as partial:
        model.save_pretrained(partial)
        trained.tokenizer.save_pretrained(partial)
