"""The batch inspector's records (issue 15): step records reproduce the scheduler's decisions
under chunked prefill, preemption and prefix hits; request timelines agree with them; the KV
block map and the Chrome trace are well formed."""

from __future__ import annotations

import time
from collections import defaultdict

import pytest
from observe import recorded_steps
from trace_format import validate_trace

from cb_serve import EngineConfig, SamplingParams
from cb_serve.engine.inspector import MAX_KV_CELLS
from cb_serve.engine.llm_engine import LLMEngine

BUDGET = 64


@pytest.fixture(scope="module")
def engine(random_model_dir):
    """Small budget (long prompts are chunked) and few KV blocks (decodes preempt)."""
    config = EngineConfig.from_kwargs(
        model=str(random_model_dir("llama")),
        max_model_len=256,
        num_gpu_blocks=24,
        block_size=16,
        max_num_batched_tokens=BUDGET,
        max_num_seqs=8,
        inspector_steps=10_000,
    )
    return LLMEngine(config)


def run(engine, prompts: dict[str, list[int]], max_tokens: int = 40) -> list:
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    for request_id, ids in prompts.items():
        engine.add_request(request_id, ids, params)
    start = engine.num_steps
    with recorded_steps(engine) as stats:
        while engine.has_unfinished_requests():
            engine.step()
    records = [r for r in engine.inspector.steps if r.step_id > start]
    assert len(records) == len(stats)
    return records, stats


@pytest.fixture(scope="module")
def workload(engine):
    """A shared 48-token prefix (a prefix hit for the later requests), prompts of 60-150 tokens
    (chunked under a 64-token budget), and 24 blocks for 6 sequences growing to ~190 tokens
    (preemptions)."""
    shared = list(range(100, 148))
    prompts = {f"r{i}": shared + [1000 + i * 7 + j for j in range(12 + 20 * i)] for i in range(6)}
    engine.add_request("warm", shared + [5, 6, 7], SamplingParams(max_tokens=1))  # caches the shared prefix
    while engine.has_unfinished_requests():
        engine.step()
    records, stats = run(engine, prompts)
    return prompts, records, stats


def test_step_records_reproduce_the_schedule(engine, workload):
    prompts, records, stats = workload
    assert [r.step_id for r in records] == list(range(records[0].step_id, records[0].step_id + len(records)))
    for r, s in zip(records, stats):
        assert r.num_scheduled_tokens == s.num_scheduled_tokens <= BUDGET
        assert len(r.seqs) == s.num_seqs and len(r.preempted) == s.num_preempted
        assert sum(x.num_tokens for x in r.seqs if x.is_decode) == s.num_decode_tokens
        assert r.kv_used + r.kv_free == engine.num_blocks and r.kv_cached_free <= r.kv_free
        assert len({(x.request_id, x.index) for x in r.seqs}) == len(r.seqs)
    assert any(r.preempted for r in records), "the workload must preempt"
    assert any(x.chunk > 1 for r in records for x in r.seqs), "the workload must chunk prefills"

    # Between (re)admissions, each sequence's prefill chunks are numbered 1, 2, ... and cover
    # exactly its tokens from the cached prefix to the target; then decodes follow one by one.
    pieces = defaultdict(list)
    for r in records:
        for x in r.seqs:
            pieces[x.request_id].append((r.step_id, x))
    for request_id, seen in pieces.items():
        computed = target = None
        for step_id, x in seen:
            if x.chunk == 1:  # a (re)admission: starts at its prefix hit
                assert x.computed_before % 16 == 0
            elif computed is not None:
                assert x.computed_before == computed, (request_id, step_id, x)
            if not x.is_decode and x.chunk > 1:
                assert x.target == target  # a chunked prefill keeps its target
            target = x.target
            computed = x.computed_before + x.num_tokens
        assert computed == len(prompts[request_id]) + 40 - 1  # the last token is sampled, never computed


def test_prefix_hits_show_in_the_admissions(engine, workload):
    prompts, records, _ = workload
    timelines = {rid: engine.inspector.timeline(rid) for rid in prompts}
    first = {rid: next(e for e in tl["events"] if e["event"] == "scheduled") for rid, tl in timelines.items()}
    assert all(e["cached_tokens"] >= 48 for e in first.values()), first  # the shared prefix's 3 blocks


