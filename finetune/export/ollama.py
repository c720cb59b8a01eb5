"""The Ollama ``Modelfile`` beside a GGUF file (``NAME.Modelfile`` for ``NAME.gguf``): the file, and the tokens a
reply stops at.

Ollama takes the chat template from the GGUF file (``tokenizer.chat_template``), which it recognises for the
families the GGUF writer supports (ChatML, Llama 3, Qwen, Gemma); the stops are said here so that a reply ends at
the end of turn the run trained, whatever Ollama's guess."""

from __future__ import annotations

import json
from pathlib import Path

__all__ = ["write_modelfile"]


def write_modelfile(trained, gguf_path: Path) -> Path:
    stops = dict.fromkeys(trained.tokenizer.convert_ids_to_tokens(trained.stops))
    lines = [f"FROM ./{gguf_path.name}", *(f"PARAMETER stop {json.dumps(stop)}" for stop in stops)]
    modelfile = gguf_path.with_suffix(".Modelfile")  # one per file: an f16 and a q8_0 can share a folder
    modelfile.write_text("\n".join(lines) + "\n")
    return modelfile
