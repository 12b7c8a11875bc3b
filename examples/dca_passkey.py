"""Passkey retrieval past the trained context with Dual Chunk Attention.

SmolLM2-135M-Instruct was trained to 8K. This measures passkey accuracy at 16K and 32K for the plain model,
DCA with dense attention, and DCA + MoBA; trials per length sit at depths spread evenly over [0, 1]
(midpoints of equal slices).

    python examples/dca_passkey.py --device cuda                      # the full table (GPU)
    python examples/dca_passkey.py --lengths 4096 --pretraining-length 2048 --trials 3   # CPU sanity run

Before measuring, a short self-check confirms that cached decoding with DCA gives the logits of one full
forward on this transformers version (keys are remapped in place in the KV cache).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

import torch

import moba_hf
from moba_hf import DcaConfig, MobaConfig
from moba_hf.eval.decoding import forward_kwargs, output_cache
from moba_hf.eval.passkey import run_trial, trial_passkey
from moba_hf.models import load
from moba_hf.prompts import build_prompt


def settings(args: argparse.Namespace) -> dict[str, MobaConfig | None]:
    dca = DcaConfig(
        pretraining_length=args.pretraining_length, chunk_size=args.chunk_size, temperature=args.temperature
    )
    if args.moba_config:  # e.g. training-free: its MoBA fields, with DCA added
        sparse = dataclasses.replace(MobaConfig.from_spec(args.moba_config), dca=dca)
        sparse_name = f"DCA + MoBA {Path(args.moba_config).stem}"
    else:
        sparse = MobaConfig(block_size=args.block_size, top_k=args.top_k, dca=dca)
        sparse_name = f"DCA + MoBA {args.block_size}x{args.top_k}"
    table = {"plain (no DCA)": None, "DCA dense": MobaConfig(sparse=False, dca=dca), sparse_name: sparse}
    chosen = {"plain": "plain (no DCA)", "dense": "DCA dense", "moba": next(k for k in table if k.startswith("DCA +"))}
    return {chosen[name]: table[chosen[name]] for name in args.settings}


@torch.no_grad()
def self_check(model, tokenizer, device: str) -> None:
    """DCA with a tiny chunk on a short prompt: prefill + cached decode must match a full forward."""
    moba_hf.apply(model, MobaConfig(block_size=64, top_k=3, dca=DcaConfig(pretraining_length=256, chunk_size=192)))
    ids = tokenizer(build_prompt(tokenizer, 700, 0.5, 12345), return_tensors="pt").input_ids.to(device)
    full = model(ids).logits[0, -8:]
    cache_kw, _ = forward_kwargs(model)  # "cache" or "past_key_values", by transformers version
    out = model(ids[:, :-8], use_cache=True)
    steps = []
    for t in range(ids.shape[1] - 8, ids.shape[1]):
        out = model(ids[:, t : t + 1], use_cache=True, **{cache_kw: output_cache(out)})
        steps.append(out.logits[0, -1])
    error = (torch.stack(steps) - full).abs().max().item()
    moba_hf.revert(model)
    if error > 1e-3:
        sys.exit(f"self-check failed: cached DCA decoding differs from a full forward by {error:.2e}")
    print(f"self-check: cached DCA decoding matches a full forward (max |diff| {error:.1e})", file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu", help="torch device, e.g. cpu or cuda (default cpu)")
    parser.add_argument("--lengths", type=int, nargs="+", default=[16384, 32768], help="prompt lengths in tokens")
    parser.add_argument("--trials", type=int, default=10, help="trials per length, depths spread evenly (default 10)")
    parser.add_argument("--settings", nargs="+", choices=("plain", "dense", "moba"), default=["plain", "dense", "moba"])
    parser.add_argument("--pretraining-length", type=int, default=None, help="DCA c (default: the model's, 8192)")
    parser.add_argument("--chunk-size", type=int, default=None, help="DCA s (default c - c // 8)")
    parser.add_argument(
        "--temperature", action="store_true", help="DCA attention temperature max(1, 0.1 ln(L / c) + 1) past c"
    )
    parser.add_argument("--block-size", type=int, default=512, help="MoBA block size (default 512)")
    parser.add_argument("--top-k", type=int, default=8, help="MoBA blocks per query (default 8)")
    parser.add_argument(
        "--moba-config",
        default=None,
        help="MoBA preset (training-free) or config file for the sparse setting (instead of --block-size / --top-k)",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default=None, help="also write every trial to this JSON file")
    parser.add_argument("--no-check", action="store_true", help="skip the cached-decoding self-check")
    args = parser.parse_args(argv)
    if args.trials < 1:
        parser.error(f"--trials must be >= 1, got {args.trials}")

    model, tokenizer = load("smollm2")
    model.to(args.device)
    if not args.no_check:
        self_check(model, tokenizer, args.device)
    # depths at the midpoints of `trials` equal slices of [0, 1] (0.05, 0.15, ..., 0.95 for 10): at depth 1.0 the
    # passkey line sits right before the question and SmolLM2 answers "the pass key" even at 1K without DCA
    depths = [(i + 0.5) / args.trials for i in range(args.trials)]
    rows, trials = [], []
    for name, config in settings(args).items():
        if config is None:
            moba_hf.revert(model)
        else:
            moba_hf.apply(model, config)
        if config is not None:
            p = moba_hf.dca.resolve(config.dca, model.config, config.block_size if config.sparse else None)
            name = f"{name} (c={p.pretraining_length}, s={p.chunk_size}{', temperature' if p.temperature else ''})"
        row = {"setting": name}
        for length in args.lengths:
            correct, seconds = 0, 0.0
            for index, depth in enumerate(depths):
                passkey = trial_passkey(args.seed, length, depth, index)
                trial = run_trial(model, tokenizer, length, depth, passkey)
                correct += trial.correct
                seconds += trial.prefill_seconds
                trials.append({"setting": name, **vars(trial)})
                print(
                    f"{name:>22} len={length} depth={depth:.2f} expected={passkey} got={trial.got} "
                    f"prefill={trial.prefill_seconds:.2f}s",
                    file=sys.stderr,
                    flush=True,
                )
            row[length] = (correct, len(depths), seconds / len(depths))
        rows.append(row)
        moba_hf.revert(model)

    print(f"\nPasskey retrieval, SmolLM2-135M-Instruct (trained to 8K), {args.trials} trials per "
          f"length (depths evenly spread), device {args.device}, torch {torch.__version__}, "
          f"{time.strftime('%Y-%m-%d')}\n")  # fmt: skip
    header = "| setting | " + " | ".join(f"{n // 1024}K accuracy | {n // 1024}K prefill s" for n in args.lengths) + " |"
    print(header)
    print("|" + "---|" * (1 + 2 * len(args.lengths)))
    for row in rows:
        cells = []
        for n in args.lengths:
            ok, total, secs = row[n]
            cells += [f"{100 * ok / total:.0f}% ({ok}/{total})", f"{secs:.2f}"]
        print(f"| {row['setting']} | " + " | ".join(cells) + " |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(trials, f, indent=1, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())
