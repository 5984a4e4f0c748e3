"""One HTTP request's path through a Router replica, shared by every API: **validate** (the API key, the body
under its byte limit and schema, the model or adapter it names), **render** (a prompt or a conversation to
token ids, once: engine replicas get ids), **dispatch** (one engine request per prompt, on the replica the
request router picks, retried elsewhere while nothing was sent) and **stream** (the replicas' chunks, which
each API's module turns into its own bodies).

Route modules take the pipeline as a FastAPI dependency (``pipeline_of``): it is the Router replica's state
(settings, engine handle, tokenizer, adapters, the Responses and Messages frontends, the inspector's client)
in one object.
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import logging
import os
import secrets
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, Field, ValidationError
from ray import serve
from ray.serve.handle import DeploymentHandle

from cb_serve import (
    TOOL_CALL_PARSERS,
    EngineConfig,
    HarmonySplitter,
    HarmonyToolParser,
    InvalidRequestError,
    LoRARequest,
    MultiModalFeature,
    PromptEncoder,
    ReasoningParser,
    StructuredOutputsParams,
    ToolCallParser,
    image_prompts_for,
    prefix_block_hashes,
    split_images,
    tool_call_parser_for_template,
)
from cb_serve import reasoning_parser as make_reasoning_parser
from cb_serve.serve.anthropic_api import MessagesFrontend
from cb_serve.serve.api_error import REQUEST_ID_HEADER, APIError, short
from cb_serve.serve.choice_assembler import DroppedReasoning, ReasoningSplitter
from cb_serve.serve.engine_chunk import EngineChunk
from cb_serve.serve.engine_request import ChatEngineRequest, EngineRequest
from cb_serve.serve.generation import Started, merged, start_all
from cb_serve.serve.http_body import read_json
from cb_serve.serve.inspector_client import Inspector
from cb_serve.serve.lora_registry import LoRARegistry
from cb_serve.serve.metrics import router_metrics
from cb_serve.serve.protocol import ChatCompletionRequest
from cb_serve.serve.responses import ResponseMeta
from cb_serve.serve.responses_api import ResponsesFrontend

logger = logging.getLogger("cb_serve.serve.router")

REPLICA_HEADER = "x-cb-replica"  # which engine replica served the request (operators, tests)
SESSION_HEADER = "x-session-id"  # requests of one session prefer one replica (so does the ``user`` field)
HEALTH_TIMEOUT_S = 5.0


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


@dataclass
class ChatPrompt:
    """A conversation rendered for the engine: its token ids, the messages the template took (images as
    ``{"type": "image"}`` parts) and its images, processed (``MultiModalFeature``s, in prompt order)."""

    token_ids: list[int]
    messages: list[dict[str, Any]]
    features: tuple[MultiModalFeature, ...] = ()


@dataclass
class Run:
    """One HTTP request's engine requests (one per prompt), started, and what its bodies share."""

    started: list[Started]
    meta: ResponseMeta
    headers: dict[str, str]
    n: int  # choices per prompt
    prompt_token_ids: list[list[int]] = field(default_factory=list)

    def chunks(self) -> AsyncIterator[EngineChunk]:
        return merged(self.started, [i * self.n for i in range(len(self.started))])


