"""Does continued training activate MoBA? Passkey accuracy before and after `moba-hf train`.

    python -m moba_hf.train.experiment configs/train_cpu_demo.toml --lengths 1024 --trials 20

1. passkey accuracy of the untrained model, with full attention and with the run's MoBA setting;
2. `train(config)` (the same code path as `moba-hf train`);
3. the same trials on the trained checkpoint, reloaded with `from_pretrained(out, attn_implementation="moba")`.
The trials (keys, depths) come from their own seed, apart from the training data's random stream.
Writes <output_dir>/experiment.json and prints a table.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path
from typing import Any

import torch

from ..eval.grid import model_info, run_grid
from ..eval.passkey import run_trial
from ..eval.run_store import ResultStore
from ..eval.settings import Setting
from ..models import load_model
from ..prompts import random_passkey
from .cli import load_config
from .trainer import train


def _trial_cells(lengths: list[int], trials: int, seed: int) -> list[dict[str, Any]]:
    """Per length, `trials` evenly spread depths with keys from the length's own stream."""
    cells = []
    for length in lengths:
        rng = random.Random(f"moba_hf.train.experiment:{seed}:{length}")
        for i in range(trials):
            cells.append({"length": length, "depth": i / max(1, trials - 1), "passkey": random_passkey(rng)})
    return cells


def evaluate(
    model: Any, tokenizer: Any, moba: Any, lengths: list[int], trials: int, seed: int, modes: list[str]
) -> dict:
    """{"moba": [...], "full": [...]}: greedy passkey accuracy per length with MoBA (`moba` config) and/or sdpa."""
    model.eval()
    cells = _trial_cells(lengths, trials, seed)
    store = ResultStore(None, "passkey", {"lengths": lengths, "trials": trials, "seed": seed}, model_info(model))

    def run_cell(cell: dict[str, Any]) -> dict[str, Any]:
        trial = run_trial(model, tokenizer, cell["length"], cell["depth"], cell["passkey"])
        where = f"length {trial.length} depth {trial.depth:.2f}"
        print(f"    {where}: expected {trial.expected} got {trial.got}", flush=True)
        return {"expected": trial.expected, "got": trial.got, "correct": trial.correct}

    out = {}
    for mode in modes:
        setting = Setting(mode, "moba", moba) if mode == "moba" else Setting(mode, "sdpa")
        start = time.perf_counter()
        run_grid(model, [setting], cells, run_cell, store, progress=False)
        if mode in store.failures:
            raise RuntimeError(f"passkey trials with {mode} attention failed: {store.failures[mode]}")
        records = store.records([setting])
        out[mode] = []
        for n in lengths:
            results = [{k: r[k] for k in ("depth", "expected", "got", "correct")} for r in records if r["length"] == n]
            correct = sum(r["correct"] for r in results)
            out[mode].append({"length": n, "correct": correct, "trials": trials, "results": results})
        summary = ", ".join(f"{r['correct']}/{r['trials']} at {r['length']}" for r in out[mode])
        print(f"  {mode:>4}: {summary}  ({time.perf_counter() - start:.0f} s)", flush=True)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("config")
    parser.add_argument("--lengths", default="1024", help="passkey prompt lengths, comma separated")
    parser.add_argument("--trials", type=int, default=20, help="trials per length (depths spread evenly)")
    parser.add_argument("--seed", type=int, default=1234, help="seed of the eval keys (not the training data's)")
    parser.add_argument("--model", help="override [model] name")
    parser.add_argument("--output-dir", help="override [train] output_dir")
    parser.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE")
    parser.add_argument("--before", default="moba", help="attention modes evaluated before training: moba,full")
    parser.add_argument("--after", default="moba,full", help="attention modes evaluated after training")
    parser.add_argument("--checkpoint", help="skip training: compare the base model with this trained checkpoint")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    config = load_config(
        args.config, args.set, {("model", "name"): args.model, ("train", "output_dir"): args.output_dir}
    )
    lengths = [int(n) for n in args.lengths.split(",")]
    from transformers import AutoModelForCausalLM

    device = "cuda" if torch.cuda.is_available() else "cpu"
    model, tokenizer = load_model(config.model.name, dtype=config.model.dtype, tokenizer="optional")
    model.to(device)
    print(f"before training ({config.model.name}, {config.moba}):", flush=True)
    before = evaluate(model, tokenizer, config.moba, lengths, args.trials, args.seed, args.before.split(","))

    start = time.perf_counter()
    if args.checkpoint:
        out, losses, sparsity = Path(args.checkpoint), [], []
    else:
        result = train(config, model=model, tokenizer=tokenizer)
        out, losses, sparsity = result.output_dir, result.losses, result.sparsity
        trend = f"; logged loss {losses[0]:.3g} -> {losses[-1]:.3g}" if losses else ""
        print(f"trained {config.train.max_steps} steps in {time.perf_counter() - start:.0f} s{trend}", flush=True)
    train_seconds = time.perf_counter() - start

    trained = AutoModelForCausalLM.from_pretrained(out, attn_implementation="moba", dtype=config.model.dtype)
    trained.to(device)
    print("after training (reloaded with attn_implementation='moba'):", flush=True)
    after = evaluate(trained, tokenizer, config.moba, lengths, args.trials, args.seed, args.after.split(","))

    report = {
        "config": config.to_dict(),
        "eval": {"lengths": lengths, "trials": args.trials, "seed": args.seed},
        "before": before,
        "after": after,
        "train_seconds": train_seconds,
        "losses": losses,
        "sparsity": sparsity,
        "torch": torch.__version__,
        "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
    }
    name = "experiment.json" if not args.checkpoint else f"experiment_{'_'.join(map(str, lengths))}.json"
    (out / name).write_text(json.dumps(report, indent=1))
    print("\n| attention | length | before | after |\n|---|---|---|---|")
    for mode in ("moba", "full"):
        label = "full (sdpa)" if mode == "full" else str(config.moba)
        for i, n in enumerate(lengths):
            cells = [f"{r[mode][i]['correct']}/{args.trials}" if mode in r else "-" for r in (before, after)]
            print(f"| {label} | {n} | {cells[0]} | {cells[1]} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
