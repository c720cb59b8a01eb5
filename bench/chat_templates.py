"""How the chat recipes take every text template TRL ships, on the conversation shapes of tests/test_chat_templates.py:
trained as one row, split into rows (the template rewrites the history), or refused and why.

    python bench/chat_templates.py        # a few seconds -> bench/results/chat-templates.{json,md}
"""

from __future__ import annotations

import copy
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests"))

from test_chat_templates import SHAPES, TEMPLATES, TEXT_TEMPLATES, WEATHER  # noqa: E402
from transformers import AutoTokenizer  # noqa: E402

from finetune.errors import UserError  # noqa: E402
from finetune.models.loading import default_chat_model_path  # noqa: E402
from finetune.tasks.chat import read_tools, render_rows  # noqa: E402


def outcome(tokenizer, messages, tools) -> str:
    try:
        rows = render_rows([messages], tokenizer, ["row"], [read_tools(tools, "row")])[0]
    except UserError as err:
        return "refused: the template raises" if "refuses it" in str(err) else "refused: reply rendered otherwise"
    return "one row" if len(rows) == 1 else f"{len(rows)} rows"


def main() -> None:
    base = AutoTokenizer.from_pretrained(default_chat_model_path())
    table = {}
    for name in TEXT_TEMPLATES:
        tokenizer = copy.deepcopy(base)
        tokenizer.chat_template = (TEMPLATES / f"{name}.jinja").read_text()
        table[name] = {shape: outcome(tokenizer, messages, [WEATHER] if "tool" in shape else None)
                       for shape, messages in SHAPES.items()}
    out = REPO / "bench" / "results"
    (out / "chat-templates.json").write_text(json.dumps(table, indent=2) + "\n")
    lines = ["| template | " + " | ".join(SHAPES) + " |", "|---" * (len(SHAPES) + 1) + "|"]
    lines += [f"| {name} | " + " | ".join(row.values()) + " |" for name, row in table.items()]
    (out / "chat-templates.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
