"""Using a trained folder: ``python -m finetune.predict`` runs every recipe's model over a file (``predictors``:
labels, tags, replies; ``sharing``: the rows split across processes and gathered back in order), and ``generation``
holds the replies a chat model gives, for it and for ``python -m finetune.chat``.

May import: models, tasks, data, distributed, checkpointing and the core.
"""
