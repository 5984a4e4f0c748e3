"""HTTP ingress: OpenAI-compatible API in front of the engine replicas.

The validation boundary for HTTP: the body is read under a byte limit (chunked bodies too),
must be ``application/json``, UTF-8, valid JSON without NaN/Infinity and at most
``MAX_JSON_DEPTH`` deep, and must fit the request schema (``protocol.py``); the engine's input
processor then checks its own caps before the engine thread sees anything. Every error is an
OpenAI error object; internals (tracebacks, paths, actor ids) are logged under the request id
and never sent.
"""

import asyncio
import hashlib
import json
import logging
import os
import re
import secrets
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

import numpy as np
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, Field, ValidationError
from ray import serve
from ray.serve.handle import DeploymentHandle
from starlette.exceptions import HTTPException as StarletteHTTPException

from cb_serve import (
    EngineConfig,
    EngineDeadError,
    EngineShutdownError,
    EngineUnavailableError,
    InvalidRequestError,
    LoRARequest,
    PromptEncoder,
    prefix_block_hashes,
)
from cb_serve.serve.api_error import (
    REQUEST_ID_HEADER,
    APIError,
    engine_error,
    root_cause,
    short,
)
from cb_serve.serve.engine_replica import log_to_serve
from cb_serve.serve.engine_request import ChatEngineRequest, EngineRequest
from cb_serve.serve.inspect_api import InspectorRoutes, debug_routes
from cb_serve.serve.lora_registry import LoRARegistry
from cb_serve.serve.lora_routes import LoRARoutes, lora_routes
from cb_serve.serve.metrics import router_metrics
from cb_serve.serve.protocol import ChatCompletionRequest, CompletionRequest, error_body
from cb_serve.serve.replica_health import mark_unavailable
from cb_serve.serve.responses import ResponseMeta, Usage

logger = logging.getLogger(__name__)
app = FastAPI(title="cb-serve", description="OpenAI-compatible API over continuous-batching engines.")


class RouterSettings(BaseModel):
    api_key: str | None = None  # also CB_SERVE_API_KEY
    max_request_bytes: int = Field(1 << 20, ge=1024)
    max_tokens_cap: int | None = Field(None, ge=1)
    served_model_name: str | None = None
    inspector: bool = True  # the batch inspector's routes: /inspect, /debug/*, /v1/requests/{id}/timeline
    # vLLM's POST /v1/load_lora_adapter and /v1/unload_lora_adapter (behind the API key): False: 404;
    # None (the default): on when an API key is set (they read paths on the server).
    allow_runtime_lora_updating: bool | None = None


REPLICA_HEADER = "x-cb-replica"  # which engine replica served the request (operators, tests)
SESSION_HEADER = "x-session-id"  # requests of one session prefer one replica (so does the ``user`` field)
REQUEST_ID = re.compile(r"[A-Za-z0-9._~:;=/+@-]{1,128}")  # what REQUEST_ID_HEADER may hold
MAX_JSON_DEPTH = 64  # nesting of [ and { in a request body
HEALTH_TIMEOUT_S = 5.0
# A request a replica refused (its engine dead or closing) or cut by a shutdown before its first
# output is sent again, to another replica: nothing of it reached the client. One whose engine
# died while running it is not (it may be what killed the engine).
ROUTE_ATTEMPTS = 3
_JSON_STRING = re.compile(rb'"(?:[^"\\]|\\.)*"')


def request_id_of(request: Request, prefix: str) -> str:
    """The client's x-request-id if it is within limits (400 if not); without one (the app called
    without Ray Serve's proxy, which always sets it), ``prefix``-<random hex>, as OpenAI's ids."""
    given = request.headers.get(REQUEST_ID_HEADER)
    if given is None:
        return f"{prefix}-{uuid.uuid4().hex}"
    if not REQUEST_ID.fullmatch(given):
        raise APIError(
            400, "x-request-id must be 1 to 128 characters of A-Z a-z 0-9 . _ ~ : ; = / + @ -", param=REQUEST_ID_HEADER
        )
    return given


def json_depth(body: bytes) -> int:
    """How deeply ``[`` and ``{`` nest in a JSON text (outside strings); vectorized, so a
    hostile megabyte costs milliseconds and no recursion."""
    brackets = np.frombuffer(_JSON_STRING.sub(b"", body), dtype=np.uint8)
    steps = np.isin(brackets, (0x5B, 0x7B)).astype(np.int32) - np.isin(brackets, (0x5D, 0x7D))
    return int(np.cumsum(steps).max(initial=0))


