"""cb-serve: continuous-batching LLM serving with a paged KV cache."""

from cb_serve.config import EngineConfig
from cb_serve.llm import LLM
from cb_serve.outputs import CompletionOutput, RequestOutput
from cb_serve.sampling_params import RequestOutputKind, SamplingParams

__all__ = ["LLM", "EngineConfig", "SamplingParams", "RequestOutputKind", "RequestOutput", "CompletionOutput"]
__version__ = "0.1.0"
