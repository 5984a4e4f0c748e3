"""What a request constrains its output to (vLLM's ``StructuredOutputsParams``), and the caps a
client's constraint must fit before anything compiles it."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from cb_serve.errors import InvalidRequestError
from cb_serve.schema_bounds import smallest_instance

PARAM = "structured_outputs"


@dataclass(frozen=True)
class ConstraintLimits:
    """Caps on a client's constraint, checked in the caller before it is compiled: a schema
    bomb is a 400 in bounded time, never a stalled compiler."""

    max_schema_bytes: int = 64 * 1024  # a JSON schema, serialized
    max_schema_depth: int = 32  # nesting of objects and arrays in the schema document
    max_schema_nodes: int = 4096  # objects, arrays and values in the schema document (10k-member enums)
    max_regex_chars: int = 4096
    max_grammar_chars: int = 64 * 1024
    max_choices: int = 1024
    max_choice_chars: int = 4096
    max_smallest_instance: int = 65_536  # values in the smallest output a schema allows ($ref bombs)
    compile_timeout_s: float = 10.0

    def __post_init__(self) -> None:
        assert min(self.max_schema_bytes, self.max_schema_depth, self.max_schema_nodes) > 0
        assert min(self.max_regex_chars, self.max_grammar_chars, self.max_choices, self.max_choice_chars) > 0
        assert self.compile_timeout_s > 0


@dataclass(frozen=True)
class StructuredOutputsParams:
    """Exactly one of: ``json`` (a JSON schema, as a dict or its text), ``regex``, ``choice``
    (the output is one of these strings), ``grammar`` (a Lark grammar, llguidance's dialect),
    or ``json_object=True`` (any JSON object). With a reasoning model the constraint applies once the
    reasoning ends; ``enable_in_reasoning`` (vLLM's server-wide flag, here per request): from the first
    token, for a grammar that writes the reasoning too (as Harmony's forced tool calls do)."""

    json: dict[str, Any] | str | None = None
    regex: str | None = None
    choice: tuple[str, ...] | list[str] | None = None
    grammar: str | None = None
    json_object: bool = False
    enable_in_reasoning: bool = False

    def __post_init__(self) -> None:
        given = [k for k in ("json", "regex", "choice", "grammar") if getattr(self, k) is not None]
        given += ["json_object"] if self.json_object else []
        if len(given) != 1:
            raise InvalidRequestError(
                f"structured_outputs needs exactly one of json, regex, choice, grammar, json_object; got {given}.",
                PARAM,
            )
        if self.choice is not None:
            object.__setattr__(self, "choice", tuple(self.choice))

    @property
    def kind(self) -> str:
        """``json``, ``regex``, ``choice``, ``grammar`` or ``json_object``."""
        if self.json_object:
            return "json_object"
        return next(k for k in ("json", "regex", "choice", "grammar") if getattr(self, k) is not None)

    def key(self) -> str:
        """The constraint as canonical text: what compiled grammars are cached by."""
        kind = self.kind
        value = (
            self.schema() if kind == "json" else list(self.choice or ()) if kind == "choice" else getattr(self, kind)
        )
        return json.dumps([kind, value], sort_keys=True, separators=(",", ":"))

    def schema(self) -> dict[str, Any] | bool:
        """The JSON schema (``json`` only), parsed."""
        if isinstance(self.json, str):
            try:
                return json.loads(self.json)
            except json.JSONDecodeError as e:
                raise InvalidRequestError(f"structured_outputs.json is not valid JSON: {e}.", PARAM) from None
        assert self.json is not None
        return self.json

    def check(self, limits: ConstraintLimits) -> None:
        """Raises ``InvalidRequestError`` (a 400) when the constraint is over a cap."""
        kind = self.kind
        if kind == "json":
            check_schema(self.schema(), limits)
        elif kind == "regex":
            _cap(isinstance(self.regex, str) and 0 < len(self.regex) <= limits.max_regex_chars,
                 f"the regex must be 1 to {limits.max_regex_chars} characters")  # fmt: skip
        elif kind == "grammar":
            _cap(isinstance(self.grammar, str) and 0 < len(self.grammar) <= limits.max_grammar_chars,
                 f"the grammar must be 1 to {limits.max_grammar_chars} characters")  # fmt: skip
        elif kind == "choice":
            choices = self.choice or ()
            _cap(0 < len(choices) <= limits.max_choices, f"choice must list 1 to {limits.max_choices} strings")
            _cap(all(isinstance(c, str) and 0 < len(c) <= limits.max_choice_chars for c in choices),
                 f"each choice must be a string of 1 to {limits.max_choice_chars} characters")  # fmt: skip


def _cap(ok: bool, message: str) -> None:
    if not ok:
        raise InvalidRequestError(f"structured_outputs: {message}.", PARAM)


def check_schema(schema: Any, limits: ConstraintLimits) -> None:
    """Size, depth and node count of a JSON schema document (iterative: no recursion to blow)."""
    _cap(isinstance(schema, (dict, bool)), "a JSON schema must be an object (or a boolean)")
    size = len(json.dumps(schema, separators=(",", ":")))
    _cap(size <= limits.max_schema_bytes, f"the schema is {size} bytes, over the limit of {limits.max_schema_bytes}")
    nodes, stack = 0, [(schema, 1)]
    while stack:
        node, depth = stack.pop()
        nodes += 1
        _cap(depth <= limits.max_schema_depth, f"the schema nests deeper than {limits.max_schema_depth} levels")
        _cap(nodes <= limits.max_schema_nodes, f"the schema has more than {limits.max_schema_nodes} nodes")
        children = node.values() if isinstance(node, dict) else node if isinstance(node, list) else ()
        stack.extend((child, depth + 1) for child in children)
    smallest = smallest_instance(schema)
    cap = limits.max_smallest_instance
    _cap(smallest <= cap, f"the schema has no instance of at most {cap} values (a required $ref recursion?)")
