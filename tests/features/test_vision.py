"""Images in the ragged batch (issue 54): a random-weight tiny Gemma 3 with a SigLIP tower, saved with its
real processor (``Gemma3Processor`` over the PIL-backed ``Gemma3ImageProcessorPil``), against HF's
``generate`` on the processor's own inputs, float32.

Under stress settings (4-token blocks, 7-token steps so chunks would end inside the 4-token images, a KV pool
that preempts) on the torch and C++ attention backends, with one to three images per prompt and an image
repeated across requests:

- greedy tokens equal HF's, and the first token's log-probabilities within float32 noise (1e-4; without
  the image tokens' bidirectional attention they are off by 1e-2 to 2e-1, which greedy tokens of a random
  model hide);
- each distinct image is encoded once (the engine's counter), every other use a cache hit;
- a second turn with the same image hits the first turn's cached prefix, through the image; the same text
  with another image does not hit past the image's first block;
- hostile inputs are ``InvalidRequestError`` (a 400 in the HTTP API), and the engine serves at once after.
"""

from __future__ import annotations

import base64
import struct
import zlib

import pytest
import torch

from cb_serve import LLM, SamplingParams
from cb_serve.errors import InvalidRequestError
from cb_serve.multimodal.features import MultiModalFeature, fit_chunk
from cb_serve.multimodal.processor import placeholder_runs
from cb_serve.prefix_hash import block_extra_keys, num_hit_blocks, prefix_block_hashes

pytest.importorskip("PIL")
from vision_models import IMG, data_url, encoded, hf_chat_greedy, image, make_gemma3_vision  # noqa: E402

ENGINE = dict(block_size=4, max_num_batched_tokens=7, num_gpu_blocks=40, max_model_len=64, max_num_seqs=4)
MAX_TOKENS = 10


@pytest.fixture(scope="module")
def gemma3_vision(tmp_path_factory, tokenizer):
    """(checkpoint directory, HF processor, HF model): ``vision_models.make_gemma3_vision``."""
    return make_gemma3_vision(tmp_path_factory.mktemp("gemma3-vision"), tokenizer)


def hf_reference(processor, model, prompt: str, images: list) -> tuple[list[int], torch.Tensor]:
    """HF's greedy tokens and its first token's log-probabilities."""
    inputs = processor(text=prompt, images=images, return_tensors="pt")
    with torch.no_grad():
        first = torch.log_softmax(model(**inputs).logits[0, -1].float(), -1)
        out = model.generate(**inputs, max_new_tokens=MAX_TOKENS, do_sample=False)
    return out[0, inputs["input_ids"].shape[1] :].tolist(), first


def requests() -> list[tuple[str, list]]:
    a, b, c = image(1), image(2, (90, 30)), image(3, (56, 56))
    return [
        (f"Describe {IMG} please", [a]),
        (f"Compare {IMG} with {IMG} now", [b, c]),
        (f"Three: {IMG}, {IMG} and {IMG}.", [c, a, b]),
        (f"Again {IMG}", [a]),
        ("Text alone, no image here at all", []),
    ]


def prompt_of(text: str, images: list) -> dict:
    return {"prompt": text, "multi_modal_data": {"image": images}} if images else {"prompt": text}


