"""vLLM's runtime LoRA admin routes: ``POST /v1/load_lora_adapter`` and ``/v1/unload_lora_adapter``, behind
the API key, on by default only when one is set (they read paths on the server)."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Depends, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import PlainTextResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from cb_serve.serve.api_error import APIError, engine_error
from cb_serve.serve.lora_registry import MAX_LORA_NAME, LoRARegistry
from cb_serve.serve.pipeline import RequestPipeline, pipeline_of

lora_routes = APIRouter()


class LoadLoRAAdapterRequest(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")

    lora_name: str = Field(min_length=1, max_length=MAX_LORA_NAME)
    lora_path: str = Field(min_length=1, max_length=4096)


class UnloadLoRAAdapterRequest(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")

    lora_name: str = Field(min_length=1, max_length=MAX_LORA_NAME)
    lora_int_id: int | None = None  # vLLM's field; the name decides here


@lora_routes.post("/v1/load_lora_adapter")
async def load_lora_adapter(request: Request, pipeline: RequestPipeline = Depends(pipeline_of)) -> PlainTextResponse:
    """vLLM's: serve a PEFT adapter directory under ``lora_name`` (read and checked by an engine
    replica now; the others read it on its first request there). 400 for a bad path or adapter."""
    req = await _lora_call(pipeline, request, LoadLoRAAdapterRequest)
    name, loras = req.lora_name, pipeline.loras
    if loras.get(name) is not None or name in pipeline.lora_names_loading or name == await pipeline.model():
        raise APIError(400, f"The model name {name!r} is already in use; unload it first.", param="lora_name")
    lora = LoRARegistry().add(name, req.lora_path, fresh=True)
    pipeline.lora_names_loading.add(name)
    try:
        await pipeline.engine.load_lora.remote(lora)
    except Exception as e:  # noqa: BLE001 - a bad adapter is a 400 (engine_error maps it)
        raise engine_error(e, f"load_lora_adapter {name}") from None
    finally:
        pipeline.lora_names_loading.discard(name)
    loras.adapters[name] = lora
    return PlainTextResponse(f"Success: LoRA adapter '{name}' added successfully.")


@lora_routes.post("/v1/unload_lora_adapter")
async def unload_lora_adapter(request: Request, pipeline: RequestPipeline = Depends(pipeline_of)) -> PlainTextResponse:
    """vLLM's: stop serving an adapter (requests using it finish; engines drop it as it goes idle:
    a later load of the name gets a new id, so nothing held or cached under this one is reused)."""
    req = await _lora_call(pipeline, request, UnloadLoRAAdapterRequest)
    if pipeline.loras.remove(req.lora_name) is None:
        raise APIError(404, f"The LoRA adapter {req.lora_name!r} cannot be found.", "not_found_error", "lora_name")
    return PlainTextResponse(f"Success: LoRA adapter '{req.lora_name}' removed successfully.")


async def _lora_call(pipeline: RequestPipeline, request: Request, model: type[BaseModel]) -> Any:
    await pipeline.authorize(request)  # the API key first
    allowed = pipeline.settings.allow_runtime_lora_updating
    if not (allowed or (allowed is None and pipeline.api_key is not None)):
        raise APIError(404, "Loading LoRA adapters at run time is turned off on this server.", "not_found_error")
    try:
        return model.model_validate(await pipeline.read_json(request))
    except ValidationError as e:
        raise RequestValidationError(e.errors()) from None
