"""``python -m finetune.predict OUTPUT_DIR --input FILE``: a trained folder's predictions for every row of a file,
one JSON line each, in the input's order: a classifier's label and probabilities, a tagger's tags and entities, a
chat model's reply. On one process, or many under ``accelerate launch`` or ``torchrun`` (each row once).

    python -m finetune.predict outputs/classify --input tickets.csv                 # outputs/classify/predictions.jsonl
    python -m finetune.predict outputs/sft --input chats.jsonl --output replies.jsonl --max_new_tokens 128
    torchrun --nproc_per_node 2 -m finetune.predict outputs/sft --input chats.jsonl --output replies.jsonl
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from finetune.checkpointing.files import check_new_output, replacing
from finetune.distributed.ddp import init_distributed
from finetune.environment import LaunchEnvironment
from finetune.errors import UserError, run_main
from finetune.predict.generation import Sampling
from finetune.predict.predictors import load_predictor, plan_for
from finetune.predict.sharing import predict_shared


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m finetune.predict", description=__doc__.splitlines()[0])
    parser.add_argument("output_dir", type=Path, help="a recipe's --output_dir (a model folder or an adapter)")
    parser.add_argument("--input", required=True, help="csv, tsv, jsonl, json or parquet (taggers: CoNLL too), "
                        "with the columns the recipe trains on")
    parser.add_argument("--output", type=Path, help="the JSON lines to write (default: OUTPUT_DIR/predictions.jsonl)")
    parser.add_argument("--batch_size", type=int, default=8, help="rows a process predicts at once")
    parser.add_argument("--text_column", help="classify, tag and embed: the text column (default: the run's; text, "
                        "tokens)")
    parser.add_argument("--text_pair_column", help="classify: the second text of sentence pairs (default: the run's)")
    parser.add_argument("--max_new_tokens", type=int, default=256, help="chat: the longest reply")
    parser.add_argument("--temperature", type=float, default=0.0, help="chat: 0 is greedy")
    parser.add_argument("--top_p", type=float, default=1.0, help="chat: nucleus sampling's share")
    parser.add_argument("--seed", type=int, default=42, help="chat: sampling's seed (each process adds its rank)")
    parser.add_argument("--base_model", help="an adapter's base model, where it is not where the run loaded it")
    args = parser.parse_args(argv)
    if args.batch_size < 1 or args.max_new_tokens < 1 or args.temperature < 0:
        raise UserError("--batch_size and --max_new_tokens must be at least 1, --temperature at least 0")
    return args


def main(argv: list[str] | None = None) -> None:
    import datasets
    import torch
    import torch.distributed as dist
    from tqdm.auto import tqdm

    from finetune.data.sources import read_file
    from finetune.tasks.tagging import read_conll

    args = parse_args(argv)
    env = LaunchEnvironment.read()
    output = args.output or args.output_dir / "predictions.jsonl"
    check_new_output(output, "--output")
    plan = plan_for(args.output_dir, args.text_column, args.text_pair_column, args.base_model)
    datasets.disable_progress_bars()  # the rows' own bar is the one to watch
    rows = plan.rows(read_file(args.input, "--input", {".conll": read_conll, ".txt": read_conll}))
    device = init_distributed().device  # (a process group where a launcher started several, each on its own GPU)
    try:
        predictor = load_predictor(plan, args.batch_size, device)
        torch.manual_seed(args.seed + env.rank)
        sampling = Sampling(args.max_new_tokens, args.temperature, args.top_p)
        with tqdm(total=len(rows[env.rank::env.world_size]), disable=env.rank != 0, unit="row",
                  desc=f"predicting ({plan.kind})") as progress:
            results = predict_shared(rows, lambda mine: predictor(mine, sampling, progress), env)
        if env.rank == 0:
            with replacing(output) as partial, open(partial, "w") as f:
                for row, result in zip(rows, results, strict=True):
                    f.write(json.dumps({**row, **result}, ensure_ascii=False, default=str) + "\n")
            print(f"wrote {len(rows)} {plan.kind} predictions to {output}")
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


if __name__ == "__main__":
    run_main(main)