def test_timeline_of_a_chunked_and_preempted_request(engine, workload):
    prompts, records, _ = workload
    by_step = {r.step_id: r for r in records}
    preempted = {rid for r in records for rid, _ in r.preempted}
    chunked = {x.request_id for r in records for x in r.seqs if x.chunk > 1}
    assert preempted & chunked, "some request must be both chunked and preempted"
    for rid in prompts:
        tl = engine.inspector.timeline(rid)
        kinds = [e["event"] for e in tl["events"]]
        assert kinds[0] == "scheduled" and kinds[-1] == "finished" and tl["finish_reasons"] == {"0": "length"}
        assert kinds.count("first_token") == 1
        assert kinds.count("preempted") == kinds.count("readmitted") == (rid in preempted) * kinds.count("preempted")
        for e in tl["events"]:  # every step id names a step whose record agrees
            if e["event"] == "prefill":
                x = next(x for x in by_step[e["step"]].seqs if x.request_id == rid)
                assert (x.num_tokens, x.chunk, x.is_decode) == (e["tokens"], e["chunk"], False)
            if e["event"] == "preempted":
                assert (rid, 0) in by_step[e["step"]].preempted
        # The first prefill (before any preemption) covers the prompt beyond the prefix hit.
        upto = kinds.index("first_token")
        first_pass = [e for e in tl["events"][:upto] if e["event"] == "prefill"]
        if "preempted" not in kinds[:upto]:
            assert sum(e["tokens"] for e in first_pass) + tl["events"][0]["cached_tokens"] == len(prompts[rid])
        decode = tl["decode"]["0"]
        decode_steps = [r.step_id for r in records for x in r.seqs if x.request_id == rid and x.is_decode]
        assert decode["steps"] == len(decode_steps) and decode["last_step"] == decode_steps[-1]
        assert tl["arrival"] <= tl["first_token"] <= tl["finished"] and tl["queue_wait_s"] >= 0


def test_kv_map_owners_and_sharing(engine):
    ids = list(range(300, 380))
    params = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True, n=2)
    engine.add_request("kvmap", ids, params)
    engine.step()  # prefill 64 of 80 tokens
    engine.step()
    kv = engine.inspect("state")["kv"]
    assert kv["group"] == 1 and len(kv["cells"]) == engine.num_blocks
    mine = [c for c in kv["cells"] if "kvmap" in c["owners"]]
    assert mine and all(c["state"] == "used" for c in mine)
    assert any(c["shared"] for c in mine), "n=2 shares the prompt's blocks"
    while engine.has_unfinished_requests():
        engine.step()
    kv = engine.inspect("state")["kv"]
    assert not any(c["owners"] for c in kv["cells"]) and any(c["state"] == "cached" and c["hash"] for c in kv["cells"])
    engine.check_invariants()


def test_a_large_cache_is_summarized(random_model_dir):
    config = EngineConfig.from_kwargs(model=str(random_model_dir("llama")), max_model_len=256, num_gpu_blocks=10_000)
    kv = LLMEngine(config).inspect("state")["kv"]
    assert len(kv["cells"]) <= MAX_KV_CELLS and kv["group"] == 3 and sum(c["blocks"] for c in kv["cells"]) == 10_000


def test_an_aborted_request_ends_its_timeline(engine):
    engine.add_request("gone", list(range(10, 90)), SamplingParams(max_tokens=5))
    engine.step()
    engine.abort_request("gone")
    tl = engine.inspector.timeline("gone")
    assert tl["finish_reasons"] == {"0": "abort"} and tl["events"][-1]["event"] == "finished"
    assert not engine.inspector.live


def test_recording_off_records_nothing(random_model_dir):
    config = EngineConfig.from_kwargs(model=str(random_model_dir("llama")), max_model_len=256, inspector_steps=0)
    engine = LLMEngine(config)
    engine.add_request("x", [1, 2, 3], SamplingParams(max_tokens=2))
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.inspector is None and engine.inspect("timeline", request_id="x") is None


def test_trace_export_is_valid_trace_event_json(engine, workload):
    prompts, records, _ = workload
    events = engine.inspect("trace", since=records[0].start - 1, pid=3, name="r1")
    validate_trace(events)
    steps = [e for e in events if e["ph"] == "X"]
    assert len(steps) >= len(records)
    requests = {e["id"] for e in events if e["ph"] == "b" and e["name"].startswith("request ")}
    assert set(prompts) <= requests
    assert any(e["ph"] == "n" and e["name"] == "preempted" for e in events)
    recent = engine.inspect("trace", since=time.time() + 60, pid=3, name="r1")
    assert not [e for e in recent if e["ph"] in "Xb"]
