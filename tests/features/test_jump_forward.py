"""Jump-forward (issue 23): tokens a grammar forces are appended without a step of their own, only
where the mask admits that token and nothing else, so greedy output is the same token for token
with and without it (and equals HF ``generate`` under llguidance's mask: test_structured_engine.py
runs with jump-forward on); fewer steps; max_tokens, stop strings and logprobs still hold; the
inspector marks the forced tokens."""

from __future__ import annotations

import json
from types import SimpleNamespace

import jsonschema
import pytest
from json_schemas import SCHEMAS

from cb_serve import LLM, SamplingParams, StructuredOutputsParams

llguidance = pytest.importorskip("llguidance")

KEYS = {  # long fixed keys and enums: most of the output is forced
    "type": "object",
    "properties": {
        "customer_identification_number": {"type": "integer", "minimum": 0, "maximum": 99},
        "preferred_contact_channel_for_notifications": {"enum": ["electronic_mail", "short_message_service"]},
        "account_is_currently_active_and_verified": {"type": "boolean"},
    },
    "required": [
        "customer_identification_number",
        "preferred_contact_channel_for_notifications",
        "account_is_currently_active_and_verified",
    ],
    "additionalProperties": False,
}
CHOICE = StructuredOutputsParams(choice=["the quick brown fox jumps over the lazy dog", "a"])
PROMPTS = [[1, 5, 9, 23, 42, 7], [3, 3, 3, 8], [11, 12, 13, 14, 15]]


@pytest.fixture(scope="module")
def engines(random_model_dir):
    model = str(random_model_dir("llama"))
    kwargs = dict(max_model_len=512, num_gpu_blocks=256, inspector_steps=500)
    return LLM(model, **kwargs), LLM(model, enable_jump_forward=False, **kwargs)


def steps_and_outputs(llm: LLM, prompts, params):
    engine = llm.engine
    before, jumped = engine.num_steps, engine.jump_forward_tokens
    outs = llm.generate(prompts, params, use_tqdm=False)
    return engine.num_steps - before, engine.jump_forward_tokens - jumped, outs


def test_greedy_output_is_the_same_with_fewer_steps(engines):
    on, off = engines
    constraints = [StructuredOutputsParams(json=KEYS), CHOICE, StructuredOutputsParams(regex=r"id-[0-9]{3}-end")]
    for constraint in constraints:
        params = SamplingParams(temperature=0, max_tokens=120, structured_outputs=constraint)
        steps_on, jumped, outs_on = steps_and_outputs(on, PROMPTS, params)
        steps_off, none, outs_off = steps_and_outputs(off, PROMPTS, params)
        assert none == 0 and jumped > 0
        assert steps_on < steps_off
        for a, b in zip(outs_on, outs_off):
            assert a.outputs[0].token_ids == b.outputs[0].token_ids
            assert a.outputs[0].finish_reason == b.outputs[0].finish_reason == "stop"


def test_key_heavy_suite_schemas_on_smollm2_match_and_validate(smol_llm):
    """The suite's key-heavy schemas on the real model: the same tokens with jump-forward off."""
    heavy = [(n, s) for n, s in SCHEMAS if n.startswith("key_heavy")]
    assert heavy
    messages = [[{"role": "user", "content": f"Write one example {n.replace('_', ' ')} as JSON."}] for n, _ in heavy]
    params = [SamplingParams(temperature=0, max_tokens=200, structured_outputs=StructuredOutputsParams(json=s))
              for _, s in heavy]  # fmt: skip
    engine = smol_llm.engine
    jumped = engine.jump_forward_tokens
    outs = smol_llm.chat(messages, params, use_tqdm=False)
    assert engine.jump_forward_tokens > jumped
    engine.structured.enable_jump_forward = False
    try:
        plain = smol_llm.chat(messages, params, use_tqdm=False)
    finally:
        engine.structured.enable_jump_forward = True
    for (name, schema), a, b in zip(heavy, outs, plain):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids, name
        if a.outputs[0].finish_reason == "stop":
            jsonschema.validate(json.loads(a.outputs[0].text), schema)


