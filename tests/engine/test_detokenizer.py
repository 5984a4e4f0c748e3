"""The detokenizer's Rust step (``tokenizers``' ``DecodeStream``) gives exactly the text of its Python
step (two ``tokenizer.decode`` calls per token), token by token, on the built-in model's byte-level BPE
tokenizer and on Gemma 3's byte-fallback SentencePiece one: random ids over the whole vocabulary
(special tokens and lone bytes included, with and without ``skip_special_tokens``) and real
multilingual text, after prompts whose last tokens set the first token's spacing."""

from __future__ import annotations

import importlib.util
import random

import pytest

from cb_serve.engine.detokenizer import IncrementalDetokenizer, rust_tokenizer
from cb_serve.model_executor.builtin_models import GEMMA3_PACKAGE

TEXTS = [
    "Emoji 🎉🚀 and 日本語のテキスト, accents: café naïve — ünïcödé ✓",
    "def f(x):\n    return {'a': [1, 2]}  # tabs\tand   spaces\n\n",
    "Привет, мир! Ελληνικά. עברית. العربية. हिन्दी. 한국어. 🏳️‍🌈👩‍👩‍👧",
    " leading space, trailing space ",
]


def gemma_tokenizer():
    if importlib.util.find_spec(GEMMA3_PACKAGE) is None:
        pytest.skip("gemma-3-270m not installed")
    from cb_serve.model_executor.loader import load_tokenizer, resolve_model_source

    return load_tokenizer(resolve_model_source("gemma-3-270m"))


@pytest.fixture(scope="module", params=["smollm2", "gemma3"])
def tok(request, tokenizer):
    return tokenizer if request.param == "smollm2" else gemma_tokenizer()


def same_text_token_by_token(tok, prompt: list[int], output: list[int], skip_special_tokens: bool) -> None:
    rust = rust_tokenizer(tok)
    assert rust is not None, "a fast tokenizer that cleans up no spaces takes the Rust step"
    fast = IncrementalDetokenizer(tok, prompt, skip_special_tokens, rust)
    slow = IncrementalDetokenizer(tok, prompt, skip_special_tokens)
    for i, token_id in enumerate(output):
        assert fast.append(token_id) == slow.append(token_id), (prompt, output[: i + 1])
        assert fast.text == slow.text, (prompt, output[: i + 1])


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_random_ids_give_the_same_text(tok, skip_special_tokens):
    rng = random.Random(0)
    vocab = len(tok)
    special = sorted(tok.all_special_ids)
    for _ in range(60):
        pool = [rng.randrange(vocab) for _ in range(40)] + rng.sample(special, min(3, len(special)))
        rng.shuffle(pool)
        prompt = [rng.randrange(vocab) for _ in range(rng.randrange(0, 8))]
        same_text_token_by_token(tok, prompt, pool, skip_special_tokens)


def test_real_text_gives_the_same_text(tok):
    for text in TEXTS:
        ids = tok.encode(text, add_special_tokens=False)
        for cut in (0, 1, 3, len(ids) // 2):
            same_text_token_by_token(tok, ids[:cut], ids[cut:], skip_special_tokens=True)
        ends = tok.encode(text + text[::-1], add_special_tokens=False)
        same_text_token_by_token(tok, [], ends, skip_special_tokens=False)


def test_a_tokenizer_that_cleans_up_spaces_takes_the_python_step(tokenizer):
    class CleansUp:
        is_fast = True
        clean_up_tokenization_spaces = True
        backend_tokenizer = tokenizer.backend_tokenizer

    assert rust_tokenizer(CleansUp()) is None
    assert rust_tokenizer(object()) is None


def test_tokenizers_whose_stream_takes_one_id_at_a_time_take_the_python_step(tokenizer, monkeypatch):
    """tokenizers 0.21's ``DecodeStream.step`` refuses the list that primes the context: the sequence
    decodes in Python, with the same text."""
    import cb_serve.engine.detokenizer as detokenizer

    real = detokenizer.DecodeStream

    class OneIdStream:  # (the Rust class takes no subclasses)
        def __init__(self, skip_special_tokens: bool) -> None:
            self.stream = real(skip_special_tokens=skip_special_tokens)

        def step(self, tokenizer, token_id):
            if isinstance(token_id, list):
                raise TypeError("'list' object cannot be interpreted as an integer")
            return self.stream.step(tokenizer, token_id)

    ids = tokenizer.encode(TEXTS[0], add_special_tokens=False)
    monkeypatch.setattr(detokenizer, "DecodeStream", OneIdStream)
    old = IncrementalDetokenizer(tokenizer, ids[:4], True, rust_tokenizer(tokenizer))
    monkeypatch.undo()
    new = IncrementalDetokenizer(tokenizer, ids[:4], True, rust_tokenizer(tokenizer))
    for token_id in ids[4:]:
        assert old.append(token_id) == new.append(token_id) and old.text == new.text
    assert old.text == new.text != ""
