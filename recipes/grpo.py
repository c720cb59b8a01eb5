"""Reinforcement learning with rewards a program checks (GRPO with LoRA), on one process or many.

With no flags it trains SmolLM2-135M-Instruct (the chat recipe's converted folder) on the embedded support-ticket
prompts, offline: each prompt's completions score 1 where the reply's first line names the team that owns the ticket
and no other, else 0; no reference reply is trained on. It saves the LoRA adapter with the tokenizer to outputs/grpo.

    accelerate launch recipes/grpo.py                                                  # 1 process
    torchrun --nproc_per_node=2 recipes/grpo.py --model_name_or_path outputs/sft        # after the chat recipe

Data: jsonl, json or parquet with a `prompt` column (text, or a list of {role, content} messages) and the columns the
reward functions read, or `--dataset_name`. Reward functions have TRL's signature, `func(prompts, completions,
**columns)` -> a list of floats or None, and run in worker processes: `--reward_funcs my_rewards.py:accuracy`.
Flags follow TRL's GRPO script; `--config FILE.yaml` sets any of them.
"""

from pathlib import Path

import torch

from finetune.data.batching import TokenizedDataset
from finetune.data.embedded.support_chats import SUPPORT_PROMPTS
from finetune.data.sources import load_splits
from finetune.environment import LaunchEnvironment
from finetune.errors import UserError, run_main
from finetune.models.loading import default_chat_model_path
from finetune.recipe import run_recipe
from finetune.task import TaskSetup
from finetune.tasks import causal_lm, grpo, rollout, scoring
from finetune.tasks.episodes import Episodes, EvalEpisodes, response_template, row_columns
from finetune.tasks.grpo import GRPOArguments
from finetune.tasks.preference import Reference, policy_precision
from finetune.tasks.rewards import RewardPool
from finetune.tasks.tools import ToolPool

DEFAULT_REWARD = "finetune.data.embedded.support_chats:routing_reward"
DEFAULTS = {"output_dir": "outputs/grpo", "num_train_epochs": 1, "learning_rate": 1e-3,
            "per_device_train_batch_size": 16, "max_seq_length": 1024, "logging_steps": 1, "num_generations": 4,
            "max_completion_length": 16, "reward_funcs": [DEFAULT_REWARD]}
"""This recipe's defaults: LoRA at a high learning rate, a step of 16 completions (four prompts' groups of 4),
completions as long as a reply's first line (all the routing reward reads) needs, so that one epoch of the embedded
prompts is 40 steps, and the routing reward for the embedded prompts."""


