"""The serving layer's metrics by name: each one's kind, description, extra labels and histogram buckets, the
engine counters they follow, and the series names Ray exports them under (``metrics.py`` records them)."""

from __future__ import annotations

PREFIX = "cb_serve_"
EXPORT_PREFIX = "ray_"  # what Ray prepends when it exports

# Seconds: from a GPU decode step to a long generation on a busy CPU replica.
LATENCY_BUCKETS = [0.001, 0.0025, 0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75]
LATENCY_BUCKETS += [1.0, 1.5, 2.0, 3.0, 5.0, 7.5, 10.0, 15.0, 20.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1200.0]
FILL_BUCKETS = [0.01, 0.02, 0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 1.0]
SEQS_BUCKETS = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024]
# Images per request, counts: Ray takes only positive bounds, so each ends halfway to the next count (le="0.5":
# requests without images) and Ray's midpoint sums come out whole.
IMAGES_BUCKETS = [0.5, 1.5, 2.5, 3.5, 4.5, 6.5, 8.5, 12.5, 16.5, 24.5, 32.5, 64.5]
# Seconds: a grammar compile, from a cached-tokenizer regex to a schema near the compile timeout.
COMPILE_BUCKETS = [0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0]
# Seconds: one step's bitmask fill (or the wait for it), from a few rows of a regex to a large batch.
MASK_BUCKETS = [0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0]
# A step's expert imbalance (busiest expert over the mean): 1 is balanced, the top is the number of experts.
# Nothing is below 1: the first bucket ends just under it, so a balanced step falls in (0.99, 1.05] and reads
# about 1 in histogram_quantile and in Ray's sums (Ray exports a histogram's sum from its buckets' midpoints).
IMBALANCE_BUCKETS = [0.99, 1.05, 1.1, 1.2, 1.35, 1.5, 1.75, 2.0, 2.5, 3.0, 4.0, 6.0, 8.0, 12.0, 16.0, 32.0, 64.0, 128.0]

