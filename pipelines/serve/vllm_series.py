"""vLLM's Prometheus series, named once: what `quantize watch` reads, what the deployed alert rules and dashboard query
(pipelines/deploy/promql.py) and what the fleet's proxy re-exports (pipelines/fleet/metrics.py).

vLLM 0.32's series (vllm/v1/metrics/loggers.py of the serve environment, measured on its CPU build; a server started with
--disable-log-stats exports none of the vllm:* ones): the histograms vllm:time_to_first_token_seconds,
vllm:inter_token_latency_seconds, vllm:e2e_request_latency_seconds, vllm:request_time_per_output_token_seconds,
vllm:request_queue_time_seconds, vllm:iteration_tokens_total (tokens per engine step: the batch size in tokens); the counters
vllm:generation_tokens_total, vllm:prompt_tokens_total, vllm:num_preemptions_total, vllm:prefix_cache_queries_total /
_hits_total, vllm:request_success_total by finished_reason (stop, length, abort, error, repetition) and the HTTP layer's
http_requests_total by handler and status class (prometheus-fastapi-instrumentator: 2xx ... 5xx); the gauges
vllm:kv_cache_usage_perc (a fraction, 0..1), vllm:num_requests_running / _waiting, process_resident_memory_bytes (the API
server process only: the engine core is a process of its own), and vllm:cache_config_info, whose labels say the KV cache's
size in tokens and blocks.
"""

from __future__ import annotations

VLLM_PREFIX = "vllm:"
# Admissions refused by a queue limit (--max-num-queued-reqs / --max-num-queued-tokens), by `reason`: vLLM answers them
# HTTP 503 (QueueOverflowError, MaxQueuedTokensError in vllm/exceptions.py), so the HTTP layer's 5xx count holds them too.
ADMISSION_REJECTIONS = f"{VLLM_PREFIX}admission_rejections_total"
# Requests with a NaN in their logits; the series exists only on a server started with VLLM_COMPUTE_NANS_IN_LOGITS=1.
CORRUPTED_REQUESTS = f"{VLLM_PREFIX}corrupted_requests_total"
REQUEST_SUCCESS = f"{VLLM_PREFIX}request_success_total"  # by finished_reason
HTTP_REQUESTS = "http_requests_total"  # by handler and status class
RESIDENT_MEMORY = "process_resident_memory_bytes"
CACHE_INFO = f"{VLLM_PREFIX}cache_config_info"
# http_requests_total counts every handler, /metrics and /health included (a watcher's own reads): only the API's are requests.
API_HANDLER_PREFIX = "/v1/"

# figure key -> sample name of a counter summed over every series
COUNTERS = {
    "generation_tokens": f"{VLLM_PREFIX}generation_tokens_total",
    "prompt_tokens": f"{VLLM_PREFIX}prompt_tokens_total",
    "preemptions": f"{VLLM_PREFIX}num_preemptions_total",
    "prefix_cache_queries": f"{VLLM_PREFIX}prefix_cache_queries_total",
    "prefix_cache_hits": f"{VLLM_PREFIX}prefix_cache_hits_total",
    # admissions refused by a queue limit (answered 503: overload, left out of the error rate) and requests with NaN logits
    "admission_rejections": ADMISSION_REJECTIONS,
    "corrupted_requests": CORRUPTED_REQUESTS,
}
# key prefix -> (sample name, the label a counter is split by): `finished:stop`, `http:5xx`
GROUPED_COUNTERS = {
    "finished": (REQUEST_SUCCESS, "finished_reason"),
    "http": (HTTP_REQUESTS, "status"),
}
# figure key -> histogram base name (samples NAME_bucket{le}, NAME_sum, NAME_count)
HISTOGRAMS = {
    "ttft": f"{VLLM_PREFIX}time_to_first_token_seconds",
    "itl": f"{VLLM_PREFIX}inter_token_latency_seconds",
    "e2e": f"{VLLM_PREFIX}e2e_request_latency_seconds",
    "tpot": f"{VLLM_PREFIX}request_time_per_output_token_seconds",
    "queue": f"{VLLM_PREFIX}request_queue_time_seconds",
    "batch_tokens": f"{VLLM_PREFIX}iteration_tokens_total",
}
# The bucket bounds (seconds) of the latency histograms a limit is held against: vLLM's defaults (vllm/v1/metrics/buckets.py
# of the pinned vLLM; a server started with --custom-histogram-buckets has others). Below the first bound a p95 cannot be told
# apart from zero: pipelines/deploy/limits.py raises a limit there to that bound. The burn-rate alert rules count the requests
# over the first bound at or above each limit (pipelines/deploy/slo.py).
LATENCY_BUCKETS_S = {
    "ttft": (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0,
             640.0, 2560.0),
    "itl": (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0),
    "e2e": (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0,
            7680.0),
}
FIRST_LATENCY_BUCKET_S = {key: bounds[0] for key, bounds in LATENCY_BUCKETS_S.items()}
# figure key -> gauge sample name, summed over series at each sample time
GAUGES = {
    "kv_cache_usage": f"{VLLM_PREFIX}kv_cache_usage_perc",
    "running": f"{VLLM_PREFIX}num_requests_running",
    "waiting": f"{VLLM_PREFIX}num_requests_waiting",
    "memory": RESIDENT_MEMORY,
}
