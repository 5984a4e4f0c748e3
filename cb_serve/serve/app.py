"""Ray Serve application builder: ``import_path: cb_serve.serve.app:build_app``."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator
from ray.serve import Application
from ray.serve.config import RequestRouterConfig

from cb_serve import EngineConfig
from cb_serve.serve.engine_replica import EngineReplica
from cb_serve.serve.router import Router, RouterSettings


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


class AppArgs(BaseModel):
    """The ``args`` of the application in a Serve config file."""

    model_config = ConfigDict(extra="forbid")

    model: str | None = Field(None, description="Model path / hub id; None or 'default' = built-in SmolLM2.")
    engine: dict[str, Any] = Field(default_factory=dict, description="Engine arguments (see EngineConfig).")
    router: RouterSettings = Field(default_factory=RouterSettings)
    routing_stats_period_s: float = Field(0.5, gt=0)
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


def build_app(args: dict[str, Any]) -> Application:
    """Router (HTTP ingress) in front of ``EngineReplica`` deployments, from validated ``args``."""
    parsed = AppArgs.model_validate(args or {})
    engine = EngineReplica.options(
        **parsed.engine_replica.model_dump(exclude_none=True),
        request_router_config=RequestRouterConfig(
            request_router_class="cb_serve.serve.request_router:KVCacheAwareRouter",
            request_routing_stats_period_s=parsed.routing_stats_period_s,
            request_routing_stats_timeout_s=max(1.0, 2 * parsed.routing_stats_period_s),
            # A replica whose reports stop (its process died, its node is gone) ranks last after this.
            request_router_kwargs={"stale_after_s": max(2.0, 4 * parsed.routing_stats_period_s)},
        ),
    ).bind({"model": parsed.model, **parsed.engine})
    router = Router.options(**parsed.router_replica.model_dump(exclude_none=True))
    return router.bind(engine, parsed.router.model_dump())