# name without prefix -> (type, description); the buckets of histograms are in BUCKETS.
ENGINE_METRICS: dict[str, tuple[str, str]] = {
    "num_requests_running": ("gauge", "Requests with a sequence in the running batch (as vLLM counts them)."),
    "num_requests_waiting": (
        "gauge",
        "Requests waiting to be scheduled (new, preempted, or waiting for their grammar), none of them running.",
    ),
    "num_seqs_running": ("gauge", "Sequences in the running batch (a request with n > 1 has n)."),
    "num_seqs_waiting": ("gauge", "Sequences waiting to be scheduled (new, preempted, or waiting for their grammar)."),
    "kv_cache_usage_perc": ("gauge", "Fraction of KV-cache blocks in use (0 to 1)."),
    "kv_cache_blocks_used": ("gauge", "KV-cache blocks in use."),
    "kv_cache_blocks_total": ("gauge", "KV-cache blocks of the replica."),
    "model_weight_bytes": (
        "gauge",
        "Bytes of model weights resident in the replica (its driver rank), by the format kept (label format: "
        "float32, bfloat16, q4_groups, q8_groups, ...).",
    ),
    "state_slots_used": ("gauge", "Recurrent layers (hybrid models): state slots held by running sequences."),
    "state_slots_total": ("gauge", "Recurrent layers: state slots (max_num_seqs; 0 without recurrent layers)."),
    "state_snapshots_used": (
        "gauge",
        "Hybrid models with prefix caching: snapshots of the recurrent states at block boundaries held (a prefix "
        "hit resumes from one).",
    ),
    "state_snapshots_total": ("gauge", "Hybrid models: state snapshots (num_state_snapshots; 0 otherwise)."),
    "prompt_tokens": ("counter", "Prompt tokens of requests that produced their first token (once per request)."),
    "generation_tokens": ("counter", "Tokens generated."),
    "num_preemptions": ("counter", "Sequences preempted (their KV blocks freed, recomputed later)."),
    "prefix_cache_queries": ("counter", "Prompt tokens looked up in the prefix cache."),
    "prefix_cache_hits": ("counter", "Prompt tokens found in the prefix cache."),
    "request_success": (
        "counter",
        "Requests finished, by finished_reason (stop, length) and lora_name (the LoRA adapter; empty: the base model).",
    ),
    "time_to_first_token_seconds": ("histogram", "Arrival in the engine to the first token."),
    "inter_token_latency_seconds": ("histogram", "Time between consecutive tokens of a sequence."),
    "e2e_request_latency_seconds": ("histogram", "Arrival in the engine to the last token."),
    "request_queue_time_seconds": ("histogram", "Arrival in the engine to first scheduled."),
    "batch_token_fill_ratio": ("histogram", "Per step: tokens scheduled over the token budget."),
    "batch_num_seqs": ("histogram", "Per step: sequences in the batch."),
    "structured_output_requests": ("counter", "Requests with a structured-output constraint (grammar)."),
    "num_requests_waiting_grammar": ("gauge", "Requests waiting for their grammar to compile (of those waiting)."),
    "grammar_compile_seconds": ("histogram", "Compiling one grammar (cache hits are not compiles)."),
    "grammar_bitmask_fill_seconds": (
        "histogram",
        "Per step with constrained sequences: filling their token bitmasks (on its own thread, beside the forward).",
    ),
    "grammar_bitmask_wait_seconds": (
        "histogram",
        "Per step with constrained sequences: sampling waiting for the bitmasks after the forward.",
    ),
    "jump_forward_tokens": ("counter", "Tokens a grammar forced, appended without a step of their own (jump-forward)."),
    "spec_decode_num_drafts": ("counter", "Speculative decoding: sequence-steps that verified drafts."),
    "spec_decode_num_draft_tokens": ("counter", "Speculative decoding: draft tokens verified."),
    "spec_decode_num_accepted_tokens": ("counter", "Speculative decoding: draft tokens accepted."),
    "spec_decode_num_accepted_tokens_per_pos": (
        "counter",
        "Speculative decoding: draft tokens accepted at each draft position (label position, from 0).",
    ),
    "lora_slots_used": ("gauge", "LoRA: adapter slots holding an adapter (of max_loras)."),
    "lora_slots_total": ("gauge", "LoRA: adapter slots (max_loras; 0 without enable_lora)."),
    "lora_adapters_loaded": ("gauge", "LoRA: adapters held in slots or host memory."),
    "lora_loads": ("counter", "LoRA: adapters copied into a slot."),
    "lora_evictions": ("counter", "LoRA: adapters displaced from a slot by another."),
    "images_encoded": ("counter", "Images run through the vision encoder (models that read images)."),
    "encoder_cache_hits": (
        "counter",
        "Images whose encoder outputs a step took from the encoder cache (a repeated image, a later chunk, a "
        "re-prefill after preemption) instead of encoding them again.",
    ),
    "encoder_cache_embeddings": ("gauge", "Encoder outputs the encoder cache holds, in embeddings (image tokens)."),
    "encoder_seconds": (
        "histogram",
        "Per step that ran the vision encoder: the host wall seconds of its encoder calls (on a GPU, their launches).",
    ),
    "request_images": ("histogram", "Images per request, at its arrival in the engine (models that read images)."),
    "cpu_kernels_info": ("gauge", "The CPU GEMM kernels this replica runs (label kernels, value 1; CPU engines)."),
    "triton_compiles": (
        "counter",
        "Triton kernel variants compiled (GPU engines): start-up's warm-up and graph capture, then none; a rise "
        "while serving is a live compile that stalled the engine.",
    ),
    "moe_expert_tokens": (
        "counter",
        "Mixture of experts: tokens the routers sent to each expert (label expert, from 0), summed over the MoE "
        "layers (a token counts once per expert it goes to).",
    ),
    "moe_expert_imbalance": (
        "histogram",
        "Mixture of experts, per step: the busiest expert's tokens over the mean per expert, summed over the MoE "
        "layers (1: balanced; how much longer the expert work takes than balanced work).",
    ),
}
# Labels beside the model's, per metric.
EXTRA_TAGS = {
    "request_success": ("finished_reason", "lora_name"),
    "spec_decode_num_accepted_tokens_per_pos": ("position",),
    "cpu_kernels_info": ("kernels",),
    "model_weight_bytes": ("format",),
    "moe_expert_tokens": ("expert",),
}
ROUTER_METRICS: dict[str, tuple[str, str]] = {
    "router_requests": (
        "counter",
        "Requests the router sent to each engine replica (labels engine_replica, lora_name: empty for the base model).",
    ),
    "router_rejections": ("counter", "Requests answered with an error, by HTTP status and error type."),
    "router_predicted_prefix_hit_tokens": (
        "counter",
        "Prompt tokens the request router expected each engine replica's prefix cache to serve.",
    ),
    "router_prefix_hit_tokens": (
        "counter",
        "Prompt tokens the engine replicas' prefix caches served, for requests the router sent them.",
    ),
}
BUCKETS: dict[str, list[float]] = {
    "time_to_first_token_seconds": LATENCY_BUCKETS,
    "inter_token_latency_seconds": LATENCY_BUCKETS,
    "e2e_request_latency_seconds": LATENCY_BUCKETS,
    "request_queue_time_seconds": LATENCY_BUCKETS,
    "batch_token_fill_ratio": FILL_BUCKETS,
    "batch_num_seqs": SEQS_BUCKETS,
    "grammar_compile_seconds": COMPILE_BUCKETS,
    "grammar_bitmask_fill_seconds": MASK_BUCKETS,
    "grammar_bitmask_wait_seconds": MASK_BUCKETS,
    "moe_expert_imbalance": IMBALANCE_BUCKETS,
    "encoder_seconds": LATENCY_BUCKETS,
    "request_images": IMAGES_BUCKETS,
}
# vLLM's label for the served model, and ours from before it (the same value): dashboards and
# alerts written for vLLM's series filter on model_name.
MODEL_TAGS = ("model_name", "model")
# counter -> the cumulative EngineStats field it follows
_COUNTER_FIELDS = {
    "prompt_tokens": "prompt_tokens",
    "generation_tokens": "generation_tokens",
    "num_preemptions": "num_preemptions",
    "prefix_cache_queries": "prefix_cache_queries",
    "prefix_cache_hits": "prefix_cache_hits",
    "structured_output_requests": "num_constrained_requests",
    "lora_loads": "lora_loads",
    "lora_evictions": "lora_evictions",
    "triton_compiles": "num_triton_compiles",
    "images_encoded": "num_images_encoded",
    "encoder_cache_hits": "encoder_cache_hits",
}


def exported_name(name: str) -> str:
    """The series name Prometheus sees for metric ``name`` (without prefix): ``ray_cb_serve_…``,
    counters with ``_total`` (histograms add ``_bucket``/``_sum``/``_count`` themselves)."""
    kind = (ENGINE_METRICS | ROUTER_METRICS)[name][0]
    return EXPORT_PREFIX + PREFIX + name + ("_total" if kind == "counter" else "")
