# The README's two commands: `make demo` (set up, then run the main job) and `make test`.
VENV ?= .venv
BIN := $(VENV)/bin

.PHONY: setup vllm demo test test-all lint bench wheels gpu-wheels gpu-check

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

# docs/install.md's install lines (the three distributions by git URL, with and without the engine) run
# against this checkout's last commit in clean venvs, then what they installed imported and called once
wheels:
	bash scripts/check_wheels.sh

# here, with PyPI: what a GPU machine without a network lacks for the device script, into the git-ignored
# .whl/, .whl-train/ and .gpu-stage/ (docs/benchmarks.md, "gpu-check", has the calls to make there)
gpu-wheels: setup
	bash scripts/prepare_gpu.sh

# there: the device check (at most 4 minutes by its own budget), then the embedded pair's EAGLE-3 head
# trained on the whole response set (when its target is staged), into $OUT
gpu-check:
	bash scripts/gpu_check.sh
