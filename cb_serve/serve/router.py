"""HTTP ingress: OpenAI-compatible API in front of the engine replicas."""

import json
import os
import secrets
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, Field, ValidationError
from ray import serve
from ray.serve.exceptions import BackPressureError
from ray.serve.handle import DeploymentHandle
from starlette.exceptions import HTTPException as StarletteHTTPException

from cb_serve.engine.async_llm import EngineDeadError
from cb_serve.engine.llm_engine import EngineOverloadedError
from cb_serve.serve.metrics import router_metrics
from cb_serve.serve.protocol import ChatCompletionRequest, CompletionRequest, error_body

app = FastAPI(title="cb-serve", description="OpenAI-compatible API over continuous-batching engines.")


class RouterSettings(BaseModel):
    api_key: str | None = None  # also CB_SERVE_API_KEY
    max_request_bytes: int = Field(1 << 20, ge=1024)
    max_tokens_cap: int | None = Field(None, ge=1)
    served_model_name: str | None = None


RETRY_AFTER_S = 1  # Retry-After of overload answers (the openai client honours it when it retries)
REPLICA_HEADER = "x-cb-replica"  # which engine replica served the request (operators, tests)


class APIError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        type_: str = "invalid_request_error",
        param: str | None = None,
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.status, self.message, self.type, self.param = status, message, type_, param
        self.headers = headers

    def response(self) -> JSONResponse:
        router_metrics().rejected(self.status, self.type)
        body = error_body(self.message, self.type, self.status, self.param)
        return JSONResponse(body, status_code=self.status, headers=self.headers)


def overloaded(message: str) -> APIError:
    """503 Service Unavailable + Retry-After: the server (not this client) is over capacity;
    OpenAI's API answers engine overload with 503 too and keeps 429 for per-key rate limits."""
    return APIError(503, message, "overloaded_error", headers={"Retry-After": str(RETRY_AFTER_S)})


def engine_error(e: BaseException) -> APIError:
    """Maps an exception from the engine replica to the HTTP error the client sees."""
    if isinstance(e, EngineOverloadedError):
        return overloaded(str(e))
    if isinstance(e, BackPressureError):
        return overloaded("The server is overloaded (all engine replicas and their queues are full); retry later.")
    if isinstance(e, ValueError):
        return APIError(400, str(e).splitlines()[-1] if "Traceback" in str(e) else str(e))
    if isinstance(e, EngineDeadError):
        return APIError(503, "The engine is restarting; retry later.", "service_unavailable",
                        headers={"Retry-After": str(RETRY_AFTER_S)})  # fmt: skip
    return APIError(500, "Internal server error.", "internal_error")


@app.exception_handler(APIError)
async def _api_error(_: Request, e: APIError) -> JSONResponse:
    return e.response()


@app.exception_handler(RequestValidationError)
async def _validation_error(_: Request, e: RequestValidationError) -> JSONResponse:
    first = e.errors()[0] if e.errors() else {}
    loc = ".".join(str(p) for p in first.get("loc", ()) if p != "body")
    message = f"{loc}: {first.get('msg', 'invalid request')}" if loc else first.get("msg", "invalid request")
    return APIError(400, message, param=loc or None).response()


@app.exception_handler(StarletteHTTPException)
async def _http_error(_: Request, e: StarletteHTTPException) -> JSONResponse:
    kind = "not_found_error" if e.status_code == 404 else "invalid_request_error"
    return APIError(e.status_code, str(e.detail), kind).response()


class _Usage:
    def __init__(self, n: int) -> None:
        self.prompt_tokens = 0
        self.completion = [0] * n
        self.cached = 0

    def add(self, chunk: dict[str, Any]) -> None:
        self.prompt_tokens = chunk["prompt_tokens"]
        self.cached = chunk["cached_tokens"]
        self.completion[chunk["index"]] += chunk["num_tokens"]

    def body(self) -> dict[str, Any]:
        total = sum(self.completion)
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": total,
                "total_tokens": self.prompt_tokens + total,
                "prompt_tokens_details": {"cached_tokens": self.cached}}  # fmt: skip


