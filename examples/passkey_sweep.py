"""Passkey accuracy, prefill time and measured sparsity for several settings on one loaded model.

python examples/passkey_sweep.py --out runs/passkey        # re-run to resume; see runs/passkey/summary.md
"""

import argparse

from moba_hf import MobaConfig
from moba_hf.eval import passkey_eval
from moba_hf.models import load_model, pick_dtype

parser = argparse.ArgumentParser()
parser.add_argument("--model", default="smollm2")
parser.add_argument("--lengths", default="1024,2048")
parser.add_argument("--trials", type=int, default=2)
parser.add_argument("--out", default="runs/passkey")
args = parser.parse_args()

model, tokenizer = load_model(args.model, dtype=pick_dtype(), device="auto")
settings = [("sdpa", None)] + [
    (f"b{bs}-k{k}", MobaConfig(block_size=bs, top_k=k, full_attn_layers=3)) for bs, k in [(512, 3), (128, 6), (64, 16)]
]
result = passkey_eval(
    model, tokenizer, settings, lengths=[int(n) for n in args.lengths.split(",")],
    depths=[0.0, 0.5, 1.0], trials=args.trials, out_dir=args.out, model_name=args.model,
)  # fmt: skip
print(result.summary)
for (setting, length), cell in sorted(result.cells().items()):
    print(f"{setting:10s} {length:6d}  acc {cell['accuracy']:.2f}  prefill {cell['prefill_seconds']:.2f}s  "
          f"sparsity {cell['sparsity']:.2f}")  # fmt: skip
