"""The structured-outputs schema suite (tests/json_schemas.py): valid, well-formed, and covering
the features issue 23's acceptance lists; the hostile schemas are what their names say."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from typing import Any

import jsonschema
import pytest
from json_schemas import HOSTILE_SCHEMAS, SCHEMAS
from jsonschema.validators import validator_for

_MAP_KEYWORDS = ("properties", "$defs", "definitions", "patternProperties", "dependentSchemas")
_ONE_KEYWORDS = ("items", "additionalProperties", "contains", "not", "if", "then", "else", "propertyNames")
_LIST_KEYWORDS = ("anyOf", "oneOf", "allOf", "prefixItems")


def subschemas(schema: Any) -> Iterator[dict]:
    """Every schema object inside ``schema`` (itself included), following keywords, not ``$ref``s."""
    if not isinstance(schema, dict):
        return
    yield schema
    for key in _MAP_KEYWORDS:
        for sub in schema.get(key, {}).values():
            yield from subschemas(sub)
    for key in _ONE_KEYWORDS:
        yield from subschemas(schema.get(key))
    for key in _LIST_KEYWORDS:
        for sub in schema.get(key, []):
            yield from subschemas(sub)


def object_depth(schema: Any) -> int:
    """How many object levels nest through properties, items and combinators (references not followed)."""
    if not isinstance(schema, dict):
        return 0
    children = list(schema.get("properties", {}).values())
    children += [schema[k] for k in ("items", "additionalProperties") if isinstance(schema.get(k), dict)]
    for key in _LIST_KEYWORDS:
        children += schema.get(key, [])
    here = 1 if schema.get("type") == "object" or "properties" in schema else 0
    return here + max((object_depth(c) for c in children), default=0)


def resolve(root: dict, ref: str) -> Any:
    assert ref.startswith("#"), f"non-local $ref {ref!r}"
    node: Any = root
    for part in ref[1:].lstrip("/").split("/") if ref != "#" else []:
        node = node[part.replace("~1", "/").replace("~0", "~")]
    return node


def all_nodes(suite: list[tuple[str, dict]]) -> list[tuple[str, dict]]:
    return [(name, node) for name, schema in suite for node in subschemas(schema)]


NODES = all_nodes(SCHEMAS)


def names_using(predicate) -> set[str]:
    return {name for name, node in NODES if predicate(node)}


def test_suite_size_and_unique_names():
    names = [name for name, _ in SCHEMAS]
    assert len(names) >= 32
    assert len(set(names)) == len(names)
    hostile = [name for name, _ in HOSTILE_SCHEMAS]
    assert len(set(hostile)) == len(hostile)
    assert not set(names) & set(hostile)
    assert all(re.fullmatch(r"[a-z0-9_]+", n) for n in names + hostile)


@pytest.mark.parametrize("name,schema", SCHEMAS, ids=[n for n, _ in SCHEMAS])
def test_schema_is_valid_under_its_draft(name, schema):
    cls = validator_for(schema, default=jsonschema.Draft202012Validator)
    cls.check_schema(schema)  # the metaschema, with its format checker (a bad "pattern" regex fails here)
    assert json.loads(json.dumps(schema)) == schema  # plain JSON data


@pytest.mark.parametrize("name,schema", SCHEMAS, ids=[n for n, _ in SCHEMAS])
def test_refs_resolve_and_patterns_are_anchored(name, schema):
    for node in subschemas(schema):
        if "$ref" in node:
            target = resolve(schema, node["$ref"])
            assert isinstance(target, dict), (name, node["$ref"])
        if "pattern" in node:
            pattern = node["pattern"]
            assert pattern.startswith("^") and pattern.endswith("$"), (name, pattern)
            re.compile(pattern)
        if node.get("type") == "object" and "required" in node:
            assert set(node["required"]) <= set(node.get("properties", {})), (name, node["required"])


def test_declared_drafts():
    drafts = {validator_for(s, default=jsonschema.Draft202012Validator) for _, s in SCHEMAS}
    assert jsonschema.Draft202012Validator in drafts
    assert jsonschema.Draft7Validator in drafts


@pytest.mark.parametrize(
    "keyword",
    ["$ref", "anyOf", "oneOf", "enum", "const", "pattern", "format", "minItems", "maxItems", "minimum", "maximum"]
    + ["exclusiveMinimum", "exclusiveMaximum", "minLength", "maxLength", "prefixItems", "additionalProperties"],
)
def test_each_feature_is_covered(keyword):
    assert len(names_using(lambda node: keyword in node)) >= 1, keyword


def test_feature_breadth():
    assert len(names_using(lambda n: "$ref" in n)) >= 5
    assert len(names_using(lambda n: "anyOf" in n)) >= 3
    assert len(names_using(lambda n: "oneOf" in n)) >= 3
    assert len(names_using(lambda n: "enum" in n)) >= 10
    assert len(names_using(lambda n: "pattern" in n)) >= 10
    assert len(names_using(lambda n: "minItems" in n or "maxItems" in n)) >= 10
    assert len(names_using(lambda n: "minimum" in n or "maximum" in n)) >= 10
    assert len(names_using(lambda n: n.get("additionalProperties") is False)) >= 20
    # the two union forms: anyOf with null (Optional[...] in pydantic) and a multi-type "type" list
    assert names_using(lambda n: any(s.get("type") == "null" for s in n.get("anyOf", [])))
    assert names_using(lambda n: isinstance(n.get("type"), list))
    # maps: additionalProperties with a schema
    assert names_using(lambda n: isinstance(n.get("additionalProperties"), dict))


def test_formats():
    formats = {node["format"] for _, node in NODES if "format" in node}
    assert {"uuid", "email", "uri", "date", "date-time"} <= formats


def test_optional_fields():
    def has_optional(node):
        return set(node.get("properties", {})) - set(node.get("required", []))

    assert len(names_using(has_optional)) >= 10


def test_nesting_depth():
    depths = {name: object_depth(schema) for name, schema in SCHEMAS}
    assert max(depths.values()) >= 5
    assert sum(d >= 4 for d in depths.values()) >= 3, depths


def test_recursive_refs():
    def recursive(schema):
        for name, sub in schema.get("$defs", {}).items():
            refs = {n["$ref"] for n in subschemas(sub) if "$ref" in n}
            if f"#/$defs/{name}" in refs:
                return True
        return False

    assert sum(recursive(schema) for _, schema in SCHEMAS) >= 2


def test_key_heavy_schemas():
    """For jump-forward: objects with many long fixed keys, all required."""
    heavy = [
        name
        for name, schema in SCHEMAS
        if len(schema.get("required", [])) >= 10
        and set(schema["required"]) == set(schema["properties"])
        and sum(len(k) >= 25 for k in schema["required"]) >= 10
    ]
    assert len(heavy) >= 2, heavy


def test_hostile_schemas():
    hostile = dict(HOSTILE_SCHEMAS)
    assert {"ref_bomb_exponential", "enum_10k", "large_1mb", "invalid_schema", "invalid_regex"} <= set(hostile)

    bomb = hostile["ref_bomb_exponential"]
    assert len(bomb["$defs"]) > 40  # 2**40+ nodes if the references were inlined
    chain = bomb["$defs"]["d0"]["properties"]
    assert chain["a"]["$ref"] == chain["b"]["$ref"] == "#/$defs/d1"

    enum = hostile["enum_10k"]["properties"]["code"]["enum"]
    assert len(enum) == len(set(enum)) == 10_000

    size = len(json.dumps(hostile["large_1mb"]))
    assert 0.9e6 <= size <= 1.5e6, size

    for name in ("ref_bomb_exponential", "ref_recursion_unsatisfiable", "enum_10k", "large_1mb"):
        jsonschema.Draft202012Validator.check_schema(hostile[name])  # valid, only too big or deep
    for name in ("invalid_schema", "invalid_regex"):
        with pytest.raises(jsonschema.SchemaError):
            jsonschema.Draft202012Validator.check_schema(hostile[name])
    with pytest.raises(re.error):
        re.compile(hostile["invalid_regex"]["properties"]["code"]["pattern"])
