"""Real pretrained models, offline: the GGUF catalogue and conversion, and the GGUF tokenizer."""
