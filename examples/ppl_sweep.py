"""Perplexity at several context lengths, dense vs MoBA, on one loaded model.

python examples/ppl_sweep.py --text book.txt --out runs/ppl   # default text: generated offline
python examples/ppl_sweep.py --dataset pg19 --out runs/ppl   # a `datasets` dataset you have access to
"""

import argparse

from moba_hf.eval import load_texts, ppl_eval
from moba_hf.models import load_model, pick_dtype

parser = argparse.ArgumentParser()
parser.add_argument("--model", default="smollm2")
parser.add_argument("--text", help="text file or directory")
parser.add_argument("--dataset", help="datasets.load_dataset name (column 'text')")
parser.add_argument("--lengths", default="512,1024,2048")
parser.add_argument("--out", default="runs/ppl")
args = parser.parse_args()

documents = None
if args.text or args.dataset:
    documents = load_texts(args.text, dataset=args.dataset, max_docs=4 if args.dataset else None)
model, tokenizer = load_model(args.model, dtype=pick_dtype(), device="auto")
result = ppl_eval(
    model, tokenizer, ["sdpa", "moba:block_size=64,top_k=16", "moba:block_size=512,top_k=3"],
    lengths=[int(n) for n in args.lengths.split(",")], out_dir=args.out, documents=documents, mode="first",
    model_name=args.model,
)  # fmt: skip
print(result.summary)
