"""``python -m finetune.chat OUTPUT_DIR``: talk to a trained chat model in the terminal. Each reply streams as its
tokens come and ends at the end of turn the run trained; the conversation is kept until ``/reset``; ``/exit`` or
end of input (Ctrl-D) leaves.

    python -m finetune.chat outputs/sft --system "You route support tickets." --temperature 0.7
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from finetune.errors import UserError, run_main
from finetune.predict.generation import Sampling, replies


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m finetune.chat", description=__doc__.splitlines()[0])
    parser.add_argument("output_dir", type=Path, help="a chat, DPO or GRPO run's --output_dir (adapter or model)")
    parser.add_argument("--system", help="a system message that starts the conversation (and each /reset)")
    parser.add_argument("--max_new_tokens", type=int, default=512, help="the longest reply")
    parser.add_argument("--temperature", type=float, default=0.0, help="0 is greedy")
    parser.add_argument("--top_p", type=float, default=1.0, help="nucleus sampling's share")
    parser.add_argument("--base_model", help="an adapter's base model, where it is not where the run loaded it")
    args = parser.parse_args(argv)
    if args.max_new_tokens < 1 or args.temperature < 0:
        raise UserError("--max_new_tokens must be at least 1 and --temperature at least 0")
    return args


def main(argv: list[str] | None = None) -> None:
    from transformers import TextStreamer

    from finetune.environment import LaunchEnvironment
    from finetune.models.trained import load_trained
    from finetune.predict.sharing import device_for

    args = parse_args(argv)
    trained = load_trained(args.output_dir, args.base_model)
    model = trained.model.to(device_for(LaunchEnvironment.read()))
    sampling = Sampling(args.max_new_tokens, args.temperature, args.top_p)
    start = [{"role": "system", "content": args.system}] if args.system else []
    history = list(start)
    streamer = TextStreamer(trained.tokenizer, skip_prompt=True, skip_special_tokens=True)
    interactive = sys.stdin.isatty()
    print(f"{args.output_dir}: /reset starts over, /exit leaves", file=sys.stderr)
    while True:
        if interactive:
            print("> ", end="", flush=True, file=sys.stderr)
        line = sys.stdin.readline()
        if not line or line.strip() == "/exit":
            return
        if line.strip() == "/reset":
            history = list(start)
            continue
        if not line.strip():
            continue
        history.append({"role": "user", "content": line.rstrip("\n")})
        reply = replies(model, trained.tokenizer, [history], sampling, streamer=streamer)[0]
        history.append({"role": "assistant", "content": reply})


if __name__ == "__main__":
    run_main(main)
