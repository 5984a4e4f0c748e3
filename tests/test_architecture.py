"""The import rules of the package, checked on its source (every import, module level or not):

- shared leaf modules (configs, errors, outputs, prefix hashes, sampling params, sequences, stats,
  the request-side types of capabilities: ``LoRARequest``, ``StructuredOutputsParams``) import only
  each other; no module of a capability package is a leaf;
- ``attention/``, ``cpu_ops/``, ``distributed/``, ``lora/`` and ``structured_outputs/`` sit below
  ``model_executor/``, which sits below ``spec_decode/`` (its draft model and verifier run the
  model), then ``executor/`` and ``engine/`` (the layering ``docs/architecture.md`` draws):
  nothing imports upwards, so no two packages import each other in a circle;
- ``serve/`` uses only the public API (``from cb_serve import <name in __all__>``) and no private
  attribute of anything but its own objects;
- inside ``model_executor/``, ``layers/`` sits below ``models/``, which sits below the rest (loader, runner,
  sampler): no folder imports a folder that imports it back;
- there is no import cycle between modules at all: every import counts, deferred (inside a function) and
  type-checking ones included.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import cb_serve

PACKAGE = Path(cb_serve.__file__).parent
LEAVES = {
    "config",
    "errors",
    "fault_injection",
    "harmony_format",
    "inputs",
    "kv_cache_interface",
    "lora_request",
    "outputs",
    "prefix_hash",
    "sampling_params",
    "schema_bounds",
    "sequence",
    "stats",
    "structured_outputs_params",
    "text_stream",
    "tool_format",
}
# The cb_serve.* groups each group may import (besides itself and the leaves).
ALLOWED = {
    "leaf": set(),
    "cpu_ops": set(),
    "attention": {"cpu_ops"},
    "structured_outputs": set(),  # constraint backends and their manager: below the model runner
    "reasoning": set(),  # reasoning parsers (think tags in text and tokens): the engine and the HTTP layer read them
    "tool_parsers": set(),  # tool-call formats in text: the HTTP layer reads them, through the public API
    "distributed": set(),  # tensor-parallel shards and communicator: below the model
    "lora": {"cpu_ops"},  # adapters' loading, slots and batched apply: below the model runner
    "multimodal": set(),  # images checked and processed, their features and encoder outputs: below the runner
    "model_executor": {"attention", "cpu_ops", "distributed", "lora", "multimodal", "structured_outputs"},
    # proposers, the draft model and verification: above the model they run, below the engine
    "spec_decode": {"model_executor", "structured_outputs"},
    "executor": {"distributed", "model_executor"},  # one rank, or tensor-parallel workers
    "engine": {
        *("attention", "cpu_ops", "distributed", "executor", "lora", "model_executor", "spec_decode"),
        "structured_outputs",
        "reasoning",
        "multimodal",
    },
    # conversations to prompt token ids (the chat template, tools, thinking switches): LLM.chat and the HTTP front end
    "chat_template": {"engine", "model_executor"},
    "llm": {"engine", "chat_template"},
    "cli": {"engine", "root", "llm", "benchmarks"},
    "benchmarks": {"cpu_ops", "model_executor", "root"},  # the serving benchmark: an HTTP client and the HF baseline
}


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def group(module: str) -> str:
    parts = module.split(".")
    if len(parts) == 1:
        return "root"
    return "leaf" if parts[1] in LEAVES else parts[1]


def is_module(name: str) -> bool:
    path = PACKAGE.parent.joinpath(*name.split("."))
    return path.with_suffix(".py").exists() or (path / "__init__.py").exists()


def imports(tree: ast.AST, top_level_only: bool = False) -> list[tuple[str, str | None]]:
    """(module, imported name or None) for every ``cb_serve`` import."""
    nodes = tree.body if top_level_only else ast.walk(tree)
    found = []
    for node in nodes:
        if isinstance(node, ast.Import):
            found += [(a.name, None) for a in node.names if a.name.split(".")[0] == "cb_serve"]
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "cb_serve":
            for alias in node.names:
                sub = f"{node.module}.{alias.name}"
                found.append((sub, None) if is_module(sub) else (node.module, alias.name))
    return found


SOURCES = {module_name(p): ast.parse(p.read_text()) for p in sorted(PACKAGE.rglob("*.py"))}


@pytest.mark.parametrize("module", sorted(m for m in SOURCES if group(m) not in ("root", "serve")))
def test_layers_import_only_downwards(module):
    mine = group(module)
    allowed = ALLOWED[mine] | {mine, "leaf"}
    bad = sorted({m for m, _ in imports(SOURCES[module]) if group(m) not in allowed})
    assert not bad, f"{module} ({mine}) imports {bad}; allowed: {sorted(allowed)}"


@pytest.mark.parametrize("module", sorted(m for m in SOURCES if group(m) == "serve"))
def test_serve_uses_only_the_public_api(module):
    tree = SOURCES[module]
    for imported, name in imports(tree):
        if group(imported) == "serve":
            continue
        assert imported == "cb_serve" and name in cb_serve.__all__, (
            f"{module} imports {imported}{'.' + name if name else ''}: use `from cb_serve import ...` "
            f"(public names: cb_serve.__all__)"
        )
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
            owner = node.value
            assert isinstance(owner, ast.Name) and owner.id in ("self", "cls"), (
                f"{module}:{node.lineno} reads the private attribute .{node.attr} of another object"
            )


def assert_acyclic(graph: dict[str, set[str]], what: str) -> None:
    state: dict[str, int] = {}

    def visit(m: str, path: list[str]) -> None:
        state[m] = 1
        for n in sorted(graph.get(m, set()) - {m}):
            assert state.get(n) != 1, f"{what} cycle: " + " -> ".join([*path[path.index(n) :], n])
            if n not in state:
                visit(n, [*path, n])
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m, [m])


def module_graph() -> dict[str, set[str]]:
    """Every import, at any depth (a deferred or ``TYPE_CHECKING`` import hides a cycle, it does not break it)."""
    graph = {m: {i for i, _ in imports(tree) if i in SOURCES} for m, tree in SOURCES.items()}
    for m, tree in SOURCES.items():  # `from cb_serve import Name` runs the package's __init__
        graph[m] |= {"cb_serve" for i, name in imports(tree) if i == "cb_serve" and name}
    return graph


def test_no_import_cycles():
    assert_acyclic(module_graph(), "import")


def folder(module: str) -> str:
    """The folder a module's file is in (below ``cb_serve/``: ``model_executor.layers``), the root's modules by
    ``group``: the shared leaves, or the root (``llm``, ``cli``, the package's ``__init__``)."""
    path = PACKAGE.parent.joinpath(*module.split("."))
    package = module if (path / "__init__.py").exists() else module.rsplit(".", 1)[0]
    return group(module) if package == "cb_serve" else package.removeprefix("cb_serve.")


def test_no_folder_cycles():
    """No folder imports one that imports it back, at any depth of nesting or of a function: in particular
    ``model_executor/layers/`` < ``model_executor/models/`` < ``model_executor/``."""
    graph: dict[str, set[str]] = {}
    for m, deps in module_graph().items():
        graph.setdefault(folder(m), set()).update(folder(d) for d in deps)
    assert_acyclic(graph, "folder")
    assert {"model_executor", "model_executor.layers", "model_executor.models"} <= set(graph)


def test_no_import_cycles_between_packages():
    """Between the groups (each package, the leaves, the root modules) the imports, at any depth
    of a function, form a layering; and every capability package is a whole group: none of its
    modules is counted as a leaf."""
    graph: dict[str, set[str]] = {}
    for m, tree in SOURCES.items():
        graph.setdefault(group(m), set()).update(group(i) for i, _ in imports(tree) if i in SOURCES or i == "cb_serve")
    assert_acyclic(graph, "package")
    packages = {p.name for p in PACKAGE.iterdir() if (p / "__init__.py").exists()}
    assert not {g for g in packages if g in LEAVES and g != "config"}, "a capability package listed as a leaf"


def test_the_rules_see_the_imports():
    """The checker is not vacuous: it finds the engine's imports of the model executor and the
    leaves, and the serve layer's imports of the public API."""
    engine = {m for m, _ in imports(SOURCES["cb_serve.engine.core"])}
    assert {"cb_serve.model_executor.step_output", "cb_serve.sequence"} <= engine
    assert ("cb_serve", "AsyncLLM") in imports(SOURCES["cb_serve.serve.engine_replica"])


def test_the_step_is_short_and_the_engine_files_small():
    """docs/architecture.md's shape: ``EngineCore.step`` is its few named lines (at most 15), and
    no file of ``engine/`` grows past 350 lines (a concern that needs more is a module of its own)."""
    core = SOURCES["cb_serve.engine.core"]
    (cls,) = [n for n in core.body if isinstance(n, ast.ClassDef) and n.name == "EngineCore"]
    (step,) = [n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == "step"]
    assert step.end_lineno - step.lineno + 1 <= 15
    sizes = {p.name: len(p.read_text().splitlines()) for p in (PACKAGE / "engine").glob("*.py")}
    assert max(sizes.values()) <= 350, sizes


def test_one_grammar_mask_producer():
    """Sampling, draft verification and jump-forward read masks from one producer: the structured
    outputs manager's ``fill_rows`` alone asks a matcher for its mask (a backend probes its own
    grammar's first mask as it compiles it: a grammar that fails there is the request's 400)."""
    callers = [
        module
        for module, tree in SOURCES.items()
        if module != "cb_serve.structured_outputs.llguidance_backend"
        for node in ast.walk(tree)
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "fill_bitmask"
    ]
    assert set(callers) == {"cb_serve.structured_outputs.manager"}


# Model families, which the shared parts of the model wing name none of.
FAMILY_NAMES = ("llama", "mistral", "qwen", "gemma", "olmo", "granite", "phi", "mixtral", "gpt-oss", "gpt_oss")


def test_attention_spec_names_no_family():
    """``AttentionSpec`` is composed of orthogonal features (window, soft-cap, sinks, norms, scale, RoPE table,
    biases, ...): no field, default or comment of it names a model family."""
    module = "cb_serve.model_executor.layers.attention"
    source = (PACKAGE / "model_executor" / "layers" / "attention.py").read_text()
    (spec,) = [n for n in SOURCES[module].body if isinstance(n, ast.ClassDef) and n.name == "AttentionSpec"]
    text = "\n".join(source.splitlines()[spec.lineno - 1 : spec.end_lineno]).lower()
    assert not [name for name in FAMILY_NAMES if name in text]


def test_every_family_is_a_plan_over_the_neutral_base():
    """Each served class derives from ``CausalLM`` itself, not from another family's class (a variant such as
    Mistral is served by its family's class, named in the registry), and declares its plan."""
    from cb_serve.model_executor.models import MODELS, CausalLM

    for model_type, cls in MODELS.items():
        assert cls.__bases__ == (CausalLM,), f"{model_type}: {cls.__name__} derives from {cls.__bases__}"
        assert "plan" in vars(cls), f"{model_type}: {cls.__name__} declares no plan"
    classes = [
        (m, n.name, [ast.unparse(b) for b in n.bases])
        for m, tree in SOURCES.items()
        if m.startswith("cb_serve.model_executor.models.")
        for n in tree.body
        if isinstance(n, ast.ClassDef) and n.name.endswith("ForCausalLM")
    ]
    assert classes and all(bases == ["CausalLM"] for _, _, bases in classes), classes
