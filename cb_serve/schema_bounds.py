"""The smallest output a JSON schema allows, counted in JSON values: a schema whose required
``$ref`` recursion has no finite instance, or whose smallest instance is astronomically large (a
reference bomb: each level requiring two of the next), can only run to ``max_tokens``; it is
refused before it compiles. A lower bound, computed as a fixed point over the references."""

from __future__ import annotations

import math
from typing import Any

MAX_ROUNDS = 64  # reference chains longer than this are not followed to the end (never refused for it)


def smallest_instance(schema: Any) -> float:
    """A lower bound on the values in any instance of ``schema`` (``math.inf``: none exists).
    Recursive over the document: call it only on schemas within the depth cap."""
    estimates: dict[str, float] = {}  # $ref -> its target's size, from the previous round
    for _ in range(MAX_ROUNDS):
        seen: dict[str, float] = {}
        try:
            root = _size(schema, schema, estimates, seen)
        except (RecursionError, TypeError, ValueError):  # a reference chain thousands long, or odd values: no claim
            return 1.0
        if seen == estimates:
            return root
        estimates = seen
    return 1.0  # not settled: no claim


def _resolve(root: Any, ref: str) -> Any:
    node = root
    for part in ref[2:].split("/") if ref != "#" else []:
        part = part.replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return True  # a reference this check cannot follow: no claim
    return node


def _size(node: Any, root: Any, estimates: dict[str, float], seen: dict[str, float]) -> float:
    if node is False:
        return math.inf
    if not isinstance(node, dict):
        return 1.0
    sizes = [_own_size(node, root, estimates, seen)]
    ref = node.get("$ref")
    if isinstance(ref, str) and (ref == "#" or ref.startswith("#/")):
        if ref not in seen:
            seen[ref] = math.inf  # a cycle within this round reads the previous round's estimate
            seen[ref] = _size(_resolve(root, ref), root, estimates, seen)
        sizes.append(estimates.get(ref, math.inf))
    sizes += [_size(s, root, estimates, seen) for s in _list(node.get("allOf"))]
    for key in ("anyOf", "oneOf"):
        options = [_size(s, root, estimates, seen) for s in _list(node.get(key))]
        if options:
            sizes.append(min(options))
    return max(sizes)


def _list(value: Any) -> list:
    return value if isinstance(value, list) else []


def _own_size(node: dict[str, Any], root: Any, estimates: dict[str, float], seen: dict[str, float]) -> float:
    """The smallest instance by the node's own keywords: 1 when it may be a scalar or null (object
    keywords bind objects only, ``minItems`` arrays only)."""
    if "const" in node:
        return 1.0
    if "enum" in node:
        return math.inf if node["enum"] == [] else 1.0
    types = node.get("type")
    types = [types] if isinstance(types, str) else _list(types) if types is not None else None
    if types is None or not types or any(t not in ("object", "array") for t in types):
        return 1.0
    options = []
    if "object" in types:
        properties = node.get("properties") if isinstance(node.get("properties"), dict) else {}
        required = [k for k in _list(node.get("required")) if isinstance(k, str)]
        options.append(1.0 + sum(_size(properties.get(k, True), root, estimates, seen) for k in required))
    if "array" in types:
        options.append(_array_size(node, root, estimates, seen))
    return min(options)


def _array_size(node: dict[str, Any], root: Any, estimates: dict[str, float], seen: dict[str, float]) -> float:
    min_items = node.get("minItems", 0)
    if not isinstance(min_items, int) or min_items <= 0:
        return 1.0
    prefix = _list(node.get("prefixItems"))
    items = node.get("items", True)
    first = [prefix[i] if i < len(prefix) else items for i in range(min(min_items, 1024))]
    return 1.0 + sum(_size(item, root, estimates, seen) for item in first) + max(0, min_items - 1024)
