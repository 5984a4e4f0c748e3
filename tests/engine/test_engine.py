"""Engine behaviour: batch invariance, seeded sampling, mixed steps without padding,
sampling options, stop conditions, n > 1, logprobs, no leaked blocks."""

from __future__ import annotations

import pytest
import torch
from observe import recorded_steps

from cb_serve import LLM, RequestOutputKind, SamplingParams

PROMPTS = [
    "The quick brown fox jumps over the lazy dog. " * 3,
    "Once upon a time",
    "def fibonacci(n):",
    "Paris is the capital of France, and Berlin is",
    "1, 2, 3, 4,",
    "In a hole in the ground there lived a hobbit. Not a nasty, dirty, wet hole",
]


def tokens(out) -> list[int]:
    return out.outputs[0].token_ids


def test_greedy_alone_equals_in_busy_batch(smol_llm):
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    alone = smol_llm.generate([PROMPTS[1]], params, use_tqdm=False)[0]
    busy_prompts = PROMPTS * 3
    with recorded_steps(smol_llm.engine) as steps:
        busy = smol_llm.generate(
            busy_prompts, [SamplingParams(temperature=0.0, max_tokens=40)] * len(busy_prompts), use_tqdm=False
        )
    assert max(s.num_seqs for s in steps) > 1
    in_batch = smol_llm.generate(busy_prompts[:4] + [PROMPTS[1]] + busy_prompts[4:], [params] * 19, use_tqdm=False)[4]
    assert tokens(alone) == tokens(in_batch)
    assert busy[1].outputs[0].text  # sanity: the busy batch produced text


def test_seeded_sampling_is_reproducible(smol_llm):
    seeded = SamplingParams(temperature=0.9, top_p=0.95, top_k=50, seed=1234, max_tokens=24, ignore_eos=True)
    first = smol_llm.generate([PROMPTS[0]], seeded, use_tqdm=False)[0]
    again = smol_llm.generate([PROMPTS[0]], seeded, use_tqdm=False)[0]
    mates = [SamplingParams(temperature=1.0, max_tokens=30)] * 3
    in_batch = smol_llm.generate(
        [PROMPTS[2], PROMPTS[0], PROMPTS[3], PROMPTS[4]], [mates[0], seeded, *mates[1:]], use_tqdm=False
    )[1]
    assert tokens(first) == tokens(again) == tokens(in_batch)
    other_seed = smol_llm.generate([PROMPTS[0]], SamplingParams(**{**seeded.__dict__, "seed": 99}), use_tqdm=False)[0]
    assert tokens(other_seed) != tokens(first)


def test_step_mixes_decodes_and_prefill_chunk_without_padding(tiny_llm):
    engine = tiny_llm.engine
    seen = []
    prepare = engine.runner.prepare

    def spy(sched):
        inp = prepare(sched)
        seen.append((inp.input_ids.numel(), inp.positions.numel(), list(inp.meta.query_lens), inp.meta.num_decodes))
        return inp

    engine.runner.prepare = spy
    try:
        with recorded_steps(engine) as steps:
            engine.add_request("short", list(range(100, 110)), SamplingParams(temperature=0, max_tokens=20))
            engine.step()  # prefill of "short"; it now decodes
            engine.add_request("long", list(range(200, 500)), SamplingParams(temperature=0, max_tokens=2))
            while engine.has_unfinished_requests():
                engine.step()
    finally:
        engine.runner.prepare = prepare
    mixed = [s for s in steps if s.num_decode_tokens and s.num_prefill_tokens]
    assert mixed, "no step mixed decode tokens and a prefill chunk"
    for num_ids, num_pos, query_lens, num_decodes in seen:
        assert num_ids == num_pos == sum(query_lens), "the batch is padded"
        assert all(n == 1 for n in query_lens[:num_decodes]) and all(n > 1 for n in query_lens[num_decodes:])
    assert any(nd and len(q) > nd for _, _, q, nd in seen)
    for s in mixed:
        assert s.num_scheduled_tokens == s.num_decode_tokens + s.num_prefill_tokens <= s.token_budget


