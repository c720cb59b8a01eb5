"""``python -m finetune.chat OUTPUT_DIR``: a chat, DPO or GRPO run's model in the terminal, its replies streamed as
they are generated, through the replies of ``predict.generation``.

May import: predict, models and the core.
"""
