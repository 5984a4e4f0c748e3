"""Published multimodal checkpoints served as their text model (issue 52, item 4). A random-weight
checkpoint shaped like one of these loads, its vision weights unread:

- Gemma 3 4B (``Gemma3ForConditionalGeneration``: a SigLIP tower, a projector, the text stack stored
  as ``language_model.model.*``);
- Gemma 4 (``Gemma4ForConditionalGeneration``, ``model.language_model.*``);
- Mistral Small 3.x (``Mistral3ForConditionalGeneration``, a Pixtral tower);
- Qwen3-VL (``Qwen3VLForConditionalGeneration``: interleaved M-RoPE, DeepStack).

Each gives HF's greedy tokens on text through the exactness harness's stress settings (chunked prompts,
preemption, prefix-cache hits). The HF reference is the whole multimodal model's ``generate`` on text, as
a user of transformers would run it."""

from __future__ import annotations

import pytest
import torch
from exactness import check_engine_exercised, make_prompts, run_and_compare
from models import stress_engine_args, tiny_config

from cb_serve import LLM

TOWER = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2)
VISION = {  # the smallest towers each config class takes
    "gemma3": dict(TOWER, model_type="siglip_vision_model", image_size=28, patch_size=14),
    "gemma4": dict(TOWER, model_type="gemma4_vision", num_key_value_heads=2, head_dim=16, position_embedding_size=64),
    "mistral3": dict(TOWER, model_type="pixtral", head_dim=16, image_size=28, patch_size=14),
    "qwen3_vl": dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64),
}
TEXT = {"gemma3": "gemma3_text", "gemma4": "gemma4_text", "mistral3": "mistral", "qwen3_vl": "qwen3"}
# Qwen3-VL's M-RoPE, interleaved as its published configs have it (a text token's three positions equal)
MROPE = {"rope_type": "default", "rope_theta": 5000000.0, "mrope_section": [4, 2, 2], "mrope_interleaved": True}


def multimodal_checkpoint(directory, kind: str, tokenizer):
    import transformers

    torch.manual_seed(0)
    text = tiny_config(TEXT[kind], len(tokenizer)).to_dict()
    if kind == "gemma3":
        config = transformers.Gemma3Config(text_config=text, vision_config=VISION[kind], mm_tokens_per_image=4)
        model = transformers.Gemma3ForConditionalGeneration(config)
    elif kind == "qwen3_vl":
        windows = ("use_sliding_window", "sliding_window", "max_window_layers", "layer_types")  # none in Qwen3-VL
        text = {k: v for k, v in text.items() if k not in windows} | {
            "model_type": "qwen3_vl_text",
            "rope_parameters": MROPE,
        }
        config = transformers.Qwen3VLConfig(text_config=text, vision_config=VISION[kind])
        model = transformers.Qwen3VLForConditionalGeneration(config)
    elif kind == "gemma4":
        config = transformers.Gemma4Config(text_config=text, vision_config=VISION[kind], audio_config=None)
        model = transformers.Gemma4ForConditionalGeneration(config)
    else:
        config = transformers.Mistral3Config(text_config=text, vision_config=VISION[kind], spatial_merge_size=1)
        model = transformers.Mistral3ForConditionalGeneration(config)
    with torch.no_grad():  # non-trivial norms, as the text models' tests have
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.1 * torch.randn_like(p))
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory, model.eval()


@pytest.mark.parametrize("kind", ["gemma3", "gemma4", "mistral3", "qwen3_vl"])
def test_a_multimodal_checkpoint_serves_its_text_model_exactly(kind, tmp_path, tokenizer):
    model_dir, hf_model = multimodal_checkpoint(tmp_path, kind, tokenizer)
    llm = LLM(str(model_dir), **stress_engine_args(TEXT[kind]))
    try:
        assert llm.engine.hf_config.model_type == (TEXT[kind] if kind != "qwen3_vl" else "qwen3_vl_text")
        prompts, max_tokens = make_prompts(list(range(100, 40000)), seed=7)
        deltas = run_and_compare(llm, hf_model, prompts, max_tokens, kind, stop_at_eos=False)
        check_engine_exercised(llm, prompts, deltas)
    finally:
        llm.engine.shutdown()