def _no_constants(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


@app.exception_handler(APIError)
async def _api_error(_: Request, e: APIError) -> JSONResponse:
    return e.response()


@app.exception_handler(RequestValidationError)
async def _validation_error(_: Request, e: RequestValidationError) -> JSONResponse:
    first = e.errors()[0] if e.errors() else {}
    loc = [p for p in first.get("loc", ()) if p != "body"]
    # The field, and the list index under it: pydantic's deeper parts name union members ("str", ...).
    loc = ".".join(str(p) for p in loc[:1] + [p for p in loc[1:2] if isinstance(p, int)])
    if first.get("type") == "extra_forbidden":
        return APIError(400, short(f"Unrecognized request argument supplied: {loc}"), param=loc[:128]).response()
    message = short(str(first.get("msg", "invalid request")))
    return APIError(400, f"{loc}: {message}" if loc else message, param=loc or None).response()


@app.exception_handler(StarletteHTTPException)
async def _http_error(_: Request, e: StarletteHTTPException) -> JSONResponse:
    kind = "not_found_error" if e.status_code == 404 else "invalid_request_error"
    return APIError(e.status_code, str(e.detail), kind).response()


@app.exception_handler(Exception)
async def _unexpected(request: Request, e: Exception) -> JSONResponse:
    logger.error("unhandled error on %s %s", request.method, request.url.path, exc_info=e)
    return APIError(500, "Internal server error.", "internal_error").response()


app.include_router(debug_routes)
app.include_router(lora_routes)


@serve.deployment(max_ongoing_requests=1024, graceful_shutdown_timeout_s=40)
@serve.ingress(app)
class Router(InspectorRoutes, LoRARoutes):
    """Validates requests, checks the API key and size limits, applies the chat template and
    tokenizes (once: the engine replica gets token ids), hashes the prompt's leading KV blocks
    for the request router, and streams from the engine replica it picks (see
    ``request_router.KVCacheAwareRouter``)."""

    def __init__(
        self,
        engine: DeploymentHandle,
        settings: dict[str, Any],
        engine_args: dict[str, Any],
        lora_modules: dict[str, str] | None = None,
    ) -> None:
        log_to_serve()
        self.engine = engine
        self.settings = RouterSettings(**settings)
        self.api_key = self.settings.api_key or os.environ.get("CB_SERVE_API_KEY") or None
        self.encoder = PromptEncoder(EngineConfig.from_kwargs(**engine_args))
        self.model_name: str | None = self.settings.served_model_name
        self.engine_info: dict[str, Any] | None = None
        self.loras = LoRARegistry(lora_modules)  # adapters served under the model field
        self.lora_names_loading: set[str] = set()  # runtime loads in progress
        self._init_inspector()

    async def _info(self) -> dict[str, Any]:
        """The engine replicas' model name, block size and whether they cache prefixes."""
        if self.engine_info is None:
            self.engine_info = await self.engine.model_info.remote()
        return self.engine_info

    async def _model(self) -> str:
        if self.model_name is None:
            self.model_name = (await self._info())["model"]
        return self.model_name

    async def _check(self, request: Request, requested_model: str | None) -> LoRARequest | None:
        """Checks the API key and the model name: the adapter it names (None: the base model).
        The base model's name wins over an adapter of the same name."""
        if self.api_key is not None:
            header = request.headers.get("authorization", "")
            if not secrets.compare_digest(header.encode(), f"Bearer {self.api_key}".encode()):
                raise APIError(401, "Invalid or missing API key (Authorization: Bearer <key>).", "authentication_error")
        if requested_model is None or requested_model == await self._model():
            return None
        lora = self.loras.get(requested_model)
        if lora is None:
            raise APIError(404, f"The model {requested_model!r} does not exist.", "not_found_error", "model")
        return lora

    async def _read_json(self, request: Request) -> dict[str, Any]:
        """The body as a JSON object, or an APIError: 415 not JSON, 413 too large (counting the
        bytes read, chunked bodies included), 400 bad UTF-8 / JSON / nesting."""
        media_type = request.headers.get("content-type", "").split(";")[0].strip().lower()
        if media_type != "application/json":
            raise APIError(415, "The request body must be JSON (Content-Type: application/json).")
        limit = self.settings.max_request_bytes
        too_large = APIError(413, f"Request body exceeds {limit} bytes.")
        length = request.headers.get("content-length", "")
        if length.isdigit() and int(length) > limit:
            raise too_large
        body = bytearray()
        async for chunk in request.stream():
            body += chunk
            if len(body) > limit:
                raise too_large
        if json_depth(bytes(body)) > MAX_JSON_DEPTH:
            raise APIError(400, f"The request body nests deeper than {MAX_JSON_DEPTH} levels.")
        try:
            data = json.loads(bytes(body).decode("utf-8"), parse_constant=_no_constants)
        except UnicodeDecodeError:
            raise APIError(400, "The request body is not valid UTF-8.") from None
        except (ValueError, RecursionError):
            raise APIError(400, "The request body is not valid JSON.") from None
        if not isinstance(data, dict):
            raise APIError(400, "The request body must be a JSON object.")
        return data

    async def _parse(self, request: Request, model: type[BaseModel]) -> tuple[BaseModel, LoRARequest | None]:
        """The request body as ``model``, and the LoRA adapter its ``model`` field names (if any)."""
        if self.api_key is not None:
            await self._check(request, None)
        data = await self._read_json(request)
        try:
            parsed = model.model_validate(data)
        except ValidationError as e:
            raise RequestValidationError(e.errors()) from None
        for param, what in parsed.unsupported():
            message = f"Unsupported parameter {param!r}: cb-serve does not implement {what}."
            raise APIError(400, message, "unsupported", param)
        return parsed, await self._check(request, parsed.model)

    @app.get("/health")
    async def health(self) -> JSONResponse:
        """200 while at least one engine replica is alive (the request router prefers live
        replicas, so one that answers dead means none is alive); 503 otherwise."""
        try:
            alive = await asyncio.wait_for(self.engine.is_alive.remote(), timeout=HEALTH_TIMEOUT_S)
        except Exception as e:  # noqa: BLE001 - no replica answered: not healthy
            logger.warning("health check: no engine replica answered: %r", e)
            alive = False
        if alive:
            return JSONResponse({"status": "ok"})
        return JSONResponse({"status": "unavailable", "detail": "no live engine replica"}, status_code=503)

    @app.get("/stats")
    async def stats(self, request: Request) -> dict[str, Any]:
        """Engine counters of one replica (operators, tests): running/waiting, KV blocks, steps."""
        await self._check(request, None)
        return await self.engine.stats.remote()

    @app.get("/v1/models")
    async def models(self, request: Request) -> dict[str, Any]:
        await self._check(request, None)
        return {"object": "list", "data": self.loras.model_cards(await self._model())}

    @app.post("/v1/completions")
    async def completions(self, request: Request):
        req, lora = await self._parse(request, CompletionRequest)  # the API key first
        request_id = request_id_of(request, "cmpl")
        prompt = req.prompt
        token_ids = await self._encode(self.encoder.encode, prompt) if isinstance(prompt, str) else list(prompt)
        return await self._respond(request, request_id, req, lora, EngineRequest, token_ids, prompt=prompt)

    @app.post("/v1/chat/completions")
    async def chat_completions(self, request: Request):
        req, lora = await self._parse(request, ChatCompletionRequest)  # the API key first
        request_id = request_id_of(request, "chatcmpl")
        messages = [m.to_template() for m in req.messages]
        tools = req.prompt_tools()
        token_ids = await self._encode(self.encoder.encode_chat, messages, req.add_generation_prompt, tools)
        return await self._respond(request, request_id, req, lora, ChatEngineRequest, token_ids, messages=messages)

    async def _encode(self, encode, *args) -> list[int]:
        """Tokenizes off the event loop; the client's input errors become 400s."""
        try:
            return await asyncio.to_thread(encode, *args)
        except InvalidRequestError as e:
            raise APIError(400, short(str(e)), param=e.param) from None

    async def _respond(
        self,
        request: Request,
        request_id: str,
        req,
        lora: LoRARequest | None,
        kind: type[EngineRequest],
        token_ids: list[int],
        **text,
    ):
        chat = kind is ChatEngineRequest
        # Behind Ray Serve's proxy the response gets x-request-id from it (adding ours would repeat it).
        headers = {} if REQUEST_ID_HEADER in request.headers else {REQUEST_ID_HEADER: request_id}
        cap = self.settings.max_tokens_cap
        try:  # without max_tokens: 16 for completions (OpenAI's default), the cap (or the context) for chat
            params = req.to_sampling_params(cap if chat else 16, cap)
        except InvalidRequestError as e:
            raise APIError(400, short(str(e)), param=e.param) from None
        info = await self._info()
        block_size = info["block_size"] if info.get("enable_prefix_caching") else 0
        # At most a context's worth: a longer prompt is refused by the engine, and this runs on the event loop.
        hashed = token_ids[: info["max_model_len"]]
        salt = lora.cache_salt if lora is not None else None  # the engine keys an adapter's KV apart
        hashes = b"".join(prefix_block_hashes(hashed, block_size, salt)) if block_size else b""
        session = request.headers.get(SESSION_HEADER) or req.user
        payload = kind(
            request_id=request_id,
            params=params,
            prompt_token_ids=token_ids,
            block_size=block_size,
            block_hashes=hashes,
            session_id=hashlib.sha256(session.encode()).hexdigest() if session else None,
            return_timeline=req.return_timeline,
            lora_request=lora,
            **text,
        )
        gen, first = await self._start(payload)
        model = lora.lora_name if lora is not None else await self._model()
        max_calls = 1 if chat and req.parallel_tool_calls is False else None
        meta = ResponseMeta(request_id, int(time.time()), model, chat, chat and req.tool_mode != "none", max_calls)
        replica = first[0]["replica"] if first else None
        if replica:
            headers[REPLICA_HEADER] = replica
            self._remember_replica(request_id, replica)
            lora_name = lora.lora_name if lora is not None else ""
            expected, cached = first[0]["expected_cached_tokens"], first[0]["cached_tokens"]
            router_metrics().routed(await self._model(), replica, expected, cached, lora_name)
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            events = self._sse(gen, first, meta, req.n, include_usage)
            return StreamingResponse(events, media_type="text/event-stream", headers=headers)
        return JSONResponse(await self._collect(gen, first, meta, req.n), headers=headers)

    async def _start(self, payload: EngineRequest) -> tuple[Any, list[dict[str, Any]] | None]:
        """Sends the request to an engine replica and waits for its first output, so errors (bad
        input, overload) surface before any byte is sent; retries elsewhere when the replica
        could not take it (``ROUTE_ATTEMPTS``)."""
        for attempt in range(1, ROUTE_ATTEMPTS + 1):
            gen = self.engine.options(stream=True).generate.remote(payload)
            try:
                return gen, await gen.__anext__()
            except StopAsyncIteration:
                return gen, None
            except Exception as e:  # noqa: BLE001
                cause = root_cause(e)
                replica = getattr(cause, "replica", None)
                if replica and isinstance(cause, (EngineDeadError, EngineUnavailableError, EngineShutdownError)):
                    mark_unavailable(replica)
                retry = isinstance(cause, (EngineUnavailableError, EngineShutdownError))
                if not retry or attempt == ROUTE_ATTEMPTS:
                    raise engine_error(e, payload.request_id) from None
                logger.warning("request %s: replica %s unavailable; retrying", payload.request_id, replica)
        raise AssertionError("unreachable")

    async def _chunks(self, gen, first) -> AsyncIterator[dict[str, Any]]:
        """The engine replica's chunks one by one (it sends them a step's worth at a time)."""
        try:
            for chunk in first or []:
                yield chunk
            async for step in gen:
                for chunk in step:
                    yield chunk
        finally:
            gen.cancel()  # a client that went away aborts the engine request (no-op once finished)

    async def _sse(self, gen, first, meta: ResponseMeta, n: int, include_usage: bool) -> AsyncIterator[str]:
        base = meta.base(stream=True)
        usage = Usage(n)
        choices = meta.choices(n)
        try:
            async for c in self._chunks(gen, first):
                usage.add(c)
                choice = choices[c["index"]].delta(c)
                if choice is None:
                    continue
                extra = {"timeline": c["timeline"]} if "timeline" in c else {}
                yield f"data: {json.dumps({**base, 'choices': [choice], **extra})}\n\n"
        except Exception as e:  # noqa: BLE001 - mid-stream failure: tell the client in-band, then [DONE]
            err = engine_error(e, meta.id)
            router_metrics().rejected(err.status, err.type)
            yield f"data: {json.dumps(error_body(err.message, err.type, err.status, err.param))}\n\n"
        if include_usage:
            yield f"data: {json.dumps({**base, 'choices': [], 'usage': usage.body()})}\n\n"
        yield "data: [DONE]\n\n"

    async def _collect(self, gen, first, meta: ResponseMeta, n: int) -> dict[str, Any]:
        usage = Usage(n)
        choices = meta.choices(n)
        try:
            async for c in self._chunks(gen, first):
                usage.add(c)
                choices[c["index"]].add(c)
        except Exception as e:  # noqa: BLE001
            raise engine_error(e, meta.id) from None
        return {
            **meta.base(stream=False),
            "choices": [c.body() for c in choices],
            "usage": usage.body(),
            **({"timeline": usage.timeline} if usage.timeline else {}),
        }
