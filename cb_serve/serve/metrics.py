"""Prometheus metrics of the serving layer, vLLM-style names under ``cb_serve_``.

Recorded with ``ray.serve.metrics``: Ray exports them on every node's metrics export port
(the port KubeRay's ``PodMonitor``s scrape) with a ``ray_`` prefix, adds a ``_total`` suffix
to counters, and labels every series with the Serve ``deployment``, ``replica`` and
``application``; we add ``model_name`` (vLLM's label; ``model`` too, the same value). So
``cb_serve_generation_tokens`` below is scraped as
``ray_cb_serve_generation_tokens_total{model_name=..., replica=...}``.

Cost on the engine: ``EngineMetrics`` adds one step listener that appends each ``StepStats`` to a
deque (O(1), in the engine thread), and one output listener that appends each ``RequestOutput`` the
front end makes (in the caller's coroutine), and the end of a request that had no finished output, to
the same deque. A daemon thread drains it every
``interval_s`` and does the recording: per step two histogram observations (two more on steps
with constrained sequences, one per grammar compiled, one for a mixture of experts' imbalance), per
request and token what the latency histograms need, counters as deltas of the engine's own cumulative
``EngineStats`` (no per-token counting), and a mixture of experts' tokens per expert summed over the
flush's steps (one increment per expert and flush).
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from types import ModuleType
from typing import Any

from cb_serve import AsyncLLM, EngineStats, RequestOutput, StepStats
from cb_serve.serve.metric_names import (  # noqa: F401 (re-exported: the names tests and dashboards use)
    _COUNTER_FIELDS,
    BUCKETS,
    ENGINE_METRICS,
    EXPORT_PREFIX,
    EXTRA_TAGS,
    MODEL_TAGS,
    PREFIX,
    ROUTER_METRICS,
    exported_name,
)

logger = logging.getLogger(__name__)


def _make(api: ModuleType, name: str, tag_keys: tuple[str, ...], defaults: dict[str, str]) -> Any:
    kind, description = (ENGINE_METRICS | ROUTER_METRICS)[name]
    if kind == "counter":
        metric = api.Counter(PREFIX + name, description=description, tag_keys=tag_keys)
    elif kind == "gauge":
        metric = api.Gauge(PREFIX + name, description=description, tag_keys=tag_keys)
    else:
        metric = api.Histogram(PREFIX + name, description=description, boundaries=BUCKETS[name], tag_keys=tag_keys)
    metric.set_default_tags(dict(defaults))  # Serve adds its labels to the dict it is given
    return metric


def _serve_metrics() -> ModuleType:
    from ray.serve import metrics

    return metrics


class EngineMetrics:
    """Records one engine replica's metrics through ``AsyncLLM``'s observer interface (a step
    listener and ``get_stats()``). ``api``: a module with Counter/Gauge/Histogram classes
    (``ray.serve.metrics`` by default; tests pass fakes)."""

    MAX_PENDING_EVENTS = 1 << 17  # bounds memory if the flusher ever stalls

    def __init__(self, engine: AsyncLLM, model: str, interval_s: float = 1.0, api: ModuleType | None = None) -> None:
        api = api or _serve_metrics()
        tags = {"model_name": model, "model": model}
        self.m = {name: _make(api, name, (*MODEL_TAGS, *EXTRA_TAGS.get(name, ())), tags) for name in ENGINE_METRICS}
        self._engine = engine
        self._counted = dict.fromkeys(_COUNTER_FIELDS, 0)
        self._events: deque[StepStats | tuple[str, RequestOutput | None]] = deque(maxlen=self.MAX_PENDING_EVENTS)
        self._last_token: dict[str, float] = {}  # request id -> its latest token time (monotonic)
        self._expert_tokens: Any = None  # a mixture of experts: tokens per expert of the steps being flushed
        self._lock = threading.Lock()  # one flush at a time (the thread and close())
        self._stop = threading.Event()
        self.interval_s = interval_s
        engine.add_step_listener(self.on_step)
        engine.add_output_listener(self.on_output)
        self._thread = threading.Thread(target=self._run, name="cb-serve-metrics", daemon=True)
        self._thread.start()

    def on_step(self, stats: StepStats, _records: list) -> None:
        """Step listener (engine thread): queue the step, nothing else."""
        self._events.append(stats)

    def on_output(self, request_id: str, out: RequestOutput | None) -> None:
        """Output listener (the caller's coroutine): queue the output, nothing else."""
        self._events.append((request_id, out))

    def close(self) -> None:
        """Stops the flusher after one last flush."""
        self._engine.remove_step_listener(self.on_step)
        self._engine.remove_output_listener(self.on_output)
        self._stop.set()
        self._thread.join(timeout=10)
        self.flush()

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.flush()
            except Exception:  # noqa: BLE001 - metrics must never take the replica down
                logger.exception("recording metrics failed")

    def flush(self) -> None:
        """Records the queued steps and the engine's current counters and gauges."""
        with self._lock:
            while self._events:
                event = self._events.popleft()
                if isinstance(event, StepStats):
                    self._record_step(event)
                else:
                    self._record_output(*event)
            self._record_expert_tokens()
            self._record_stats(self._engine.get_stats())

    def _record_step(self, step: StepStats) -> None:
        m = self.m
        m["batch_token_fill_ratio"].observe(step.budget_fill)
        m["batch_num_seqs"].observe(step.num_seqs)
        self._record_grammar(step)
        self._record_spec_decode(step)
        if step.num_images_encoded:
            m["encoder_seconds"].observe(step.encoder_s)
        for images in step.request_images:
            m["request_images"].observe(images)
        if (load := step.expert_load) is not None:  # a mixture of experts: summed, recorded once per flush
            m["moe_expert_imbalance"].observe(load.imbalance)
            tokens = load.counts.sum(axis=0)
            self._expert_tokens = tokens if self._expert_tokens is None else self._expert_tokens + tokens
        for request_id in step.ended_request_ids:
            self._last_token.pop(request_id, None)

    def _record_output(self, request_id: str, out: RequestOutput | None) -> None:
        """A request's latencies: its first token, each token after it, its end (None: it ended without
        a finished output, and is forgotten)."""
        if out is None:
            self._last_token.pop(request_id, None)
            return
        m, t = self.m, out.metrics
        if t is None or t.last_token_time is None:  # a failed request's output carries no metrics
            if out.finished:
                self._last_token.pop(out.request_id, None)
            return
        prev = self._last_token.get(out.request_id)
        if prev is None:  # the request's first output: its first token
            m["time_to_first_token_seconds"].observe(t.first_token_time - t.arrival_time)
            if t.first_scheduled_time is not None:
                m["request_queue_time_seconds"].observe(t.first_scheduled_time - t.arrival_time)
        # Each completion of a DELTA output advanced by its new tokens: one sampled, maybe more a
        # grammar forced (jump-forward); the step's interval is shared among them, per token.
        for c in out.outputs:
            new = max(1, len(c.token_ids)) - (prev is None)
            for _ in range(new):
                m["inter_token_latency_seconds"].observe(0.0 if prev is None else (t.last_token_time - prev) / new)
        if out.finished:
            self._last_token.pop(out.request_id, None)
            m["e2e_request_latency_seconds"].observe((t.finished_time or t.last_token_time) - t.arrival_time)
            reason = next((c.finish_reason for c in out.outputs if c.finish_reason), None) or "stop"
            lora = out.lora_request.lora_name if out.lora_request is not None else ""
            m["request_success"].inc(1, tags={"finished_reason": reason, "lora_name": lora})
        else:
            self._last_token[out.request_id] = t.last_token_time

    def _record_grammar(self, step: StepStats) -> None:
        """Structured outputs: the step's compiles, and its mask fill and wait if it had constrained rows."""
        m = self.m
        for seconds in step.grammar_compile_s:
            m["grammar_compile_seconds"].observe(seconds)
        if step.num_constrained_seqs:
            m["grammar_bitmask_fill_seconds"].observe(step.grammar_fill_s)
            m["grammar_bitmask_wait_seconds"].observe(step.grammar_wait_s)
        if step.jump_forward_tokens:
            m["jump_forward_tokens"].inc(step.jump_forward_tokens)

    def _record_spec_decode(self, step: StepStats) -> None:
        """Speculative decoding: the step's verified drafts and what was accepted, by position."""
        m = self.m
        for name in ("num_drafts", "num_draft_tokens", "num_accepted_tokens"):
            if value := getattr(step, name):
                m["spec_decode_" + name].inc(value)
        for position, accepted in enumerate(step.num_accepted_tokens_per_pos):
            if accepted:
                m["spec_decode_num_accepted_tokens_per_pos"].inc(accepted, tags={"position": str(position)})

    def _record_expert_tokens(self) -> None:
        """The flushed steps' tokens per expert: one increment per expert that had any."""
        tokens, self._expert_tokens = self._expert_tokens, None
        for expert, n in enumerate([] if tokens is None else tokens.tolist()):
            if n:  # Ray's counters take only positive increments
                self.m["moe_expert_tokens"].inc(n, tags={"expert": str(expert)})

    def _record_stats(self, s: EngineStats) -> None:
        m = self.m
        m["num_requests_running"].set(s.num_requests_running)
        m["num_requests_waiting"].set(s.num_requests_waiting)
        m["num_seqs_running"].set(s.num_running)
        m["num_seqs_waiting"].set(s.num_waiting)
        m["kv_cache_usage_perc"].set(s.kv_cache_usage)
        m["kv_cache_blocks_used"].set(s.kv_blocks_used)
        m["kv_cache_blocks_total"].set(s.kv_blocks_total)
        m["state_slots_used"].set(s.state_slots_used)
        m["state_slots_total"].set(s.state_slots_total)
        m["state_snapshots_used"].set(s.state_snapshots_used)
        m["state_snapshots_total"].set(s.state_snapshots_total)
        m["num_requests_waiting_grammar"].set(s.num_requests_waiting_grammar)
        m["lora_slots_used"].set(s.lora_slots_used)
        m["lora_slots_total"].set(s.max_loras)
        m["lora_adapters_loaded"].set(s.lora_adapters_loaded)
        m["encoder_cache_embeddings"].set(s.encoder_cache_embeddings)
        if s.cpu_kernels:
            m["cpu_kernels_info"].set(1, tags={"kernels": s.cpu_kernels})
        for fmt, nbytes in s.weight_bytes.items():
            m["model_weight_bytes"].set(nbytes, tags={"format": fmt})
        for name, field in _COUNTER_FIELDS.items():
            value = getattr(s, field)
            if value > self._counted[name]:
                m[name].inc(value - self._counted[name])
                self._counted[name] = value


class RouterMetrics:
    """The router's (HTTP ingress) metrics: where requests went and what was refused."""

    def __init__(self, api: ModuleType | None = None) -> None:
        api = api or _serve_metrics()
        self.requests = _make(api, "router_requests", (*MODEL_TAGS, "engine_replica", "lora_name"), {})
        self.rejections = _make(api, "router_rejections", ("status", "type"), {})
        tags = (*MODEL_TAGS, "engine_replica", "lora_name")
        self.predicted_hits = _make(api, "router_predicted_prefix_hit_tokens", tags, {})
        self.hits = _make(api, "router_prefix_hit_tokens", tags, {})

    def routed(
        self, model: str, engine_replica: str, predicted_hit_tokens: int | None, hit_tokens: int, lora_name: str = ""
    ) -> None:
        """One request sent to ``engine_replica``: what the router expected of its prefix cache
        (None: no prediction, e.g. the replica had no fresh report) and what it served;
        ``lora_name``: its adapter (empty: the base model)."""
        tags = {"model_name": model, "model": model, "engine_replica": engine_replica, "lora_name": lora_name}
        self.requests.inc(1, tags=tags)
        if predicted_hit_tokens:  # Ray's counters take only positive increments
            self.predicted_hits.inc(predicted_hit_tokens, tags=tags)
        if hit_tokens:
            self.hits.inc(hit_tokens, tags=tags)

    def rejected(self, status: int, error_type: str) -> None:
        self.rejections.inc(1, tags={"status": str(status), "type": error_type})


_router_metrics: RouterMetrics | None = None


def router_metrics() -> RouterMetrics:
    """The process's ``RouterMetrics``, made on first use (inside the Serve replica, so
    Serve's labels are attached)."""
    global _router_metrics
    if _router_metrics is None:
        _router_metrics = RouterMetrics()
    return _router_metrics
