"""Checkpoints and the output folder: what makes a checkpoint complete, progress and manifests, resume and restart
rules, the unwrapped save and the final model swapped in (``checkpoint``); stop signals noted for a checkpoint at
the next step (``preemption``); the rules a run writes and stops by: no non-finite number saved, a step
checkpointed once, a stop signal on any process saving and stopping all (``guard``); files and folders written
whole or not at all (``files``).

May import: the core only.
"""
