"""The engine's configuration (vLLM's engine arguments) and the capability configs it validates."""

from cb_serve.config.engine import EngineConfig
from cb_serve.config.lora import LoRAConfig
from cb_serve.config.speculative import SpeculativeConfig

__all__ = ["EngineConfig", "LoRAConfig", "SpeculativeConfig"]
