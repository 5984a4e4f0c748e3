"""One file per model family, each a plan over the shared layers (``base.py``, ``plan.py``); ``MODELS`` maps
an HF config's ``model_type`` to the class that serves it (``docs/architecture.md``: adding a family)."""

from __future__ import annotations

from cb_serve.model_executor.models.base import CausalLM
from cb_serve.model_executor.models.gemma2 import Gemma2ForCausalLM
from cb_serve.model_executor.models.gemma3 import Gemma3ForCausalLM
from cb_serve.model_executor.models.gemma3_mm import Gemma3ForConditionalGeneration
from cb_serve.model_executor.models.gemma4 import Gemma4ForCausalLM
from cb_serve.model_executor.models.gpt_oss import GptOssForCausalLM
from cb_serve.model_executor.models.granite import GraniteForCausalLM
from cb_serve.model_executor.models.granitemoehybrid import GraniteMoeHybridForCausalLM
from cb_serve.model_executor.models.llama import LlamaForCausalLM
from cb_serve.model_executor.models.moe_models import (
    MixtralForCausalLM,
    OlmoeForCausalLM,
    Qwen2MoeForCausalLM,
    Qwen3MoeForCausalLM,
)
from cb_serve.model_executor.models.olmo2 import Olmo2ForCausalLM
from cb_serve.model_executor.models.phi3 import Phi3ForCausalLM
from cb_serve.model_executor.models.qwen2 import Qwen2ForCausalLM
from cb_serve.model_executor.models.qwen3 import Qwen3ForCausalLM
from cb_serve.model_executor.models.qwen3_next import Qwen3_5ForCausalLM, Qwen3_5MoeForCausalLM, Qwen3NextForCausalLM
from cb_serve.model_executor.models.qwen3_vl import (
    Qwen3_5ForConditionalGeneration,
    Qwen3_5MoeForConditionalGeneration,
    Qwen3VLForConditionalGeneration,
)
from cb_serve.model_executor.models.smollm3 import SmolLM3ForCausalLM

__all__ = ["MODELS", "MULTIMODAL_MODELS", "CausalLM", "model_class"]

MODELS: dict[str, type[CausalLM]] = {
    "llama": LlamaForCausalLM,
    "mistral": LlamaForCausalLM,  # Llama's plan: its sliding window comes from the config
    "qwen2": Qwen2ForCausalLM,
    "qwen3": Qwen3ForCausalLM,
    # Qwen3-VL's language model on text: Qwen3's layers; its M-RoPE, with a text token's three positions
    # equal, turns each pair by that position (the default RoPE: layers/rope_tables.py)
    "qwen3_vl_text": Qwen3ForCausalLM,
    "gemma2": Gemma2ForCausalLM,
    "gemma3_text": Gemma3ForCausalLM,
    "gemma4_text": Gemma4ForCausalLM,
    "olmo2": Olmo2ForCausalLM,
    "granite": GraniteForCausalLM,
    "phi3": Phi3ForCausalLM,
    "mixtral": MixtralForCausalLM,
    "qwen3_moe": Qwen3MoeForCausalLM,
    "qwen2_moe": Qwen2MoeForCausalLM,
    "olmoe": OlmoeForCausalLM,
    "gpt_oss": GptOssForCausalLM,
    "qwen3_5_text": Qwen3_5ForCausalLM,
    "qwen3_next": Qwen3NextForCausalLM,
    "qwen3_5_moe_text": Qwen3_5MoeForCausalLM,
    "granitemoehybrid": GraniteMoeHybridForCausalLM,
    "smollm3": SmolLM3ForCausalLM,
}


# Checkpoints whose images cb-serve reads (the whole checkpoint's model_type): the text model's class
# with a vision tower, built with the whole config as ``mm_config`` (``loader.load_multimodal_config``).
MULTIMODAL_MODELS: dict[str, type[CausalLM]] = {
    "gemma3": Gemma3ForConditionalGeneration,
    "qwen3_vl": Qwen3VLForConditionalGeneration,
    "qwen3_5": Qwen3_5ForConditionalGeneration,
    "qwen3_5_moe": Qwen3_5MoeForConditionalGeneration,
}


def model_class(config, mm_config=None) -> type[CausalLM]:
    """The class serving ``config`` (with images: ``mm_config``'s); a clear error naming the architecture
    where none does."""
    if mm_config is not None:
        return MULTIMODAL_MODELS[mm_config.model_type]
    if config.model_type not in MODELS:
        raise ValueError(
            f"Unsupported architecture {config.model_type!r} "
            f"({', '.join(getattr(config, 'architectures', None) or [])}); supported: {', '.join(sorted(MODELS))}."
        )
    return MODELS[config.model_type]
