"""Async scheduling (issue 51): step N+1 is scheduled and launched while step N runs, its sampled ids fed
back on the device. On the CPU the launch itself is synchronous, so every piece of the pipeline runs here
(pending tokens, the placeholders filled on the device, deferred frees, the sync fallback); only the overlap
needs a GPU.

Each test compares an engine with ``async_scheduling=True`` against one without: the same greedy and seeded
tokens, text and finish reasons, under stop strings that span tokens, ``max_tokens`` and the context length,
``n > 1``, shared prefixes, preemption by recompute, aborts of requests in flight, requests that need the
host each step mixed in (prompt logprobs, a grammar), penalties, bias and min_tokens run ahead, a hybrid
recurrent model and a mixture of experts; and every KV block and state slot back at the end."""

from __future__ import annotations

import os
import random

import pytest
import torch

from cb_serve import LLM, SamplingParams
from cb_serve.structured_outputs_params import StructuredOutputsParams

PROMPTS = [[7 + i, 40 + 3 * i] * (3 + i) for i in range(6)] + [[5, 6, 7, 8] * 5] * 3  # distinct and shared


def params_mix(seed: int = 0) -> list[SamplingParams]:
    rng = random.Random(seed)
    out = []
    for i in range(len(PROMPTS)):
        kw = dict(max_tokens=rng.randint(1, 40), ignore_eos=rng.random() < 0.5)
        if i % 3 == 0:
            kw.update(temperature=0.9, seed=100 + i)
        else:
            kw.update(temperature=0)
        if i % 4 == 1:
            kw.update(n=2, temperature=0.7, seed=7)
        out.append(SamplingParams(**kw))
    return out


def run(llm: LLM, prompts, params):
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [[(c.token_ids, c.text, c.finish_reason, c.stop_reason) for c in o.outputs] for o in outs]


def assert_all_back(llm: LLM) -> None:
    engine = llm.engine
    assert not engine.has_unfinished_requests()
    engine.check_invariants()
    stats = engine.get_stats()
    assert stats.kv_blocks_used == 0, stats
    assert engine.in_flight is None and not engine.scheduler.deferred_frees


@pytest.fixture(scope="module")
def pair(random_model_dir):
    """The same tiny Llama with async scheduling off and on; a small KV pool so long runs preempt."""
    model = str(random_model_dir("llama"))
    args = dict(max_model_len=128, num_gpu_blocks=12, max_num_seqs=6, max_num_batched_tokens=48)
    return LLM(model, **args), LLM(model, async_scheduling=True, **args)


def test_cpu_default_is_off_and_the_flag_turns_it_on(pair):
    sync, ahead = pair
    assert not sync.engine.async_scheduling and ahead.engine.async_scheduling


def test_a_step_is_launched_before_the_previous_ones_outputs_are_taken(pair):
    _, ahead = pair
    engine = ahead.engine
    engine.add_request("r", {"prompt_token_ids": PROMPTS[0]}, SamplingParams(temperature=0, max_tokens=4))
    assert engine.step() == [] and engine.in_flight is not None  # launched; nothing on the host yet
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
    assert outputs[-1].finished and len(outputs[-1].outputs[0].token_ids) == 4
    assert_all_back(ahead)


def test_same_tokens_with_and_without_async_scheduling(pair):
    sync, ahead = pair
    for seed in range(3):
        params = params_mix(seed)
        assert run(ahead, PROMPTS, params) == run(sync, PROMPTS, params), seed
        assert_all_back(ahead)
    assert ahead.engine.get_stats().num_preemptions > 0  # the small pool preempted sequences in flight