def test_n_parallel_samples_and_logprobs(tiny_llm):
    out = tiny_llm.generate(
        ["Hello there"],
        SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=8, logprobs=4, ignore_eos=True),
        use_tqdm=False,
    )[0]
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1
    for c in out.outputs:
        assert len(c.token_ids) == len(c.logprobs) == 8
        for tok, lp in zip(c.token_ids, c.logprobs):
            assert tok in lp and len(lp) >= 4 and all(v.logprob <= 0 for v in lp.values())
        assert c.cumulative_logprob == pytest.approx(sum(lp[t].logprob for t, lp in zip(c.token_ids, c.logprobs)))
    greedy = tiny_llm.generate(
        ["Hello there"], SamplingParams(temperature=0, max_tokens=4, logprobs=2), use_tqdm=False
    )[0].outputs[0]
    for tok, lp in zip(greedy.token_ids, greedy.logprobs):
        assert lp[tok].rank == 1 and lp[tok].logprob == max(v.logprob for v in lp.values())


def test_top_k_one_is_greedy_and_min_tokens(tiny_llm):
    greedy = tiny_llm.generate(["abc"], SamplingParams(temperature=0, max_tokens=10, ignore_eos=True), use_tqdm=False)[
        0
    ]
    top1 = tiny_llm.generate(
        ["abc"], SamplingParams(temperature=5.0, top_k=1, max_tokens=10, ignore_eos=True), use_tqdm=False
    )[0]
    assert tokens(greedy) == tokens(top1)
    first = tokens(greedy)[0]
    out = tiny_llm.generate(
        ["abc"], SamplingParams(temperature=0, max_tokens=10, min_tokens=4, stop_token_ids=[first]), use_tqdm=False
    )[0].outputs[0]
    assert len(out.token_ids) >= 4 and first not in out.token_ids[:4]
    stopped = tiny_llm.generate(
        ["abc"], SamplingParams(temperature=0, max_tokens=10, stop_token_ids=[first]), use_tqdm=False
    )[0].outputs[0]
    assert stopped.token_ids == [first] and stopped.finish_reason == "stop" and stopped.stop_reason == first


def test_stop_string_spanning_tokens(smol_llm):
    tok = smol_llm.get_tokenizer()
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    full = smol_llm.generate([PROMPTS[5]], params, use_tqdm=False)[0].outputs[0]
    # A stop string that starts inside one token and ends inside a later one.
    pieces = [tok.decode([t]) for t in full.token_ids]
    k = next(i for i in range(3, len(pieces) - 2) if len(pieces[i]) >= 2 and len(pieces[i + 1]) >= 2)
    start = len("".join(pieces[:k])) + 1
    stop = full.text[start : start + len(pieces[k]) + 1]
    out = smol_llm.generate([PROMPTS[5]], SamplingParams(**{**params.__dict__, "stop": [stop]}), use_tqdm=False)[
        0
    ].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.text == full.text[: full.text.index(stop)]
    kept = smol_llm.generate(
        [PROMPTS[5]],
        SamplingParams(**{**params.__dict__, "stop": [stop], "include_stop_str_in_output": True}),
        use_tqdm=False,
    )[0].outputs[0]
    assert kept.text == full.text[: full.text.index(stop) + len(stop)]


def test_multibyte_text_streams_whole_characters(smol_llm):
    from cb_serve.engine.detokenizer import IncrementalDetokenizer

    tok = smol_llm.get_tokenizer()
    text = "Emoji 🎉🚀 and 日本語のテキスト, accents: café naïve — ünïcödé ✓"
    ids = tok.encode(text)
    detok = IncrementalDetokenizer(tok, [], skip_special_tokens=True)
    pieces = []
    for t in ids:
        before = detok.text
        detok.append(t)
        pieces.append(detok.text[len(before) :])
    assert "".join(pieces) == tok.decode(ids) == text
    assert all("\ufffd" not in p for p in pieces)
    assert any(p == "" for p in pieces), "some characters span several tokens"


