# The README's two commands: `make demo` (set up, then run the main job) and `make test`.
VENV ?= .venv
BIN := $(VENV)/bin

.PHONY: setup vllm demo test test-all lint bench wheels gpu-wheels

setup:
	bash scripts/setup.sh

# vLLM in an environment of its own, .venv-vllm (it pins torch and transformers below .venv's), for
# `agentspec vllm-worker` and the tests against it
vllm:
	bash scripts/setup_vllm.sh

demo: setup
	$(BIN)/python examples/agent_demo.py

lint:
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

# the default suite: everything but tests marked slow (17 minutes on a 2-core AVX-512 EPYC, 31 on an
# AVX2 one); vllm for the tests against a vLLM worker
test: setup vllm lint
	$(BIN)/python -m pytest -m "not slow"

test-all: setup vllm lint
	$(BIN)/python -m pytest

# every system side by side: the single calls and the roofline (`agentspec bench`, quick; `--full` for the
# long run), then the agent loop through LangChain chat models (`python -m benchmarks loop`)
bench: setup
	$(BIN)/agentspec bench
	$(BIN)/python -m benchmarks loop

# the three distributions (agentspec-toolcalls, agentspec-decode, langchain-agentspec) built as wheels and
# imported in a clean venv
wheels:
	bash scripts/check_wheels.sh

# the wheels a bare GPU machine lacks for benchmarks/gpu_check.py, into the git-ignored .whl/ (needs PyPI;
# docs/benchmarks.md, "gpu-check", has the command to run there)
gpu-wheels:
	bash scripts/prepare_gpu.sh
