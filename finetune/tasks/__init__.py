"""The tasks' libraries, what a recipe's Task is made of: class labels (``classification``), BIO tags, sub-token
alignment and entity scores (``tagging``), conversations through the chat template and the tokens that train
(``chat``), causal-LM batches, log-probabilities in chunks and greedy replies (``causal_lm``), preference pairs,
the DPO losses and the reference (``preference``), the worker pool that runs the user's functions out of process,
so that a hang or a crash does not stop the run (``workers``), reward functions in it, their failures counted
(``rewards``), scoring replies with them and judging a run's scores (``scoring``), tools and environments in it
(``tools``), multi-turn episodes with them (``episodes``), GRPO's options, advantages and losses (``grpo``) and its
rollouts (``rollout``), sentence embeddings (``embedding``), and the metrics as evaluate modules (``metrics``).

May import: models, hub, distributed, data, checkpointing and the core.
"""