class GRPOTask(causal_lm.ChatTask):
    name, what = "grpo", "reinforcement learning with verifiable rewards (GRPO)"
    tokenizing_code = ("finetune.tasks.grpo", "finetune.tasks.episodes", "finetune.tasks.chat", "finetune.data.sources",
                       "finetune.data.embedded", "finetune.data.embedded.support_chats",
                       "finetune.data.embedded.support_tickets")
    pool = tools = None

    def __init__(self, args):
        super().__init__(args)
        # An agent's held-out success before GRPO (after the chat recipe's step) is what GRPO is measured against.
        self.evaluate_first = bool(args.tools or args.environment)

    def load_tokenizer(self, cfg):
        tokenizer = super().load_tokenizer(cfg)
        if self.args.tools or self.args.environment:  # a template without a tool-call format: before anything heavy
            response_template(tokenizer, self.args.template_options)
        return tokenizer

    def load_data(self, cfg):
        if (cfg.train_file or cfg.dataset_name) and self.args.reward_funcs == [DEFAULT_REWARD]:
            raise UserError("your data needs reward functions of its own: give --reward_funcs module:function ... "
                            "(TRL's signature, func(prompts, completions, **columns) -> list of floats)")
        if (self.args.tools or self.args.environment) and self.tools is None:  # their schemas go into the prompts
            self.tools = ToolPool(self.args.tools, self.args.environment, timeout=self.args.tool_timeout)
        return load_splits(cfg, SUPPORT_PROMPTS)

    def data_options(self, cfg):
        return {**super().data_options(cfg), "tools": self.tools.schemas if self.tools else None}

    def tokenize(self, raw, tokenizer, cfg, tokenizing):
        for split in ("train", "validation"):
            grpo.tokenize_prompts(raw[split], tokenizer, cfg.max_seq_length, split, tokenizing,
                                  self.args.template_options, self.tools.schemas if self.tools else None)
        return {"answers": SUPPORT_PROMPTS.answers(raw, cfg)}

    def setup(self, cfg, tokenizer, data):
        args, env = self.args, LaunchEnvironment.read()
        episodes = self.tools and Episodes(args, tokenizer, self.tools, args.template_options)
        train_set = TokenizedDataset(data.train, ["index"])
        sampler = rollout.RolloutSampler.for_run(train_set.lengths, cfg, args, env.world_size)
        self.run_files = tuple(f"rollout-rank{rank}.pt" for rank in range(env.world_size))  # (num_iterations > 1)
        # one pool however often the model is set up (--prepare_only counts on two cut models)
        self.pool = self.pool or RewardPool(args.reward_funcs, timeout=args.reward_timeout,
                                            passed_environment=args.reward_env, environment=args.environment)
        # an environment that cannot start is refused before the model loads; the rewards check gets it started
        started = self.tools.reset(row_columns(data.train.select([0])))[0][1] if args.environment else None
        scoring.check_rewards_on(self.pool, data.train[0], environment=started)
        model = causal_lm.load_causal_lm(cfg.model_name_or_path or default_chat_model_path(),
                                         trust_remote_code=cfg.trust_remote_code, **args.loading_options(cfg))
        model, adapters = causal_lm.adapt_chat_model(model, args, tokenizer)
        self.rollouts = rollout.Rollouts(
            args, data.train, tokenizer, self.pool, args.weights.tolist(),
            model.generation_config.eos_token_id, world_size=env.world_size, rank=env.rank,
            per_device_batch_size=cfg.per_device_train_batch_size, accumulation_steps=cfg.gradient_accumulation_steps,
            seed=cfg.seed, reference=Reference(model, **policy_precision(cfg)) if args.beta else None,
            kept=Path(cfg.output_dir) / self.run_files[env.rank], episodes=episodes)
        if episodes:  # scored where they ran: their messages and the tools' state stay there
            self.evaluation = EvalEpisodes(episodes, data.validation, self.pool, args.weights,
                                           rollout.greedy_sampling(self.rollouts.pad))
        else:
            replies = causal_lm.EvalReplies(data.validation, tokenizer, args, data.info["answers"],
                                            SUPPORT_PROMPTS.score_replies, count=len(data.validation))
            self.evaluation = rollout.EvalReplyRewards(replies, self.pool, args.weights)
        summary = [f"{args.num_generations} completions a prompt, --loss_type {args.loss_type}, rewards: "
                   + ", ".join(args.reward_funcs), args.tools and "tools: " + ", ".join(args.tools),
                   args.environment and f"environment: {args.environment}", adapters]
        return TaskSetup(train_set, TokenizedDataset(data.validation, ["index"]), _indices, model, sampler=sampler,
                         largest_batch=self.rollouts.largest_micro_batch(), summary=", ".join(filter(None, summary)))

    def rollout(self, model, window, epoch):
        return self.rollouts(model, window, epoch)

    def loss(self, model, batch):
        return self.rollouts.loss(model, batch)

    def interval_logs(self):
        return self.rollouts.interval_logs()

    def state_dict(self):
        return {"reward_judge": self.rollouts.judge.state_dict()}

    def load_state_dict(self, state):
        if state:  # (a checkpoint from before the judge's counters were kept has none)
            self.rollouts.judge.load_state_dict(state["reward_judge"])

    def eval_outputs(self, model, batch):
        return self.evaluation.outputs(model, batch["index"])

    def metrics(self, outputs):
        return self.evaluation.metrics(outputs)

    def write_predictions(self, outputs, output_dir):
        self.evaluation.write(outputs[0], output_dir)

    def close(self):
        for pool in (self.pool, self.tools):
            if pool is not None:
                pool.close()


def _indices(rows: list[dict]) -> dict:
    return {"index": torch.tensor([row["index"] for row in rows])}


def main(argv=None):
    run_recipe(GRPOTask, GRPOArguments, argv, description="Reinforcement learning with verifiable rewards (GRPO).",
               defaults=DEFAULTS)


if __name__ == "__main__":
    run_main(main)
