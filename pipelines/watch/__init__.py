"""`quantize watch`: a deployed vLLM server's metrics, window by window, judged against the limits of the envelope its
version was promoted on (pipelines/deploy/limits.py), with tuning recommendations, a shadow comparison and a rollback."""
