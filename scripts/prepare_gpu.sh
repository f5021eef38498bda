#!/usr/bin/env bash
# Fetch, into .whl/ (git-ignored), the wheels a bare GPU machine lacks for benchmarks/gpu_check.py:
# that machine has Python 3.12 on x86-64 Linux with torch, tokenizers, huggingface-hub, numpy,
# safetensors and accelerate, no network, and an older transformers than this project's pin. So
# this fetches this project's pins that are missing or too old there (transformers, xgrammar,
# tenacity, opentelemetry-api, gguf) and what those need that the machine lacks, each one version
# (two versions of one package stop the whole install there), with --no-deps: every needed
# package is named here. The versions are the ones the test suite runs with here.
# There: pip install --no-index --no-deps --target from .whl/, then run the check (docs/benchmarks.md,
# "GPU check").
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
WHEELS=(
    transformers==5.24.0
    xgrammar==0.2.9
    apache-tvm-ffi==0.1.15.post2   # xgrammar's
    tenacity==9.1.4
    opentelemetry-api==1.45.2
    gguf==0.19.0
    pydantic==2.14.4               # xgrammar's and agentspec's (its config)
    pydantic-core==2.50.5
    annotated-types==0.8.0
    typing-inspection==0.4.5
    typing-extensions==4.16.0      # new enough for pydantic-core, whatever the machine holds
    regex==2026.11.19              # transformers needs a newer one than some images hold
)
PLATFORMS=()
for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_24_x86_64 manylinux_2_17_x86_64 \
    manylinux_2_31_x86_64 manylinux_2_34_x86_64 \
    manylinux2014_x86_64 manylinux1_x86_64; do
    PLATFORMS+=(--platform "$p")
done
rm -rf .whl
mkdir -p .whl
"$PYTHON" -m pip download -q --disable-pip-version-check --no-deps --only-binary=:all: \
    --python-version 3.12 --implementation cp "${PLATFORMS[@]}" -d .whl "${WHEELS[@]}"
ls -l .whl
total=$(du -sb .whl | cut -f1)
echo ".whl: $((total / 1024 / 1024)) MiB in $(ls .whl | wc -l) wheels"
# the working tree that travels to the machine is at most 64 MiB, the wheels included
if (( total >= 60 * 1024 * 1024 )); then
    echo "prepare_gpu: .whl is over 60 MiB" >&2
    exit 1
fi
