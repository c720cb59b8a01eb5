"""The Hugging Face Hub: pushes while training goes on and at the end, the model card, resuming from the Hub
(``pusher``), and the upload process behind the pushes (``uploader``, run by path; it imports only
huggingface_hub).

May import: checkpointing and the core.
"""
