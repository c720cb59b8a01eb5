"""The tasks' libraries, what a recipe's Task is made of: class labels (``classification``), BIO tags, sub-token
alignment and entity scores (``tagging``), conversations through the chat template and the tokens that train
(``chat``), causal-LM batches, log-probabilities in chunks and greedy replies (``causal_lm``), preference pairs,
the DPO losses and the reference (``preference``), reward functions run in worker processes that a hang or a crash
does not stop, their failures counted (``rewards``), scoring replies with them and judging a run's scores
(``scoring``), GRPO's rollouts, advantages and losses (``grpo``), and the metrics as evaluate modules
(``metrics``).

May import: models, hub, distributed, data, checkpointing and the core.
"""
