#!/usr/bin/env bash
# Set up .venv/ with agentspec and its dependencies, and fetch the embedded default model.
#  - torch: kept as is if the venv already has one (e.g. your CUDA build); otherwise the CUDA build
#    where an NVIDIA GPU is present, and the CPU build (torch==2.13.0) where none is. Outside this
#    project's machines, point TORCH_INDEX_URL at PyTorch's CPU wheel index to get a CPU-only wheel.
#  - the default model lands in $AGENTSPEC_HOME (default ~/.cache/agentspec), checked by SHA-256.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
VENV=${VENV:-.venv}

[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
PIP=("$VENV/bin/python" -m pip --disable-pip-version-check)
"${PIP[@]}" install -q --upgrade pip setuptools wheel

if "$VENV/bin/python" -c "import torch" 2>/dev/null; then
  echo "setup: using the installed torch $("$VENV/bin/python" -c 'import torch; print(torch.__version__)')"
elif command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  echo "setup: NVIDIA GPU found, installing a CUDA build of torch"
  "${PIP[@]}" install -q "torch>=2.4"
else
  echo "setup: no GPU, installing the CPU build torch==2.13.0"
  "${PIP[@]}" install -q torch==2.13.0 ${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"}
fi

# the three distributions, editable, in one pip command: the tool-call parser (agentspec-toolcalls), the
# engine (agentspec-decode) and the LangChain integration (langchain-agentspec). Their pins on each other
# (==0.1.0+git, which no index can serve: pyproject.toml) are met by the folders named here, which pip
# takes for those names without asking an index.
"${PIP[@]}" install -q -e ./toolcalls -e ".[dev,serve]" -e "./integrations/langchain[local,remote,test]"
"$VENV/bin/agentspec" fetch
