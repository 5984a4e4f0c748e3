"""A random-weight tiny Gemma 3 with a SigLIP tower, saved with its real processor (``Gemma3Processor`` over
the PIL-backed ``Gemma3ImageProcessorPil``) and a Gemma-style chat template that renders image parts: the
model of the vision tests, offline (``tests/features/test_vision.py``) and over HTTP
(``tests/serve/test_vision_serve.py``). Its tokenizer adds a BOS, as Gemma's does, so a chat whose template
writes the BOS must not get a second one."""

from __future__ import annotations

import base64
import io
from pathlib import Path

import numpy as np
import torch

SPECIAL = {"boi_token": "<start_of_image>", "image_token": "<image_soft_token>", "eoi_token": "<end_of_image>"}
IMG = "<start_of_image>"
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<start_of_turn>{{ m['role'] }}\n"
    "{% if m['content'] is string %}{{ m['content'] }}{% else %}{% for p in m['content'] %}"
    "{% if p['type'] == 'image' %}<start_of_image>{% elif p['type'] == 'text' %}{{ p['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<end_of_turn>\n{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)


def image(seed: int, size=(40, 70)):
    from PIL import Image

    return Image.fromarray(np.random.RandomState(seed).randint(0, 255, (*size, 3), dtype=np.uint8))


def encoded(img, fmt: str = "PNG") -> bytes:
    buf = io.BytesIO()
    img.save(buf, fmt)
    return buf.getvalue()


def data_url(img, fmt: str = "PNG") -> str:
    return f"data:image/{fmt.lower()};base64," + base64.b64encode(encoded(img, fmt)).decode()


def make_gemma3_vision(tmp: Path, tokenizer):
    """(checkpoint directory, HF processor, HF model): 4 tokens per 56 x 56 image (16 patches pooled 2 x 2)."""
    import transformers
    from models import tiny_config
    from tokenizers.processors import TemplateProcessing

    tokenizer.save_pretrained(tmp / "tok")
    tok = transformers.AutoTokenizer.from_pretrained(tmp / "tok", extra_special_tokens=SPECIAL)
    tok.add_special_tokens({"additional_special_tokens": list(SPECIAL.values())})
    bos = (tok.bos_token, tok.bos_token_id)
    tok.backend_tokenizer.post_processor = TemplateProcessing(single=f"{bos[0]} $A", special_tokens=[bos])
    tok.chat_template = CHAT_TEMPLATE
    boi, soft, eoi = tok.convert_tokens_to_ids(list(SPECIAL.values()))
    image_processor = transformers.Gemma3ImageProcessorPil(size={"height": 56, "width": 56})
    processor = transformers.Gemma3Processor(
        image_processor=image_processor, tokenizer=tok, image_seq_length=4, chat_template=CHAT_TEMPLATE
    )
    torch.manual_seed(0)
    vision = dict(model_type="siglip_vision_model", hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=2, image_size=56, patch_size=14)  # fmt: skip
    config = transformers.Gemma3Config(
        text_config=tiny_config("gemma3_text", len(tok)).to_dict(),
        vision_config=vision,
        mm_tokens_per_image=4,
        boi_token_index=boi,
        image_token_index=soft,
        eoi_token_index=eoi,
    )
    model = transformers.Gemma3ForConditionalGeneration(config).eval()
    with torch.no_grad():  # non-trivial norms and projection (HF initializes them to no-ops and zeros)
        for name, p in model.named_parameters():
            if "norm" in name or "mm_input_projection" in name:
                p.copy_(1 + 0.1 * torch.randn_like(p) if "norm" in name else 0.3 * torch.randn_like(p))
    directory = tmp / "model"
    processor.save_pretrained(directory)
    model.save_pretrained(directory)
    return str(directory), processor, model


def hf_chat_greedy(processor, model, messages: list[dict], max_new_tokens: int) -> tuple[list[int], list[int]]:
    """(the prompt's ids, HF's greedy tokens) of a conversation HF's processor renders (images as
    ``{"type": "image", "image": PIL}`` parts)."""
    inputs = processor.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True, return_dict=True, return_tensors="pt"
    )
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False)
    prompt = inputs["input_ids"][0].tolist()
    return prompt, out[0, len(prompt) :].tolist()


QWEN_SPECIAL = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
QWEN_IMG = "<|vision_start|><|image_pad|><|vision_end|>"
QWEN_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% if m['content'] is string %}{{ m['content'] }}{% else %}{% for p in m['content'] %}"
    "{% if p['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>{% elif p['type'] == 'text' %}"
    "{{ p['text'] }}{% endif %}{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# Qwen3-VL's M-RoPE as its configs have it, at a tiny head (8 frequencies: 4 by T, 2 by H, 2 by W)
