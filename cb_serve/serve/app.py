"""Ray Serve application builder: ``import_path: cb_serve.serve.app:build_app``."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator
from ray.serve import Application
from ray.serve.config import RequestRouterConfig

from cb_serve.config import EngineConfig
from cb_serve.serve.engine_replica import EngineReplica
from cb_serve.serve.router import Router, RouterSettings


class AppArgs(BaseModel):
    """The ``args`` of the application in a Serve config file."""

    model_config = ConfigDict(extra="forbid")

    model: str | None = Field(None, description="Model path / hub id; None or 'default' = built-in SmolLM2.")
    engine: dict[str, Any] = Field(default_factory=dict, description="Engine arguments (see EngineConfig).")
    router: RouterSettings = Field(default_factory=RouterSettings)
    routing_stats_period_s: float = Field(0.5, gt=0)

    @field_validator("engine")
    @classmethod
    def _known_engine_args(cls, v: dict[str, Any]) -> dict[str, Any]:
        EngineConfig.from_kwargs(**{"model": "default", **v})  # raises on unknown names or bad values
        return v


def build_app(args: dict[str, Any]) -> Application:
    parsed = AppArgs.model_validate(args or {})
    engine = EngineReplica.options(
        request_router_config=RequestRouterConfig(
            request_router_class="cb_serve.serve.request_router:KVCacheAwareRouter",
            request_routing_stats_period_s=parsed.routing_stats_period_s,
            request_routing_stats_timeout_s=max(1.0, 2 * parsed.routing_stats_period_s),
        )
    ).bind({"model": parsed.model, **parsed.engine})
    return Router.bind(engine, parsed.router.model_dump())
