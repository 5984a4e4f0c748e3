"""The chat-shaped APIs beside Chat Completions, mixed into the ``Router``: OpenAI's Responses
(``/v1/responses``) and Anthropic's Messages (``/v1/messages``, ``/v1/messages/count_tokens``).
Each is a ``ChatFrontend`` (``frontend_base``): its body becomes a Chat Completions request, which
runs the router's one path (validation, chat template, routing, retries, cancellation); the
neutral outputs (``ChoiceAssembler``) come back in the API's own shapes, errors included."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING, Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel

from cb_serve import EngineConfig, InvalidRequestError, LoRARequest, ReasoningParser, reasoning_parser
from cb_serve.serve.anthropic_api import MessagesFrontend
from cb_serve.serve.api_error import APIError, engine_error, short
from cb_serve.serve.choice_assembler import ChoiceAssembler, DroppedReasoning, ReasoningSplitter
from cb_serve.serve.frontend_base import ChatFrontend, ChoiceDelta, ResponseContext, UsageInfo
from cb_serve.serve.http_body import request_id_of
from cb_serve.serve.metrics import router_metrics
from cb_serve.serve.protocol import ChatCompletionRequest
from cb_serve.serve.responses_api import ResponsesFrontend

if TYPE_CHECKING:
    from cb_serve.serve.router import Run

frontend_routes = APIRouter()


class FrontendRoutes:
    """The Router sets ``settings``, ``engine_config`` and ``encoder`` and provides ``_check``,
    ``_read_json``, ``_parse_body``, ``_render_chat`` and ``_run``."""

    settings: Any
    engine_config: EngineConfig
    encoder: Any

    if TYPE_CHECKING:

        async def _check(self, request: Request, requested_model: str | None) -> LoRARequest | None: ...
        async def _read_json(self, request: Request) -> dict[str, Any]: ...
        async def _render_chat(self, req: ChatCompletionRequest) -> tuple[list[int], list[dict[str, Any]]]: ...
        async def _run(self, request: Request, request_id: str, req: Any, lora: Any, prompts: list[list[int]],
                       chat: bool, **text: Any) -> Run: ...  # fmt: skip
        def _parse_body(self, data: dict[str, Any], model: type[BaseModel]) -> Any: ...

    def _init_frontends(self) -> None:
        self.reasoning_parser: ReasoningParser | None = None
        self.responses_api = ResponsesFrontend(max_stored=self.settings.max_stored_responses)
        self.messages_api = MessagesFrontend()

    @frontend_routes.post("/v1/responses")
    async def responses(self, request: Request):
        return await self._frontend(request, self.responses_api, "resp")

    @frontend_routes.post("/v1/messages")
    async def messages(self, request: Request):
        return await self._frontend(request, self.messages_api, "msg")

    @frontend_routes.post("/v1/messages/count_tokens")
    async def count_tokens(self, request: Request):
        """Anthropic's: the prompt's tokens under the chat template, ``{"input_tokens": n}``."""
        api = self.messages_api
        try:
            body, req, _ = await self._chat_of(request, api.count_request_model, api.count_to_chat)
            token_ids, _ = await self._render_chat(req)
            return JSONResponse({"input_tokens": len(token_ids)})
        except APIError as e:
            return self._error(api, e)

    async def _chat_of(
        self, request: Request, model: type[BaseModel], to_chat: Callable[[Any], dict[str, Any]]
    ) -> tuple[BaseModel, ChatCompletionRequest, LoRARequest | None]:
        """The API's body, the chat request it stands for, and the adapter it names."""
        await self._check(request, None)  # the API key first
        body = self._parse_body(await self._read_json(request), model)
        try:
            chat = to_chat(body)
        except InvalidRequestError as e:
            raise APIError(400, short(str(e)), param=e.param) from None
        req = self._parse_body(chat, ChatCompletionRequest)
        return body, req, await self._check(request, req.model)

    async def _frontend(self, request: Request, api: ChatFrontend, prefix: str):
        try:
            body, req, lora = await self._chat_of(request, api.request_model, api.to_chat)
            request_id = request_id_of(request, prefix)
            token_ids, messages = await self._render_chat(req)
            run = await self._run(request, request_id, req, lora, [token_ids], chat=True, messages=messages)
        except APIError as e:
            return self._error(api, e)
        ctx = ResponseContext(run.meta.id, run.meta.created, run.meta.model)
        reasoning = self._reasoning(run, req)
        assembler = ChoiceAssembler(0, run.meta.tools, run.meta.max_calls, reasoning and reasoning())
        usage = UsageInfo()
        deltas = self._deltas(run, assembler, usage)
        if req.stream:
            events = api.events(ctx, body, deltas, usage)
            return StreamingResponse(events, media_type="text/event-stream", headers=run.headers)
        try:
            async for _ in deltas:
                pass
        except APIError as e:
            return self._error(api, e)
        return JSONResponse(api.response(ctx, body, assembler.result(), usage), headers=run.headers)

    @staticmethod
    async def _deltas(run: Run, assembler: ChoiceAssembler, usage: UsageInfo) -> AsyncIterator[ChoiceDelta]:
        """The one choice's deltas; ``usage`` follows them; a failure is raised as an ``APIError``."""
        try:
            async for c in run.chunks():
                usage.prompt_tokens, usage.cached_tokens = c["prompt_tokens"], c["cached_tokens"]
                usage.completion_tokens += c["num_tokens"]
                yield assembler.feed(c)
        except APIError:
            raise
        except Exception as e:  # noqa: BLE001
            raise engine_error(e, run.meta.id) from None

    def _reasoning(self, run: Run, req: ChatCompletionRequest) -> Callable[[], ReasoningSplitter] | None:
        """Makes each choice's reasoning splitter (None: no reasoning parser, or not asked for)."""
        name = self.engine_config.reasoning_parser
        if name is None:
            return None
        if self.reasoning_parser is None:  # the engine replicas checked the tokenizer has think tokens
            self.reasoning_parser = self.encoder.with_tokenizer(lambda tok: reasoning_parser(name, tok))
        parser, prompt = self.reasoning_parser, run.prompt_token_ids[0]
        if not req.include_reasoning:
            return lambda: DroppedReasoning(parser.splitter(prompt))
        return lambda: parser.splitter(prompt)

    @staticmethod
    def _error(api: ChatFrontend, e: APIError) -> JSONResponse:
        router_metrics().rejected(e.status, e.type)
        body = api.error_body(e.status, e.type, e.message, e.param)
        return JSONResponse(body, status_code=e.status, headers=e.headers)
