"""Runtimes: what the loop asks of a way of running (the process group and device, data loaders, accumulation,
gradient clipping, collectives, checkpoint I/O, the trackers) behind one interface, ``base.Runtime``: on Accelerate
(``accelerate``), on raw torch.distributed (``ddp``), sharded with FSDP2 on that (``fsdp``); ``launcher`` picks
the one the launcher asked for. The loop never asks which it got.

May import: models, observability, distributed, data, checkpointing and the core (errors, environment, config).
"""
