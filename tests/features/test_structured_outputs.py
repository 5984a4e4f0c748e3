"""The structured-outputs foundation (issue 23): constraint parameters and their caps, the
llguidance backend on SmolLM2's tokenizer (a matcher follows a valid output token by token and
refuses an invalid one), the bitmask applied to logits, and the compiler's cache and thread."""

from __future__ import annotations

import json
import threading
import time

import pytest
import torch

from cb_serve.errors import InvalidRequestError
from cb_serve.structured_outputs import (
    ConstraintLimits,
    GrammarCompiler,
    StructuredOutputsParams,
    allocate_bitmask,
    apply_bitmask,
)

llguidance_backend = pytest.importorskip("cb_serve.structured_outputs.llguidance_backend")

PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer", "minimum": 0, "maximum": 150}},
    "required": ["name", "age"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def backend(tokenizer):
    return llguidance_backend.LLGuidanceBackend(tokenizer, vocab_size=len(tokenizer))


def allowed(matcher, vocab_size: int) -> set[int]:
    bitmask = allocate_bitmask(1, vocab_size)
    bitmask.zero_()
    matcher.fill_bitmask(bitmask, 0)
    logits = torch.zeros(1, vocab_size)
    apply_bitmask(logits, bitmask)
    return set(torch.nonzero(logits[0] == 0).flatten().tolist())


def follow(backend, tokenizer, params: StructuredOutputsParams, text: str) -> bool:
    """Whether the matcher allows ``text``'s tokens one by one (each in the mask, then accepted)
    and, after them, only the end."""
    matcher = backend.compile(params).matcher()
    for token in tokenizer.encode(text, add_special_tokens=False):
        if token not in allowed(matcher, backend.vocab_size) or not matcher.accept_token(token):
            return False
    after = allowed(matcher, backend.vocab_size)
    return matcher.is_terminated or after <= {tokenizer.eos_token_id}


# ---- parameters and caps --------------------------------------------------------------
def test_exactly_one_constraint():
    with pytest.raises(InvalidRequestError, match="exactly one"):
        StructuredOutputsParams()
    with pytest.raises(InvalidRequestError, match="exactly one"):
        StructuredOutputsParams(regex="a+", choice=["a"])
    assert StructuredOutputsParams(choice=["a", "b"]).kind == "choice"
    assert StructuredOutputsParams(json_object=True).kind == "json_object"


def test_equal_constraints_have_one_key_whatever_their_form():
    as_dict = StructuredOutputsParams(json=PERSON)
    as_text = StructuredOutputsParams(json=json.dumps(PERSON, indent=2))
    assert as_dict.key() == as_text.key() != StructuredOutputsParams(json={"type": "string"}).key()


def nested(depth: int) -> dict:
    schema: dict = {"type": "string"}
    for _ in range(depth):
        schema = {"type": "array", "items": schema}
    return schema


@pytest.mark.parametrize(
    "params, match",
    [
        (StructuredOutputsParams(json={"enum": list(range(10_000))}), "nodes"),
        (StructuredOutputsParams(json={"type": "string", "description": "x" * (1 << 20)}), "bytes"),
        (StructuredOutputsParams(json=nested(40)), "deeper"),
        (StructuredOutputsParams(json="{not json"), "not valid JSON"),
        (StructuredOutputsParams(json=[1, 2]), "must be an object"),
        (StructuredOutputsParams(regex="a" * 5000), "regex"),
        (StructuredOutputsParams(choice=[]), "choice"),
        (StructuredOutputsParams(choice=["ok", ""]), "choice"),
    ],
    ids=["10k-enum", "1MB-schema", "40-deep", "bad-json", "not-an-object", "long-regex", "no-choice", "empty-choice"],
)
def test_a_constraint_over_a_cap_is_refused_at_once(params, match):
    started = time.perf_counter()
    with pytest.raises(InvalidRequestError, match=match) as refused:
        params.check(ConstraintLimits())
    assert refused.value.param == "structured_outputs"
    assert time.perf_counter() - started < 1.0


# ---- the llguidance backend --------------------------------------------------------------
def test_a_json_schema_admits_a_valid_object_and_refuses_an_invalid_one(backend, tokenizer):
    params = StructuredOutputsParams(json=PERSON)
    assert follow(backend, tokenizer, params, '{"name":"Ada","age":36}')
    assert not follow(backend, tokenizer, params, '{"name":"Ada","age":-3}')  # below minimum
    assert not follow(backend, tokenizer, params, '{"name":"Ada","age":36,"x":1}')  # additionalProperties
    assert not follow(backend, tokenizer, params, '{"age":36}')  # name is required


def test_regex_choice_json_object_and_lark_grammar(backend, tokenizer):
    assert follow(backend, tokenizer, StructuredOutputsParams(regex=r"\d{3}-\d{4}"), "555-1234")
    assert not follow(backend, tokenizer, StructuredOutputsParams(regex=r"\d{3}-\d{4}"), "555-12345")
    choice = StructuredOutputsParams(choice=["positive", "negative"])
    assert follow(backend, tokenizer, choice, "negative") and not follow(backend, tokenizer, choice, "neutral")
    assert follow(backend, tokenizer, StructuredOutputsParams(json_object=True), '{"a":[1,2]}')
    assert not follow(backend, tokenizer, StructuredOutputsParams(json_object=True), "[1,2]")
    grammar = 'start: "yes" | "no"'
    assert follow(backend, tokenizer, StructuredOutputsParams(grammar=grammar), "yes")


def test_forced_tokens_and_rollback(backend, tokenizer):
    matcher = backend.compile(StructuredOutputsParams(regex="constant-prefix-[0-9]")).matcher()
    forced = matcher.forced_tokens()
    assert tokenizer.decode(forced) and "constant-prefix-".startswith(tokenizer.decode(forced))
    before = allowed(matcher, backend.vocab_size)
    assert matcher.accept_token(forced[0])
    matcher.rollback(1)
    assert allowed(matcher, backend.vocab_size) == before


@pytest.mark.parametrize(
    "params",
    [
        StructuredOutputsParams(regex="(unclosed"),
        StructuredOutputsParams(json={"type": "nonsense"}),
        StructuredOutputsParams(grammar="start: undefined_rule"),
    ],
    ids=["bad-regex", "bad-schema", "bad-grammar"],
)
def test_a_constraint_the_backend_cannot_compile_is_a_400_naming_it(backend, params):
    with pytest.raises(InvalidRequestError, match=f"the {params.kind} cannot be used") as refused:
        backend.compile(params)
    assert refused.value.param == "structured_outputs" and "\n" not in str(refused.value)


# ---- the bitmask on logits -------------------------------------------------------------
def test_apply_bitmask_masks_exactly_the_cleared_bits_of_the_rows_named():
    """Bitmask row i masks logits row rows[i]; the other rows are untouched."""
    vocab = 70  # not a multiple of 32: the last word is partly padding
    allowed_ids = {0: {0, 31, 32, 69}, 2: {5}}
    bitmask = torch.zeros(len(allowed_ids), (vocab + 31) // 32, dtype=torch.int32)
    for i, ids in enumerate(allowed_ids.values()):
        for t in ids:
            bitmask[i, t // 32] |= torch.tensor(1 << (t % 32), dtype=torch.int64).to(torch.int32)
    logits = torch.randn(3, vocab)
    original = logits.clone()
    apply_bitmask(logits, bitmask, rows=[0, 2])
    for row in range(3):
        kept = set(torch.nonzero(torch.isfinite(logits[row])).flatten().tolist())
        assert kept == allowed_ids.get(row, set(range(vocab)))
        assert torch.equal(logits[row][list(kept)], original[row][list(kept)])


# ---- the compiler -----------------------------------------------------------------------
def test_the_compiler_caches_by_constraint_and_compiles_off_the_calling_thread(backend):
    compiler = GrammarCompiler(lambda: backend)
    threads: list[str] = []
    real = backend.compile

    def recording(params):
        threads.append(threading.current_thread().name)
        return real(params)

    backend.compile = recording
    try:
        first = compiler.submit(StructuredOutputsParams(json=PERSON))
        again = compiler.submit(StructuredOutputsParams(json=json.dumps(PERSON)))
        assert again is first and first.result(timeout=30) is not None
        bad = compiler.submit(StructuredOutputsParams(regex="(unclosed"))
        with pytest.raises(InvalidRequestError):
            bad.result(timeout=30)
        assert compiler.submit(StructuredOutputsParams(regex="(unclosed")) is not bad  # failures are not cached
    finally:
        backend.compile = real
        compiler.shutdown()
    assert len(threads) >= 2 and all(name.startswith("cb-serve-grammar") for name in threads)


def test_the_compile_deadline_counts_compiling_only(backend):
    """A compile over ``compile_timeout_s`` refuses its request (a 400); the request queued behind
    it is not charged for the wait, nor for the backend's one-off setup."""
    from cb_serve.structured_outputs.manager import StructuredOutputManager
    from cb_serve.structured_outputs_params import ConstraintLimits

    slow, fast = StructuredOutputsParams(regex="slow+"), StructuredOutputsParams(regex="fast+")
    real = backend.compile

    def compile_(params):
        time.sleep(0.8 if params == slow else 0.0)
        return real(params)

    def setup():
        time.sleep(0.5)  # as wrapping a tokenizer does
        return backend

    admission = StructuredOutputManager(None, backend.vocab_size, limits=ConstraintLimits(compile_timeout_s=0.4))
    admission._make_backend = setup
    backend.compile = compile_
    try:
        for rid, constraint in (("slow", slow), ("fast", fast)):
            admission.add_request(rid, constraint, [])
        refused: list = []
        deadline = time.monotonic() + 10
        while admission.waiting and time.monotonic() < deadline:
            refused += admission.admit()[1]
            time.sleep(0.02)
    finally:
        backend.compile = real
        admission.compiler.shutdown()
    assert [(rid, "compiling took over" in str(e)) for rid, e in refused] == [("slow", True)]
    assert not admission.waiting  # the fast one was admitted after waiting over the deadline


@pytest.mark.parametrize(
    "schema",
    [
        {"type": ["object", "null"], "properties": {"next": {"$ref": "#"}}, "required": ["next"]},
        {"properties": {"next": {"$ref": "#"}}, "required": ["next"]},  # no type: a scalar is an instance
        {"type": ["array", "null"], "minItems": 1, "items": {"$ref": "#"}},
        {"anyOf": [{"type": "object"}, {"type": "null"}], "properties": {"n": {"$ref": "#"}}, "required": ["n"]},
        {"type": "object", "properties": [1], "required": "x"},  # malformed: no claim, no crash
        {"allOf": 5, "anyOf": 3},
        {"type": "array", "minItems": 2, "prefixItems": {"a": 1}},
    ],
)
def test_schemas_with_small_instances_are_never_refused(schema):
    from cb_serve.schema_bounds import smallest_instance

    assert smallest_instance(schema) <= 3


@pytest.mark.parametrize(
    "schema",
    [
        {"$ref": "#/$defs/a", "$defs": {"a": {"$ref": "#/$defs/a"}}},
        {"type": "object", "properties": {"a": {"$ref": "#"}}, "required": ["a"]},
        {"type": "array", "minItems": 1, "items": {"$ref": "#"}},
    ],
)
def test_schemas_without_a_finite_instance_are_refused(schema):
    with pytest.raises(InvalidRequestError, match="no instance of at most"):
        StructuredOutputsParams(json=schema).check(ConstraintLimits())