@pytest.mark.parametrize("backend", ["torch", "cpu"])
def test_images_give_hf_s_tokens_under_chunking_and_preemption(gemma3_vision, backend):
    directory, processor, model = gemma3_vision
    llm = LLM(directory, attention_backend=backend, **ENGINE)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True, logprobs=3)
    steps = []
    llm.engine.add_step_listener(lambda stats, outputs: steps.append(stats))
    try:
        outs = llm.generate([prompt_of(*r) for r in requests()], params, use_tqdm=False)
        for (text, images), out in zip(requests(), outs):
            ref_tokens, ref_first = hf_reference(processor, model, text, images) if images else (None, None)
            if images:
                assert out.outputs[0].token_ids == ref_tokens, text
                for token, lp in out.outputs[0].logprobs[0].items():
                    assert abs(lp.logprob - ref_first[token].item()) < 1e-4, (text, token)
        stats = llm.engine.get_stats()
        assert stats.num_images_encoded == 3, stats  # a, b, c: each once
        assert stats.encoder_cache_hits >= 4, stats  # the other uses (and re-prefills after preemption)
        assert stats.num_preemptions > 0 and stats.num_partial_prefills > 0, stats
        # Issue 54's step metrics: the encoder's steps and seconds, the images of each request at arrival;
        # the inspector's image segments: every image token of every prompt chunk, re-prefills included.
        assert sum(s.num_images_encoded for s in steps) == 3
        assert all(s.encoder_s > 0 for s in steps if s.num_images_encoded)
        assert sorted(n for s in steps for n in s.request_images) == [0, 1, 1, 2, 3]
        recorded = llm.engine.inspect("steps", limit=1000)
        segments = [q for step in recorded for q in step["seqs"] if q["image_tokens"]]
        assert all(q["kind"] == "prefill" and 0 < q["image_tokens"] <= q["tokens"] for q in segments)
        assert sum(step["images_encoded"] for step in recorded) == 3
        image_tokens = sum(len(images) for _, images in requests()) * 4  # the tiny tower: 4 tokens an image
        assert sum(q["image_tokens"] for q in segments) >= image_tokens, segments  # more: re-prefills
    finally:
        llm.engine.shutdown()


def test_a_second_turn_hits_the_cached_prefix_through_its_image(gemma3_vision):
    directory, processor, model = gemma3_vision
    llm = LLM(directory, attention_backend="cpu", **{**ENGINE, "num_gpu_blocks": 200, "max_num_batched_tokens": 64})
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
    first = f"Turn one: {IMG} describe it in a few words"
    try:
        llm.generate([prompt_of(first, [image(1)])], params, use_tqdm=False)
        hits = llm.engine.get_stats().prefix_cache_hits
        second = first + " and then once more with feeling"
        (out,) = llm.generate([prompt_of(second, [image(1)])], params, use_tqdm=False)
        ids = processor(text=first, images=[image(1)], return_tensors="pt")["input_ids"][0].tolist()
        image_end = placeholder_runs(ids, model.config.image_token_index)[0]
        assert llm.engine.get_stats().prefix_cache_hits - hits > sum(image_end), "no hit through the image"
        assert out.outputs[0].token_ids == hf_reference(processor, model, second, [image(1)])[0]
        hits = llm.engine.get_stats().prefix_cache_hits
        llm.generate([prompt_of(second, [image(9)])], params, use_tqdm=False)  # the same text, another image
        assert llm.engine.get_stats().prefix_cache_hits - hits <= image_end[0], "a hit past another image's start"
    finally:
        llm.engine.shutdown()


