"""The load test: candidate against baseline under the deployment's load, measured by `vllm bench serve`.

After the quality gate promotes a candidate, both models are driven by vLLM's own benchmark with the
business eval sets' prompts at a sweep of concurrencies (1, 2, 4, ... up to the deployment's), in repeated
runs that alternate the two models; the stage reports throughput, TTFT/TPOT/ITL percentiles, goodput under
the policy's SLOs, errors, KV capacity and memory, the candidate/baseline ratios with an interval, the
largest max_num_seqs that met the SLOs, and plots. The policy's `performance:` block judges the ratios:
enforced on a GPU target, reported only on a CPU target (docs/loadtest.md).

Modules: config (the policy block), workload (prompts and output lengths), bench (driving the tool and
reading its result files; vllm_bench_driver is the tool's side, run in the serve environment), memory (KV
capacity and memory watermark), figures (per model and level, ratios), tuning, verdict, plots, render (report
sections), results (the gate.json section), stage (the whole stage against running servers), gate_hook (the
runner's side: which servers are reused or started, when the stage runs).
Nothing here imports vllm: the tool runs in the serve environment (vllm_bench_driver.py).
"""
