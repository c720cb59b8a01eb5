"""Checkpoints and the output folder: what makes a checkpoint complete, progress and manifests, resume and restart
rules, the unwrapped save and the final model swapped in (``checkpoint``); stop signals noted for a checkpoint at
the next step (``preemption``).

May import: the core only.
"""