def test_finish_reasons_eos_and_length(smol_llm):
    out = smol_llm.chat(
        [{"role": "user", "content": "Say hi."}], SamplingParams(temperature=0, max_tokens=200), use_tqdm=False
    )[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason is None and out.text.strip()
    assert "<|im_end|>" not in out.text
    short = smol_llm.generate(
        [PROMPTS[1]], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True), use_tqdm=False
    )[0].outputs[0]
    assert short.finish_reason == "length" and len(short.token_ids) == 3


def test_delta_outputs_add_up(tiny_llm):
    engine = tiny_llm.engine
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, output_kind=RequestOutputKind.DELTA)
    engine.add_request("d", "Streaming test", params)
    text, ids = "", []
    while engine.has_unfinished_requests():
        for out in engine.step():
            text += out.outputs[0].text
            ids += out.outputs[0].token_ids
    final = tiny_llm.generate(
        ["Streaming test"], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), use_tqdm=False
    )[0].outputs[0]
    assert (text, ids) == (final.text, final.token_ids)


def test_abort_frees_blocks(tiny_llm):
    engine = tiny_llm.engine
    engine.add_request("a", "x " * 100, SamplingParams(max_tokens=50))
    engine.step()
    assert engine.get_stats().kv_blocks_used > 0
    engine.abort_request("a")
    assert engine.get_stats().kv_blocks_used == 0 and not engine.has_unfinished_requests()


def test_token_id_prompts_and_order(tiny_llm: LLM):
    outs = tiny_llm.generate(
        [[5, 6, 7], "text prompt", [9] * 40], SamplingParams(temperature=0, max_tokens=3), use_tqdm=False
    )
    assert [o.prompt_token_ids[:3] for o in (outs[0], outs[2])] == [[5, 6, 7], [9, 9, 9]]
    assert outs[1].prompt == "text prompt"


@pytest.mark.parametrize("kv_dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("backend", ["cpu", "torch"])
def test_half_kv_cache_halves_kv_memory_and_keeps_greedy_outputs(random_model_dir, tokenizer, backend, kv_dtype):
    """``kv_cache_dtype="bfloat16"`` (or ``"float16"``) under float32 weights: twice the blocks in the same memory,
    and greedy outputs that still follow HF's float32 ones. Rounding K/V to bf16 moves logits by
    ~1e-2 here, so a divergence is accepted only where HF's top-2 logits are within 0.05 and
    our token is its second choice."""
    from models import assert_greedy_match, hf_greedy

    if backend == "cpu":
        from cb_serve import cpu_ops

        if not cpu_ops.available():
            pytest.skip("the C++ kernels did not build")
    model = str(random_model_dir("llama"))
    args = dict(max_model_len=256, kv_cache_memory=1 << 20, attention_backend=backend, max_num_batched_tokens=32)
    fp32 = LLM(model, **args).engine.num_blocks
    llm = LLM(model, kv_cache_dtype=kv_dtype, **args)
    assert llm.engine.num_blocks == 2 * fp32
    assert all(c.dtype == getattr(torch, kv_dtype) for c in llm.engine.runner.kv_caches)
    prompts = [tokenizer.encode(p) for p in PROMPTS]
    lens = [12, 20, 8, 16, 10, 24]
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in lens]
    outputs = llm.generate(prompts, params, use_tqdm=False)
    for i, ((ref, logits), out) in enumerate(zip(hf_greedy(model, prompts, lens), outputs)):
        assert_greedy_match(tokens(out), ref, logits, context=f"prompt {i}", tie_tolerance=0.05)
    assert llm.engine.get_stats().kv_blocks_used == 0


