"""Outputs made off the engine thread (issue 51, item 2): the engine hands each advanced sequence a
record of token ids (``EngineCoreOutput``); the front end's ``RequestState`` detokenizes, finds stop
strings and makes the ``RequestOutput``s.

- The front end alone: a stop string ends the sequence at its token and drops what the engine made
  after it (in the same record, or in later ones); it beats the length on the same token; the engine
  hears only of stops it did not make itself; an abort or an error ends every sequence.
- Through the real engines, with async scheduling on and off: stop strings that span tokens end
  streamed and offline outputs where the text first has them, with exactly the tokens up to the
  one that completed them (the engine ran ahead); ``n=2`` stops both children; every KV block is
  back and the request id is free at once.
"""

from __future__ import annotations

import asyncio

import pytest
from test_async_races import settled

from cb_serve import LLM, AsyncLLM, EngineConfig, RequestOutputKind, SamplingParams
from cb_serve.engine.core_output import EngineCoreOutput
from cb_serve.engine.processor import ProcessedRequest
from cb_serve.engine.request_state import RequestState
from cb_serve.outputs import Logprob

ARGS = dict(max_model_len=256, num_gpu_blocks=64, max_num_seqs=4, max_num_batched_tokens=64)
PROMPTS = [[7 + i, 40 + 3 * i] * (3 + i) for i in range(3)]
MAX_TOKENS = 32


def state_of(tokenizer, params: SamplingParams) -> RequestState:
    req = ProcessedRequest(None, [1, 2, 3], params, params.max_tokens)
    return RequestState("r", req, tokenizer, arrival_time=0.0)


def record(token_ids: list[int], index: int = 0, **kw) -> EngineCoreOutput:
    return EngineCoreOutput("r", index, token_ids, time=1.0, **kw)


def pieces(tokenizer, words: list[str]) -> list[int]:
    return [t for w in words for t in tokenizer.encode(w, add_special_tokens=False)]


def test_a_stop_string_drops_the_tokens_after_it_and_tells_the_engine(tokenizer):
    ids = pieces(tokenizer, ["Hello", " world", " END", " more", " words"])
    end = len(pieces(tokenizer, ["Hello", " world", " END"]))
    state = state_of(tokenizer, SamplingParams(stop=["world E"], max_tokens=50))
    out, stops = state.process([record(ids[:2]), record(ids[2:])])  # one step's records, say speculation's
    (c,) = out.outputs
    assert (c.text, c.finish_reason, c.stop_reason) == ("Hello ", "stop", "world E")
    assert c.token_ids == ids[:end] and out.finished and stops == [(0, "world E", end)]
    assert state.process([record([5, 6])]) == (None, [])  # the engine ran on before it heard: dropped


def test_a_stop_string_beats_the_length_on_the_same_token_and_needs_no_stop(tokenizer):
    ids = pieces(tokenizer, ["one", " two", " three"])
    state = state_of(tokenizer, SamplingParams(stop=["three"], max_tokens=len(ids), include_stop_str_in_output=True))
    out, stops = state.process([record(ids, finish_reason="length", request_finished=True)])
    c = out.outputs[0]
    assert (c.text, c.finish_reason, c.stop_reason, stops) == ("one two three", "stop", "three", [])


def test_logprobs_get_their_text_and_forced_tokens_none(tokenizer):
    ids = pieces(tokenizer, ["alpha", " beta"])
    state = state_of(tokenizer, SamplingParams(logprobs=1, max_tokens=9))
    entries = [{ids[0]: Logprob(-0.5, 1)}, None]  # the second token a grammar forced
    out, _ = state.process([record(ids, new_logprobs=entries)])
    c = out.outputs[0]
    assert c.cumulative_logprob == -0.5 and len(c.logprobs) == 1
    assert c.logprobs[0][ids[0]].decoded_token == tokenizer.decode([ids[0]])


def test_n_children_stop_apart_and_an_abort_ends_the_rest(tokenizer):
    ids = pieces(tokenizer, ["x", " STOP", " y"])
    params = SamplingParams(n=3, stop=["STOP"], max_tokens=50, output_kind=RequestOutputKind.DELTA)
    state = state_of(tokenizer, params)
    out, stops = state.process([record(ids, 0), record(ids[:1], 1)])
    assert stops == [(0, "STOP", len(pieces(tokenizer, ["x", " STOP"])))] and not out.finished
    assert [(c.index, c.finish_reason) for c in out.outputs] == [(0, "stop"), (1, None)]
    out, stops = state.process([record([], 1, finish_reason="abort", request_finished=True)])
    assert out.finished and stops == [] and state.engine_finished
    assert {c.index: c.finish_reason for c in out.outputs} == {1: "abort", 2: "abort"}


def test_an_error_record_fails_the_request(tokenizer):
    from cb_serve.errors import RequestFailedError

    state = state_of(tokenizer, SamplingParams(max_tokens=5))
    error = RequestFailedError("boom")
    out, _ = state.process([record([], finish_reason="error", request_finished=True, error=error)])
    assert out.error is error and out.finished and out.outputs[0].finish_reason == "error"


