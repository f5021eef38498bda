"""The import graph of the three distributions: no circle, and no import from a lower layer to a higher one.

Every import counts, wherever it stands: at the top of a module, inside a function, or under
``TYPE_CHECKING`` (a reader follows those too). The layers, top to bottom, are ``LAYERS``; a module
belongs to the layer of its longest listed prefix, and a module may import its own layer (its
package's siblings) or any layer below. The graph is read from the source with ``ast``: nothing is
imported.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = {
    "agentspec": ROOT / "agentspec",
    "langchain_agentspec": ROOT / "integrations/langchain/langchain_agentspec",
    "agentspec_toolcalls": ROOT / "toolcalls/agentspec_toolcalls",
}

# Top to bottom. The engine's face (the package ``agentspec`` itself, re-exporting the loop, the
# models and the drafters) sits with the chat layer, above the loop. ``cost`` sits below the drafters:
# the drafting schedule prices passes with its ``VerifyCost``.
LAYERS: list[tuple[str, ...]] = [
    ("langchain_agentspec",),  # the LangChain integration, its own distribution
    ("agentspec.cli",),
    ("agentspec.serve", "agentspec.fleet", "agentspec.bench", "agentspec.distill"),
    ("agentspec.telemetry",),
    ("agentspec.chat", "agentspec"),
    ("agentspec.decode",),
    ("agentspec.models", "agentspec.draft_folder", "agentspec.head_folder"),
    ("agentspec.scheduler", "agentspec.request"),  # the engine's loop, and the requests it runs
    ("agentspec.drafters", "agentspec.warm"),  # warm: a loaded pair's passes, for the models to run at load
    ("agentspec.cost",),
    ("agentspec.cache", "agentspec.static_kv"),
    (
        "agentspec.kv",
        "agentspec.forward",
        "agentspec.linears",
        "agentspec.packed",
        "agentspec.lean",
        "agentspec.attention",
        "agentspec.grammar",
        "agentspec.text",
        "agentspec.verify",
        "agentspec.logprobs",
        "agentspec.sampling",
        "agentspec.config",
        "agentspec.stats",
        "agentspec.memory",
        "agentspec.threads",
        "agentspec.numerics",
        "agentspec.steps",
    ),
    # the tool-call parser, a distribution of its own that the engine and the integration both import
    ("agentspec_toolcalls",),
]


def modules() -> dict[str, Path]:
    """Every module of the packages, by dotted name (a package by its own name)."""
    found = {}
    for name, folder in PACKAGES.items():
        for path in folder.rglob("*.py"):
            parts = [name, *path.relative_to(folder).with_suffix("").parts]
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join(parts)] = path
    return found


def _owner(name: str, known: dict[str, Path]) -> str | None:
    """The module ``name`` lives in (``a.b.c`` may be a function ``c`` of module ``a.b``)."""
    while name and name not in known:
        name = name.rpartition(".")[0]
    return name or None


def imports_of(module: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The project's modules ``module`` imports, anywhere in its source."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: up from this module's package
                up = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join(up + ([node.module] if node.module else []))
            targets = [f"{base}.{a.name}" for a in node.names]
        else:
            continue
        for target in targets:
            owner = _owner(target, known)
            if owner is not None and owner != module:
                found.add(owner)
    return found


def graph() -> dict[str, set[str]]:
    known = modules()
    return {m: imports_of(m, path, known) for m, path in known.items()}


def layer(module: str) -> int:
    """The index in ``LAYERS`` of the longest listed prefix of ``module``."""
    best, best_len = None, -1
    for i, names in enumerate(LAYERS):
        for prefix in names:
            if (module == prefix or module.startswith(prefix + ".")) and len(prefix) > best_len:
                best, best_len = i, len(prefix)
    assert best is not None, f"{module} is in no layer: add it to LAYERS"
    return best


def circles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(edges[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return found


def test_the_graph_is_read_whole():
    edges = graph()
    # a known edge of each kind: at the top, inside a function (the CLI's commands), under a package
    assert "agentspec.decode" in edges["agentspec.chat.reply"]
    assert "agentspec.cost" in edges["agentspec.cli"]
    assert "agentspec.drafters.registry" in edges["agentspec.drafters"]
    # and across distributions: the parser from the engine and from the integration's remote path
    assert "agentspec_toolcalls" in edges["agentspec.chat.request"]
    assert "agentspec_toolcalls" in edges["langchain_agentspec.text_calls"]


def test_the_parser_imports_the_standard_library_only():
    # what lets the remote-only langchain-agentspec read tool calls without torch (its pyproject
    # declares no dependencies)
    outside = set()
    for path in PACKAGES["agentspec_toolcalls"].rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                outside |= {a.name.split(".")[0] for a in node.names}
            elif isinstance(node, ast.ImportFrom) and not node.level:
                outside.add((node.module or "").split(".")[0])
    assert outside - set(sys.stdlib_module_names) == set()


def test_no_import_circle():
    assert circles(graph()) == []


def test_no_import_from_a_lower_layer_to_a_higher_one():
    upward = sorted(
        f"{m} (layer {layer(m)}) imports {t} (layer {layer(t)})"
        for m, targets in graph().items()
        for t in targets
        if layer(t) < layer(m)
    )
    assert upward == []


def test_the_engine_never_imports_the_integration():
    assert [
        m
        for m, targets in graph().items()
        if m.startswith("agentspec") and "langchain_agentspec" in {t.split(".")[0] for t in targets}
    ] == []


@pytest.mark.parametrize(
    ("edges", "expected"),
    [
        ({"a": {"b"}, "b": {"c"}, "c": set()}, []),
        ({"a": {"b"}, "b": {"a"}, "c": {"a"}}, [["a", "b"]]),
        ({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"d"}}, [["a", "b", "c"]]),
    ],
)
def test_circles_finds_each_circle(edges, expected):
    assert circles(edges) == expected


def test_a_module_takes_the_layer_of_its_longest_prefix():
    assert layer("agentspec") == layer("agentspec.chat.reply")  # the face sits with the chat layer
    assert layer("agentspec.decode") > layer("agentspec") > layer("agentspec.telemetry.otel")
    assert layer("agentspec.cost") > layer("agentspec.drafters.schedule") > layer("agentspec.models")
    with pytest.raises(AssertionError, match="in no layer"):
        layer("elsewhere.module")
