"""One line switches a loaded Llama / Qwen model to MoBA; one more switches it back.

python examples/patch_one_line.py                      # the embedded SmolLM2-135M-Instruct
python examples/patch_one_line.py --model PATH_OR_HUB_ID
"""

import argparse

import moba_hf
from moba_hf.eval.passkey import run_trial
from moba_hf.models import load_model, pick_dtype
from moba_hf.prompts import build_prompt

parser = argparse.ArgumentParser()
parser.add_argument("--model", default="smollm2", help="embedded model name or a local path / hub id")
parser.add_argument("--length", type=int, default=2048)
args = parser.parse_args()

model, tokenizer = load_model(args.model, dtype=pick_dtype(), device="auto")  # dense (sdpa) attention
# equivalently, at load time: moba_hf.from_pretrained(path, moba=cfg) or, after `import moba_hf`,
# AutoModelForCausalLM.from_pretrained(path, attn_implementation="moba")

print(build_prompt(tokenizer, 120, 0.5, 72109)[:200], "...")
for name, cfg in [("sdpa", None), ("moba", moba_hf.MobaConfig(block_size=64, top_k=16))]:
    if cfg is not None:
        moba_hf.apply(model, cfg)  # <- the one line
    trial = run_trial(model, tokenizer, args.length, 0.5, 72109)  # measures the prefill's sparsity too
    print(f"{name:5s} answer={trial.got} correct={trial.correct} prefill={trial.prefill_seconds:.2f}s "
          f"sparsity={trial.sparsity:.2f}")  # fmt: skip
    moba_hf.revert(model)  # back to the attention the model was loaded with
