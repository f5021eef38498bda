"""Every dotted name the docs cite in code spans (``agentspec.kv.ModelState``, ``decode._land``,
``lean.LeanForward.bind``) names something that exists: a module of one of our packages, and each
attribute after it. Not ours to check: a name whose first part is no module of ours
(``torch.compile``, ``pair.scheduler``), a file (``bench.json``), a span attribute or JSON field
under the bare package name (``agentspec.draft_tokens``), and a short name that is also a common
word (``model.generate``, ``stats.draft_failures``: an object of that name, not the module)."""

from __future__ import annotations

import importlib
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = [
    ROOT / "README.md",
    *sorted((ROOT / "docs").glob("*.md")),
    ROOT / "integrations/langchain/README.md",
    ROOT / "toolcalls/README.md",
]
PACKAGES = {
    "agentspec": ROOT / "agentspec",
    "langchain_agentspec": ROOT / "integrations/langchain/langchain_agentspec",
    "agentspec_toolcalls": ROOT / "toolcalls/agentspec_toolcalls",
}
SPAN = re.compile(r"`([^`\n]+)`")
DOTTED = re.compile(r"^[A-Za-z_][\w]*(?:\.[A-Za-z_]\w*)+")
FILES = {"json", "jsonl", "md", "png", "py", "safetensors", "toml", "txt", "yaml", "gguf"}
# modules cited by their last name alone whose name is no common word (others need their package path)
SHORT = {
    "kv", "decode", "lean", "linears", "forward", "packed", "attention", "models", "scheduler", "cost",
    "static_kv", "draft_folder", "warm", "threads", "grammar", "verify", "sampling", "logprobs", "radix",
    "replay", "passes", "roofline", "syncs", "eagle", "hybrid", "suffix", "prompt_lookup", "registry",
    "tenants", "schedule", "protocol", "worker", "replies", "workers", "otel",
}  # fmt: skip


def submodules() -> dict[str, str]:
    """Each module's last name (and its dotted path within a package) -> its full dotted name."""
    found: dict[str, str] = {}
    for package, folder in PACKAGES.items():
        for path in folder.rglob("*.py"):
            parts = list(path.relative_to(folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            full = ".".join([package, *parts])
            found[full] = full
            for i in range(len(parts)):
                found.setdefault(".".join(parts[i:]), full)
    return found


def cited() -> list[tuple[str, str]]:
    """(doc, dotted name) for every code span that starts with a dotted name."""
    out = []
    for doc in DOCS:
        if not doc.exists():
            continue
        for span in SPAN.findall(doc.read_text()):
            m = DOTTED.match(span.strip())
            if m:
                out.append((doc.name, m.group(0)))
    return out


# span attributes (``agentspec.telemetry.attributes``) whose namespace is also a module's dotted name
ATTRIBUTE_NAMESPACES = ("agentspec.request.",)


def resolve(name: str, modules: dict[str, str]) -> str | None:
    """None where ``name`` resolves (or is not ours), else what is missing."""
    parts = name.split(".")
    if parts[-1] in FILES or name.startswith(ATTRIBUTE_NAMESPACES):
        return None
    for cut in range(len(parts), 0, -1):  # the longest leading part that is one of our modules
        full = modules.get(".".join(parts[:cut]))
        if full is not None:
            break
    else:
        return None
    if cut == 1 and (parts[0] in PACKAGES or parts[0] not in SHORT):
        return None
    obj = importlib.import_module(full)
    for attr in parts[cut:]:
        if not hasattr(obj, attr):
            if isinstance(obj, type) and attr in getattr(obj, "__annotations__", {}):
                return None  # a dataclass field without a default
            return f"{full}: no {'.'.join(parts[cut:])}"
        obj = getattr(obj, attr)
    return None


@pytest.mark.parametrize(("doc", "name"), sorted(set(cited())))
def test_a_cited_name_exists(doc, name):
    missing = resolve(name, submodules())
    assert missing is None, f"{doc} cites `{name}`: {missing}"
