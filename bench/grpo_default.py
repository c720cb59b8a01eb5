"""The GRPO recipe's default run beside the base model it starts from, and the usual pipeline (the chat recipe's
default run, then GRPO from its adapter), on the same 47 validation prompts.

    python bench/grpo_default.py           # about 25 minutes on 2 CPU cores: bench/results/grpo-default.json
    python bench/grpo_default.py --trials  # other settings from the base: bench/results/grpo-from-base-trials.json

Each model is evaluated exactly as the recipe evaluates: greedy replies to every validation prompt, scored by the
routing reward (1 where the reply's first line names the ticket's team and no other). The runs are launched as
the README launches them, under ``bench/probe.py`` for their peak resident memory; the reward curve is each step's
mean reward over the completions it sampled (``log_history.jsonl``).

``--trials`` measures what might lift GRPO from the base model: how often the base model's sampled replies name a
team with the default prompts and with a question that lists the teams after each ticket; then GRPO from the base
at a lower learning rate with hotter sampling, and with the question at the default settings and at those.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

from sft_default import launch_default_run, recipe_metrics  # noqa: E402


def held_out_reward(model: str | None) -> float:
    """The GRPO recipe's evaluation reward of ``model`` (default: the base model) on the validation prompts."""
    return recipe_metrics("grpo", "GRPOArguments", "GRPOTask",
                          ["--model_name_or_path", model] if model else [])["eval_reward"]


def grpo_run(output_dir: Path, *flags: str) -> dict:
    run, wall, peak = launch_default_run("grpo", output_dir, *flags)
    steps = [step for step in map(json.loads, open(output_dir / "log_history.jsonl")) if "reward" in step]
    return {"held_out_reward": run["eval_reward"], "wall_seconds": wall, "peak_rss_mib": peak,
            "global_step": run["global_step"], "train_runtime": run["train_runtime"],
            "training_reward_curve": [round(step["reward"], 4) for step in steps],
            # groups whose completions all scored alike, which give no gradient: what stalls learning
            "frac_reward_zero_std_curve": [step["frac_reward_zero_std"] for step in steps],
            "grad_norm_curve": [round(step["grad_norm"], 4) for step in steps]}


QUESTION = ("\n\nWhich team should handle this ticket: billing, technical, shipping or account? "
            "Answer with the team's name.")
# The default reward under another name: the recipe asks data of its own to name its reward functions.
ROUTING_REWARD = f"{REPO / 'finetune' / 'data' / 'embedded' / 'support_chats.py'}:routing_reward"
HOTTER = ["--learning_rate", "3e-4", "--temperature", "1.2"]
TRIALS = {"lr_3e-4_temperature_1.2": (False, HOTTER),  # (the question after each ticket, flags)
          "question_after_the_ticket": (True, []),
          "question_lr_3e-4_temperature_1.2": (True, HOTTER)}


def prompts(question: str) -> dict:
    """The embedded prompts, ``question`` added to each ticket."""
    from finetune.data.embedded.support_chats import make_support_prompts

    def asked(prompt):
        return [prompt[0], {**prompt[1], "content": prompt[1]["content"] + question}]

    return {split: [{"prompt": asked(row["prompt"]), "team": row["team"]} for row in rows]
            for split, rows in make_support_prompts().items()}


def sampled_routing(question: str, count: int = 32, samples: int = 4) -> dict:
    """The share of the base model's replies, sampled with transformers' ``generate`` at the recipe's settings
    (temperature 1, top_p 1, 16 tokens), whose first line names a team (and the ticket's team), over the first
    ``count`` training prompts."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from finetune.data.embedded.support_chats import routed_team
    from finetune.models.loading import default_chat_model_path

    tokenizer = AutoTokenizer.from_pretrained(default_chat_model_path(), padding_side="left")
    model = AutoModelForCausalLM.from_pretrained(default_chat_model_path()).eval()
    rows = prompts(question)["train"][:count]
    texts = [tokenizer.apply_chat_template(row["prompt"], tokenize=False, add_generation_prompt=True) for row in rows]
    torch.manual_seed(0)
    named = right = 0
    for start in range(0, count, 8):
        batch = tokenizer(texts[start:start + 8], return_tensors="pt", padding=True, add_special_tokens=False)
        with torch.no_grad():
            out = model.generate(**batch, do_sample=True, temperature=1.0, top_p=1.0, max_new_tokens=16,
                                 num_return_sequences=samples, pad_token_id=tokenizer.pad_token_id)
        replies = tokenizer.batch_decode(out[:, batch["input_ids"].shape[1]:], skip_special_tokens=True)
        for k, reply in enumerate(replies):
            team = routed_team(reply)
            named += team is not None
            right += team == rows[start + k // samples]["team"]
    return {"replies": count * samples, "name_a_team": named / (count * samples),
            "name_the_right_team": right / (count * samples)}


def trials(results_file: Path) -> None:
    torch.set_num_threads(2)
    results = {"device": f"cpu ({torch.get_num_threads()} threads)", "torch": torch.__version__, "question": QUESTION,
               "base_model_sampling": {"default_prompts": sampled_routing(""),
                                       "question_after_the_ticket": sampled_routing(QUESTION)}}
    print(json.dumps(results), flush=True)
    with tempfile.TemporaryDirectory() as scratch:
        files = []
        for split, rows in prompts(QUESTION).items():
            files += [f"--{split}_file", str(Path(scratch, f"{split}.jsonl"))]
            Path(files[-1]).write_text("".join(json.dumps(row) + "\n" for row in rows))
        for name, (question, flags) in TRIALS.items():
            data = [*files, "--reward_funcs", ROUTING_REWARD] if question else []
            results[name] = {"question": question, "flags": flags, **grpo_run(Path(scratch, name), *data, *flags)}
            print(name, json.dumps(results[name]), flush=True)
    results_file.write_text(json.dumps(results, indent=2) + "\n")


def main(results_file: Path) -> None:
    torch.set_num_threads(2)
    results = {"device": f"cpu ({torch.get_num_threads()} threads)", "torch": torch.__version__,
               "base_model": {"held_out_reward": held_out_reward(None)}}
    print(json.dumps(results), flush=True)
    with tempfile.TemporaryDirectory() as scratch:
        out = Path(scratch)
        results["default_run"] = grpo_run(out / "grpo")
        print(json.dumps(results["default_run"]), flush=True)
        _, wall, _ = launch_default_run("sft", out / "sft")
        results["sft_default_run"] = {"held_out_reward": held_out_reward(str(out / "sft")), "wall_seconds": wall}
        results["grpo_after_sft"] = grpo_run(out / "grpo-after-sft", "--model_name_or_path", str(out / "sft"))
    results_file.write_text(json.dumps(results, indent=2) + "\n")
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trials", action="store_true", help="GRPO from the base model with other prompts and "
                        "settings: bench/results/grpo-from-base-trials.json")
    parser.add_argument("--results_file", type=Path)
    args = parser.parse_args()
    if args.trials:
        trials(args.results_file or REPO / "bench" / "results" / "grpo-from-base-trials.json")
    else:
        main(args.results_file or REPO / "bench" / "results" / "grpo-default.json")
