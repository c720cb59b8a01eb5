"""The sentence-transformers folder: how a base model pools and normalises its embeddings, read from its folder or
the Hub, and a trained encoder written as one that ``SentenceTransformer(path)`` loads (transformer files at the top,
``modules.json`` naming the pooling and normalisation modules after it)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import huggingface_hub
from huggingface_hub.errors import HFValidationError, RemoteEntryNotFoundError, RepositoryNotFoundError

from finetune.checkpointing.checkpoint import save_model
from finetune.errors import UserError

__all__ = ["Pooling", "base_pooling", "pooling_for", "save_sentence_transformer"]

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
    does not compute.

    Raises:
        UserError: the Hub could not say (offline and not cached, no network), or a file is no JSON of its kind.
    """
    if name_or_path is None:
        return None
    modules = _json_file(name_or_path, "modules.json", list)
    pooling = next((m for m in modules or [] if isinstance(m, dict) and m.get("type") == _MODULE + "Pooling"), None)
    config = pooling and _json_file(name_or_path, f"{pooling.get('path', '')}/config.json".lstrip("/"), dict)
    if not config:
        return None
    modes = [mode for mode, key in _MODES.items() if config.get(key)]
    others = [key for key, value in config.items() if value and key.startswith("pooling_mode")
              and key not in _MODES.values()]
    if len(modes) != 1 or others:
        return None
    return Pooling(modes[0], any(isinstance(m, dict) and m.get("type") == _MODULE + "Normalize" for m in modules))


def pooling_for(name_or_path: str | Path, mode: str | None, normalize: bool | None) -> Pooling:
    """The pooling a run asks for: ``mode`` and ``normalize`` where given, else the base model's (``base_pooling``,
    read only where one of them is not given), else mean, not normalised."""
    base = (base_pooling(name_or_path) if mode is None or normalize is None else None) or Pooling("mean", False)
    return Pooling(mode or base.mode, base.normalize if normalize is None else normalize)


def _json_file(name_or_path: str | Path, name: str, kind: type):
    folder = Path(name_or_path).expanduser()
    if folder.is_dir():
        path = folder / name
    else:
        try:
            path = Path(huggingface_hub.hf_hub_download(str(name_or_path), name))
        except (RemoteEntryNotFoundError, RepositoryNotFoundError, HFValidationError):
            return None  # a plain model; no repository or Hub id at all, which loading the model reports
        except OSError as error:  # guessing would save an embedder that pools unlike its base
            raise UserError(f"{name_or_path}: its {name}, which says how it pools, could not be read "
                            f"({type(error).__name__}: offline and not cached?); give --pooling and --normalize "
                            "true/false, or run once online") from error
    if not path.is_file():
        return None
    try:
        content = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise UserError(f"{path} is no JSON ({error}); fix or remove it") from error
    if not isinstance(content, kind):
        raise UserError(f"{path} holds a {type(content).__name__} where sentence-transformers writes a "
                        f"{kind.__name__}; fix or remove it")
    return content


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
