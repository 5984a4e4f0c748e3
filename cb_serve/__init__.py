"""cb-serve: continuous-batching LLM serving with a paged KV cache.

The public API: what ``cb_serve.serve`` and users import (``from cb_serve import ...``)."""

from cb_serve.chat_template import PromptEncoder, split_images
from cb_serve.config import EngineConfig
from cb_serve.engine.async_llm import AsyncLLM
from cb_serve.engine.processor import image_prompts_for
from cb_serve.errors import (
    EngineDeadError,
    EngineError,
    EngineFatalError,
    EngineOverloadedError,
    EngineShutdownError,
    EngineUnavailableError,
    InvalidRequestError,
    RequestFailedError,
    RequestIdInUseError,
    StepFailedError,
)
from cb_serve.inputs import PromptType, TextPrompt, TokensPrompt
from cb_serve.llm import LLM
from cb_serve.lora_request import LoRARequest
from cb_serve.multimodal import MultiModalFeature
from cb_serve.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from cb_serve.prefix_hash import PrefixDigest, prefix_block_hashes
from cb_serve.reasoning import HarmonySplitter, ReasoningParser, ReasoningSplitter, reasoning_parser
from cb_serve.sampling_params import SEED_MAX, SEED_MIN, RequestOutputKind, SamplingParams
from cb_serve.stats import EngineStats, StepPhases, StepStats
from cb_serve.structured_outputs_params import ConstraintLimits, StructuredOutputsParams
from cb_serve.tool_format import tool_call_constraint
from cb_serve.tool_parsers import (
    TOOL_CALL_PARSERS,
    DeepSeekV3ToolParser,
    GraniteToolParser,
    HarmonyToolParser,
    Llama3JsonToolParser,
    MistralToolParser,
    ParsedToolCall,
    Qwen3CoderToolParser,
    ToolCallParser,
    tool_call_parser_for_template,
)

__all__ = [
    "LLM",
    "LoRARequest",
    "AsyncLLM",
    "EngineConfig",
    "PromptEncoder",
    "split_images",
    "image_prompts_for",
    "MultiModalFeature",
    "PrefixDigest",
    "prefix_block_hashes",
    "SamplingParams",
    "StructuredOutputsParams",
    "ConstraintLimits",
    "tool_call_constraint",
    "ToolCallParser",
    "Qwen3CoderToolParser",
    "DeepSeekV3ToolParser",
    "GraniteToolParser",
    "HarmonySplitter",
    "HarmonyToolParser",
    "Llama3JsonToolParser",
    "MistralToolParser",
    "TOOL_CALL_PARSERS",
    "tool_call_parser_for_template",
    "ParsedToolCall",
    "ReasoningParser",
    "ReasoningSplitter",
    "reasoning_parser",
    "PromptType",
    "TextPrompt",
    "TokensPrompt",
    "RequestOutputKind",
    "SEED_MIN",
    "SEED_MAX",
    "RequestOutput",
    "CompletionOutput",
    "Logprob",
    "RequestMetrics",
    "EngineStats",
    "StepStats",
    "StepPhases",
    "EngineError",
    "InvalidRequestError",
    "RequestIdInUseError",
    "EngineOverloadedError",
    "EngineDeadError",
    "EngineUnavailableError",
    "EngineShutdownError",
    "RequestFailedError",
    "StepFailedError",
    "EngineFatalError",
]
__version__ = "0.1.0"
