"""vLLM's small endpoints: ``/tokenize`` and ``/detokenize`` (vLLM's
bodies: a prompt or a conversation, rendered as generation renders it), ``/version``, ``/ping``
(SageMaker's health path), and the model list with each model's card (``max_model_len`` in it)."""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse
from pydantic import Field

from cb_serve.serve.api_error import APIError
from cb_serve.serve.pipeline import RequestPipeline, pipeline_of
from cb_serve.serve.protocol import ChatCompletionRequest
from cb_serve.serve.request_parts import Strict

token_routes = APIRouter()
MAX_DETOKENIZE = 1 << 20  # token ids in one /detokenize body (the body's byte limit binds first)


class TokenizeCompletionRequest(Strict):
    model: str | None = None
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool = False


class DetokenizeRequest(Strict):
    model: str | None = None
    tokens: Annotated[list[Annotated[int, Field(ge=0)]], Field(max_length=MAX_DETOKENIZE)]


@token_routes.post("/tokenize")
async def tokenize(request: Request, pipeline: RequestPipeline = Depends(pipeline_of)) -> dict[str, Any]:
    """vLLM's: ``{prompt, add_special_tokens}`` or ``{messages, add_generation_prompt, ...}`` (as
    /v1/chat/completions renders it) -> ``{count, max_model_len, tokens, token_strs}``."""
    await pipeline.authorize(request)  # the API key first
    data = await pipeline.read_json(request)
    return_strs = data.get("return_token_strs") is True
    if "messages" in data:
        chat = {k: v for k, v in data.items() if k != "return_token_strs"}
        req = pipeline.parse_body({"max_tokens": 1, **chat}, ChatCompletionRequest)
        await pipeline.authorize(request, req.model)
        if req.add_special_tokens:
            raise APIError(400, "add_special_tokens with messages is not supported: the chat template "
                           "places the special tokens.", "unsupported", "add_special_tokens")  # fmt: skip
        token_ids = (await pipeline.render_chat(req)).token_ids
    else:
        body = pipeline.parse_body(data, TokenizeCompletionRequest)
        await pipeline.authorize(request, body.model)
        token_ids = await pipeline.encode(pipeline.encoder.encode, body.prompt, body.add_special_tokens)
    strs = await pipeline.encode(pipeline.encoder.token_strs, token_ids) if return_strs else None
    max_model_len = (await pipeline.info())["max_model_len"]
    return {"count": len(token_ids), "max_model_len": max_model_len, "tokens": token_ids, "token_strs": strs}


@token_routes.post("/detokenize")
async def detokenize(request: Request, pipeline: RequestPipeline = Depends(pipeline_of)) -> dict[str, Any]:
    """vLLM's: ``{tokens}`` -> ``{prompt}`` (a token id out of the vocabulary is a 400)."""
    await pipeline.authorize(request)
    body = pipeline.parse_body(await pipeline.read_json(request), DetokenizeRequest)
    await pipeline.authorize(request, body.model)
    return {"prompt": await pipeline.decode(body.tokens)}


@token_routes.get("/version")
async def version_info() -> dict[str, Any]:
    try:
        return {"version": version("cb-serve")}
    except PackageNotFoundError:  # run from a source tree without installing
        return {"version": "unknown"}


@token_routes.get("/ping")
async def ping(pipeline: RequestPipeline = Depends(pipeline_of)) -> JSONResponse:
    """SageMaker's health path (as vLLM serves it): /health's answer."""
    return await pipeline.health()


@token_routes.post("/ping")
async def ping_post(pipeline: RequestPipeline = Depends(pipeline_of)) -> JSONResponse:
    return await pipeline.health()


@token_routes.get("/v1/models")
async def models(request: Request, pipeline: RequestPipeline = Depends(pipeline_of)) -> dict[str, Any]:
    await pipeline.authorize(request)
    return {"object": "list", "data": await _model_cards(pipeline)}


@token_routes.get("/v1/models/{model_id:path}")
async def model(request: Request, model_id: str, pipeline: RequestPipeline = Depends(pipeline_of)) -> dict[str, Any]:
    await pipeline.authorize(request)
    card = next((c for c in await _model_cards(pipeline) if c["id"] == model_id), None)
    if card is None:
        raise APIError(404, f"The model {model_id!r} does not exist.", "not_found_error", "model")
    return card


async def _model_cards(pipeline: RequestPipeline) -> list[dict[str, Any]]:
    return pipeline.loras.model_cards(await pipeline.model(), (await pipeline.info())["max_model_len"])