MROPE = {"rope_type": "default", "rope_theta": 5000000.0, "mrope_section": [4, 2, 2], "mrope_interleaved": True}


def make_qwen3_vl(tmp: Path, tokenizer, family: str = "qwen3_vl"):
    """(checkpoint directory, image processor, tokenizer, HF model): a tiny random Qwen3-VL with two DeepStack
    levels (or ``family="qwen3_5"``: Qwen3.5, its hybrid text model, no DeepStack), its images 4-pixel patches
    merged 2 x 2 (``Qwen2VLImageProcessorPil``, up to 32 x 32 pixels: at most 16 tokens an image), saved with the
    image processor and tokenizer (``Qwen3VLProcessor`` itself needs a video processor, which needs
    torchvision)."""
    import transformers
    from models import tiny_config

    tokenizer.save_pretrained(tmp / "tok")
    tok = transformers.AutoTokenizer.from_pretrained(tmp / "tok")
    tok.add_special_tokens({"additional_special_tokens": QWEN_SPECIAL})
    tok.chat_template = QWEN_TEMPLATE
    start, end, pad, video = tok.convert_tokens_to_ids(QWEN_SPECIAL)
    images = transformers.Qwen2VLImageProcessorPil(
        patch_size=4, merge_size=2, temporal_patch_size=2, size={"shortest_edge": 16 * 16, "longest_edge": 32 * 32},
        image_mean=[0.5] * 3, image_std=[0.5] * 3,
    )  # fmt: skip
    vision = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, patch_size=4, out_hidden_size=64,
                  num_position_embeddings=16)  # fmt: skip
    tokens = dict(image_token_id=pad, video_token_id=video, vision_start_token_id=start, vision_end_token_id=end)
    if family == "qwen3_5":  # rotary over half of each 16-wide head: 4 frequencies, 2 by T, 1 by H, 1 by W
        text = tiny_config("qwen3_5_text", len(tok)).to_dict()
        text["rope_parameters"] = {**text["rope_parameters"], "mrope_section": [2, 1, 1], "mrope_interleaved": True}
        config = transformers.Qwen3_5Config(text_config=text, vision_config=vision, **tokens)
        make = transformers.Qwen3_5ForConditionalGeneration
    else:
        windows = ("use_sliding_window", "sliding_window", "max_window_layers", "layer_types")
        text = {k: v for k, v in tiny_config("qwen3", len(tok)).to_dict().items() if k not in windows}
        text |= {"model_type": "qwen3_vl_text", "rope_parameters": MROPE}
        vision["deepstack_visual_indexes"] = [0, 1]
        config = transformers.Qwen3VLConfig(text_config=text, vision_config=vision, **tokens)
        make = transformers.Qwen3VLForConditionalGeneration
    torch.manual_seed(0)
    model = make(config).eval()
    with torch.no_grad():  # non-trivial norms, and mergers whose outputs move the text model (not 0.02-scaled)
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.1 * torch.randn_like(p))
            elif "merger" in name and name.endswith("weight"):
                p.copy_(torch.randn_like(p) / p.shape[-1] ** 0.5)
    directory = tmp / "model"
    model.save_pretrained(directory)
    images.save_pretrained(directory)
    tok.save_pretrained(directory)
    return str(directory), images, tok, model


def qwen_prompt_ids(images_processor, tok, text: str, images: list) -> tuple[torch.Tensor, dict]:
    """The ids of a prompt with ``<|image_pad|>`` placeholders, expanded by ``Qwen3VLProcessor``'s rule
    (``t * h * w / merge^2`` pads per image), and the image processor's output."""
    out = images_processor(images=images, return_tensors="pt")
    pieces = text.split("<|image_pad|>")
    grids = out["image_grid_thw"]
    expanded = pieces[0] + "".join("<|image_pad|>" * (int(g.prod()) // 4) + p for g, p in zip(grids, pieces[1:]))
    return tok(expanded, return_tensors="pt")["input_ids"], out


def qwen3_vl_greedy(images_processor, tok, model, text: str, images: list, max_new_tokens: int) -> list[int]:
    """HF's greedy tokens for a prompt with ``<|image_pad|>`` placeholders (``qwen_prompt_ids``), with the
    model's M-RoPE inputs."""
    ids, out = qwen_prompt_ids(images_processor, tok, text, images)
    grids = out["image_grid_thw"]
    pad = tok.convert_tokens_to_ids("<|image_pad|>")
    with torch.no_grad():
        gen = model.generate(
            input_ids=ids, attention_mask=torch.ones_like(ids), pixel_values=out["pixel_values"], image_grid_thw=grids,
            mm_token_type_ids=(ids == pad).int(), max_new_tokens=max_new_tokens, do_sample=False,
        )  # fmt: skip
    return gen[0, ids.shape[1] :].tolist()
