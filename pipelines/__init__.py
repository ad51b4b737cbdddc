"""quantgate: quantize an LLM, serve it on vLLM, score it against its 16-bit baseline, gate, promote."""

__version__ = "0.1.0"
