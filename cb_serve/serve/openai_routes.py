"""OpenAI's Completions and Chat Completions (``/v1/completions``, ``/v1/chat/completions``), their bodies
whole or as server-sent events, and the operator routes ``/health`` and ``/stats``."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, StreamingResponse

from cb_serve.serve.api_error import APIError, engine_error
from cb_serve.serve.choice_assembler import ReasoningSplitter
from cb_serve.serve.engine_chunk import EngineChunk
from cb_serve.serve.http_body import request_id_of
from cb_serve.serve.metrics import router_metrics
from cb_serve.serve.pipeline import RequestPipeline, Run, pipeline_of
from cb_serve.serve.protocol import ChatCompletionRequest, CompletionRequest, error_body
from cb_serve.serve.responses import EchoedPrompt, ResponseMeta, Usage, echo_chunks

openai_routes = APIRouter()
Reasoning = Callable[[], ReasoningSplitter] | None


@openai_routes.get("/health")
async def health(pipeline: RequestPipeline = Depends(pipeline_of)) -> JSONResponse:
    return await pipeline.health()


@openai_routes.get("/stats")
async def stats(request: Request, pipeline: RequestPipeline = Depends(pipeline_of)) -> dict[str, Any]:
    """Engine counters of one replica (operators, tests): running/waiting, KV blocks, steps."""
    await pipeline.authorize(request)
    return await pipeline.engine.stats.remote()


@openai_routes.post("/v1/completions")
async def completions(request: Request, pipeline: RequestPipeline = Depends(pipeline_of)):
    req, lora = await pipeline.parse(request, CompletionRequest)  # the API key first
    request_id = request_id_of(request, "cmpl")
    prompts = req.prompts
    encode = pipeline.encoder.encode
    token_ids = [await pipeline.encode(encode, p) if isinstance(p, str) else list(p) for p in prompts]
    run = await pipeline.start(request, request_id, req, lora, token_ids, chat=False)
    if not req.echo:
        return await respond(run, req, None)
    echoed = []  # each choice starts with its prompt (and its logprobs)
    for p, ids in zip(prompts, run.prompt_token_ids):
        text = p if isinstance(p, str) and ids == token_ids[len(echoed)] else await pipeline.decode(ids)
        echoed.append(EchoedPrompt(text, ids, await pipeline.decode(ids[:1])))
    return await respond(run, req, None, echo=echoed)


@openai_routes.post("/v1/chat/completions")
async def chat_completions(request: Request, pipeline: RequestPipeline = Depends(pipeline_of)):
    req, lora = await pipeline.parse(request, ChatCompletionRequest)  # the API key first
    request_id = request_id_of(request, "chatcmpl")
    chat = await pipeline.render_chat(req)
    run = await pipeline.start(request, request_id, req, lora, [chat.token_ids], True, chat.features,
                               messages=chat.messages)  # fmt: skip
    return await respond(run, req, pipeline.reasoning(run, req))


async def respond(run: Run, req: Any, reasoning: Reasoning, echo: list[EchoedPrompt] | None = None):
    """OpenAI's bodies (Chat Completions or Completions), streamed or whole."""
    n = run.n * len(run.started)
    chunks = run.chunks()
    if echo is not None:
        chunks = echo_chunks(chunks, echo, run.n, req.echo_only)
    if req.stream:
        options = req.stream_options
        usage_every = bool(options and options.continuous_usage_stats)
        include_usage = bool(options and options.include_usage)
        events = sse(chunks, run.meta, n, include_usage, usage_every, reasoning)
        return StreamingResponse(events, media_type="text/event-stream", headers=run.headers)
    return JSONResponse(await collect(chunks, run.meta, n, reasoning), headers=run.headers)


async def sse(
    chunks: AsyncIterator[EngineChunk], meta: ResponseMeta, n: int, include_usage: bool, usage_every: bool, reasoning
) -> AsyncIterator[str]:
    base = meta.base(stream=True)
    usage = Usage(n)
    choices = meta.choices(n, reasoning)
    try:
        async for c in chunks:
            usage.add(c)
            choice = choices[c.index].delta(c)
            if choice is None:
                continue
            extra = {"timeline": c.timeline} if c.timeline else {}
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


async def collect(chunks: AsyncIterator[EngineChunk], meta: ResponseMeta, n: int, reasoning) -> dict[str, Any]:
    usage = Usage(n)
    choices = meta.choices(n, reasoning)
    try:
        async for c in chunks:
            usage.add(c)
            choices[c.index].add(c)
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
