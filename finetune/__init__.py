"""Fine-tune Hugging Face transformers on one process or many, under Accelerate or raw torch DDP.

The core, here: ``errors`` (the one-line refusals and the entry point), ``environment`` (what the launcher set),
``config`` (options, YAML and command line), ``task`` (what a recipe plugs in), ``loop`` (the shared training loop),
``startup`` (what it works out before its first step; all ``--prepare_only`` does), ``evaluation`` (its exact
evaluation), ``recipe`` (a recipe's command line around it) and ``cli`` (the ``finetune``
command, the launchers that show a refusal once). The rooms, each a sub-package that says what it may import, from
the top down: ``chat`` over ``predict``, and ``export``: the commands that use a trained folder (``python -m
finetune.chat``, ``finetune.predict``, ``finetune.export``), beside the core's commands; ``runtimes`` and
``tasks``; ``models``, ``hub`` and ``observability``; ``distributed`` and ``data``; ``checkpointing``. Importing
the package loads none of them, so a recipe checks its flags before the loop and its libraries load.
"""

__version__ = "0.1.0"