def test_kv_cache_dtype_is_validated(random_model_dir):
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        LLM(str(random_model_dir("llama")), kv_cache_dtype="int8")
    with pytest.raises(ValueError, match="kv_cache_dtype=float32 differs"):
        LLM(str(random_model_dir("llama")), dtype="bfloat16", kv_cache_dtype="float32", max_model_len=128)


def test_skip_special_tokens_false_keeps_them_in_the_text(smol_llm, tokenizer):
    """A chat reply runs past its ``<|im_end|>`` (EOS ignored): with ``skip_special_tokens=False``
    the special tokens are in the text, by default they are not; the token ids are the same."""
    messages = [{"role": "user", "content": "Say hi."}]
    args = dict(temperature=0, max_tokens=48, ignore_eos=True)
    keep = smol_llm.chat(messages, SamplingParams(**args, skip_special_tokens=False), use_tqdm=False)[0].outputs[0]
    skip = smol_llm.chat(messages, SamplingParams(**args), use_tqdm=False)[0].outputs[0]
    assert keep.token_ids == skip.token_ids
    assert set(tokenizer.all_special_ids) & set(keep.token_ids), "no special token generated: the test proves nothing"
    assert keep.text == tokenizer.decode(keep.token_ids, skip_special_tokens=False)
    assert skip.text == tokenizer.decode(skip.token_ids, skip_special_tokens=True) != keep.text


def test_an_explicit_gguf_path_loads_the_same_model(smol_llm):
    from models import STRESS_ENGINE_ARGS

    from cb_serve.model_executor.loader import default_model_source

    source = default_model_source()
    path = f"{source.path}/{source.gguf_file}"
    assert path.endswith(".gguf")
    llm = LLM(path, **STRESS_ENGINE_ARGS)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    ours = [o.outputs[0].token_ids for o in llm.generate(PROMPTS[:3], params, use_tqdm=False)]
    assert ours == [o.outputs[0].token_ids for o in smol_llm.generate(PROMPTS[:3], params, use_tqdm=False)]


def test_a_gguf_files_config_and_tokenizer_are_parsed_once_per_process(tmp_path):
    """transformers parses the whole GGUF file (every vocabulary string) for a config or a
    tokenizer: the loader keeps each per file, hands every caller its own copy, and parses
    again once the file changes."""
    import os
    import shutil

    from cb_serve.model_executor import loader

    default = loader.default_model_source()
    gguf = tmp_path / "model.gguf"
    shutil.copy(f"{default.path}/{default.gguf_file}", gguf)
    source = loader.resolve_model_source(str(gguf))
    loader.load_config.cache_clear()
    first, second = loader.load_config(source), loader.load_config(source)
    assert first is not second and first.to_dict() == second.to_dict()
    first.num_hidden_layers = 1
    assert loader.load_config(source).num_hidden_layers == second.num_hidden_layers == 30
    assert (loader.load_config.cache_info().hits, loader.load_config.cache_info().misses) == (2, 1)
    stat = gguf.stat()
    os.utime(gguf, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))
    loader.load_config(source)
    assert loader.load_config.cache_info().misses == 2
    a, b = loader.load_tokenizer(source), loader.load_tokenizer(source)
    assert a is not b and a.chat_template == b.chat_template and a.encode("Hi there") == b.encode("Hi there")


