#!/usr/bin/env bash
# Build both distributions' wheels and install them in a clean virtual environment (no editable
# installs, no checkout on sys.path), then check what each installs and imports:
#  - agentspec-decode installs the one top-level name agentspec (with the embedded draft), and
#    `import agentspec` reaches no LangChain module;
#  - langchain-agentspec installs the one top-level name langchain_agentspec;
#  - nothing installs a module named integrations.
# CI runs it after the tests (.ci/run). torch: the CPU build, as scripts/setup.sh installs it.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

"$PYTHON" -m venv "$work/build"
"$work/build/bin/python" -m pip install -q --disable-pip-version-check --upgrade pip
"$work/build/bin/python" -m pip wheel -q --disable-pip-version-check --no-deps -w "$work/dist" . ./integrations/langchain
ls "$work/dist"

"$PYTHON" -m venv "$work/env"
PIP=("$work/env/bin/python" -m pip install -q --disable-pip-version-check)
"${PIP[@]}" torch==2.13.0 ${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"}
"${PIP[@]}" "$work"/dist/*.whl

cd "$work"  # away from the checkout: only what the wheels installed can be imported
"$work/env/bin/python" - "$work/dist" <<'PY'
import importlib.util
import pathlib
import sys
import zipfile

for wheel in pathlib.Path(sys.argv[1]).glob("*.whl"):
    names = zipfile.ZipFile(wheel).namelist()
    top = {n.split("/")[0] for n in names if not n.split("/")[0].endswith((".dist-info", ".data"))}
    want = {"agentspec"} if wheel.name.startswith("agentspec_decode") else {"langchain_agentspec"}
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
