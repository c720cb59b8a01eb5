"""``python -m finetune.export OUTPUT_DIR --to gguf|merged``: a trained folder as a GGUF file (with its Ollama
Modelfile) or as a full Hugging Face folder.

    python -m finetune.export sft-output --to gguf --quant q8_0        # sft-output/sft-output-q8_0.gguf
    python -m finetune.export sft-output --to merged --dtype bfloat16  # sft-output/merged
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from finetune.checkpointing.files import check_new_output
from finetune.errors import UserError, run_main
from finetune.export.gguf_file import QUANTS, architecture_of, vocabulary, write_gguf
from finetune.export.merged import write_merged
from finetune.export.ollama import modelfile_path, write_modelfile
from finetune.models.loading import from_pretrained
from finetune.models.trained import load_trained, trained_config


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m finetune.export", description=__doc__.splitlines()[0])
    parser.add_argument("output_dir", type=Path, help="a chat, DPO or GRPO run's --output_dir (adapter or model)")
    parser.add_argument("--to", choices=("gguf", "merged"), required=True)
    parser.add_argument("--quant", choices=QUANTS, default="f16", help="GGUF: the 2-D weights' type")
    parser.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default="bfloat16",
                        help="merged: the weights' dtype")
    parser.add_argument("--out", type=Path, help="the file or folder to write (default: inside OUTPUT_DIR)")
    parser.add_argument("--base_model", help="an adapter's base model, where it is not where the run loaded it")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    from transformers import AutoTokenizer

    args = parse_args(argv)
    folder = args.output_dir
    config = trained_config(folder, args.base_model)
    if args.to == "gguf":
        architecture_of(config)
    out = args.out or (folder / f"{folder.resolve().name}-{args.quant}.gguf" if args.to == "gguf"
                       else folder / "merged")
    if args.to == "gguf" and out.suffix != ".gguf":  # (NAME.Modelfile would be its own Modelfile)
        raise UserError(f"--out {out}: a GGUF file's name ends in .gguf")
    check_new_output(out, "--out")
    if args.to == "gguf":
        check_new_output(modelfile_path(out), "--out's Modelfile")
        vocabulary(from_pretrained(AutoTokenizer, str(folder)), config, folder)
    trained = load_trained(folder, args.base_model)
    if args.to == "gguf":
        write_gguf(trained, out, args.quant)
        print(f"wrote {out} ({out.stat().st_size / 2**20:,.1f} MiB) and {write_modelfile(trained, out)}",
              file=sys.stderr)
    else:
        write_merged(trained, out, args.dtype)
        print(f"wrote {out}", file=sys.stderr)


if __name__ == "__main__":
    run_main(main)