def test_stop_strings_spanning_tokens_and_the_context_length(pair):
    sync, ahead = pair
    text = run(sync, PROMPTS[:3], SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))
    stops = []
    for (_tokens, full, *_), *_ in text:
        cut = full[len(full) // 3 : len(full) // 3 + 3]
        stops.append(SamplingParams(temperature=0, max_tokens=30, stop=[cut] if cut.strip() else None))
    assert run(ahead, PROMPTS[:3], stops) == run(sync, PROMPTS[:3], stops)
    long = [[3, 4, 5, 6] * 28]  # 112 of the 128 tokens: ends at the context length
    unlimited = SamplingParams(temperature=0, max_tokens=None, ignore_eos=True)
    got = run(ahead, long, unlimited)
    assert got == run(sync, long, unlimited) and got[0][0][2] == "length" and len(got[0][0][0]) == 16
    assert_all_back(ahead)


def test_requests_that_need_the_host_each_step_run_synchronously_beside_the_others(pair):
    sync, ahead = pair
    host_each_step = [
        SamplingParams(temperature=0, max_tokens=12, prompt_logprobs=1),
        SamplingParams(temperature=0, max_tokens=12, structured_outputs=StructuredOutputsParams(regex="[0-9]{4}")),
    ]
    params = [*host_each_step, *params_mix(5)[: len(PROMPTS) - len(host_each_step)]]
    for p in host_each_step:
        assert p.needs_host_each_step
    got, want = run(ahead, PROMPTS, params), run(sync, PROMPTS, params)
    assert got == want
    assert_all_back(ahead)


AHEAD_PROCESSORS = [  # each changes the logits every step, from the tokens so far or from its own data
    dict(repetition_penalty=1.3),
    dict(frequency_penalty=1.5, presence_penalty=0.5),
    dict(repetition_penalty=0.8, presence_penalty=-1.0),
    dict(frequency_penalty=-2.0),  # seen tokens favoured: the step in flight's token counts at once
    dict(logit_bias={11: 5.0, 12: 3.0, 40: -100.0}),
    dict(allowed_token_ids=[11, 12, 13, 14, 40, 41]),
    dict(frequency_penalty=2.0, seed=3, temperature=0.9),
    dict(repetition_penalty=1.2, logit_bias={13: 2.0}, min_tokens=4, seed=8, temperature=0.8),
]


def test_penalties_bias_allowed_ids_and_min_tokens_run_ahead(pair):
    """None of these needs the host to see the step in flight's token: the penalties count it on the device.
    The same tokens as synchronous steps, mixed with plain requests, under preemption; one launched ahead."""
    sync, ahead = pair
    eos = ahead.get_tokenizer().eos_token_id
    processors = [*AHEAD_PROCESSORS, dict(min_tokens=5, logit_bias={eos: 100.0})]  # EOS the first allowed pick
    params = [
        SamplingParams(max_tokens=14, ignore_eos=i % 2 == 0 and i < 8, **{"temperature": 0, **kw})
        for i, kw in enumerate(processors)
    ]
    assert not any(p.needs_host_each_step for p in params)
    engine = ahead.engine
    engine.add_request("r", {"prompt_token_ids": PROMPTS[0]}, params[1])
    assert engine.step() == [] and engine.in_flight is not None  # launched ahead
    while engine.has_unfinished_requests():
        engine.step()
    mixed = params + params_mix(7)[len(params) :]
    got, want = run(ahead, PROMPTS, mixed), run(sync, PROMPTS, mixed)
    assert got == want
    plain = run(sync, PROMPTS, SamplingParams(temperature=0, max_tokens=14, ignore_eos=True))
    changed = [g[0][0] != p[0][0] for g, p in zip(got, plain)]
    assert changed[3], "the negative frequency penalty had no effect: the test would not see a missed count"
    assert len(got[-1][0][0]) == 6 and got[-1][0][2] == "stop"  # 5 tokens, then EOS: the ban ended in time
    assert_all_back(ahead)


def test_logprobs_come_back_with_the_ids(pair):
    """Logprobs need no synchronous step: computed on the device with every row's rank, copied with the ids."""
    sync, ahead = pair
    params = [
        SamplingParams(temperature=0, max_tokens=9, logprobs=3, ignore_eos=True),
        SamplingParams(temperature=0.9, seed=5, max_tokens=7, logprobs=0),  # the sampled token's alone
        SamplingParams(temperature=0, max_tokens=5),
    ]
    assert not any(p.needs_host_each_step for p in params)

    def logprobs(llm):
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS[:3]], params, use_tqdm=False)
        return [(c.token_ids, c.logprobs, c.cumulative_logprob) for o in outs for c in o.outputs]

    engine = ahead.engine
    engine.add_request("probe", {"prompt_token_ids": PROMPTS[0]}, params[0])
    assert engine.step() == [] and engine.in_flight is not None  # launched ahead, logprobs and all
    engine.abort_request("probe")
    while engine.has_unfinished_requests():
        engine.step()
    got, want = logprobs(ahead), logprobs(sync)
    assert got == want and want[0][1][0] and len(want[1][1][0]) == 1
    assert_all_back(ahead)


