"""The chat-shaped APIs beside Chat Completions: OpenAI's Responses (``/v1/responses``) and Anthropic's
Messages (``/v1/messages``, ``/v1/messages/count_tokens``). Each is a ``ChatFrontend`` (``frontend_base``,
the pipeline's ``responses_api`` / ``messages_api``): its body becomes a Chat Completions request, which
runs the pipeline's one path (validation, chat template, routing, retries, cancellation); the neutral
outputs (``ChoiceAssembler``) come back in the API's own shapes, errors included."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel

from cb_serve import InvalidRequestError, LoRARequest
from cb_serve.serve.api_error import APIError, engine_error, short
from cb_serve.serve.choice_assembler import ChoiceAssembler
from cb_serve.serve.frontend_base import ChatFrontend, ChoiceDelta, ResponseContext, UsageInfo
from cb_serve.serve.http_body import request_id_of
from cb_serve.serve.metrics import router_metrics
from cb_serve.serve.pipeline import RequestPipeline, Run, pipeline_of
from cb_serve.serve.protocol import ChatCompletionRequest

frontend_routes = APIRouter()


@frontend_routes.post("/v1/responses")
async def responses(request: Request, pipeline: RequestPipeline = Depends(pipeline_of)):
    return await _frontend(pipeline, request, pipeline.responses_api, "resp")


@frontend_routes.post("/v1/messages")
async def messages(request: Request, pipeline: RequestPipeline = Depends(pipeline_of)):
    return await _frontend(pipeline, request, pipeline.messages_api, "msg")


@frontend_routes.post("/v1/messages/count_tokens")
async def count_tokens(request: Request, pipeline: RequestPipeline = Depends(pipeline_of)):
    """Anthropic's: the prompt's tokens under the chat template, ``{"input_tokens": n}``."""
    api = pipeline.messages_api
    try:
        body, req, _ = await _chat_of(pipeline, request, api.count_request_model, api.count_to_chat)
        chat = await pipeline.render_chat(req)
        return JSONResponse({"input_tokens": len(chat.token_ids)})
    except APIError as e:
        return _error(api, e)


async def _chat_of(
    pipeline: RequestPipeline, request: Request, model: type[BaseModel], to_chat: Callable[[Any], dict[str, Any]]
) -> tuple[Any, ChatCompletionRequest, LoRARequest | None]:
    """The API's body, the chat request it stands for, and the adapter it names."""
    await pipeline.authorize(request)  # the API key first
    body = pipeline.parse_body(await pipeline.read_json(request), model)
    try:
        chat = to_chat(body)
    except InvalidRequestError as e:
        raise APIError(400, short(str(e)), param=e.param) from None
    req = pipeline.parse_body(chat, ChatCompletionRequest)
    return body, req, await pipeline.authorize(request, req.model)


async def _frontend(pipeline: RequestPipeline, request: Request, api: ChatFrontend, prefix: str):
    try:
        body, req, lora = await _chat_of(pipeline, request, api.request_model, api.to_chat)
        request_id = request_id_of(request, prefix)
        chat = await pipeline.render_chat(req)
        run = await pipeline.start(request, request_id, req, lora, [chat.token_ids], True, chat.features,
                                   messages=chat.messages)  # fmt: skip
    except APIError as e:
        return _error(api, e)
    ctx = ResponseContext(run.meta.id, run.meta.created, run.meta.model)
    reasoning = pipeline.reasoning(run, req)
    assembler = ChoiceAssembler(0, run.meta.tools, run.meta.max_calls, reasoning and reasoning(), run.meta.tool_parser)
    usage = UsageInfo()
    deltas = _deltas(run, assembler, usage)
    if req.stream:
        events = api.events(ctx, body, deltas, usage)
        return StreamingResponse(events, media_type="text/event-stream", headers=run.headers)
    try:
        async for _ in deltas:
            pass
    except APIError as e:
        return _error(api, e)
    return JSONResponse(api.response(ctx, body, assembler.result(), usage), headers=run.headers)


async def _deltas(run: Run, assembler: ChoiceAssembler, usage: UsageInfo) -> AsyncIterator[ChoiceDelta]:
    """The one choice's deltas; ``usage`` follows them; a failure is raised as an ``APIError``."""
    try:
        async for c in run.chunks():
            usage.prompt_tokens, usage.cached_tokens = c.prompt_tokens, c.cached_tokens
            usage.completion_tokens += c.num_tokens
            yield assembler.feed(c)
    except APIError:
        raise
    except Exception as e:  # noqa: BLE001
        raise engine_error(e, run.meta.id) from None


def _error(api: ChatFrontend, e: APIError) -> JSONResponse:
    router_metrics().rejected(e.status, e.type)
    body = api.error_body(e.status, e.type, e.message, e.param)
    return JSONResponse(body, status_code=e.status, headers=e.headers)
