"""`moba-hf demo`: passkey retrieval on the embedded SmolLM2, full attention vs MoBA, one honest table."""

from __future__ import annotations

import argparse
import random
import statistics
from pathlib import Path
from typing import Any

from tqdm.auto import tqdm

from .config import MobaConfig

DEFAULT_CONFIG = Path(__file__).resolve().parents[1] / "configs" / "moba_demo.toml"


def add_commands(sub: Any) -> None:
    p = sub.add_parser("demo", help="passkey retrieval on the embedded SmolLM2: full attention vs MoBA")
    p.add_argument("--lengths", default="2048,4096,8000", help="prompt lengths in tokens (model window: 8192)")
    p.add_argument("--trials", type=int, default=2, help="trials per length (depths spread evenly)")
    p.add_argument("--config", default=None, help="MoBA config file (default: configs/moba_demo.toml)")
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=run)


def _moba_config(path: str | None) -> MobaConfig:
    if path is not None:
        return MobaConfig.from_file(path)
    return MobaConfig.from_file(DEFAULT_CONFIG) if DEFAULT_CONFIG.is_file() else MobaConfig()


def run(args: argparse.Namespace) -> int:
    import torch

    from . import apply, revert, track_sparsity
    from .eval.passkey import run_trial
    from .models import load

    lengths = [int(x) for x in args.lengths.split(",")]
    if args.trials < 1:
        raise ValueError(f"--trials must be >= 1, got {args.trials}")
    moba = _moba_config(args.config)
    model, tokenizer = load("smollm2")
    rng = random.Random(args.seed)
    depths = [(i + 0.5) / args.trials for i in range(args.trials)]
    jobs = [(n, d, rng.randint(10000, 99999)) for n in lengths for d in depths]
    settings = [("sdpa", None), ("moba", moba)]
    results: dict[tuple[str, int], list] = {}
    sparsity: dict[int, float] = {}

    print(f"model: SmolLM2-135M-Instruct (embedded), torch {torch.__version__}, {torch.get_num_threads()} threads")
    print(f"MoBA: {moba}")
    with tqdm(total=len(jobs) * len(settings), desc="passkey", unit="trial") as bar:
        for name, cfg in settings:
            if cfg is None:
                revert(model)
            else:
                apply(model, cfg)
            for length, depth, key in jobs:
                bar.set_postfix_str(f"{name} {length} tokens")
                with track_sparsity() as stats:
                    trial = run_trial(model, tokenizer, length, depth, key)
                if cfg is not None:
                    sparsity[length] = stats.overall
                results.setdefault((name, length), []).append(trial)
                bar.update()
    revert(model)

    print()
    print("| length | sdpa acc | moba acc | sdpa prefill s | moba prefill s | moba speed-up | moba sparsity |")
    print("|---:|---:|---:|---:|---:|---:|---:|")
    for length in lengths:
        full, sparse = results[("sdpa", length)], results[("moba", length)]
        t_full = statistics.median(t.prefill_seconds for t in full)
        t_sparse = statistics.median(t.prefill_seconds for t in sparse)
        print(
            f"| {full[0].prompt_tokens} | {sum(t.correct for t in full)}/{len(full)} "
            f"| {sum(t.correct for t in sparse)}/{len(sparse)} | {t_full:.2f} | {t_sparse:.2f} "
            f"| {t_full / t_sparse:.2f}x | {sparsity[length]:.2f} |"
        )
    print(
        "\nprefill = median wall time of the first forward pass; sparsity = fraction of causal query-key pairs "
        "MoBA skipped (all layers). Stock checkpoints are not trained for MoBA: see README, 'Training-free MoBA'."
    )
    return 0
