"""Fine-tune Hugging Face transformers on one process or many, under Accelerate or raw torch DDP.

The modules, each named for what it holds: ``config`` (options, YAML and command line), ``task`` (what a
recipe plugs in), ``loop`` (the shared training loop), ``batching`` (the global-batch plan), ``data``,
``checkpoint``, ``runtime`` with ``accelerate_runtime`` and ``ddp_runtime``, ``ddp`` (the raw
torch.distributed layer, usable on its own), ``hub``. Importing the package itself loads none of them, so a
recipe checks its flags before the loop and its libraries load.
"""

__version__ = "0.1.0"
