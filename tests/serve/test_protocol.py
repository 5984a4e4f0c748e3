"""The request bodies' JSON types are strict, as OpenAI's (a string is no boolean, a boolean no
number), and unknown top-level fields are refused by name: each field of each request model
gets a value of a wrong JSON type and must be refused naming that field."""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import BaseModel, TypeAdapter, ValidationError

pytest.importorskip("fastapi")
from cb_serve.serve.protocol import UNSUPPORTED_EXTRAS, ChatCompletionRequest, CompletionRequest  # noqa: E402

VALID: dict[type[BaseModel], dict[str, Any]] = {
    CompletionRequest: {"prompt": "x"},
    ChatCompletionRequest: {"messages": [{"role": "user", "content": "x"}]},
}


def accepts(annotation: Any, value: Any) -> bool:
    try:
        TypeAdapter(annotation).validate_python(value, strict=True)
    except ValidationError:
        return False
    return True


def wrong_values(annotation: Any) -> list[Any]:
    """JSON values of a type the field does not take (empty: it takes anything)."""
    return [v for v in ("1", 12345, True, 1.5, [1], {"a": 1}) if not accepts(annotation, v)][:3]


CASES = [
    (model, name, value)
    for model in VALID
    for name, field in model.model_fields.items()
    for value in wrong_values(field.annotation)
]


@pytest.mark.parametrize("model, name, value", CASES, ids=[f"{m.__name__}.{n}={v!r}" for m, n, v in CASES])
def test_a_value_of_the_wrong_json_type_is_refused_naming_its_field(model, name, value):
    with pytest.raises(ValidationError) as refused:
        model.model_validate({**VALID[model], name: value})
    assert refused.value.errors()[0]["loc"][0] == name


def test_every_field_that_takes_a_type_is_checked():
    for model in VALID:
        untyped = {n for n, f in model.model_fields.items() if not wrong_values(f.annotation)}
        declared_to_refuse = set(UNSUPPORTED_EXTRAS) | {"audio", "prediction", "web_search_options", "documents"}
        assert untyped <= declared_to_refuse | {"function_call"}, untyped


@pytest.mark.parametrize(
    "field, value",
    [("stream", "yes"), ("stream", 1), ("temperature", "0.5"), ("temperature", True), ("max_tokens", 16.0)],
)
def test_lax_coercions_are_gone(field, value):
    with pytest.raises(ValidationError):
        CompletionRequest.model_validate({"prompt": "x", field: value})


def test_numbers_stand_for_floats_and_messages_ignore_response_fields():
    request = CompletionRequest.model_validate({"prompt": "x", "temperature": 0, "top_p": 1})
    assert request.temperature == 0.0 and request.top_p == 1.0
    # What the openai client sends back when a response message is appended to the history.
    message = {"role": "assistant", "content": "hi", "refusal": None, "annotations": [], "audio": None}
    ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "x"}, message]})


@pytest.mark.parametrize("model", list(VALID))
def test_unknown_top_level_fields_are_refused_by_name(model):
    with pytest.raises(ValidationError) as refused:
        model.model_validate({**VALID[model], "made_up_backend": "xgrammar"})
    error = refused.value.errors()[0]
    assert error["type"] == "extra_forbidden" and error["loc"] == ("made_up_backend",)


def test_openai_fields_that_change_nothing_are_accepted_and_those_that_would_are_unsupported():
    chat = {**VALID[ChatCompletionRequest], "metadata": {"k": "v"}, "store": False, "service_tier": "auto"}
    assert ChatCompletionRequest.model_validate(chat).unsupported() == []
    reasoning = ChatCompletionRequest.model_validate({**chat, "reasoning_effort": "high"})
    assert reasoning.unsupported() == []  # the chat template's thinking switch decides (a 400 without one)
    verbose = ChatCompletionRequest.model_validate({**chat, "verbosity": "low", "use_beam_search": True})
    assert [name for name, _ in verbose.unsupported()] == ["use_beam_search", "verbosity"]