VARIANTS = [
    SamplingParams(temperature=0, max_tokens=60, ignore_eos=True),
    SamplingParams(temperature=0, max_tokens=60, stop=["a", "e"]),  # stop strings (often inside a token)
    SamplingParams(temperature=0, max_tokens=7),
    SamplingParams(temperature=0, max_tokens=20, prompt_logprobs=1),  # the host each step: the engine drains
]


def test_a_soak_of_aborts_preemption_and_stop_strings(pair):
    """Requests come and go at random, some aborted while a step that computes them is in flight; a few need
    the host each step, so the engine drains and goes back to launching ahead. Every request run to the end
    gets what the synchronous engine gives it alone, and every block comes back."""
    sync, ahead = pair
    engine = ahead.engine
    rng = random.Random(3)
    expected: dict[tuple[int, int], tuple] = {}
    live: dict[str, tuple[int, int]] = {}
    finished = 0
    for i in range(300):
        if rng.random() < 0.2 or not live:
            key = (rng.randrange(len(PROMPTS)), rng.choices(range(len(VARIANTS)), weights=[16, 16, 8, 1])[0])
            if key not in expected:
                expected[key] = run(sync, [PROMPTS[key[0]]], VARIANTS[key[1]])[0][0]
            engine.add_request(f"a{i}", {"prompt_token_ids": PROMPTS[key[0]]}, VARIANTS[key[1]])
            live[f"a{i}"] = key
        if rng.random() < 0.1:
            victim = rng.choice(sorted(live))
            engine.abort_request(victim)  # possibly while a step that computes it is in flight
            del live[victim]
        for out in engine.step():
            if out.finished:
                c = out.outputs[0]
                assert (c.token_ids, c.text, c.finish_reason, c.stop_reason) == expected[live.pop(out.request_id)]
                finished += 1
        engine.check_invariants()  # blocks held back for a step in flight are counted as held
    engine.abort_request(sorted(live))
    while engine.has_unfinished_requests():
        engine.step()
    assert finished > 20 and engine.get_stats().num_preemptions > 0
    assert_all_back(ahead)


@pytest.mark.parametrize("arch", ["qwen3_next", "mixtral"])
def test_hybrid_and_moe_models(random_model_dir, arch):
    model = str(random_model_dir(arch))
    args = dict(max_model_len=128, num_gpu_blocks=48, max_num_seqs=4, max_num_batched_tokens=32)
    params = params_mix(1)
    want = run(LLM(model, **args), PROMPTS, params)
    ahead = LLM(model, async_scheduling=True, **args)
    assert run(ahead, PROMPTS, params) == want
    assert_all_back(ahead)


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="the triton backend on CPU tensors, interpreted")
def test_decode_graphs_launched_ahead(pair, random_model_dir):
    """The CUDA path's decode graphs (capture off: the same buffers, logits and greedy ids from the graph's
    forward) under async scheduling, against the synchronous eager engine."""
    from cb_serve.model_executor.cuda_graph import DecodeGraphRunner

    sync, _ = pair
    args = dict(max_model_len=128, num_gpu_blocks=12, max_num_seqs=6, max_num_batched_tokens=48)
    ahead = LLM(str(random_model_dir("llama")), attention_backend="triton", async_scheduling=True, **args)
    engine = ahead.engine
    runner = engine.runner
    runner.graph_runner = DecodeGraphRunner(
        runner.decode_graph_forward, [1, 2, 4, 8], engine.max_model_len, engine.block_size, engine.device, capture=False
    )
    used = []
    run_graph = runner.graph_runner.run
    runner.graph_runner.run = lambda ids, pos, meta: (used.append(ids.shape[0]), run_graph(ids, pos, meta))[1]
    params = [
        SamplingParams(temperature=0, max_tokens=6, ignore_eos=True),
        SamplingParams(temperature=0.8, seed=3, max_tokens=5),
        SamplingParams(temperature=0, max_tokens=3),
    ]
    assert run(ahead, PROMPTS[:3], params) == run(sync, PROMPTS[:3], params)
    assert used  # decode steps replayed "graphs"
    assert_all_back(ahead)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_async_scheduling_with_graphs(random_model_dir):
    """On CUDA (async scheduling and decode graphs on by default): the same tokens as synchronous steps."""
    model = str(random_model_dir("llama"))
    args = dict(device="cuda", dtype="float32", max_model_len=128, num_gpu_blocks=64, max_num_seqs=8)
    ahead = LLM(model, **args)
    assert ahead.engine.async_scheduling and ahead.engine.runner.graph_runner is not None
    params = params_mix(4)
    got = run(ahead, PROMPTS, params)
    assert_all_back(ahead)
    ahead.engine.async_scheduling = False  # between generate calls nothing is in flight
    assert run(ahead, PROMPTS, params) == got


