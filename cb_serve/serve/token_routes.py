"""vLLM's small endpoints, mixed into the ``Router``: ``/tokenize`` and ``/detokenize`` (vLLM's
bodies: a prompt or a conversation, rendered as generation renders it), ``/version``, ``/ping``
(SageMaker's health path), and the model list with each model's card (``max_model_len`` in it)."""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version
from typing import TYPE_CHECKING, Annotated, Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from pydantic import Field

from cb_serve import LoRARequest
from cb_serve.serve.api_error import APIError
from cb_serve.serve.lora_registry import LoRARegistry
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


class TokenRoutes:
    """The Router sets ``encoder`` and ``loras`` and provides ``_check``, ``_read_json``, ``_model``,
    ``_info``, ``_render_chat``, ``_encode`` and ``health``."""

    encoder: Any
    loras: LoRARegistry

    if TYPE_CHECKING:

        async def _check(self, request: Request, requested_model: str | None) -> LoRARequest | None: ...
        async def _read_json(self, request: Request) -> dict[str, Any]: ...
        async def _model(self) -> str: ...
        async def _info(self) -> dict[str, Any]: ...
        async def _render_chat(self, req: ChatCompletionRequest) -> tuple[list[int], list[dict[str, Any]]]: ...
        async def _encode(self, encode: Any, *args: Any) -> Any: ...
        async def health(self) -> JSONResponse: ...
        def _parse_body(self, data: dict[str, Any], model: Any) -> Any: ...

    @token_routes.post("/tokenize")
    async def tokenize(self, request: Request) -> dict[str, Any]:
        """vLLM's: ``{prompt, add_special_tokens}`` or ``{messages, add_generation_prompt, ...}`` (as
        /v1/chat/completions renders it) -> ``{count, max_model_len, tokens, token_strs}``."""
        await self._check(request, None)  # the API key first
        data = await self._read_json(request)
        return_strs = data.get("return_token_strs") is True
        if "messages" in data:
            chat = {k: v for k, v in data.items() if k != "return_token_strs"}
            req = self._parse_body({"max_tokens": 1, **chat}, ChatCompletionRequest)
            await self._check(request, req.model)
            if req.add_special_tokens:
                raise APIError(400, "add_special_tokens with messages is not supported: the chat template "
                               "places the special tokens.", "unsupported", "add_special_tokens")  # fmt: skip
            token_ids, _ = await self._render_chat(req)
        else:
            body = self._parse_body(data, TokenizeCompletionRequest)
            await self._check(request, body.model)
            token_ids = await self._encode(self.encoder.encode, body.prompt, body.add_special_tokens)
        strs = await self._encode(self.encoder.token_strs, token_ids) if return_strs else None
        max_model_len = (await self._info())["max_model_len"]
        return {"count": len(token_ids), "max_model_len": max_model_len, "tokens": token_ids, "token_strs": strs}

    @token_routes.post("/detokenize")
    async def detokenize(self, request: Request) -> dict[str, Any]:
        """vLLM's: ``{tokens}`` -> ``{prompt}`` (a token id out of the vocabulary is a 400)."""
        await self._check(request, None)
        body = self._parse_body(await self._read_json(request), DetokenizeRequest)
        await self._check(request, body.model)
        return {"prompt": await self._encode(self.encoder.decode, body.tokens)}

    @token_routes.get("/version")
    async def version(self) -> dict[str, Any]:
        try:
            return {"version": version("cb-serve")}
        except PackageNotFoundError:  # run from a source tree without installing
            return {"version": "unknown"}

    @token_routes.get("/ping")
    async def ping(self) -> JSONResponse:
        """SageMaker's health path (as vLLM serves it): /health's answer."""
        return await self.health()

    @token_routes.post("/ping")
    async def ping_post(self) -> JSONResponse:
        return await self.health()

    @token_routes.get("/v1/models")
    async def models(self, request: Request) -> dict[str, Any]:
        await self._check(request, None)
        return {"object": "list", "data": await self._model_cards()}

    @token_routes.get("/v1/models/{model_id:path}")
    async def model(self, request: Request, model_id: str) -> dict[str, Any]:
        await self._check(request, None)
        card = next((c for c in await self._model_cards() if c["id"] == model_id), None)
        if card is None:
            raise APIError(404, f"The model {model_id!r} does not exist.", "not_found_error", "model")
        return card

    async def _model_cards(self) -> list[dict[str, Any]]:
        return self.loras.model_cards(await self._model(), (await self._info())["max_model_len"])
