"""The Ray Serve deployment that owns one engine (one GPU where there are GPUs)."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

from ray import serve

from cb_serve import AsyncLLM, EngineConfig, EngineError, LoRARequest, RequestOutput
from cb_serve.serve.engine_chunk import EngineChunk
from cb_serve.serve.engine_request import EngineRequest, InspectRequest
from cb_serve.serve.lora_registry import LoRARegistry
from cb_serve.serve.metrics import EngineMetrics
from cb_serve.serve.routing_report import ReplicaReporter

logger = logging.getLogger(__name__)


def log_to_serve() -> None:
    """Sends cb_serve's log records (tracebacks of failed requests, under their request ids)
    to the Ray Serve replica's log, where its other records are."""
    serve_logger, ours = logging.getLogger("ray.serve"), logging.getLogger("cb_serve")
    if serve_logger.handlers and not ours.handlers:
        for handler in serve_logger.handlers:
            ours.addHandler(handler)
        ours.setLevel(logging.INFO)
        ours.propagate = False


def log_finished(out: RequestOutput, num_output_tokens: int) -> None:
    """One line per finished request, under its id (the client's x-request-id), as vLLM logs requests."""
    t = out.metrics
    ttft = e2e = float("nan")
    if t is not None and t.first_token_time is not None:
        ttft = t.first_token_time - t.arrival_time
        e2e = (t.finished_time or t.last_token_time or t.first_token_time) - t.arrival_time
    logger.info(
        "request %s finished (%s): %d prompt tokens (%d cached), %d output tokens, TTFT %.3f s, e2e %.3f s",
        out.request_id,
        ",".join(str(c.finish_reason) for c in out.outputs),
        len(out.prompt_token_ids),
        out.num_cached_tokens,
        num_output_tokens,
        ttft,
        e2e,
    )