# ---- through the engines -------------------------------------------------------------------------
@pytest.fixture(scope="module")
def reference(random_model_dir, tokenizer):
    """Each prompt's greedy ids and text, and a stop string across two tokens found first there."""
    llm = LLM(str(random_model_dir("llama")), **ARGS)
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True), use_tqdm=False)
    cases = []
    for out in outs:
        ids, text = out.outputs[0].token_ids, out.outputs[0].text
        for k in range(MAX_TOKENS // 3, MAX_TOKENS - 2):
            pos = len(tokenizer.decode(ids[:k]))  # where token k's text begins
            stop = text[pos - 2 : pos + 2]
            if len(stop) == 4 and text.find(stop) == pos - 2 and text[:pos] == tokenizer.decode(ids[:k]):
                last = next(j for j in range(k, len(ids) + 1) if len(tokenizer.decode(ids[:j])) >= pos + 2)
                cases.append((ids, text, stop, pos - 2, last))
                break
    assert len(cases) == len(PROMPTS), "no stop string spans two tokens"
    return cases


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_offline_stop_strings_end_where_the_text_first_has_them(random_model_dir, reference, async_scheduling):
    llm = LLM(str(random_model_dir("llama")), async_scheduling=async_scheduling, **ARGS)
    generated = llm.engine.get_stats().generation_tokens
    for include in (False, True):
        params = [greedy_stop(stop, include) for _, _, stop, _, _ in reference]
        outs = llm.generate(PROMPTS, params, use_tqdm=False)
        for out, (ids, text, stop, at, last) in zip(outs, reference):
            c = out.outputs[0]
            assert c.text == text[: at + (len(stop) if include else 0)], (c.text, text, stop)
            assert (c.token_ids, c.finish_reason, c.stop_reason) == (ids[:last], "stop", stop)
    stats = llm.engine.get_stats()
    assert stats.kv_blocks_used == 0
    assert stats.generation_tokens - generated == 2 * sum(last for *_, last in reference), "tokens past a stop"


def test_a_request_whose_output_fails_in_the_front_end_fails_alone(random_model_dir, monkeypatch):
    """Its text cannot be made (a detokenizer failure, say): it ends with ``RequestFailedError``,
    counted as failed, its blocks free; the other requests and the engine go on (both front ends)."""
    from cb_serve.errors import RequestFailedError

    apply = RequestState._apply

    def failing(self, s, rec):
        if self.request_id.startswith("bad") and s.token_ids:
            raise UnicodeDecodeError("utf-8", b"", 0, 1, "injected")
        return apply(self, s, rec)

    monkeypatch.setattr(RequestState, "_apply", failing)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    llm = LLM(str(random_model_dir("llama")), **ARGS)
    engine = llm.engine
    failed = engine.get_stats().num_failed_requests
    engine.add_request("bad", PROMPTS[0], params)
    engine.add_request("good", PROMPTS[1], params)
    outs = {}
    while engine.has_unfinished_requests():
        outs.update({o.request_id: o for o in engine.step() if o.finished})
    assert isinstance(outs["bad"].error, RequestFailedError) and len(outs["good"].outputs[0].token_ids) == 8
    assert engine.get_stats().num_failed_requests == failed + 1 and engine.get_stats().kv_blocks_used == 0

    async_llm = AsyncLLM(EngineConfig(model=str(random_model_dir("llama")), async_scheduling=True, **ARGS))

    async def run(request_id: str, prompt: list[int]) -> int:
        outs = [o async for o in async_llm.generate(prompt, params, request_id)]  # cumulative outputs
        return len(outs[-1].outputs[0].token_ids)

    async def main() -> None:
        results = await asyncio.gather(run("bad", PROMPTS[0]), run("good", PROMPTS[1]), return_exceptions=True)
        assert isinstance(results[0], RequestFailedError) and results[1] == 8, results
        await settled(async_llm)

    try:
        asyncio.run(main())
        assert async_llm.is_alive and async_llm.get_stats().num_failed_requests == 1
    finally:
        async_llm.shutdown()


def greedy_stop(stop: str, include: bool = False, n: int = 1) -> SamplingParams:
    return SamplingParams(
        n=n,
        temperature=0,
        max_tokens=MAX_TOKENS,
        ignore_eos=True,
        stop=[stop],
        include_stop_str_in_output=include,
        output_kind=RequestOutputKind.DELTA,
    )


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_streams_stop_where_the_text_first_has_them_and_free_everything(random_model_dir, reference, async_scheduling):
    llm = AsyncLLM(EngineConfig(model=str(random_model_dir("llama")), async_scheduling=async_scheduling, **ARGS))

    async def stream(i: int, request_id: str, n: int = 1) -> list[tuple[str, list[int], str | None, object]]:
        ids, text, stop, at, last = reference[i]
        got = [("", [], None, None) for _ in range(n)]
        async for out in llm.generate(PROMPTS[i], greedy_stop(stop, n=n), request_id):
            for c in out.outputs:
                t, toks, _, _ = got[c.index]
                got[c.index] = (t + c.text, toks + c.token_ids, c.finish_reason, c.stop_reason)
        for g in got:
            assert g == (text[:at], ids[:last], "stop", stop), (g, text, stop)
        return got

    async def main() -> None:
        await asyncio.gather(*(stream(i, f"r{i}") for i in range(len(PROMPTS))), stream(0, "pair", n=2))
        await stream(1, "r1")  # its id is free again at once: the engine let go of it on the stop
        await settled(llm)

    try:
        asyncio.run(main())
        assert llm.is_alive
    finally:
        llm.shutdown()