def test_max_tokens_stop_strings_and_logprobs_still_hold(engines):
    on, off = engines
    cut = SamplingParams(temperature=0, max_tokens=5, structured_outputs=CHOICE)
    (a,), (b,) = on.generate(PROMPTS[:1], cut, use_tqdm=False), off.generate(PROMPTS[:1], cut, use_tqdm=False)
    assert a.outputs[0].token_ids == b.outputs[0].token_ids and len(a.outputs[0].token_ids) <= 5
    stop = SamplingParams(temperature=0, max_tokens=60, stop=["brown"], structured_outputs=CHOICE)
    (a,), (b,) = on.generate(PROMPTS[:1], stop, use_tqdm=False), off.generate(PROMPTS[:1], stop, use_tqdm=False)
    assert a.outputs[0].text == b.outputs[0].text and "brown" not in a.outputs[0].text
    logprobs = SamplingParams(temperature=0, max_tokens=60, logprobs=2, structured_outputs=CHOICE)
    steps, jumped, (out,) = steps_and_outputs(on, PROMPTS[:1], logprobs)
    assert jumped == 0 and len(out.outputs[0].logprobs) == len(out.outputs[0].token_ids)


def test_only_a_token_the_mask_alone_admits_is_forced(tokenizer):
    from cb_serve.structured_outputs.llguidance_backend import LLGuidanceBackend
    from cb_serve.structured_outputs.manager import StructuredOutputManager

    backend = LLGuidanceBackend(tokenizer, len(tokenizer))
    matcher = backend.compile(StructuredOutputsParams(choice=["alphabet soup", "alpha"])).matcher()
    manager = StructuredOutputManager(tokenizer, backend.vocab_size, enable_jump_forward=True)
    seq = SimpleNamespace(matcher=matcher, params=SamplingParams())
    assert list(manager.forced_tokens(seq, 8)) == []  # "alpha" or "alphabet soup": nothing forced yet
    for token_id in tokenizer.encode("alphabet", add_special_tokens=False):
        assert matcher.accept_token(token_id)
    forced = []
    for token_id in manager.forced_tokens(seq, 8):  # each appended before the next is checked
        assert not manager.accept_token(seq, token_id) or tokenizer.decode([*forced, token_id]) == " soup"
        forced.append(token_id)
    assert tokenizer.decode(forced) == " soup" and matcher.is_terminated
    assert list(manager.forced_tokens(SimpleNamespace(matcher=matcher, params=SamplingParams(logprobs=1)), 8)) == []

    class Offers(SimpleNamespace):  # a backend offering tokens outside the vocabulary: never forced
        def forced_tokens(self):
            return self.tokens

        def fill_bitmask(self, bitmask, row):
            bitmask[row] = 0

    for bad in (-1, backend.vocab_size):
        assert (
            list(manager.forced_tokens(SimpleNamespace(matcher=Offers(tokens=[bad]), params=SamplingParams()), 8)) == []
        )


def test_the_inspector_marks_forced_tokens(engines):
    on, _ = engines
    start = on.engine.num_steps
    keys = StructuredOutputsParams(json=KEYS)  # forced keys between free values: forced chunks get computed
    on.generate(PROMPTS[:1], SamplingParams(temperature=0, max_tokens=120, structured_outputs=keys), use_tqdm=False)
    seqs = [q for r in on.engine.inspector.steps if r.step_id > start for q in r.seqs]
    assert any(q.forced > 0 and q.constrained for q in seqs)
    assert all(q.forced == 0 for q in seqs if q.is_decode)
    (request_id,) = {q.request_id for q in seqs}
    timeline = on.engine.inspect("timeline", request_id=request_id)
    assert timeline["first_token"] is not None  # forced tokens right after the first do not hide it
