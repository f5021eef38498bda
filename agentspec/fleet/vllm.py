"""vLLM as a drop-in worker: its OpenAI server on the embedded model (``vllm_worker_command``,
``vllm_worker``).

vLLM lives in an environment of its own, ``.venv-vllm`` (``make vllm``): it pins torch, transformers
and xgrammar below what agentspec needs. The worker is started as
``python -m vllm.entrypoints.openai.api_server`` (the ``vllm`` console script of the CPU build
looks up a distribution named ``vllm`` and fails). Its settings are the ones agentspec serve's
responses are compared against: float32, n-gram speculation, automatic prefix caching, the
per-request speculation metrics (``metrics.speculative_decoding``), ``usage.prompt_tokens_details``
and the hermes tool-call parser (SmolLM2's chat template writes hermes-style ``<tool_call>`` blocks).
The served model name is agentspec serve's, so a client works against either unchanged.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from agentspec.fleet.process import STARTUP_TIMEOUT_S, ServerProcess
from agentspec.models import DEFAULT_NAME, ensure_default_model

# the checkout's environment, as `make vllm` builds it
VLLM_PYTHON = Path(__file__).resolve().parent.parent.parent / ".venv-vllm" / "bin" / "python"

# vLLM's prompt-lookup drafter: up to 4 draft tokens copied after the last 2-4 tokens' earlier match
NGRAM_SPECULATION = {
    "method": "ngram",
    "num_speculative_tokens": 4,
    "prompt_lookup_max": 4,
    "prompt_lookup_min": 2,
}

# the same with vLLM's dynamic speculation: a draft length per batch size (inclusive ranges of running
# requests), as vLLM's users set it: the full draft for one or two requests, shorter drafts as the
# batch fills (agentspec's scheduler decides per pass from survival and cost instead)
NGRAM_DYNAMIC_SPECULATION = {
    **NGRAM_SPECULATION,
    "num_speculative_tokens_per_batch_size": [[1, 2, 4], [3, 8, 2], [9, 1024, 1]],
}

# vLLM's drafter for a head in the speculators format: ``method`` is the folder's type ("eagle3")
HEAD_DRAFT_TOKENS = 4


def head_speculation(folder: str | Path, k: int = HEAD_DRAFT_TOKENS) -> dict:
    """vLLM's ``--speculative-config`` for the head folder ``folder`` (its config.json names the
    method), ``k`` draft tokens a pass."""
    method = json.loads((Path(folder) / "config.json").read_text())["speculators_model_type"]
    return {"method": method, "model": str(folder), "num_speculative_tokens": k}


MAX_MODEL_LEN = 4096
# On the CPU build this is the share of the NUMA node's host memory vLLM reserves (the KV cache
# included); its default, 0.92, fails at start-up beside other processes. On a GPU, a quarter of the
# device is ample for a small model.
MEMORY_UTILIZATION = 0.25


def cpu_bind(threads: int, first_cpu: int = 0) -> str:
    """VLLM_CPU_OMP_THREADS_BIND for ``threads`` threads on the CPUs this process may run on, from the
    ``first_cpu``-th (vLLM's CPU worker starts one OpenMP thread per CPU of the list, pinned to it)."""
    allowed = sorted(os.sched_getaffinity(0))
    if threads < 1 or first_cpu < 0 or first_cpu + threads > len(allowed):
        raise ValueError(f"{threads=} from {first_cpu=}: this process may run on {len(allowed)} CPUs")
    return ",".join(str(cpu) for cpu in allowed[first_cpu : first_cpu + threads])


def vllm_worker_command(
    port: int,
    *,
    speculative: bool | dict = True,
    head: str | Path | None = None,
    python: str | Path | None = None,
    threads: int | None = None,
    first_cpu: int = 0,
    model_dir: str | Path | None = None,
    dtype: str = "float32",
    eager: bool = False,
) -> list[str]:
    """vLLM's OpenAI server on 127.0.0.1:``port`` over ``model_dir`` (default: the embedded model).

    ``speculative``: n-gram speculation (``NGRAM_SPECULATION``), or the ``--speculative-config`` given
    (e.g. ``NGRAM_DYNAMIC_SPECULATION``); False serves without a drafter.
    ``head``: a head folder in the speculators format drafts instead (``head_speculation``).
    ``python``: the interpreter that has vLLM (default ``VLLM_PYTHON``). ``threads``: on a CPU, the
    worker's threads, bound to ``threads`` allowed CPUs from the ``first_cpu``-th (workers side by side
    take shares apart); vLLM takes no flag for this, so the command sets its environment variable
    through ``env``. Without it vLLM binds to one NUMA node's cores less one, kept for its scheduler.
    ``dtype``: the weights' and activations' type (vLLM's ``--dtype``), float32 as agentspec on a CPU.
    ``eager``: without vLLM's start-up compile (``--enforce-eager``): ready in a third of the time (64
    against 197 s on a 2-core AVX2 EPYC), its steps slower; for tests of replies, not of speed.
    """
    model = Path(model_dir) if model_dir is not None else ensure_default_model()
    command = [
        *(["env", f"VLLM_CPU_OMP_THREADS_BIND={cpu_bind(threads, first_cpu)}"] if threads else []),
        str(python or VLLM_PYTHON),
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(model),
        "--served-model-name",
        DEFAULT_NAME if model_dir is None else model.name,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--dtype",
        dtype,
        "--max-model-len",
        str(MAX_MODEL_LEN),
        "--gpu-memory-utilization",
        str(MEMORY_UTILIZATION),
        "--enable-prefix-caching",
        "--enable-prompt-tokens-details",
        "--enable-auto-tool-choice",
        "--tool-call-parser",
        "hermes",
    ]
    if eager:
        command.append("--enforce-eager")
    if speculative or head is not None:  # vLLM refuses the per-request metrics without a drafter
        if head is not None:
            config = head_speculation(head)
        else:
            config = speculative if isinstance(speculative, dict) else NGRAM_SPECULATION
        command += ["--speculative-config", json.dumps(config)]
        command += ["--per-request-spec-decode-metrics", "summary"]
    return command


def vllm_worker(
    port: int,
    *,
    log: Path | None = None,
    startup_timeout_s: float = STARTUP_TIMEOUT_S,
    **options,
) -> ServerProcess:
    """A ``ServerProcess`` (not started: enter it, or call ``start()``) running
    ``vllm_worker_command(port, **options)``; ready when vLLM's ``/health`` answers."""
    command = vllm_worker_command(port, **options)
    return ServerProcess(command, port, log=log, health_path="/health", startup_timeout_s=startup_timeout_s)
