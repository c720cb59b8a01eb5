"""What a run reports: each logging interval's loss and throughput and the run's totals (``metering``), and
TensorBoard, MLflow and W&B, each on a thread of its own (``trackers``).

May import: checkpointing and the core.
"""