@serve.deployment(
    max_ongoing_requests=256, health_check_period_s=5, health_check_timeout_s=30, graceful_shutdown_timeout_s=30
)
class EngineReplica:
    """Streams ``EngineChunk``s (plain data: no tensors cross this boundary) and reports its load."""

    def __init__(
        self, engine_args: dict[str, Any], log_requests: bool = True, lora_modules: dict[str, str] | None = None
    ) -> None:
        log_to_serve()
        self.log_requests = log_requests
        self.engine = AsyncLLM(EngineConfig.from_kwargs(**engine_args))
        self.replica_id = serve.get_replica_context().replica_id.unique_id
        self.metrics = EngineMetrics(self.engine, self.engine.model_name)  # cb_serve_* metrics (metrics.py)
        self.num_requests = 0  # generate() calls in progress, including those the engine has not taken yet
        self.reporter = ReplicaReporter()  # report numbers, and the request routers' picks that arrived
        for lora_request in LoRARegistry(lora_modules).adapters.values():  # the config's adapters: a bad one fails here
            self.engine.add_lora_blocking(lora_request)

    async def load_lora(self, lora_request: LoRARequest) -> str:
        """Reads and checks an adapter and holds it (``POST /v1/load_lora_adapter``); raises
        ``InvalidRequestError`` for one this engine cannot serve. Returns this replica's id."""
        await self.engine.add_lora(lora_request)
        return self.replica_id

    async def generate(self, request: EngineRequest) -> AsyncIterator[list[EngineChunk]]:
        """Streams ``request`` (token ids: the router tokenized it). Yields, per engine output, a
        list with one chunk per completion index that advanced (one stream item per step,
        whatever ``n``), with the prefix-hit tokens served beside those the request router
        expected of this replica (None: it had no fresh report)."""
        request_id = request.request_id
        expected = (request.expected_hit_tokens or {}).get(self.replica_id)
        self.num_requests += 1
        self.reporter.arrived(request)
        num_output_tokens = 0  # the engine's outputs are deltas
        try:
            outputs = self.engine.generate(
                request.engine_prompt(), request.params, request_id, request.lora_request, priority=request.priority
            )
            async for out in outputs:
                num_output_tokens += sum(len(c.token_ids) for c in out.outputs)
                timeline = None
                if out.finished and request.return_timeline:
                    timeline = await self._final_timeline(request_id)
                if out.finished and self.log_requests:
                    log_finished(out, num_output_tokens)
                yield [EngineChunk.of(out, c, self.replica_id, expected, timeline) for c in out.outputs]
        except EngineError as e:
            e.replica = self.replica_id  # the router avoids this replica if it retries
            raise
        except ValueError:
            raise  # typed: the router tells the client
        except Exception:
            logger.exception("request %s failed in the engine replica", request_id)
            raise
        finally:
            self.num_requests -= 1

    def record_routing_stats(self) -> dict[str, Any]:
        """Load for the request router (see ``request_router.KVCacheAwareRouter``)."""
        return self.reporter.report(self._load)  # the picks first, then the load

    def _load(self) -> dict[str, Any]:
        s = self.engine.get_stats()
        digest = self.engine.get_cache_digest()
        return dict(
            prefix_cache=digest.to_dict() if digest is not None else None,
            kv_cache_usage=s.kv_cache_usage,
            num_running=s.num_running,
            num_waiting=s.num_waiting,
            num_waiting_tokens=s.num_waiting_tokens,
            num_requests=max(self.num_requests, s.num_running + s.num_waiting),
            token_budget=self.engine.config.max_num_batched_tokens,
            max_num_seqs=self.engine.config.max_num_seqs,
            alive=self.engine.is_alive,
            lora_adapters=tuple(self.engine.lora_adapter_ids()),
            time=time.time(),
        )

    async def inspect(self, request: InspectRequest) -> dict[str, Any]:
        """A batch-inspector view of this replica's engine (``LLMEngine.inspect``); ``data`` is
        None when the engine records nothing (``inspector_steps: 0``)."""
        kwargs = dict(request.kwargs)
        if request.view == "trace":
            kwargs["name"] = self.replica_id
        data = await self.engine.inspect(request.view, **kwargs)
        return {"replica": self.replica_id, "data": data}

    async def _final_timeline(self, request_id: str) -> dict[str, Any] | None:
        """The timeline of a request that has finished, or None if the engine cannot give it
        now (stopping, or busy past the timeout): the request succeeded either way."""
        try:
            return await self.timeline(request_id)
        except (EngineError, TimeoutError) as e:
            logger.warning("request %s: no timeline for its final chunk: %r", request_id, e)
            return None

    async def timeline(self, request_id: str) -> dict[str, Any] | None:
        """The request's timeline, with the replica that served it (None: not known here)."""
        timeline = await self.engine.inspect("timeline", request_id=request_id)
        return None if timeline is None else {**timeline, "replica": self.replica_id}

    def check_health(self) -> None:
        """Ray Serve's health check: raises once the engine loop died, so Serve replaces the replica."""
        self.engine.check_health()

    async def worker_pids(self) -> list[int]:
        """Process ids of this replica's tensor-parallel workers (fault tests, debugging)."""
        return self.engine.worker_pids

    async def is_alive(self) -> bool:
        return self.engine.is_alive

    async def stats(self) -> dict[str, Any]:
        """Engine counters (tests, debugging)."""
        s = self.engine.get_stats()
        extra = {"kv_cache_usage": s.kv_cache_usage, "replica": self.replica_id, "alive": self.engine.is_alive}
        return {**s.__dict__, **extra}

    async def model_info(self) -> dict[str, Any]:
        """What the router needs to tokenize and hash prompts as this replica's engine does."""
        return {
            "model": self.engine.model_name,
            "max_model_len": self.engine.max_model_len,
            "block_size": self.engine.block_size,
            "enable_prefix_caching": self.engine.config.enable_prefix_caching,
        }

    async def __del__(self) -> None:  # pragma: no cover - best effort at replica shutdown
        await asyncio.to_thread(self.engine.shutdown)
        if hasattr(self, "metrics"):
            self.metrics.close()
