"""HTTP ingress: OpenAI-compatible API in front of the engine replicas.

The validation boundary for HTTP: the body is read under a byte limit (chunked bodies too),
must be ``application/json``, UTF-8, valid JSON without NaN/Infinity and at most
``MAX_JSON_DEPTH`` deep, and must fit the request schema (``protocol.py``); the engine's input
processor then checks its own caps before the engine thread sees anything. Every error is an
OpenAI error object; internals (tracebacks, paths, actor ids) are logged under the request id
and never sent.
"""

import asyncio
import functools
import hashlib
import json
import logging
import os
import secrets
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, Field, ValidationError
from ray import serve
from ray.serve.handle import DeploymentHandle
from starlette.exceptions import HTTPException as StarletteHTTPException

from cb_serve import EngineConfig, InvalidRequestError, LoRARequest, PromptEncoder, prefix_block_hashes
from cb_serve.serve.api_error import REQUEST_ID_HEADER, APIError, engine_error, short
from cb_serve.serve.engine_replica import log_to_serve
from cb_serve.serve.engine_request import ChatEngineRequest, EngineRequest
from cb_serve.serve.frontend_routes import FrontendRoutes, frontend_routes
from cb_serve.serve.generation import Started, merged, start_all
from cb_serve.serve.http_body import read_json, request_id_of
from cb_serve.serve.inspect_api import InspectorRoutes, debug_routes
from cb_serve.serve.lora_registry import LoRARegistry
from cb_serve.serve.lora_routes import LoRARoutes, lora_routes
from cb_serve.serve.metrics import router_metrics
from cb_serve.serve.protocol import ChatCompletionRequest, CompletionRequest, error_body
from cb_serve.serve.responses import EchoedPrompt, ResponseMeta, Usage, echo_chunks
from cb_serve.serve.token_routes import TokenRoutes, token_routes

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
    # vLLM's --trust-request-chat-template: a request's own ``chat_template`` (Jinja run on the server).
    trust_request_chat_template: bool = False
    max_stored_responses: int = Field(1024, ge=0)  # /v1/responses kept for previous_response_id (0: none)


REPLICA_HEADER = "x-cb-replica"  # which engine replica served the request (operators, tests)
SESSION_HEADER = "x-session-id"  # requests of one session prefer one replica (so does the ``user`` field)
HEALTH_TIMEOUT_S = 5.0


def validation_error(errors: list[dict[str, Any]]) -> APIError:
    """A 400 naming the first invalid field (pydantic's errors)."""
    first = errors[0] if errors else {}
    loc = [p for p in first.get("loc", ()) if p != "body"]
    # The field, and the list index under it: pydantic's deeper parts name union members ("str", ...).
    loc = ".".join(str(p) for p in loc[:1] + [p for p in loc[1:2] if isinstance(p, int)])
    if first.get("type") == "extra_forbidden":
        return APIError(400, short(f"Unrecognized request argument supplied: {loc}"), param=loc[:128])
    message = short(str(first.get("msg", "invalid request")))
    return APIError(400, f"{loc}: {message}" if loc else message, param=loc or None)


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


app.include_router(debug_routes)
app.include_router(lora_routes)
app.include_router(frontend_routes)
app.include_router(token_routes)


@dataclass
class Run:
    """One HTTP request's engine requests (one per prompt), started, and what its bodies share."""

    started: list[Started]
    meta: ResponseMeta
    headers: dict[str, str]
    n: int  # choices per prompt
    prompt_token_ids: list[list[int]] = field(default_factory=list)

    def chunks(self) -> AsyncIterator[dict[str, Any]]:
        return merged(self.started, [i * self.n for i in range(len(self.started))])