def test_a_sharded_checkpoint_loads(random_model_dir, tiny_llm, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    source = random_model_dir("llama")
    AutoModelForCausalLM.from_pretrained(source).save_pretrained(tmp_path, max_shard_size="200KB")
    AutoTokenizer.from_pretrained(source).save_pretrained(tmp_path)
    assert (tmp_path / "model.safetensors.index.json").exists() and len(list(tmp_path.glob("*.safetensors"))) > 2
    llm = LLM(str(tmp_path), max_model_len=512, num_gpu_blocks=64)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    ours = [o.outputs[0].token_ids for o in llm.generate(PROMPTS[:3], params, use_tqdm=False)]
    assert ours == [o.outputs[0].token_ids for o in tiny_llm.generate(PROMPTS[:3], params, use_tqdm=False)]


def test_a_gguf_files_config_and_tokenizer_are_cached_on_disk_as_parsed(tmp_path, monkeypatch):
    """Other processes read the config and tokenizer from the disk cache (``gguf_cache``): they equal
    what transformers parses out of the file; a damaged entry is parsed again and replaced."""
    from cb_serve.model_executor import gguf_cache, loader

    monkeypatch.setenv(gguf_cache.CACHE_ENV, str(tmp_path / "cache"))
    source = loader.default_model_source()

    def load() -> tuple:
        loader.load_config.cache_clear()
        loader._load_tokenizer.cache_clear()
        return loader.load_config(source), loader.load_tokenizer(source)

    (parsed_config, parsed), (config, tokenizer) = load(), load()
    entry = gguf_cache.entry_dir(loader.gguf_stamp(source), "config")
    assert (entry / gguf_cache.COMPLETE).is_file() and config._name_or_path == str(entry)
    ignore = {"_name_or_path"}
    assert {k: v for k, v in config.to_dict().items() if k not in ignore} == {
        k: v for k, v in parsed_config.to_dict().items() if k not in ignore
    }
    assert tokenizer.get_vocab() == parsed.get_vocab() and tokenizer.chat_template == parsed.chat_template
    assert tokenizer.special_tokens_map == parsed.special_tokens_map
    for text in ["Hello world", "  spaces\n\ttabs", "<|im_start|>user\nHi<|im_end|>", "é😀中文"]:
        assert tokenizer.encode(text) == parsed.encode(text)
        assert tokenizer.decode(tokenizer.encode(text)) == parsed.decode(parsed.encode(text))
    (entry / "config.json").write_text("{not json")
    assert load()[0].num_hidden_layers == parsed_config.num_hidden_layers  # parsed again, and cached again
    assert (entry / gguf_cache.COMPLETE).is_file() and (entry / "config.json").read_text().startswith("{\n")


def test_the_gguf_cache_is_bounded_and_evicts_the_least_recently_used_entries(tmp_path, monkeypatch):
    """Each write evicts the least recently used entries (a read marks one used) down to
    ``$CB_SERVE_CACHE_MAX_GB``, never the entry just written: keys follow a file's path and time, so a file
    assembled anew each run would otherwise grow the cache without end."""
    import os

    from cb_serve.model_executor import gguf_cache

    monkeypatch.setenv(gguf_cache.CACHE_ENV, str(tmp_path))
    monkeypatch.setenv(gguf_cache.MAX_ENV, str(2500 / 2**30))  # room for two 1000-byte entries

    def save(value: bytes, directory: str) -> None:
        (tmp_path / "writes").open("a").write("w")
        open(os.path.join(directory, "blob"), "wb").write(value)

    def get(name: str) -> bytes:
        stamp = (name, 1000, 0)
        return gguf_cache.cached(stamp, "config", lambda: b"x" * 1000, save, lambda d: open(f"{d}/blob", "rb").read())

    def present(name: str) -> bool:
        return (gguf_cache.entry_dir((name, 1000, 0), "config") / gguf_cache.COMPLETE).is_file()

    for t, name in enumerate(["a", "b"]):
        get(name)
        os.utime(gguf_cache.entry_dir((name, 1000, 0), "config").parent, (t, t))  # a, then b: a is older
    get("a")  # a read: now b is the least recently used
    get("c")  # over the bound: b goes
    assert (present("a"), present("b"), present("c")) == (True, False, True)
    assert (tmp_path / "writes").read_text() == "www"  # the read of a was a hit
    monkeypatch.setenv(gguf_cache.MAX_ENV, "0")
    get("d")  # a bound below one entry keeps the one just written
    assert [present(n) for n in "acd"] == [False, False, True]
