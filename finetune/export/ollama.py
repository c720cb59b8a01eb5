"""The Ollama ``Modelfile`` beside a GGUF file (``NAME.Modelfile`` for ``NAME.gguf``): the file, the tokens a
reply stops at, and for the template families this package writes, the chat template in Ollama's Go syntax.

Ollama does not always take the chat template from a GGUF file it imports (ollama#6371, #8982), and where it
guesses a family it renders that family's usual template, not the model's (SmolLM2's adds a default system
message the usual ChatML lacks). So for ChatML and Gemma templates the ``TEMPLATE`` is written here, rendering what
the Jinja template renders for a conversation and its generation prompt (``bench/export_check.py`` compares the
two through Go's own ``text/template``); for any other template Ollama is left to its guess, and the stops keep a
reply from running past its end of turn either way.
"""

from __future__ import annotations

import json
from pathlib import Path

from finetune.checkpointing.files import replacing

__all__ = ["go_template", "modelfile_path", "write_modelfile"]

MARK = "FINETUNE_USER_TURN"
ANY_SYSTEM = ('{{- $system := "" }}{{- range .Messages }}{{- if eq .Role "system" }}{{- $system = .Content }}'
              '{{- end }}{{- end }}')


def go_template(jinja: str | None, render) -> str | None:
    """Ollama's Go template for a ChatML or Gemma ``jinja`` template (``render(messages)`` renders the Jinja one
    with the generation prompt), or None for another family."""
    if not jinja:
        return None
    if "<|im_start|>" in jinja:
        # What the template writes before a conversation without a system message (its default system turn), and
        # its generation prompt (Qwen3's with thinking off holds an empty think block).
        before, turn, after = render([{"role": "user", "content": MARK}]).partition(
            f"<|im_start|>user\n{MARK}<|im_end|>\n")
        after = after if turn else "<|im_start|>assistant\n"
        default = before if before.startswith("<|im_start|>system\n") else ""
        return (ANY_SYSTEM + (f"{{{{- if not $system }}}}{default}{{{{ end }}}}" if default else "")
                + "{{- range .Messages }}<|im_start|>{{ .Role }}\n{{ .Content }}<|im_end|>\n{{ end }}" + after)
    if "<start_of_turn>" in jinja:
        # Gemma has no system turn: the system message opens the first user turn.
        return (ANY_SYSTEM + "{{- $first := true }}{{- range .Messages }}{{- if ne .Role \"system\" }}"
                "<start_of_turn>{{ if eq .Role \"assistant\" }}model{{ else }}{{ .Role }}{{ end }}\n"
                "{{ if and $first $system }}{{ $system }}\n\n{{ end }}{{ .Content }}<end_of_turn>\n"
                "{{ $first = false }}{{ end }}{{ end }}<start_of_turn>model\n")
    return None


def write_modelfile(trained, gguf_path: Path) -> Path:
    tokenizer = trained.tokenizer
    stops = dict.fromkeys(tokenizer.convert_ids_to_tokens(trained.stops))
    lines = [f"FROM ./{gguf_path.name}"]
    template = go_template(tokenizer.chat_template, lambda messages: tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True))
    if template:
        lines.append(f'TEMPLATE """{template}"""')
    lines += [f"PARAMETER stop {json.dumps(stop)}" for stop in stops]
    modelfile = modelfile_path(gguf_path)
    with replacing(modelfile) as partial:
        partial.write_text("\n".join(lines) + "\n")
    return modelfile


def modelfile_path(gguf_path: Path) -> Path:
    """The Modelfile of ``gguf_path``: one per file, so that an f16 and a q8_0 can share a folder."""
    return gguf_path.with_suffix(".Modelfile")
