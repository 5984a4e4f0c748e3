"""Vision benchmark (issue 54): images/s and TTFT of requests with images, cb-serve with and without encoder-cache
hits, against HF transformers' ``generate`` on the same requests, one run.

1. **Model.** A random-weight Gemma 3 (``Gemma3ForConditionalGeneration``) scaled to 2 cores: a SigLIP-base-sized
   tower (hidden 768, 12 layers, 224 x 224 pixels in 14 x 14 patches: 256 patches pooled to
   ``--tokens-per-image`` soft tokens) under a Gemma 3 270M-shaped text model (hidden 640, 18 layers), the
   built-in tokenizer with Gemma's image markers added, the real ``Gemma3Processor`` over the PIL-backed image
   processor; float32.
2. **Workload.** ``--requests`` prompts ``Describe <start_of_image> in a few words.``, each with one image, all
   submitted at once, ``--max-tokens`` greedy tokens each (EOS ignored):

   - **cache**: the images come from a pool of ``--distinct`` images, so each is used ``requests / distinct``
     times: the encoder runs once per distinct image, every other use is an encoder-cache hit (and the
     prompts' blocks through the image are prefix-cache hits);
   - **no cache**: every request its own image (the pool's, one pixel changed per request): the same shapes and
     the same compute per image, and nothing the caches can serve.
3. **HF** ``generate`` on the same requests one at a time (its processor, then ``generate``), all arrived at
   the start as for cb-serve: a request's TTFT is the generations before it plus its own first token (timed
   apart, ``max_new_tokens=1``). (HF has no continuous batching of images: its ``generate_batch`` takes no
   pixel values.)

images/s = requests (one image each) / wall seconds of generation; TTFT from each request's arrival in the
engine to its first token (cb-serve's ``RequestOutput.metrics``).

Run from the repository root:
    .venv/bin/python bench/vision_bench.py --json bench/results/vision.json      # ~3 min on 2 cores
    .venv/bin/python bench/vision_bench.py --requests 8 --distinct 2 --skip-hf  # smoke test
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from cb_serve import LLM, SamplingParams
from cb_serve.benchmarks.llama_cpp import CACHE_ROOT
from cb_serve.benchmarks.report import log, write_json
from cb_serve.cpu_ops import cpu_model_and_flags
from cb_serve.model_executor import loader

CACHE_DIR = CACHE_ROOT.parent / "vision_bench"
SPECIAL = {"boi_token": "<start_of_image>", "image_token": "<image_soft_token>", "eoi_token": "<end_of_image>"}
PROMPT = "Describe <start_of_image> in a few words."


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--distinct", type=int, default=8, help="distinct images of the cache run")
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--tokens-per-image", type=int, default=64)
    parser.add_argument("--skip-hf", action="store_true")
    parser.add_argument("--json", metavar="OUT")
    return parser.parse_args(argv)


def build_model(args: argparse.Namespace) -> tuple[Path, Any, Any]:
    """(checkpoint directory, HF processor, HF model), made once per shape under ``CACHE_DIR``."""
    import transformers

    directory = CACHE_DIR / f"gemma3-siglip-base-{args.tokens_per_image}"
    tok = loader.load_tokenizer(loader.default_model_source())
    tok = transformers.AutoTokenizer.from_pretrained(tok.name_or_path, extra_special_tokens=SPECIAL)
    tok.add_special_tokens({"additional_special_tokens": list(SPECIAL.values())})
    boi, soft, eoi = tok.convert_tokens_to_ids(list(SPECIAL.values()))
    image_processor = transformers.Gemma3ImageProcessorPil(size={"height": 224, "width": 224})
    processor = transformers.Gemma3Processor(
        image_processor=image_processor, tokenizer=tok, image_seq_length=args.tokens_per_image
    )
    vision = dict(model_type="siglip_vision_model", hidden_size=768, intermediate_size=3072, num_hidden_layers=12,
                  num_attention_heads=12, image_size=224, patch_size=14)  # fmt: skip
    text = dict(model_type="gemma3_text", vocab_size=len(tok), hidden_size=640, intermediate_size=2048,
                num_hidden_layers=18, num_attention_heads=4, num_key_value_heads=1, head_dim=256,
                sliding_window=512, max_position_embeddings=2048)  # fmt: skip
    config = transformers.Gemma3Config(text_config=text, vision_config=vision,
                                       mm_tokens_per_image=args.tokens_per_image, boi_token_index=boi,
                                       image_token_index=soft, eoi_token_index=eoi)  # fmt: skip
    if (directory / "config.json").exists():
        model = transformers.Gemma3ForConditionalGeneration.from_pretrained(directory, dtype=torch.float32)
        return directory, processor, model.eval()
    torch.manual_seed(0)
    model = transformers.Gemma3ForConditionalGeneration(config).eval()
    processor.save_pretrained(directory)
    model.save_pretrained(directory)
    return directory, processor, model


def images(distinct: int, requests: int, unique: bool) -> list:
    """The requests' images: a pool of ``distinct`` reused in turn, or each request its own (one pixel changed)."""
    from PIL import Image

    pool = [np.random.RandomState(i).randint(0, 255, (224, 224, 3), dtype=np.uint8) for i in range(distinct)]
    out = []
    for r in range(requests):
        pixels = pool[r % distinct].copy()
        if unique:
            pixels[0, 0, 0] = (int(pixels[0, 0, 0]) + 1 + r // distinct) % 256
        out.append(Image.fromarray(pixels))
    return out


def run_cb_serve(directory: Path, pictures: list, max_tokens: int) -> dict[str, Any]:
    from PIL import Image

    llm = LLM(str(directory), max_num_seqs=len(pictures), max_model_len=512)
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    try:  # a warm-up request, its image none of the workload's
        warm = Image.fromarray(np.random.RandomState(12345).randint(0, 255, (224, 224, 3), dtype=np.uint8))
        llm.generate([{"prompt": PROMPT, "multi_modal_data": {"image": warm}}], params, use_tqdm=False)
        before = llm.engine.get_stats()
        prompts = [{"prompt": PROMPT, "multi_modal_data": {"image": p}} for p in pictures]
        start = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        wall = time.perf_counter() - start
        after = llm.engine.get_stats()
    finally:
        llm.engine.shutdown()
    ttft = [o.metrics.first_token_time - o.metrics.arrival_time for o in outs]
    return {
        "wall_s": wall,
        "images_per_s": len(pictures) / wall,
        "ttft_mean_s": statistics.fmean(ttft),
        "ttft_median_s": statistics.median(ttft),
        "images_encoded": after.num_images_encoded - before.num_images_encoded,
        "encoder_cache_hits": after.encoder_cache_hits - before.encoder_cache_hits,
        "prefix_cache_hit_tokens": after.prefix_cache_hits - before.prefix_cache_hits,
        "tokens": [o.outputs[0].token_ids for o in outs],
    }


def run_hf(processor, model, pictures: list, max_tokens: int) -> dict[str, Any]:
    """One request after another (all arrived at the start): a request's TTFT is the whole generations of
    those before it plus its own first token (timed apart, as ``max_new_tokens=1``)."""
    tokens, ttft, served = [], [], 0.0
    with torch.no_grad():
        for picture in pictures:
            t0 = time.perf_counter()
            inputs = processor(text=PROMPT, images=[picture], return_tensors="pt")
            model.generate(**inputs, max_new_tokens=1, do_sample=False)
            ttft.append(served + time.perf_counter() - t0)
            t0 = time.perf_counter()
            inputs = processor(text=PROMPT, images=[picture], return_tensors="pt")
            out = model.generate(**inputs, max_new_tokens=max_tokens, min_new_tokens=max_tokens, do_sample=False)
            served += time.perf_counter() - t0
            tokens.append(out[0, inputs["input_ids"].shape[1] :].tolist())
    return {"wall_s": served, "images_per_s": len(pictures) / served, "ttft_mean_s": statistics.fmean(ttft),
            "ttft_median_s": statistics.median(ttft), "tokens": tokens}  # fmt: skip


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    torch.set_num_threads(torch.get_num_threads())
    cpu, _ = cpu_model_and_flags()
    log(f"vision benchmark: {args.requests} requests, {args.distinct} distinct images (cache run); CPU: {cpu}, "
        f"{torch.get_num_threads()} threads")  # fmt: skip
    directory, processor, model = build_model(args)
    result: dict[str, Any] = {"args": vars(args), "cpu": cpu, "threads": torch.get_num_threads(), "systems": {}}
    runs = {"cb-serve cache": False, "cb-serve no cache": True}
    for name, unique in runs.items():
        result["systems"][name] = run_cb_serve(directory, images(args.distinct, args.requests, unique),
                                               args.max_tokens)  # fmt: skip
    if not args.skip_hf:
        pictures = images(args.distinct, args.requests, True)
        result["systems"]["hf generate"] = run_hf(processor, model, pictures, args.max_tokens)
        ours = result["systems"]["cb-serve no cache"]["tokens"]
        theirs = result["systems"]["hf generate"]["tokens"]
        result["greedy_equal_to_hf"] = sum(a == b for a, b in zip(ours, theirs))
    log(f"{'system':<20}{'wall s':>8}{'images/s':>10}{'TTFT mean':>11}{'TTFT median':>13}{'encoded':>9}{'hits':>6}")
    for name, r in result["systems"].items():
        counts = f"{r.get('images_encoded', ''):>9}{r.get('encoder_cache_hits', ''):>6}"
        log(f"{name:<20}{r['wall_s']:>8.2f}{r['images_per_s']:>10.2f}{r['ttft_mean_s']:>11.3f}"
            f"{r['ttft_median_s']:>13.3f}{counts}")  # fmt: skip
    if "greedy_equal_to_hf" in result:
        log(f"greedy tokens equal to HF's (no-cache run): {result['greedy_equal_to_hf']}/{args.requests}")
    for r in result["systems"].values():
        r.pop("tokens")
    write_json(args.json, result)
    return result


if __name__ == "__main__":
    main()