def _completion_logprobs(entries: list[dict] | None) -> dict[str, Any] | None:
    if not entries:
        return None
    return {"tokens": [e["token"] for e in entries], "token_logprobs": [e["logprob"] for e in entries],
            "top_logprobs": [dict(e["top"]) for e in entries], "text_offset": []}  # fmt: skip


def _chat_logprobs(entries: list[dict] | None) -> dict[str, Any] | None:
    if not entries:
        return None
    return {"content": [{"token": e["token"], "logprob": e["logprob"], "bytes": list(e["token"].encode()),
                         "top_logprobs": [{"token": t, "logprob": lp, "bytes": list(t.encode())}
                                          for t, lp in e["top"]]} for e in entries]}  # fmt: skip


@serve.deployment(max_ongoing_requests=1024)
@serve.ingress(app)
class Router:
    """Validates requests, checks the API key and size limits, and streams from the engine
    replica the request router picks (see ``request_router.KVCacheAwareRouter``)."""

    def __init__(self, engine: DeploymentHandle, settings: dict[str, Any]) -> None:
        self.engine = engine
        self.settings = RouterSettings(**settings)
        self.api_key = self.settings.api_key or os.environ.get("CB_SERVE_API_KEY") or None
        self.model_name: str | None = self.settings.served_model_name

    async def _model(self) -> str:
        if self.model_name is None:
            info = await self.engine.model_info.remote()
            self.model_name = info["model"]
        return self.model_name

    async def _check(self, request: Request, requested_model: str | None) -> None:
        if self.api_key is not None:
            header = request.headers.get("authorization", "")
            if not secrets.compare_digest(header.encode(), f"Bearer {self.api_key}".encode()):
                raise APIError(401, "Invalid or missing API key (Authorization: Bearer <key>).", "authentication_error")
        if requested_model is not None and requested_model != await self._model():
            raise APIError(404, f"The model {requested_model!r} does not exist.", "not_found_error", "model")

    async def _parse(self, request: Request, model: type[BaseModel]) -> BaseModel:
        if self.api_key is not None:
            await self._check(request, None)
        length = request.headers.get("content-length")
        if length is not None and int(length) > self.settings.max_request_bytes:
            raise APIError(413, f"Request body exceeds {self.settings.max_request_bytes} bytes.")
        body = await request.body()
        if len(body) > self.settings.max_request_bytes:
            raise APIError(413, f"Request body exceeds {self.settings.max_request_bytes} bytes.")
        try:
            data = json.loads(body)
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise APIError(400, "The request body is not valid JSON.") from None
        if not isinstance(data, dict):
            raise APIError(400, "The request body must be a JSON object.")
        try:
            parsed = model.model_validate(data)
        except ValidationError as e:
            raise RequestValidationError(e.errors()) from None
        await self._check(request, parsed.model)
        return parsed

    @app.get("/health")
    async def health(self) -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/stats")
    async def stats(self, request: Request) -> dict[str, Any]:
        """Engine counters of one replica (operators, tests): running/waiting, KV blocks, steps."""
        await self._check(request, None)
        return await self.engine.stats.remote()

    @app.get("/v1/models")
    async def models(self, request: Request) -> dict[str, Any]:
        await self._check(request, None)
        return {"object": "list", "data": [{"id": await self._model(), "object": "model", "created": 0,
                                            "owned_by": "cb-serve"}]}  # fmt: skip

    @app.post("/v1/completions")
    async def completions(self, request: Request):
        req = await self._parse(request, CompletionRequest)
        payload = {"prompt": req.prompt}
        return await self._respond(req, payload, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(self, request: Request):
        req = await self._parse(request, ChatCompletionRequest)
        payload = {"messages": [m.to_template() for m in req.messages],
                   "add_generation_prompt": req.add_generation_prompt}  # fmt: skip
        return await self._respond(req, payload, chat=True)

    async def _respond(self, req, payload: dict[str, Any], chat: bool):
        default_max = None if chat else 16
        try:
            params = req.to_sampling_params(default_max, self.settings.max_tokens_cap)
        except ValueError as e:
            raise APIError(400, str(e), param="max_tokens") from None
        if params.max_tokens is None and self.settings.max_tokens_cap is not None:
            params.max_tokens = self.settings.max_tokens_cap
        request_id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        payload.update(request_id=request_id, params=params)
        gen = self.engine.options(stream=True).generate.remote(payload)
        try:
            first = await gen.__anext__()  # errors (bad input, overload) surface before any byte is sent
        except StopAsyncIteration:
            first = None
        except Exception as e:  # noqa: BLE001
            raise engine_error(e) from None
        meta = {"id": request_id, "created": int(time.time()), "model": await self._model(), "chat": chat}
        headers = {REPLICA_HEADER: first["replica"]} if first is not None else None
        if first is not None:
            router_metrics().routed(meta["model"], first["replica"])
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            events = self._sse(gen, first, meta, req.n, include_usage)
            return StreamingResponse(events, media_type="text/event-stream", headers=headers)
        return JSONResponse(await self._collect(gen, first, meta, req.n), headers=headers)

    async def _chunks(self, gen, first) -> AsyncIterator[dict[str, Any]]:
        try:
            if first is not None:
                yield first
            async for chunk in gen:
                yield chunk
        finally:
            gen.cancel()  # a client that went away aborts the engine request (no-op once finished)

    async def _sse(self, gen, first, meta: dict, n: int, include_usage: bool) -> AsyncIterator[str]:
        chat, obj = meta["chat"], "chat.completion.chunk" if meta["chat"] else "text_completion"
        base = {"id": meta["id"], "object": obj, "created": meta["created"], "model": meta["model"]}
        usage = _Usage(n)
        sent_role: set[int] = set()
        try:
            async for c in self._chunks(gen, first):
                usage.add(c)
                choice: dict[str, Any] = {"index": c["index"], "finish_reason": c["finish_reason"]}
                if chat:
                    delta: dict[str, Any] = {"content": c["text"]}
                    if c["index"] not in sent_role:
                        sent_role.add(c["index"])
                        delta["role"] = "assistant"
                    choice["delta"] = delta
                    choice["logprobs"] = _chat_logprobs(c["logprobs"])
                else:
                    choice["text"] = c["text"]
                    choice["logprobs"] = _completion_logprobs(c["logprobs"])
                yield f"data: {json.dumps({**base, 'choices': [choice]})}\n\n"
        except Exception as e:  # noqa: BLE001 - mid-stream failure: tell the client in-band
            err = engine_error(e)
            router_metrics().rejected(err.status, err.type)
            yield f"data: {json.dumps(error_body(err.message, err.type, err.status))}\n\n"
        if include_usage:
            yield f"data: {json.dumps({**base, 'choices': [], 'usage': usage.body()})}\n\n"
        yield "data: [DONE]\n\n"

    async def _collect(self, gen, first, meta: dict, n: int) -> dict[str, Any]:
        texts, logprobs, finish = [""] * n, [[] for _ in range(n)], [None] * n
        usage = _Usage(n)
        try:
            async for c in self._chunks(gen, first):
                usage.add(c)
                i = c["index"]
                texts[i] += c["text"]
                logprobs[i] += c["logprobs"] or []
                finish[i] = c["finish_reason"] or finish[i]
        except Exception as e:  # noqa: BLE001
            raise engine_error(e) from None
        chat = meta["chat"]
        choices = []
        for i in range(n):
            choice: dict[str, Any] = {"index": i, "finish_reason": finish[i]}
            if chat:
                choice["message"] = {"role": "assistant", "content": texts[i]}
                choice["logprobs"] = _chat_logprobs(logprobs[i]) if logprobs[i] else None
            else:
                choice["text"] = texts[i]
                choice["logprobs"] = _completion_logprobs(logprobs[i]) if logprobs[i] else None
            choices.append(choice)
        obj = "chat.completion" if chat else "text_completion"
        return {"id": meta["id"], "object": obj, "created": meta["created"], "model": meta["model"],
                "choices": choices, "usage": usage.body()}  # fmt: skip
