"""Needle-in-a-haystack depth x length heatmap, one panel per attention setting.

python examples/niah_heatmap.py --out runs/niah             # -> runs/niah/niah_heatmap.png
python examples/niah_heatmap.py --text my_essays/            # your own haystack (file or directory)
"""

import argparse

from moba_hf.eval import load_texts, niah_eval
from moba_hf.models import load_model, pick_dtype

parser = argparse.ArgumentParser()
parser.add_argument("--model", default="smollm2")
parser.add_argument("--text", help="text file or directory (default: generated offline)")
parser.add_argument("--lengths", default="1024,2048")
parser.add_argument("--out", default="runs/niah")
args = parser.parse_args()

model, tokenizer = load_model(args.model, dtype=pick_dtype(), device="auto")
result = niah_eval(
    model, tokenizer, ["sdpa", "moba-64x16=moba:block_size=64,top_k=16"],
    lengths=[int(n) for n in args.lengths.split(",")], depths=[0.0, 0.5, 1.0], trials=2, out_dir=args.out,
    haystack=load_texts(args.text) if args.text else None, model_name=args.model,
)  # fmt: skip
print(result.summary)
print("heatmap:", [str(p) for p in result.files if p.suffix == ".png"])
