"""What an engine derives from its config before it loads weights (device, dtypes, attention
backend, block size, context length), shared by the driver and its tensor-parallel workers so
every rank derives the same."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from cb_serve.attention import get_attention_backend
from cb_serve.attention.base import AttentionBackend
from cb_serve.config import EngineConfig
from cb_serve.config.engine import FP8_KV_CACHE_DTYPES
from cb_serve.distributed.group import TensorParallelGroup
from cb_serve.distributed.sharding import TensorParallelShard
from cb_serve.kv_cache_interface import KVCacheLayout
from cb_serve.model_executor import loader
from cb_serve.model_executor.device_context import concrete_device
from cb_serve.model_executor.models import CausalLM, model_class

MAX_DEFAULT_MODEL_LEN = 8192
DEVICE_ENV = "CB_SERVE_DEVICE"  # what device="auto" means in this process and its workers (the tests: cpu)


def auto_device_name(device: str, cuda_available: bool, env: Mapping[str, str] = os.environ) -> str:
    """The device an engine runs on: ``device`` unless ``auto``; then ``$CB_SERVE_DEVICE`` where set
    (a GPU host's CPU test suite pins it to cpu), else cuda where available, else cpu."""
    if device != "auto":
        return device
    return env.get(DEVICE_ENV) or ("cuda" if cuda_available else "cpu")


def resolve_device_and_dtype(config: EngineConfig) -> tuple[torch.device, torch.dtype]:
    name = auto_device_name(config.device, torch.cuda.is_available())
    device = concrete_device(torch.device(name))  # "cuda" -> "cuda:<current>": set_device refuses a bare "cuda"
    if config.dtype == "auto":
        return device, torch.bfloat16 if device.type == "cuda" else torch.float32
    return device, getattr(torch, config.dtype)


def kv_cache_torch_dtype(kv_cache_dtype: str, dtype: torch.dtype) -> torch.dtype:
    """The cache's torch dtype for ``kv_cache_dtype`` (an ``EngineConfig`` name) under weights of ``dtype``."""
    if kv_cache_dtype == "auto":
        return dtype
    return torch.float8_e4m3fn if kv_cache_dtype in FP8_KV_CACHE_DTYPES else getattr(torch, kv_cache_dtype)


def choose_backend(
    config: EngineConfig, device: torch.device, dtype: torch.dtype, kv_cache_dtype: torch.dtype
) -> tuple[AttentionBackend, int]:
    """The attention backend and the KV block size; raises if the backend cannot serve them."""
    backend = get_attention_backend(config.attention_backend, device, dtype)
    block_size = config.block_size or max(16, backend.block_size_multiple)
    if block_size % backend.block_size_multiple:
        raise ValueError(
            f"The {backend.name} backend needs block_size to be a multiple of "
            f"{backend.block_size_multiple}, got {block_size}."
        )
    if kv_cache_dtype != dtype and not (backend.supports_narrow_kv_cache and dtype == torch.float32):
        raise ValueError(
            f"kv_cache_dtype={config.kv_cache_dtype} differs from the model dtype {dtype}: supported only "
            f"under float32 weights with the cpu or torch attention backend (got {backend.name})."
        )
    return backend, block_size


def multimodal_config(config: EngineConfig, source: loader.ModelSource):
    """The whole config of a checkpoint whose images this engine serves; None where it serves text alone:
    a text model, ``limit_mm_per_prompt={"image": 0}``, or (not yet with images) tensor parallelism."""
    if config.image_limit() == 0:
        return None
    mm_config = loader.load_multimodal_config(source, config.trust_remote_code)
    if mm_config is not None and config.tensor_parallel_size > 1:
        if config.image_limit():
            raise ValueError("Images are not supported with tensor_parallel_size > 1 yet (limit_mm_per_prompt).")
        return None
    return mm_config


@dataclass
class ModelSetup:
    config: EngineConfig
    source: loader.ModelSource
    hf_config: object
    device: torch.device
    dtype: torch.dtype
    kv_cache_dtype: torch.dtype
    backend: AttentionBackend
    block_size: int
    max_model_len: int
    mm_config: object | None = None  # the whole config of a checkpoint whose images are served (else None)

    @classmethod
    def from_config(cls, config: EngineConfig, device: torch.device | None = None) -> ModelSetup:
        """``device`` overrides the config's (a tensor-parallel worker's own GPU)."""
        resolved, dtype = resolve_device_and_dtype(config)
        device = device or resolved
        kv_cache_dtype = kv_cache_torch_dtype(config.kv_cache_dtype, dtype)
        source = loader.resolve_model_source(config.model)
        hf_config = loader.load_config(source, config.trust_remote_code)
        max_positions = getattr(hf_config, "max_position_embeddings", MAX_DEFAULT_MODEL_LEN)
        max_model_len = config.max_model_len or min(max_positions, MAX_DEFAULT_MODEL_LEN)
        backend, block_size = choose_backend(config, device, dtype, kv_cache_dtype)
        mm_config = multimodal_config(config, source)
        return cls(config, source, hf_config, device, dtype, kv_cache_dtype, backend, block_size, max_model_len,
                   mm_config)  # fmt: skip

    @property
    def kv_layout(self) -> KVCacheLayout:
        """The model's KV-cache groups and state layers, from its plan (``kv_cache_interface``)."""
        plan = model_class(self.hf_config).plan(self.hf_config)
        return plan.kv_layout(hybrid=not self.config.disable_hybrid_kv_cache_manager)

    def load_model(self, shard: TensorParallelShard | None = None, tp: TensorParallelGroup | None = None) -> CausalLM:
        return loader.load_model(
            self.source,
            self.hf_config,
            self.backend,
            self.dtype,
            self.device,
            self.max_model_len,
            self.config.trust_remote_code,
            shard,
            tp,
            self.config.activation_quantization,
            self.mm_config,
            with_mtp=(self.config.speculative_config or {}).get("method") == "mtp",
        )
