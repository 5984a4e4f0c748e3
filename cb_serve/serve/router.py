"""HTTP ingress: OpenAI-compatible API (and Anthropic's Messages) in front of the engine replicas.

The validation boundary for HTTP: the body is read under a byte limit (chunked bodies too),
must be ``application/json``, UTF-8, valid JSON without NaN/Infinity and at most
``MAX_JSON_DEPTH`` deep, and must fit the request schema (``protocol.py``); the engine's input
processor then checks its own caps before the engine thread sees anything. Every error is an
OpenAI error object; internals (tracebacks, paths, actor ids) are logged under the request id
and never sent.

Each route module (``openai_routes``, ``frontend_routes``, ``token_routes``, ``lora_routes``,
``inspect_api``) takes the replica's one ``RequestPipeline`` (validate, render, dispatch, stream) as a
FastAPI dependency; the ``Router`` deployment builds it.
"""

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from ray import serve
from ray.serve.handle import DeploymentHandle
from starlette.exceptions import HTTPException as StarletteHTTPException

from cb_serve import EngineConfig
from cb_serve.serve.api_error import APIError
from cb_serve.serve.engine_replica import log_to_serve
from cb_serve.serve.frontend_routes import frontend_routes
from cb_serve.serve.inspect_api import debug_routes
from cb_serve.serve.lora_routes import lora_routes
from cb_serve.serve.openai_routes import openai_routes
from cb_serve.serve.pipeline import RequestPipeline, RouterSettings, validation_error
from cb_serve.serve.token_routes import token_routes

__all__ = ["Router", "RouterSettings", "app"]

logger = logging.getLogger(__name__)
app = FastAPI(title="cb-serve", description="OpenAI-compatible API over continuous-batching engines.")


@app.exception_handler(APIError)
async def _api_error(_: Request, e: APIError) -> JSONResponse:
    return e.response()


@app.exception_handler(RequestValidationError)
async def _validation_error(_: Request, e: RequestValidationError) -> JSONResponse:
    return validation_error(list(e.errors())).response()


@app.exception_handler(StarletteHTTPException)
async def _http_error(_: Request, e: StarletteHTTPException) -> JSONResponse:
    kind = "not_found_error" if e.status_code == 404 else "invalid_request_error"
    return APIError(e.status_code, str(e.detail), kind).response()


@app.exception_handler(Exception)
async def _unexpected(request: Request, e: Exception) -> JSONResponse:
    logger.error("unhandled error on %s %s", request.method, request.url.path, exc_info=e)
    return APIError(500, "Internal server error.", "internal_error").response()


for routes in (openai_routes, frontend_routes, token_routes, lora_routes, debug_routes):
    app.include_router(routes)


@serve.deployment(max_ongoing_requests=1024, graceful_shutdown_timeout_s=40)
@serve.ingress(app)
class Router:
    """Validates requests, checks the API key and size limits, applies the chat template and
    tokenizes (once: the engine replica gets token ids), hashes the prompt's leading KV blocks
    for the request router, and streams from the engine replica it picks (see
    ``request_router.KVCacheAwareRouter``): its ``pipeline`` (``pipeline.RequestPipeline``)."""

    def __init__(
        self,
        engine: DeploymentHandle,
        settings: dict[str, Any],
        engine_args: dict[str, Any],
        lora_modules: dict[str, str] | None = None,
    ) -> None:
        log_to_serve()
        config = EngineConfig.from_kwargs(**engine_args)
        self.pipeline = RequestPipeline(engine, RouterSettings(**settings), config, lora_modules)
