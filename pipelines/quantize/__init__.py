"""Recipe -> artifact: the compiler, calibration data, SmoothQuant mappings and the llm-compressor run."""