@serve.deployment(max_ongoing_requests=1024, graceful_shutdown_timeout_s=40)
@serve.ingress(app)
class Router(InspectorRoutes, LoRARoutes, FrontendRoutes, TokenRoutes):
    """Validates requests, checks the API key and size limits, applies the chat template and
    tokenizes (once: the engine replica gets token ids), hashes the prompt's leading KV blocks
    for the request router, and streams from the engine replica it picks (see
    ``request_router.KVCacheAwareRouter``). Every chat-shaped API (Chat Completions, Responses,
    Messages) runs through ``_run``."""

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
        self.engine_config = EngineConfig.from_kwargs(**engine_args)
        self.encoder = PromptEncoder(self.engine_config)
        self.model_name: str | None = self.settings.served_model_name
        self.engine_info: dict[str, Any] | None = None
        self.loras = LoRARegistry(lora_modules)  # adapters served under the model field
        self.lora_names_loading: set[str] = set()  # runtime loads in progress
        self._init_inspector()
        self._init_frontends()

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
            given = request.headers.get("authorization", "")
            if not given and "x-api-key" in request.headers:  # Anthropic's clients send their key here
                given = f"Bearer {request.headers['x-api-key']}"
            if not secrets.compare_digest(given.encode(), f"Bearer {self.api_key}".encode()):
                raise APIError(401, "Invalid or missing API key (Authorization: Bearer <key>).", "authentication_error")
        if requested_model is None or requested_model == await self._model():
            return None
        lora = self.loras.get(requested_model)
        if lora is None:
            raise APIError(404, f"The model {requested_model!r} does not exist.", "not_found_error", "model")
        return lora

    async def _read_json(self, request: Request) -> dict[str, Any]:
        return await read_json(request, self.settings.max_request_bytes)

    async def _parse(self, request: Request, model: type[BaseModel]) -> tuple[BaseModel, LoRARequest | None]:
        """The request body as ``model``, and the LoRA adapter its ``model`` field names (if any)."""
        if self.api_key is not None:
            await self._check(request, None)
        parsed = self._parse_body(await self._read_json(request), model)
        return parsed, await self._check(request, getattr(parsed, "model", None))

    def _parse_body(self, data: dict[str, Any], model: type[BaseModel]) -> Any:
        """``data`` as ``model`` (a 400 naming the field), its unsupported fields refused."""
        try:
            parsed = model.model_validate(data)
        except ValidationError as e:
            raise validation_error(list(e.errors())) from None
        self._refuse_unsupported(parsed)
        return parsed

    @staticmethod
    def _refuse_unsupported(parsed: BaseModel) -> None:
        for param, what in getattr(parsed, "unsupported", list)():
            message = f"Unsupported parameter {param!r}: cb-serve does not implement {what}."
            raise APIError(400, message, "unsupported", param)

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

    @app.post("/v1/completions")
    async def completions(self, request: Request):
        req, lora = await self._parse(request, CompletionRequest)  # the API key first
        request_id = request_id_of(request, "cmpl")
        prompts = req.prompts
        token_ids = [await self._encode(self.encoder.encode, p) if isinstance(p, str) else list(p) for p in prompts]
        run = await self._run(request, request_id, req, lora, token_ids, chat=False)
        if not req.echo:
            return await self._respond(run, req)
        echoed = []  # each choice starts with its prompt (and its logprobs)
        for p, ids in zip(prompts, run.prompt_token_ids):
            text = p if isinstance(p, str) and ids == token_ids[len(echoed)] else await self._decode(ids)
            echoed.append(EchoedPrompt(text, ids, await self._decode(ids[:1])))
        return await self._respond(run, req, echo=echoed)

    @app.post("/v1/chat/completions")
    async def chat_completions(self, request: Request):
        req, lora = await self._parse(request, ChatCompletionRequest)  # the API key first
        request_id = request_id_of(request, "chatcmpl")
        token_ids, messages = await self._render_chat(req)
        run = await self._run(request, request_id, req, lora, [token_ids], chat=True, messages=messages)
        return await self._respond(run, req)

    async def _render_chat(self, req: ChatCompletionRequest) -> tuple[list[int], list[dict[str, Any]]]:
        """The conversation's token ids (the chat template, with the request's options) and messages."""
        if req.chat_template is not None and not self.settings.trust_request_chat_template:
            raise APIError(400, "This server does not accept a chat_template in requests (trust_request_chat_template "
                           "is off).", "unsupported", "chat_template")  # fmt: skip
        messages = [m.to_template() for m in req.messages]
        encode = functools.partial(
            self.encoder.encode_chat,
            messages,
            req.add_generation_prompt,
            req.prompt_tools(),
            chat_template=req.chat_template,
            chat_template_kwargs=req.chat_template_kwargs,
            continue_final_message=req.continue_final_message,
            reasoning_effort=req.reasoning_effort,
        )
        return await self._encode(encode), messages

    async def _encode(self, encode, *args) -> Any:
        """Tokenizes off the event loop; the client's input errors become 400s."""
        try:
            return await asyncio.to_thread(encode, *args)
        except InvalidRequestError as e:
            raise APIError(400, short(str(e)), param=e.param) from None

    async def _run(
        self,
        request: Request,
        request_id: str,
        req,
        lora: LoRARequest | None,
        prompts: list[list[int]],
        chat: bool,
        **text,
    ) -> Run:
        """Starts one engine request per prompt (``request_id``, or ``request_id-i`` for several)."""
        # Behind Ray Serve's proxy the response gets x-request-id from it (adding ours would repeat it).
        headers = {} if REQUEST_ID_HEADER in request.headers else {REQUEST_ID_HEADER: request_id}
        cap = self.settings.max_tokens_cap
        try:  # without max_tokens: 16 for completions (OpenAI's default), the cap (or the context) for chat
            params = req.to_sampling_params(cap if chat else 16, cap)
        except InvalidRequestError as e:
            raise APIError(400, short(str(e)), param=e.param) from None
        info = await self._info()
        prompts = [self._truncate(p, req.truncate_prompt_tokens, info["max_model_len"]) for p in prompts]
        payloads = [
            self._payload(request, f"{request_id}-{i}" if len(prompts) > 1 else request_id, req, lora, p, params, chat)
            for i, p in enumerate(prompts)
        ]
        for payload in payloads:
            for name, value in text.items():
                setattr(payload, name, value)
        started = await start_all(self.engine, payloads)
        model = lora.lora_name if lora is not None else await self._model()
        max_calls = 1 if chat and req.parallel_tool_calls is False else None
        meta = ResponseMeta(request_id, int(time.time()), model, chat, chat and req.tool_mode != "none", max_calls)
        await self._note_replica(started[0], request_id, headers, lora)
        return Run(started, meta, headers, req.n, prompts)

    @staticmethod
    def _truncate(token_ids: list[int], keep: int | None, max_model_len: int) -> list[int]:
        """vLLM's ``truncate_prompt_tokens``: the last ``keep`` tokens (-1: the context length)."""
        if keep is None:
            return token_ids
        keep = max_model_len if keep == -1 else keep
        return token_ids[-keep:] if keep < len(token_ids) else token_ids

    def _payload(self, request: Request, request_id: str, req, lora, token_ids: list[int], params, chat: bool):
        info = self.engine_info or {}
        block_size = info["block_size"] if info.get("enable_prefix_caching") else 0
        # At most a context's worth: a longer prompt is refused by the engine, and this runs on the event loop.
        hashed = token_ids[: info["max_model_len"]]
        salt = lora.cache_salt if lora is not None else None  # the engine keys an adapter's KV apart
        hashes = b"".join(prefix_block_hashes(hashed, block_size, salt)) if block_size else b""
        session = request.headers.get(SESSION_HEADER) or req.user
        kind = ChatEngineRequest if chat else EngineRequest
        return kind(
            request_id=request_id,
            params=params,
            prompt_token_ids=token_ids,
            block_size=block_size,
            block_hashes=hashes,
            session_id=hashlib.sha256(session.encode()).hexdigest() if session else None,
            return_timeline=req.return_timeline,
            lora_request=lora,
            priority=req.priority,
        )

    async def _note_replica(self, started: Started, request_id: str, headers: dict[str, str], lora) -> None:
        replica = started.replica
        if replica:
            headers[REPLICA_HEADER] = replica
            self._remember_replica(request_id, replica)
            lora_name = lora.lora_name if lora is not None else ""
            expected, cached = started.first[0]["expected_cached_tokens"], started.first[0]["cached_tokens"]
            router_metrics().routed(await self._model(), replica, expected, cached, lora_name)

    async def _decode(self, token_ids: list[int]) -> str:
        return await self._encode(self.encoder.decode, token_ids)

    async def _respond(self, run: Run, req, echo: list[EchoedPrompt] | None = None):
        """OpenAI's bodies (Chat Completions or Completions), streamed or whole."""
        n = run.n * len(run.started)
        reasoning = self._reasoning(run, req) if run.meta.chat else None
        chunks = run.chunks()
        if echo is not None:
            chunks = echo_chunks(chunks, echo, run.n, req.echo_only)
        if req.stream:
            options = req.stream_options
            usage_every = bool(options and options.continuous_usage_stats)
            include_usage = bool(options and options.include_usage)
            events = self._sse(chunks, run.meta, n, include_usage, usage_every, reasoning)
            return StreamingResponse(events, media_type="text/event-stream", headers=run.headers)
        return JSONResponse(await self._collect(chunks, run.meta, n, reasoning), headers=run.headers)

    async def _sse(self, chunks, meta: ResponseMeta, n: int, include_usage: bool, usage_every: bool, reasoning):
        base = meta.base(stream=True)
        usage = Usage(n)
        choices = meta.choices(n, reasoning)
        try:
            async for c in chunks:
                usage.add(c)
                choice = choices[c["index"]].delta(c)
                if choice is None:
                    continue
                extra = {"timeline": c["timeline"]} if "timeline" in c else {}
                if usage_every:
                    extra["usage"] = usage.body()
                yield f"data: {json.dumps({**base, 'choices': [choice], **extra})}\n\n"
        except Exception as e:  # noqa: BLE001 - mid-stream failure: tell the client in-band, then [DONE]
            err = e if isinstance(e, APIError) else engine_error(e, meta.id)
            router_metrics().rejected(err.status, err.type)
            yield f"data: {json.dumps(error_body(err.message, err.type, err.status, err.param))}\n\n"
        if include_usage:
            yield f"data: {json.dumps({**base, 'choices': [], 'usage': usage.body()})}\n\n"
        yield "data: [DONE]\n\n"

    async def _collect(self, chunks, meta: ResponseMeta, n: int, reasoning) -> dict[str, Any]:
        usage = Usage(n)
        choices = meta.choices(n, reasoning)
        try:
            async for c in chunks:
                usage.add(c)
                choices[c["index"]].add(c)
        except APIError:
            raise
        except Exception as e:  # noqa: BLE001
            raise engine_error(e, meta.id) from None
        return {
            **meta.base(stream=False),
            "choices": [c.body() for c in choices],
            "usage": usage.body(),
            **({"timeline": usage.timeline} if usage.timeline else {}),
            **({"prompt_logprobs": choices[0].prompt_logprobs} if meta.chat and choices[0].prompt_logprobs else {}),
        }
