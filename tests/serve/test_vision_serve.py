"""Images over HTTP (issue 54), tried as a new user would: a real Serve app of the tiny random Gemma 3 with a
SigLIP tower (``vision_models.py``; its real processor and a Gemma-style chat template), and the ``openai`` and
``anthropic`` clients:

- a chat with a base64 PNG, streamed and whole; the Responses API's ``input_image``; Anthropic's base64
  ``image`` block: each answers what ``LLM.chat`` answers offline for the same conversation (whose tokens
  ``tests/features/test_vision.py`` checks against HF's);
- a second turn about the same image hits the first turn's cached prefix through the image (the router hashes
  the image into the blocks' keys as the engine does);
- hostile images are 400s in each API's error shape, and the server answers the next request at once.

The text model's 400 is in ``tests/serve/test_serve.py``. One Ray cluster for the module."""

from __future__ import annotations

import base64

import pytest
from serving import SHARED_PORT, local_ray_serve, run_app
from vision_models import IMG, data_url, encoded, image, make_gemma3_vision

serve = pytest.importorskip("ray.serve")
openai = pytest.importorskip("openai")
anthropic = pytest.importorskip("anthropic")

PORT = SHARED_PORT  # one Ray cluster for these modules (serving.SHARED_CLUSTER_MODULES)
BASE = f"http://127.0.0.1:{PORT}"
ENGINE = {"max_model_len": 256, "num_gpu_blocks": 128, "block_size": 4, "max_num_seqs": 4, "num_threads": 1,
          "limit_mm_per_prompt": {"image": 2}, "max_image_bytes": 64 << 10}  # fmt: skip
MAX_TOKENS = 8
QUESTION = "What is in this picture?"


@pytest.fixture(scope="module")
def vision_model(tmp_path_factory, tokenizer):
    return make_gemma3_vision(tmp_path_factory.mktemp("gemma3-vision-serve"), tokenizer)


@pytest.fixture(scope="module")
def offline(vision_model):
    """``LLM.chat``'s text for a conversation (image parts as ``image_pil``), loaded before the app."""
    from cb_serve import LLM, SamplingParams

    llm = LLM(vision_model[0], **{**ENGINE, "num_threads": None})
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0)

    def answer(parts: list) -> str:
        content = [{"type": "text", "text": p} if isinstance(p, str) else {"type": "image_pil", "image_pil": p}
                   for p in parts]  # fmt: skip
        return llm.chat([{"role": "user", "content": content}], params, use_tqdm=False)[0].outputs[0].text

    yield answer
    llm.engine.shutdown()


@pytest.fixture(scope="module")
def app(vision_model, offline):
    with local_ray_serve(PORT):
        run_app({"model": vision_model[0], "engine": ENGINE}, "vision")
        yield


def openai_client():
    return openai.OpenAI(base_url=f"{BASE}/v1", api_key="none", timeout=120, max_retries=0)


def image_part(img) -> dict:
    return {"type": "image_url", "image_url": {"url": data_url(img)}}


def test_openai_chat_with_a_base64_png_streams_the_offline_answer(app, offline):
    client = openai_client()
    messages = [{"role": "user", "content": [{"type": "text", "text": QUESTION}, image_part(image(1))]}]
    expected = offline([QUESTION, image(1)])
    whole = client.chat.completions.create(model="tiny", messages=messages, max_tokens=MAX_TOKENS, temperature=0)
    assert whole.choices[0].message.content == expected
    stream = client.chat.completions.create(
        model="tiny", messages=messages, max_tokens=MAX_TOKENS, temperature=0, stream=True
    )
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == expected


def test_a_second_turn_about_the_image_hits_its_cached_prefix(app, offline):
    client = openai_client()
    turn = [{"role": "user", "content": [image_part(image(2)), {"type": "text", "text": QUESTION}]}]
    first = client.chat.completions.create(model="tiny", messages=turn, max_tokens=MAX_TOKENS, temperature=0)
    follow = turn + [{"role": "assistant", "content": first.choices[0].message.content},
                     {"role": "user", "content": "And its colours?"}]  # fmt: skip
    second = client.chat.completions.create(model="tiny", messages=follow, max_tokens=MAX_TOKENS, temperature=0)
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert cached >= first.usage.prompt_tokens - 4, (cached, first.usage.prompt_tokens)  # all but the last block


def test_responses_input_image_and_anthropic_image_block(app, offline):
    expected = offline([QUESTION, image(3)])
    response = openai_client().responses.create(
        model="tiny",
        input=[
            {
                "role": "user",
                "content": [
                    {"type": "input_text", "text": QUESTION},
                    {"type": "input_image", "image_url": data_url(image(3))},
                ],
            }
        ],  # fmt: skip
        max_output_tokens=MAX_TOKENS,
        temperature=0,
    )
    assert response.output_text == expected
    client = anthropic.Anthropic(base_url=BASE, api_key="none", timeout=120, max_retries=0)
    png = base64.b64encode(encoded(image(3))).decode()
    source = {"type": "base64", "media_type": "image/png", "data": png}
    message = client.messages.create(
        model="tiny",
        max_tokens=MAX_TOKENS,
        extra_body={"temperature": 0},  # (this client no longer takes it as an argument)
        messages=[
            {"role": "user", "content": [{"type": "text", "text": QUESTION}, {"type": "image", "source": source}]}
        ],  # fmt: skip
    )
    assert message.content[0].text == expected
    with pytest.raises(anthropic.BadRequestError, match="base64"):
        bad = {**source, "data": "@@not base64@@"}
        client.messages.create(model="tiny", max_tokens=4, messages=[
            {"role": "user", "content": [{"type": "image", "source": bad}]}])  # fmt: skip


def bomb() -> bytes:
    """A PNG header claiming 100k x 100k pixels."""
    import struct
    import zlib

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    header = struct.pack(">IIBBBBB", 100_000, 100_000, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IEND", b"")


HOSTILE = {
    "not base64": ["data:image/png;base64,@@@@"],
    "wrong mime": ["data:text/html;base64," + base64.b64encode(b"<html>").decode()],
    "pixel bomb": ["data:image/png;base64," + base64.b64encode(bomb()).decode()],
    "truncated png": ["data:image/png;base64," + base64.b64encode(encoded(image(1))[:100]).decode()],
    "oversize": ["data:image/png;base64," + base64.b64encode(b"\x89PNG" + b"\0" * (70 << 10)).decode()],
    "http url off": ["http://169.254.169.254/latest/meta-data"],
    "too many images": [data_url(image(1))] * 3,
    "placeholder in text": [data_url(image(1)), IMG],
}


@pytest.mark.parametrize("case", list(HOSTILE))
def test_hostile_images_are_400s_and_the_server_answers_after(app, case):
    client = openai_client()
    content = [{"type": "text", "text": u} if u == IMG else {"type": "image_url", "image_url": {"url": u}}
               for u in HOSTILE[case]]  # fmt: skip
    with pytest.raises(openai.BadRequestError) as error:
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": content}], max_tokens=2)
    assert error.value.body["type"] == "invalid_request_error", error.value.body
    ok = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": [image_part(image(5))]}], max_tokens=2
    )
    assert ok.choices[0].finish_reason == "length"