def png(width: int, height: int, body: bytes = b"") -> bytes:
    """A PNG of that header (and ``body`` as its image data): a pixel bomb needs no pixels."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", body) + chunk(b"IEND", b"")


HOSTILE = {
    "too many images": (f"{IMG} {IMG} {IMG} {IMG}", [image(1)] * 4, "At most 3 images"),
    "oversize bytes": (IMG, [b"\x89PNG" + b"\0" * (64 << 10)], "limited to 65536 bytes"),
    "pixel bomb": (IMG, [png(100_000, 100_000)], "pixels"),
    "truncated png": (IMG, [encoded(image(1))[:200]], "could not be decoded"),
    "truncated jpeg": (IMG, [encoded(image(1), "JPEG")[:300]], "could not be decoded"),
    "not an image": (IMG, [b"GIF89a but not really an image at all"], "could not be decoded"),
    "wrong mime": (IMG, ["data:text/plain;base64," + base64.b64encode(b"hello").decode()], "not an image type"),
    "not base64": (IMG, ["data:image/png;base64,@@@not-base64@@@"], "not valid base64"),
    "http url": (IMG, ["http://169.254.169.254/latest/meta-data"], "allowed_media_domains is not set"),
    "ftp url": (IMG, ["ftp://example.com/a.png"], "got the scheme 'ftp'"),
    "placeholders and images apart": (f"{IMG} and {IMG}", [image(1)], "placeholders"),
    "not an image object": (IMG, [12345], "An image is"),
    "video": (IMG, None, "images only"),
}


@pytest.fixture(scope="module")
def strict_llm(gemma3_vision):
    llm = LLM(gemma3_vision[0], limit_mm_per_prompt={"image": 3}, max_image_bytes=64 << 10, **ENGINE)
    yield llm
    llm.engine.shutdown()


@pytest.mark.parametrize("case", list(HOSTILE))
def test_hostile_images_are_refused_and_the_engine_serves_after(strict_llm, case):
    text, images, message = HOSTILE[case]
    prompt = {"prompt": text, "multi_modal_data": {"video": [image(1)]} if images is None else {"image": images}}
    with pytest.raises(InvalidRequestError, match=message):
        strict_llm.generate([prompt], SamplingParams(max_tokens=2), use_tqdm=False)
    (out,) = strict_llm.generate([prompt_of(IMG, [image(1)])], SamplingParams(max_tokens=2), use_tqdm=False)
    assert len(out.outputs[0].token_ids) == 2


def test_a_text_model_refuses_images_and_a_token_prompt_takes_none(tiny_llm, strict_llm):
    with pytest.raises(InvalidRequestError, match="does not read images"):
        tiny_llm.generate([prompt_of("hi", [image(1)])], SamplingParams(max_tokens=2), use_tqdm=False)
    with pytest.raises(InvalidRequestError, match="text prompt"):
        prompt = {"prompt_token_ids": [1, 2], "multi_modal_data": {"image": [image(1)]}}
        strict_llm.generate([prompt], SamplingParams(max_tokens=2), use_tqdm=False)


def feature(offset: int, length: int, tag: str = "a") -> MultiModalFeature:
    return MultiModalFeature(tag * 64, offset, length, torch.zeros(1))


def test_chunks_never_end_inside_an_image_and_blocks_name_their_images():
    images = [feature(3, 4), feature(10, 2, "b")]
    assert fit_chunk(images, 0, 5) == 3  # would end inside the first: stops before it
    assert fit_chunk(images, 0, 7) == 7 and fit_chunk(images, 3, 3) == 0  # whole; or started, not finishable
    assert fit_chunk(images, 7, 4) == 3 and fit_chunk(images, 0, 100) == 100
    keys = block_extra_keys(images, 4, 3)
    assert keys == [bytes.fromhex("a" * 64)] * 2 + [bytes.fromhex("b" * 64)]
    assert block_extra_keys([feature(2, 8)], 4, 2) == [bytes.fromhex("a" * 64)] * 2  # (the third block: not full)
    assert placeholder_runs([5, 9, 9, 5, 9], 9) == [(1, 2), (4, 1)]


def test_a_processor_that_makes_other_inputs_than_the_model_reads_is_refused_at_start(gemma3_vision, tmp_path):
    import shutil

    import transformers

    directory, processor, _ = gemma3_vision
    other = tmp_path / "other"
    shutil.copytree(directory, other)
    transformers.Gemma3Processor(
        image_processor=transformers.Gemma3ImageProcessorPil(size={"height": 28, "width": 28}),
        tokenizer=processor.tokenizer,
        image_seq_length=4,
    ).save_pretrained(other)
    with pytest.raises(ValueError, match=r"pixels of shape \(1, 3, 28, 28\).*reads 4 and \(1, 3, 56, 56\)"):
        LLM(str(other), **ENGINE)


def chat_pair(parts: list) -> tuple[list[dict], list[dict]]:
    """(our messages, HF's): parts are text strings or (PIL image, how we send it)."""
    ours, hf = [], []
    for part in parts:
        if isinstance(part, str):
            ours.append({"type": "text", "text": part})
            hf.append({"type": "text", "text": part})
            continue
        img, form = part
        ours.append({"type": "image_url", "image_url": {"url": data_url(img)}} if form == "url"
                    else {"type": "image_pil", "image_pil": img})  # fmt: skip
        hf.append({"type": "image", "image": img})
    return [{"role": "user", "content": ours}], [{"role": "user", "content": hf}]


def test_chat_with_images_gives_hf_s_prompt_and_tokens(gemma3_vision, strict_llm):
    """``LLM.chat`` with an ``image_url`` data URL and a PIL image: the prompt is HF's processor's own
    ``apply_chat_template`` (one BOS, the template's: the processor adds none to a rendered chat), and the
    greedy tokens HF's."""
    _, processor, model = gemma3_vision
    ours, hf = chat_pair(["Look at ", (image(1), "url"), " and ", (image(2, (90, 30)), "pil"), " now"])
    prompt, ref = hf_chat_greedy(processor, model, hf, MAX_TOKENS)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
    (out,) = strict_llm.chat(ours, params, use_tqdm=False)
    assert out.prompt_token_ids == prompt
    bos = processor.tokenizer.bos_token_id
    assert processor.tokenizer("x")["input_ids"][0] == bos and prompt.count(bos) == 1  # (the tokenizer adds one)
    assert out.outputs[0].token_ids == ref


def test_processed_features_are_checked_against_their_prompt(gemma3_vision, strict_llm):
    """``multi_modal_features`` (what the HTTP router sends an engine replica): taken as they are when
    they match the ids; a moved run, a wrong name or wrong pixels are refused."""
    import dataclasses

    ours, _ = chat_pair(["Look at ", (image(1), "pil")])
    good = strict_llm.apply_chat_template(ours)
    ids, (f,) = good["prompt_token_ids"], good["multi_modal_features"]
    params = SamplingParams(max_tokens=2)
    assert len(strict_llm.generate([good], params, use_tqdm=False)[0].outputs[0].token_ids) == 2
    bad = {
        "do not match": [dataclasses.replace(f, offset=f.offset + 1)],
        "not its pixels' hash": [dataclasses.replace(f, identifier="0" * 64)],
        "pixels are": [dataclasses.replace(f, pixel_values=f.pixel_values[..., :28, :28])],
        "MultiModalFeature objects": ["an image"],
    }
    for message, features in bad.items():
        with pytest.raises(InvalidRequestError, match=message):
            strict_llm.generate([{"prompt_token_ids": ids, "multi_modal_features": features}], params, use_tqdm=False)


def test_a_repeated_image_s_pixels_are_kept_once(gemma3_vision):
    """Prompts that repeat an image (processed here, or sent processed as the router does: a copy) share one
    pixel tensor while any of them lives (``cb_serve.image_prompts_for``, the router's and engine's path)."""
    import copy

    from cb_serve import EngineConfig, image_prompts_for

    prompts = image_prompts_for(EngineConfig(model=gemma3_vision[0], **ENGINE))
    text = f"Look at {prompts.placeholder} now"
    (ids, (a,)), (_, (b,)) = (prompts.process(text, [image(7)]) for _ in range(2))
    assert a.pixel_values is b.pixel_values and a.identifier == b.identifier
    sent = copy.deepcopy(a)  # what an engine replica deserializes
    assert sent.pixel_values is not a.pixel_values
    (checked,) = prompts.check(ids, [sent])
    assert checked.pixel_values is a.pixel_values and checked.offset == a.offset


def test_image_urls_are_fetched_only_from_allowed_public_hosts(monkeypatch):
    """http(s) image URLs: off by default; on, only from the allowed domains, never from a host that
    resolves to an internal address; a fetch follows no redirect and reads at most ``max_bytes``."""
    import http.server
    import threading

    from cb_serve.multimodal import media_fetch
    from cb_serve.multimodal.image_inputs import ImageLimits, load_image

    refused = {
        "http://example.com/a.png": ((), "allowed_media_domains is not set"),
        "https://evil.org/a.png": (("example.com",), "not in allowed_media_domains"),
        "http://localhost:9/a.png": (("localhost",), "internal address"),
        "http://127.0.0.1/a.png": (("127.0.0.1",), "internal address"),
        "http://169.254.169.254/latest": (("169.254.169.254",), "internal address"),
        "http://[::1]/a.png": (("::1",), "malformed|internal address|bare domain"),
        "http://user:pw@example.com/a.png": (("example.com",), "credentials"),
    }
    for url, (domains, message) in refused.items():
        with pytest.raises((InvalidRequestError, ValueError), match=message):
            load_image(url, ImageLimits(allowed_domains=domains))
    body = encoded(image(4))

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802
            status = {"/a.png": 200, "/moved": 302}.get(self.path, 404)
            self.send_response(status)
            if status == 302:
                self.send_header("Location", "http://169.254.169.254/")
            self.send_header("Content-Length", str(len(body) if status == 200 else 0))
            self.end_headers()
            if status == 200:
                self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    monkeypatch.setattr(media_fetch, "_public", lambda address: True)  # loopback stands in for a public host
    base = f"http://localhost:{server.server_address[1]}"
    limits = ImageLimits(allowed_domains=("localhost",))
    try:
        assert load_image(f"{base}/a.png", limits).size == image(4).size
        for path, message in {"/moved": "HTTP 302", "/gone": "HTTP 404"}.items():
            with pytest.raises(InvalidRequestError, match=message):
                load_image(base + path, limits)
        with pytest.raises(InvalidRequestError, match="limited to 100 bytes"):
            load_image(f"{base}/a.png", ImageLimits(max_bytes=100, allowed_domains=("localhost",)))
    finally:
        server.shutdown()


def test_the_router_s_block_hashes_name_the_engine_s_cached_blocks(gemma3_vision, strict_llm):
    """The HTTP router hashes a prompt's blocks with their images (``prefix_block_hashes`` with
    the prompt's images), as the engine's block manager keys them: all of a finished chat's full blocks are
    found in the engine's digest; hashed as text alone, none from the image's first block on."""
    ours, _ = chat_pair(["Describe ", (image(6), "pil"), " in a few words, please, for the record"])
    prompt = strict_llm.apply_chat_template(ours)
    ids, features = prompt["prompt_token_ids"], prompt["multi_modal_features"]
    strict_llm.generate([prompt], SamplingParams(max_tokens=1), use_tqdm=False)
    bs, n = ENGINE["block_size"], num_hit_blocks(len(ids), ENGINE["block_size"])
    digest = strict_llm.engine.cache_digest()
    assert digest.hit_blocks(b"".join(prefix_block_hashes(ids, bs, None, features))) == n
    assert digest.hit_blocks(b"".join(prefix_block_hashes(ids, bs))) == features[0].offset // bs


def test_qwen3_vl_vision_tower_equals_hf_s():
    """Qwen3-VL's tower (``models/qwen3_vl_vision.py``) on two images of different grids in one call: the
    merged tokens and each DeepStack level equal HF's ``Qwen3VLVisionModel`` in float32 (each image attends
    within itself; positions resampled to each grid)."""
    import transformers

    from cb_serve.model_executor.models.qwen3_vl_vision import Qwen3VLVisionTower

    config = transformers.Qwen3VLVisionConfig(depth=3, hidden_size=32, intermediate_size=64, num_heads=2, patch_size=4,
                                              out_hidden_size=48, num_position_embeddings=16,
                                              deepstack_visual_indexes=[0, 2])  # fmt: skip
    torch.manual_seed(0)
    hf = transformers.Qwen3VLForConditionalGeneration._from_config(
        transformers.Qwen3VLConfig(
            vision_config=config.to_dict(),
            text_config={
                "hidden_size": 48,
                "num_hidden_layers": 1,
                "num_attention_heads": 2,
                "num_key_value_heads": 1,
                "head_dim": 24,
                "vocab_size": 64,
                "intermediate_size": 64,
            },
        )  # fmt: skip
    ).model.visual.eval()
    ours = Qwen3VLVisionTower(hf.config)
    ours.load_hf_weights(hf.state_dict(), "")
    grids = [(1, 4, 6), (1, 2, 2), (1, 6, 2)]
    pixels = torch.randn(sum(t * h * w for t, h, w in grids), 3 * 2 * 4 * 4)
    with torch.no_grad():
        ref = hf(pixels, grid_thw=torch.tensor(grids))
        tokens, deepstack = ours(pixels, grids)
    torch.testing.assert_close(tokens, ref.pooler_output, atol=1e-5, rtol=1e-5)
    assert len(deepstack) == len(ref.deepstack_features) == 2
    for a, b in zip(deepstack, ref.deepstack_features):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


# Qwen3.5's recurrent states: room to keep each request's two snapshots (its prompt's and its last block's)
QWEN_ENGINE = dict(
    block_size=4, max_num_batched_tokens=24, num_gpu_blocks=48, max_model_len=96, max_num_seqs=4, num_state_snapshots=8
)


@pytest.fixture(scope="module")
def qwen_vision(tmp_path_factory, tokenizer):
    """``family -> make_qwen3_vl(...)``, each made once."""
    from vision_models import make_qwen3_vl

    made: dict[str, tuple] = {}

    def get(family: str) -> tuple:
        if family not in made:
            made[family] = make_qwen3_vl(tmp_path_factory.mktemp(family), tokenizer, family)
        return made[family]

    return get


# The hybrid model on one backend, the C++ one (CI time): its text layers are checked on both elsewhere.
@pytest.mark.parametrize(("family", "backend"), [("qwen3_vl", "torch"), ("qwen3_vl", "cpu"), ("qwen3_5", "cpu")])
def test_qwen_vision_images_give_hf_s_tokens_under_chunking_and_preemption(qwen_vision, family, backend):
    """Qwen3-VL, and Qwen3.5 on its hybrid text model, with one to three images of different grids a prompt:
    M-RoPE's three positions on the image tokens and the text after them shifted, DeepStack into Qwen3-VL's
    first two layers; chunked (24-token steps), preempted (a small KV pool), an image repeated across requests
    (encoded once); a second turn hits the first's cached prefix through the image (Qwen3.5: resuming its
    recurrent states kept at the first turn's block boundaries, ``engine/state_snapshots.py``)."""
    from vision_models import QWEN_IMG, qwen3_vl_greedy, qwen_prompt_ids

    directory, images_processor, tok, model = qwen_vision(family)
    a, b, c = image(1), image(2, (90, 30)), image(3, (20, 20))
    cases = [(f"Describe {QWEN_IMG} in a few words please", [a]), (f"Compare {QWEN_IMG} with {QWEN_IMG} now", [b, c]),
             (f"{QWEN_IMG}{QWEN_IMG}, {QWEN_IMG}.", [c, a, b]), (f"Again {QWEN_IMG} and more", [a])]  # fmt: skip
    llm = LLM(directory, attention_backend=backend, **QWEN_ENGINE)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
    try:
        outs = llm.generate([prompt_of(t, i) for t, i in cases], params, use_tqdm=False)
        for (text, imgs), out in zip(cases, outs):
            assert out.outputs[0].token_ids == qwen3_vl_greedy(images_processor, tok, model, text, imgs, MAX_TOKENS), (
                text
            )
        stats = llm.engine.get_stats()
        assert stats.num_images_encoded == 3, stats
        assert stats.num_partial_prefills > 0, stats
        # the first's next turn: it resumes from the state kept at the first prompt's last full block (before its
        # last token), past the image (a chunk never ends inside one)
        text, imgs = cases[0][0] + " and once more with feeling", cases[0][1]
        (again,) = llm.generate([prompt_of(text, imgs)], params, use_tqdm=False)
        ids = qwen_prompt_ids(images_processor, tok, text, imgs)[0][0].tolist()
        image_end = max(i for i, t in enumerate(ids) if t == tok.convert_tokens_to_ids("<|image_pad|>")) + 1
        assert llm.engine.get_stats().prefix_cache_hits - stats.prefix_cache_hits >= image_end, "no hit past the image"
        assert again.outputs[0].token_ids == qwen3_vl_greedy(images_processor, tok, model, text, imgs, MAX_TOKENS)
    finally:
        llm.engine.shutdown()
