"""From a trained folder to what runs it: ``trained`` (a recipe's output folder as one full model, an adapter
merged into its base), ``gguf_file`` (a GGUF file for llama.cpp, Ollama and LM Studio), ``ollama`` (the
``Modelfile`` beside it) and ``merged`` (a plain Hugging Face folder for vLLM and TGI); ``python -m
finetune.export`` is the command. It imports ``models`` and the core, and nothing imports it."""