@pytest.mark.parametrize("faults", ["step:STEP_FAULT", "request:REQUEST_FAULT", "step:#3"])
def test_failures_under_async_scheduling_give_every_block_back(random_model_dir, faults):
    """A step that fails as it is launched (its own first step, or the third, with one in flight) fails its
    requests alone, and a request's own failure while its output is made fails it alone; every block and slot
    comes back, and the engine goes on."""
    from cb_serve.errors import RequestFailedError, StepFailedError

    args = dict(max_model_len=128, num_gpu_blocks=24, max_num_seqs=4, async_scheduling=True)
    llm = LLM(str(random_model_dir("llama")), fault_injection=faults, **args)
    engine = llm.engine
    texts = ["STEP_FAULT now", "REQUEST_FAULT here", "a healthy one", "another healthy one"]
    finals = {}
    for i, text in enumerate(texts):
        engine.add_request(f"r{i}", text, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
        if i == 0:  # alone in the first launch: it fails with nothing in flight
            finals.update((o.request_id, o) for o in engine.step() if o.finished)
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out
    assert set(finals) == {"r0", "r1", "r2", "r3"}
    errors = {r: type(o.error) for r, o in finals.items() if o.error is not None}
    if faults.startswith("request"):
        assert errors == {"r1": RequestFailedError}
    elif faults == "step:STEP_FAULT":
        assert errors == {"r0": StepFailedError}
    else:  # the third launch: its requests fail, the one in flight's tokens of them are dropped
        assert errors and set(errors.values()) == {StepFailedError}
    for request_id in set(finals) - set(errors):
        assert len(finals[request_id].outputs[0].token_ids) == 6
    assert_all_back(llm)
    again = run(llm, [PROMPTS[0]], SamplingParams(temperature=0, max_tokens=3))  # the engine goes on
    assert len(again[0][0][0]) == 3


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_launches_never_wait_for_the_device(random_model_dir):
    """Under torch's sync debug mode ("error": any host wait for the device raises), every launch of a step
    ahead: prefills, decode graphs, greedy, temperature with top-k / top-p / min-p, seeds (drawn on the device),
    logprobs, penalties (the step in flight's token counted there), bias, allowed ids and min_tokens."""
    model = str(random_model_dir("llama"))
    llm = LLM(model, device="cuda", dtype="float32", max_model_len=128, num_gpu_blocks=64, max_num_seqs=8)
    engine = llm.engine
    launch = engine.executor.launch

    def checked(sched):
        torch.cuda.set_sync_debug_mode("error")
        try:
            return launch(sched)
        finally:
            torch.cuda.set_sync_debug_mode("default")

    engine.executor.launch = checked
    params = [
        SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
        SamplingParams(temperature=0.8, top_k=20, top_p=0.9, min_p=0.05, max_tokens=8, ignore_eos=True),
        SamplingParams(temperature=0.7, seed=11, max_tokens=8, ignore_eos=True),
        SamplingParams(temperature=0, logprobs=2, max_tokens=8, ignore_eos=True),
        SamplingParams(temperature=0, repetition_penalty=1.3, frequency_penalty=0.5, max_tokens=8, ignore_eos=True),
        SamplingParams(temperature=0.8, seed=2, logit_bias={11: 3.0}, min_tokens=8, max_tokens=8),
        SamplingParams(temperature=0, allowed_token_ids=[11, 12, 13], presence_penalty=1.0, max_tokens=8),
    ]
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS[: len(params)]], params, use_tqdm=False)
    assert all(o.error is None and len(o.outputs[0].token_ids) == 8 for o in outs)
    assert_all_back(llm)
