"""Models: loading models and tokenizers by Hub id or folder with errors a user can act on, the embedded default
models and the optimizer's parameter groups (``loading``), LoRA adapters through peft (``lora``), what a model
keeps in memory while it trains (``memory``: activation checkpointing, 4-bit base weights), a process's peak
predicted before its first step (``estimate``) and a chat run's output folder read back as one model, any adapter
merged (``trained``).

May import: distributed, data, checkpointing and the core.
"""

import logging

# Where bitsandbytes is installed, peft imports it, and its CPU backend then looks for an optional Hub kernel and
# warns when it is not there, in every run that loads peft; the kernel it falls back to computes the same thing.
logging.getLogger("bitsandbytes.backends.cpu.ops").setLevel(logging.ERROR)
