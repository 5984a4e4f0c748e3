"""Ray Serve application builder: ``import_path: cb_serve.serve.app:build_app``."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from ray.serve import Application
from ray.serve.config import RequestRouterConfig

from cb_serve import EngineConfig
from cb_serve.serve.engine_replica import EngineReplica
from cb_serve.serve.lora_registry import check_lora_name
from cb_serve.serve.router import Router, RouterSettings

DEFAULT_REQUEST_ROUTER = "cb_serve.serve.request_router:KVCacheAwareRouter"


class ReplicaOptions(BaseModel):
    """Deployment options of the engine replicas (``engine_replica``) or routers
    (``router_replica``) for the Python API (``serve.run(build_app(...))``). In a config file
    the ``deployments:`` entries set these and win."""

    model_config = ConfigDict(extra="forbid")

    num_replicas: int | None = Field(None, ge=1)
    autoscaling_config: dict[str, Any] | None = None
    max_ongoing_requests: int | None = Field(None, ge=1)
    max_queued_requests: int | None = Field(None, ge=-1)
    health_check_period_s: float | None = Field(None, gt=0)
    health_check_timeout_s: float | None = Field(None, gt=0)
    graceful_shutdown_timeout_s: float | None = Field(None, ge=0)
    ray_actor_options: dict[str, Any] | None = None
    placement_group_bundles: list[dict[str, float]] | None = None
    placement_group_strategy: str | None = None


class RoutingSettings(BaseModel):
    """How requests are spread over engine replicas: the ``request_router_config`` of
    ``EngineReplica``. The knobs are those of ``KVCacheAwareRouter`` (``request_router.py``);
    another ``request_router_class`` (e.g. Ray Serve's ``PowerOfTwoChoicesRequestRouter``) gets
    ``request_router_kwargs`` instead."""

    model_config = ConfigDict(extra="forbid")

    request_router_class: str = DEFAULT_REQUEST_ROUTER
    prefix_weight: float = Field(1.0, ge=0, description="Cost cut of an expected prefix hit of one token budget.")
    imbalance_threshold: float = Field(0.25, ge=0, description="Load lead beyond which load alone decides.")
    session_affinity: bool = Field(True, description="Requests with one user / x-session-id prefer one replica.")
    adapter_weight: float = Field(1.0, ge=0, description="Cost cut of a replica holding the request's LoRA adapter.")
    stale_after_s: float | None = Field(None, gt=0, description="Default: 4 stats periods, at least 2 s.")
    request_router_kwargs: dict[str, Any] = Field(default_factory=dict)

    def router_kwargs(self, stats_period_s: float) -> dict[str, Any]:
        if self.request_router_class != DEFAULT_REQUEST_ROUTER:
            return self.request_router_kwargs
        # A replica whose reports stop (its process died, its node is gone) ranks last after stale_after_s.
        return {
            "stale_after_s": self.stale_after_s or max(2.0, 4 * stats_period_s),
            "prefix_weight": self.prefix_weight,
            "imbalance_threshold": self.imbalance_threshold,
            "session_affinity": self.session_affinity,
            "adapter_weight": self.adapter_weight,
            **self.request_router_kwargs,
        }


class AppArgs(BaseModel):
    """The ``args`` of the application in a Serve config file."""

    model_config = ConfigDict(extra="forbid")

    model: str | None = Field(None, description="Model path / hub id; None or 'default' = built-in SmolLM2.")
    engine: dict[str, Any] = Field(default_factory=dict, description="Engine arguments (see EngineConfig).")
    lora_modules: dict[str, str] = Field(
        default_factory=dict,
        description="LoRA adapters served under the model field: name -> PEFT adapter directory (needs enable_lora).",
    )
    router: RouterSettings = Field(default_factory=RouterSettings)
    routing_stats_period_s: float = Field(0.5, gt=0)
    log_requests: bool = Field(True, description="One log line per finished request in its engine replica's log.")
    routing: RoutingSettings = Field(default_factory=RoutingSettings)
    engine_replica: ReplicaOptions = Field(default_factory=ReplicaOptions)
    router_replica: ReplicaOptions = Field(default_factory=ReplicaOptions)

    @field_validator("engine")
    @classmethod
    def _known_engine_args(cls, v: dict[str, Any]) -> dict[str, Any]:
        try:
            EngineConfig.from_kwargs(**{"model": "default", **v})
        except TypeError as e:  # unknown names; pydantic reports only ValueErrors as validation errors
            raise ValueError(str(e)) from None
        return v

    @model_validator(mode="after")
    def _lora_modules_need_enable_lora(self) -> AppArgs:
        if self.lora_modules and not self.engine.get("enable_lora"):
            raise ValueError("lora_modules needs enable_lora: true under engine.")
        for name in self.lora_modules:
            check_lora_name(name)
        return self


def tensor_parallel_bundles(size: int, ray_actor_options: dict[str, Any] | None) -> list[dict[str, float]]:
    """One placement-group bundle per tensor-parallel rank, as Ray Serve LLM declares them: the
    first holds the replica (the resources of its ``ray_actor_options``), each other one worker
    (``cb_serve.executor``): one GPU where the replica asks for GPUs, else one CPU."""
    options = ray_actor_options or {}
    gpus = options.get("num_gpus", 0)
    first = {"CPU": options.get("num_cpus", 1), **({"GPU": gpus} if gpus else {})}
    return [first] + [{"GPU": 1} if gpus else {"CPU": 1}] * (size - 1)


def engine_replica_options(parsed: AppArgs) -> dict[str, Any]:
    """The engine deployment's options; with ``tensor_parallel_size`` N > 1 and no bundles given,
    a placement group of N bundles per replica (``STRICT_PACK``: one node, as NCCL wants)."""
    options = parsed.engine_replica.model_dump(exclude_none=True)
    size = parsed.engine.get("tensor_parallel_size", 1)
    if size > 1 and "placement_group_bundles" not in options:
        options["placement_group_bundles"] = tensor_parallel_bundles(size, options.get("ray_actor_options"))
        options.setdefault("placement_group_strategy", "STRICT_PACK")
    return options


def build_app(args: dict[str, Any]) -> Application:
    """Router (HTTP ingress) in front of ``EngineReplica`` deployments, from validated ``args``."""
    parsed = AppArgs.model_validate(args or {})
    engine_args = {"model": parsed.model, **parsed.engine}
    engine = EngineReplica.options(
        **engine_replica_options(parsed),
        request_router_config=RequestRouterConfig(
            request_router_class=parsed.routing.request_router_class,
            request_routing_stats_period_s=parsed.routing_stats_period_s,
            request_routing_stats_timeout_s=max(1.0, 2 * parsed.routing_stats_period_s),
            request_router_kwargs=parsed.routing.router_kwargs(parsed.routing_stats_period_s),
        ),
    ).bind(engine_args, parsed.log_requests, parsed.lora_modules)
    router = Router.options(**parsed.router_replica.model_dump(exclude_none=True))
    return router.bind(engine, parsed.router.model_dump(), engine_args, parsed.lora_modules)
