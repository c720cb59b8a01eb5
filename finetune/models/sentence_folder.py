"""The sentence-transformers folder: how a base model pools and normalises its embeddings, read from its folder or
the Hub, and a trained encoder written as one that ``SentenceTransformer(path)`` loads (transformer files at the top,
``modules.json`` naming the pooling and normalisation modules after it)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import huggingface_hub
from huggingface_hub.errors import HfHubHTTPError, HFValidationError

from finetune.checkpointing.checkpoint import save_model

__all__ = ["Pooling", "base_pooling", "save_sentence_transformer"]

_MODES = {"mean": "pooling_mode_mean_tokens", "cls": "pooling_mode_cls_token",
          "lasttoken": "pooling_mode_lasttoken"}
_MODULE = "sentence_transformers.models."


@dataclass(frozen=True)
class Pooling:
    mode: str
    """``mean`` of the text's tokens, its first (``cls``), or its last (``lasttoken``, decoder embedders)."""
    normalize: bool
    """Embeddings scaled to unit length (a ``Normalize`` module after the pooling)."""


def base_pooling(name_or_path: str | Path | None) -> Pooling | None:
    """The pooling of the sentence-transformers model ``name_or_path``, a folder (``~`` expanded) or a Hub id (read
    as transformers reads the model: from the cache when offline); None for a plain model or a pooling this package
    does not compute."""
    if name_or_path is None:
        return None
    modules = _json_file(name_or_path, "modules.json")
    pooling = next((m for m in modules or [] if m.get("type") == _MODULE + "Pooling"), None)
    config = pooling and _json_file(name_or_path, f"{pooling['path']}/config.json")
    if not config:
        return None
    modes = [mode for mode, key in _MODES.items() if config.get(key)]
    others = [key for key, value in config.items() if value and key.startswith("pooling_mode")
              and key not in _MODES.values()]
    if len(modes) != 1 or others:
        return None
    return Pooling(modes[0], any(m.get("type") == _MODULE + "Normalize" for m in modules))


def _json_file(name_or_path: str | Path, name: str):
    folder = Path(name_or_path).expanduser()
    if folder.is_dir():
        path = folder / name
    else:
        try:
            path = Path(huggingface_hub.hf_hub_download(str(name_or_path), name))
        except (HfHubHTTPError, HFValidationError, OSError):  # no such repo or file; offline and not cached
            return None
    return json.loads(path.read_text()) if path.is_file() else None


def save_sentence_transformer(model, state_dict: dict, tokenizer, output_dir: str, pooling: Pooling,
                              max_seq_length: int) -> None:
    """Write ``model`` (unwrapped) and ``tokenizer`` as a sentence-transformers folder that embeds as ``pooling``,
    texts cut to ``max_seq_length`` tokens."""
    save_model(model, state_dict, tokenizer, output_dir)
    out = Path(output_dir)
    modules = [{"idx": 0, "name": "0", "path": "", "type": _MODULE + "Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling", "type": _MODULE + "Pooling"}]
    if pooling.normalize:
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize", "type": _MODULE + "Normalize"})
        (out / "2_Normalize").mkdir(exist_ok=True)
    (out / "1_Pooling").mkdir(exist_ok=True)
    pooling_config = {"word_embedding_dimension": model.config.hidden_size, "pooling_mode_cls_token": False,
                      "pooling_mode_mean_tokens": False, "pooling_mode_max_tokens": False,
                      "pooling_mode_mean_sqrt_len_tokens": False, "pooling_mode_weightedmean_tokens": False,
                      "pooling_mode_lasttoken": False, "include_prompt": True, _MODES[pooling.mode]: True}
    files = {"modules.json": modules, "1_Pooling/config.json": pooling_config,
             "sentence_bert_config.json": {"max_seq_length": max_seq_length, "do_lower_case": False},
             "config_sentence_transformers.json": {"similarity_fn_name": "cosine", "prompts": {},
                                                   "default_prompt_name": None}}
    for name, values in files.items():
        (out / name).write_text(json.dumps(values, indent=2) + "\n")
