"""Data: a recipe's raw splits from files, the Hub or an embedded default (``sources``), tokenized once into a
cache every process memory-maps (``cache``), planned into global batches with their loss scales (``batching``);
the embedded default datasets (``embedded``).

May import: checkpointing and the core.
"""
