"""A recipe's output folder read back as one model: a full model folder as it is, an adapter merged into its base
in float32 (a 4-bit base's weights as they trained: dequantized), with its tokenizer and the stops its replies
end at."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from finetune.errors import UserError

__all__ = ["Trained", "check_trained_folder", "load_trained", "trained_config"]


@dataclass
class Trained:
    model: object  # a transformers causal LM in float32, any adapter merged in
    tokenizer: object
    stops: list[int]  # the token ids a reply ends at (the end of turn first where the run saved them)
    folder: Path


def check_trained_folder(folder: Path) -> None:
    """Raises ``UserError`` unless ``folder`` holds a model (``config.json``) or an adapter: a recipe's output."""
    if not (folder / "config.json").is_file() and not (folder / "adapter_config.json").is_file():
        raise UserError(f"{folder} holds no trained model (no config.json or adapter_config.json): give a recipe's "
                        "--output_dir")


def _base_of(folder: Path, base_model: str | None) -> str | None:
    """The base model an adapter folder trained on (``base_model`` where given), or None for a full model."""
    check_trained_folder(folder)
    adapter = folder / "adapter_config.json"
    if not adapter.is_file():
        return None
    base = base_model or json.loads(adapter.read_text()).get("base_model_name_or_path")
    if not base:
        raise UserError(f"{adapter} names no base model: give it with --base_model")
    return base


def trained_config(folder: str | Path, base_model: str | None = None):
    """The configuration of the model in ``folder`` (an adapter's base's), read before any weight loads.

    Raises:
        UserError: ``folder`` holds no trained model, the adapter's base cannot be read, or the model is not a
            causal language model.
    """
    import transformers

    from finetune.models.loading import from_pretrained
    from finetune.models.memory import FOUR_BIT_BASE_FILE, require_bitsandbytes

    folder = Path(folder)
    base = _base_of(folder, base_model)
    if base and (folder / FOUR_BIT_BASE_FILE).is_file():
        require_bitsandbytes(f"{folder} is an adapter trained on a 4-bit base, which merging it quantizes again to "
                             "fold it into the weights it trained on: it", otherwise="")
    try:
        config = from_pretrained(transformers.AutoConfig, base or str(folder))
    except UserError as err:
        raise UserError(f"the adapter's base model could not be loaded ({err}); give it with --base_model") \
            from None
    kinds = config.architectures or []
    causal = transformers.AutoModelForCausalLM._model_mapping.get(type(config), None)
    if causal is None or (kinds and causal.__name__ not in kinds):
        raise UserError(f"{folder} holds a {(kinds or [config.model_type])[0]}, not a causal language model: "
                        "export writes the models of the chat, DPO and GRPO recipes")
    return config


def load_trained(folder: str | Path, base_model: str | None = None) -> Trained:
    """The causal LM a chat, DPO or GRPO run saved in ``folder``: ``config.json`` and weights, or an adapter
    (``adapter_config.json``) loaded on its base (``base_model``, else the one the adapter names; one that trained
    in 4 bits quantized and dequantized again, as it trained) and merged in float32. Raises ``UserError`` as
    ``trained_config`` does."""
    import torch
    import transformers

    from finetune.models.loading import from_pretrained, load_model
    from finetune.models.memory import FOUR_BIT_BASE_FILE, dequantize_into

    folder = Path(folder)
    trained_config(folder, base_model)
    base = _base_of(folder, base_model)
    model = load_model(transformers.AutoModelForCausalLM, base or str(folder))
    if base:
        from peft import PeftModel

        if (folder / FOUR_BIT_BASE_FILE).is_file():  # quantized again as it trained: from the same dtype
            saved = json.loads((folder / FOUR_BIT_BASE_FILE).read_text())
            four_bit = load_model(transformers.AutoModelForCausalLM, base, dtype=getattr(torch, saved["dtype"]),
                                  quantization_config=transformers.BitsAndBytesConfig.from_dict(
                                      saved["quantization_config"]))
            dequantize_into(four_bit, model)
            del four_bit
        model = PeftModel.from_pretrained(model, folder).merge_and_unload()
    tokenizer = from_pretrained(transformers.AutoTokenizer, str(folder))
    stops = model.generation_config.eos_token_id
    if (folder / "generation_config.json").is_file():
        stops = transformers.GenerationConfig.from_pretrained(folder).eos_token_id
    stops = [stops] if isinstance(stops, int) else list(stops or [tokenizer.eos_token_id])
    model.generation_config.eos_token_id = stops
    return Trained(model.to(torch.float32).eval(), tokenizer, stops, folder)
