"""vLLM servers: started, probed and stopped, and whatever they leave behind reclaimed."""
