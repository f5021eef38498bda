#!/usr/bin/env bash
# Build the three distributions' wheels and install them in a clean virtual environment (no editable
# installs, no checkout on sys.path), then check what each installs and imports:
#  - agentspec-decode installs the one top-level name agentspec (with the embedded draft), and
#    `import agentspec` reaches no LangChain module;
#  - langchain-agentspec installs the one top-level name langchain_agentspec, and reads tool calls
#    without importing the engine or torch (the engine is only its [local] extra);
#  - agentspec-toolcalls, the tool-call parser both depend on, installs agentspec_toolcalls;
#  - nothing installs a module named integrations.
# CI runs it after the tests (.ci/run). torch: the CPU build, as scripts/setup.sh installs it.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

"$PYTHON" -m venv "$work/build"
"$work/build/bin/python" -m pip install -q --disable-pip-version-check --upgrade pip
"$work/build/bin/python" -m pip wheel -q --disable-pip-version-check --no-deps -w "$work/dist" \
  ./toolcalls . ./integrations/langchain
ls "$work/dist"

"$PYTHON" -m venv "$work/env"
PIP=("$work/env/bin/python" -m pip install -q --disable-pip-version-check)
"${PIP[@]}" torch==2.13.0 ${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"}
"${PIP[@]}" "$work"/dist/*.whl  # agentspec-toolcalls from its wheel here, not from an index

cd "$work"  # away from the checkout: only what the wheels installed can be imported
"$work/env/bin/python" - "$work/dist" <<'PY'
import importlib.util
import pathlib
import sys
import zipfile

TOP = {
    "agentspec_decode": {"agentspec"},
    "agentspec_toolcalls": {"agentspec_toolcalls"},
    "langchain_agentspec": {"langchain_agentspec"},
}
wheels = sorted(pathlib.Path(sys.argv[1]).glob("*.whl"))
assert {w.name.split("-")[0] for w in wheels} == set(TOP), [w.name for w in wheels]
for wheel in wheels:
    names = zipfile.ZipFile(wheel).namelist()
    top = {n.split("/")[0] for n in names if not n.split("/")[0].endswith((".dist-info", ".data"))}
    want = TOP[wheel.name.split("-")[0]]
    assert top == want, f"{wheel.name} installs {sorted(top)}, expected {sorted(want)}"
    print(f"{wheel.name}: installs {sorted(top)}")

import agentspec  # noqa: E402

leaked = sorted(m for m in sys.modules if m.startswith(("langchain", "integrations")))
assert not leaked, f"import agentspec loaded {leaked}"
assert agentspec.__file__.startswith(sys.prefix), agentspec.__file__
from agentspec.models import default_draft_folder  # noqa: E402

assert default_draft_folder() is not None, "the embedded draft is missing from the wheel"
assert importlib.util.find_spec("integrations") is None, "a module named integrations is installed"

from langchain_agentspec import ChatSpecDecode  # noqa: E402

print("ok:", agentspec.__file__, ChatSpecDecode.__module__, ChatSpecDecode()._llm_type)
PY

# The remote path, in a process of its own: torch is installed here, and must still not be imported.
"$work/env/bin/python" - <<'PY'
import sys
from importlib.metadata import requires

needs = requires("langchain-agentspec")
assert any(r.startswith("agentspec-toolcalls") and "extra" not in r for r in needs), needs
assert all("extra ==" in r for r in needs if r.startswith("agentspec-decode")), needs

from langchain_agentspec import parse_tool_calls  # noqa: E402
from langchain_agentspec.text_calls import TextCalls  # noqa: E402

call = '<tool_call>{"name": "add", "arguments": {"a": 1}}</tool_call>'
parsed = parse_tool_calls(call, {"add"})
assert [(c["name"], c["args"]) for c in parsed.tool_calls] == [("add", {"a": 1})], parsed
text, found = TextCalls(frozenset({"add"}), single=False).feed(call)
assert text == "" and [c["function"]["name"] for c in found] == ["add"], (text, found)
heavy = sorted(m for m in sys.modules if m.split(".")[0] in {"agentspec", "torch", "transformers"})
assert not heavy, f"reading tool calls loaded {heavy}"
print("ok: langchain_agentspec reads tool calls without the engine")
PY
