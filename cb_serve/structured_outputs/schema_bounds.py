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
        except RecursionError:  # a reference chain thousands long: no claim
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
    for key in ("allOf",):
        sizes += [_size(s, root, estimates, seen) for s in node.get(key) or []]
    for key in ("anyOf", "oneOf"):
        options = [_size(s, root, estimates, seen) for s in node.get(key) or []]
        if options:
            sizes.append(min(options))
    return max(sizes)


def _own_size(node: dict[str, Any], root: Any, estimates: dict[str, float], seen: dict[str, float]) -> float:
    if "const" in node or "enum" in node:
        return 1.0 if node.get("enum", [None]) else math.inf
    properties = node.get("properties") or {}
    required = node.get("required") or []
    if node.get("type") == "object" or properties or required:
        return 1.0 + sum(_size(properties.get(k, True), root, estimates, seen) for k in required if isinstance(k, str))
    min_items = node.get("minItems", 0)
    if isinstance(min_items, int) and min_items > 0:
        prefix = node.get("prefixItems") or []
        items = [prefix[i] if i < len(prefix) else node.get("items", True) for i in range(min(min_items, 1024))]
        return 1.0 + sum(_size(item, root, estimates, seen) for item in items) + max(0, min_items - 1024)
    return 1.0
