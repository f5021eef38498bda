"""``agentspec distill --architecture eagle3``: an EAGLE-3 head in the speculators format, which agentspec,
vLLM and SGLang all load.

Two stages: the target answers the prompts a responses file lacks (``agentspec.distill.responses``:
the pair's batched passes, the ids kept), then speculators' own model and loss train the head on them
(``speculators_train.py``, in ``.venv-vllm``, where speculators' transformers pin fits; ``make vllm``
installs it). The head folder is speculators' ``save_pretrained``; ``training.json`` inside it holds the
recipe and the learning curve.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

RESPONSES = Path(__file__).resolve().parent / "responses_data"
TRAINER = Path(__file__).resolve().parent / "speculators_train.py"


def default_responses(target_name: str) -> Path:
    """The committed responses file of a target (named after its folder)."""
    return RESPONSES / f"{Path(target_name).name.lower()}.safetensors"


def distill_eagle3(
    target: Any,
    out: str | Path,
    *,
    prompts: int,
    minutes: float,
    responses: str | Path | None = None,
    draft_vocab: int = 8192,
    feature_layers: list[int] | None = None,
    concurrency: int = 16,
    python: str | Path | None = None,
) -> Path:
    """Grow the responses to ``prompts`` prompts, then train for ``minutes``; the head folder ``out``.
    ``feature_layers``: the target layers the head reads (default: speculators', [2, L/2, L-3])."""
    from agentspec.distill.responses import grow
    from agentspec.fleet.vllm import VLLM_PYTHON
    from agentspec.models import ensure_default_model, load_pair

    python = Path(python or VLLM_PYTHON)
    if not python.exists():
        raise FileNotFoundError(f"{python}: speculators' environment is missing (make vllm sets it up)")
    folder = Path(ensure_default_model() if target is None else target).expanduser()
    if not (folder / "config.json").is_file():
        raise ValueError(f"{folder}: the target must be a local model folder (speculators reads it)")
    responses = Path(responses) if responses is not None else default_responses(folder.name)
    pair = load_pair(None if target is None else str(folder), draft_model=False)
    grow(pair, responses, prompts, concurrency=concurrency)
    del pair
    command = [str(python), str(TRAINER), str(folder), str(responses), str(out), "--minutes", str(minutes),
               "--draft-vocab", str(draft_vocab)]  # fmt: skip
    if feature_layers:
        command += ["--layer-ids", ",".join(str(i) for i in feature_layers)]
    subprocess.run(command, check=True, stdout=sys.stderr)
    return Path(out)