class RequestPipeline:
    """A Router replica's state and the stages every route runs through (see the module docstring)."""

    def __init__(
        self,
        engine: DeploymentHandle,
        settings: RouterSettings,
        engine_config: EngineConfig,
        lora_modules: dict[str, str] | None = None,
    ) -> None:
        self.engine = engine
        self.settings = settings
        self.api_key = settings.api_key or os.environ.get("CB_SERVE_API_KEY") or None
        self.engine_config = engine_config
        self.encoder = PromptEncoder(engine_config)
        self.loras = LoRARegistry(lora_modules)  # adapters served under the model field
        self.lora_names_loading: set[str] = set()  # runtime loads in progress
        self.inspector = Inspector(engine, settings.inspector, self.api_key)  # also: which replica served what
        self.responses_api = ResponsesFrontend(max_stored=settings.max_stored_responses)  # /v1/responses
        self.messages_api = MessagesFrontend()  # /v1/messages
        self._model_name: str | None = settings.served_model_name
        self._engine_info: dict[str, Any] | None = None
        self._reasoning_parser: ReasoningParser | None = None
        self._tool_parser_name: str | None = None
        self._chat_template = ""  # the model's chat template's text (its variants joined), read with the format
        self._images: Any = None  # the model's ``ImagePrompts`` (its processor), loaded at the first image
        self._images_loaded = False
        self._images_lock = asyncio.Lock()

    # -- validate --------------------------------------------------------------------------------------

    async def info(self) -> dict[str, Any]:
        """The engine replicas' model name, block size and whether they cache prefixes."""
        if self._engine_info is None:
            self._engine_info = await self.engine.model_info.remote()
        return self._engine_info

    async def model(self) -> str:
        if self._model_name is None:
            self._model_name = (await self.info())["model"]
        return self._model_name

    async def authorize(self, request: Request, requested_model: str | None = None) -> LoRARequest | None:
        """Checks the API key and the model name: the adapter it names (None: the base model).
        The base model's name wins over an adapter of the same name."""
        if self.api_key is not None:
            given = request.headers.get("authorization", "")
            if not given and "x-api-key" in request.headers:  # Anthropic's clients send their key here
                given = f"Bearer {request.headers['x-api-key']}"
            if not secrets.compare_digest(given.encode(), f"Bearer {self.api_key}".encode()):
                raise APIError(401, "Invalid or missing API key (Authorization: Bearer <key>).", "authentication_error")
        if requested_model is None or requested_model == await self.model():
            return None
        lora = self.loras.get(requested_model)
        if lora is None:
            raise APIError(404, f"The model {requested_model!r} does not exist.", "not_found_error", "model")
        return lora

    async def read_json(self, request: Request) -> dict[str, Any]:
        return await read_json(request, self.settings.max_request_bytes)

    def parse_body(self, data: dict[str, Any], model: type[BaseModel]) -> Any:
        """``data`` as ``model`` (a 400 naming the field), its unsupported fields refused."""
        try:
            parsed = model.model_validate(data)
        except ValidationError as e:
            raise validation_error(list(e.errors())) from None
        for param, what in getattr(parsed, "unsupported", list)():
            message = f"Unsupported parameter {param!r}: cb-serve does not implement {what}."
            raise APIError(400, message, "unsupported", param)
        return parsed

    async def parse(self, request: Request, model: type[BaseModel]) -> tuple[Any, LoRARequest | None]:
        """The request body as ``model``, and the LoRA adapter its ``model`` field names (if any); the API
        key is checked before the body is read."""
        if self.api_key is not None:
            await self.authorize(request)
        parsed = self.parse_body(await self.read_json(request), model)
        return parsed, await self.authorize(request, getattr(parsed, "model", None))

    # -- render ----------------------------------------------------------------------------------------

    async def encode(self, encode: Callable[..., Any], *args: Any) -> Any:
        """Tokenizes off the event loop; the client's input errors become 400s."""
        try:
            return await asyncio.to_thread(encode, *args)
        except InvalidRequestError as e:
            raise APIError(400, short(str(e)), param=e.param) from None

    async def decode(self, token_ids: list[int]) -> str:
        return await self.encode(self.encoder.decode, token_ids)

    async def render_chat(self, req: ChatCompletionRequest) -> ChatPrompt:
        """The conversation's token ids (the chat template, with the request's options), the messages, and
        its images run through the model's processor here, off the engine replicas."""
        if req.chat_template is not None and not self.settings.trust_request_chat_template:
            raise APIError(400, "This server does not accept a chat_template in requests (trust_request_chat_template "
                           "is off).", "unsupported", "chat_template")  # fmt: skip
        messages, images = split_images([m.to_template() for m in req.messages])
        options = dict(
            chat_template=req.chat_template,
            chat_template_kwargs=req.chat_template_kwargs,
            continue_final_message=req.continue_final_message,
            reasoning_effort=req.reasoning_effort,
        )
        render = functools.partial(self.encoder.encode_chat, messages, req.add_generation_prompt, req.prompt_tools())
        if not images:
            return ChatPrompt(await self.encode(functools.partial(render, **options)), messages)
        prompts = await self.image_prompts()
        text = await self.encode(functools.partial(render, tokenize=False, **options))
        token_ids, features = await self.encode(prompts.process_chat, text, images)
        return ChatPrompt(token_ids, messages, features)

    async def image_prompts(self) -> Any:
        """The model's image path (its processor, loaded once, off the event loop); a 400 for a text model."""
        async with self._images_lock:
            if not self._images_loaded:
                self._images = await asyncio.to_thread(image_prompts_for, self.engine_config)
                self._images_loaded = True
        if self._images is None:
            raise APIError(400, "This model does not read images (a text model, or limit_mm_per_prompt sets images "
                           "to 0): send text content only.", param="messages")  # fmt: skip
        return self._images

    # -- dispatch --------------------------------------------------------------------------------------

    async def start(
        self,
        request: Request,
        request_id: str,
        req: Any,
        lora: LoRARequest | None,
        prompts: list[list[int]],
        chat: bool,
        features: tuple[MultiModalFeature, ...] = (),
        **text: Any,
    ) -> Run:
        """Starts one engine request per prompt (``request_id``, or ``request_id-i`` for several);
        ``features``: the images of a single (chat) prompt."""
        # Behind Ray Serve's proxy the response gets x-request-id from it (adding ours would repeat it).
        headers = {} if REQUEST_ID_HEADER in request.headers else {REQUEST_ID_HEADER: request_id}
        cap = self.settings.max_tokens_cap
        tools = chat and req.tool_mode != "none"
        parser = self.tool_parser(req.prompt_tools()) if tools else None
        write_calls = self.calls_writer() if tools else None  # forced calls in the model's own format
        try:  # without max_tokens: 16 for completions (OpenAI's default), the cap (or the context) for chat
            params = req.to_sampling_params(cap if chat else 16, cap, write_calls)
        except InvalidRequestError as e:
            raise APIError(400, short(str(e)), param=e.param) from None
        harmony = chat and self.tool_format() == HarmonyToolParser.name  # every reply is channels
        if harmony or (parser is not None and parser.func.keeps_special_tokens):  # markers are special tokens
            params.skip_special_tokens = False
        info = await self.info()
        assert not features or len(prompts) == 1, "images go with one prompt"
        if features and req.truncate_prompt_tokens is not None:
            raise APIError(400, "truncate_prompt_tokens is not supported with images (it would cut an image's "
                           "tokens).", "unsupported", "truncate_prompt_tokens")  # fmt: skip
        prompts = [truncate(p, req.truncate_prompt_tokens, info["max_model_len"]) for p in prompts]
        payloads = [
            self._payload(
                request, f"{request_id}-{i}" if len(prompts) > 1 else request_id, req, lora, p, params, chat, features
            )  # fmt: skip
            for i, p in enumerate(prompts)
        ]
        for payload in payloads:
            for name, value in text.items():
                setattr(payload, name, value)
        started = await start_all(self.engine, payloads)
        model = lora.lora_name if lora is not None else await self.model()
        max_calls = 1 if chat and req.parallel_tool_calls is False else None
        meta = ResponseMeta(request_id, int(time.time()), model, chat, tools, max_calls, parser)
        await self._note_replica(started[0], request_id, headers, lora)
        return Run(started, meta, headers, req.n, prompts)

    def _payload(
        self, request: Request, request_id: str, req: Any, lora, token_ids: list[int], params, chat: bool, features
    ):
        info = self._engine_info or {}
        block_size = info["block_size"] if info.get("enable_prefix_caching") else 0
        # At most a context's worth: a longer prompt is refused by the engine, and this runs on the event loop.
        hashed = token_ids[: info["max_model_len"]]
        salt = lora.cache_salt if lora is not None else None  # the engine keys an adapter's KV apart
        # a block's images are part of its key, as in the engine's block manager
        hashes = b"".join(prefix_block_hashes(hashed, block_size, salt, features)) if block_size else b""
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
            mm_features=features,
        )

    async def _note_replica(self, started: Started, request_id: str, headers: dict[str, str], lora) -> None:
        replica = started.replica
        if replica:
            headers[REPLICA_HEADER] = replica
            self.inspector.remember(request_id, replica)
            lora_name = lora.lora_name if lora is not None else ""
            first = started.first[0]
            router_metrics().routed(await self.model(), replica, first.expected_cached_tokens, first.cached_tokens,
                                    lora_name)  # fmt: skip

    # -- stream ----------------------------------------------------------------------------------------

    def tool_format(self) -> str:
        """The model's tool-call format: the engine argument's, else its chat template's."""
        if self._tool_parser_name is None:
            template = self.encoder.with_tokenizer(lambda tok: getattr(tok, "chat_template", None))
            self._chat_template = "\n".join(template.values()) if isinstance(template, dict) else template or ""
            chosen = self.engine_config.tool_call_parser
            self._tool_parser_name = chosen or tool_call_parser_for_template(self._chat_template)
        return self._tool_parser_name

    def calls_writer(self) -> functools.partial[StructuredOutputsParams]:
        """The grammar of a forced call in the model's format (``tool_choice`` required or named)."""
        parser = TOOL_CALL_PARSERS[self.tool_format()]
        return functools.partial(parser.constraint, template=self._chat_template)

    def tool_parser(self, tools: list[dict[str, Any]] | None) -> functools.partial[ToolCallParser]:
        """Makes each choice's tool-call parser, of the model's format."""
        return functools.partial(TOOL_CALL_PARSERS[self.tool_format()], tools)

    def reasoning(self, run: Run, req: ChatCompletionRequest) -> Callable[[], ReasoningSplitter] | None:
        """Makes each choice's reasoning splitter (None: no reasoning parser, or not asked for)."""
        name = self.engine_config.reasoning_parser
        if name is None and self.tool_format() == HarmonyToolParser.name:  # gpt-oss: the analysis channel
            return (lambda: DroppedReasoning(HarmonySplitter())) if not req.include_reasoning else HarmonySplitter
        if name is None:
            return None
        if self._reasoning_parser is None:  # the engine replicas checked the tokenizer has think tokens
            self._reasoning_parser = self.encoder.with_tokenizer(lambda tok: make_reasoning_parser(name, tok))
        parser, prompt = self._reasoning_parser, run.prompt_token_ids[0]
        if not req.include_reasoning:
            return lambda: DroppedReasoning(parser.splitter(prompt))
        return lambda: parser.splitter(prompt)

    async def health(self) -> JSONResponse:
        """200 while at least one engine replica is alive (the request router prefers live replicas, so one
        that answers dead means none is alive); 503 otherwise."""
        try:
            alive = await asyncio.wait_for(self.engine.is_alive.remote(), timeout=HEALTH_TIMEOUT_S)
        except Exception as e:  # noqa: BLE001 - no replica answered: not healthy
            logger.warning("health check: no engine replica answered: %r", e)
            alive = False
        if alive:
            return JSONResponse({"status": "ok"})
        return JSONResponse({"status": "unavailable", "detail": "no live engine replica"}, status_code=503)


def truncate(token_ids: list[int], keep: int | None, max_model_len: int) -> list[int]:
    """vLLM's ``truncate_prompt_tokens``: the last ``keep`` tokens (-1: the context length)."""
    if keep is None:
        return token_ids
    keep = max_model_len if keep == -1 else keep
    return token_ids[-keep:] if keep < len(token_ids) else token_ids


def pipeline_of() -> RequestPipeline:
    """FastAPI dependency: this Router replica's pipeline (the deployment object Ray Serve runs here)."""
    return serve.get_replica_context().servable_object.pipeline
