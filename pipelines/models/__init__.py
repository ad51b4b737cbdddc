"""Real pretrained models, offline: the GGUF header reader, the catalogue and conversion, and the GGUF tokenizer."""
