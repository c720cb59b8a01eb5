"""From a trained folder to what runs it: ``gguf_file`` (a GGUF file for llama.cpp, Ollama and LM Studio),
``ollama`` (the ``Modelfile`` beside it) and ``merged`` (a plain Hugging Face folder for vLLM and TGI), on the
folder read back as one model by ``models.trained``; ``python -m finetune.export`` is the command.

May import: models, checkpointing and the core.
"""
