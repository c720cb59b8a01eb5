"""The raw torch.distributed layer: the process group from torchrun's environment, DDP wrapping, sums and gathers
of uneven outputs, rank-0 saving of the unwrapped model (``ddp``); sharding with FSDP2 and sharded checkpoints with
torch.distributed.checkpoint (``fsdp``). Usable in a user's own loop (``examples/raw_ddp.py``): it imports no
accelerate and nothing of the loop or the runtimes.

May import: checkpointing and the core.
"""
