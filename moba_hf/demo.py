"""`moba-hf demo`: passkey retrieval on the embedded SmolLM2, dense attention vs MoBA, the answers side by side.

By default one 8K prompt (the model's window is 8192 tokens; at 8K the `training-free` preset already prefills
faster than dense attention, docs/results.md), answered once by each attention: two 8K prefills and a few decode
steps, so the command answers in minutes on a 2-core CPU. Both settings get one untimed warm-up forward, then each
prompt runs sdpa and MoBA back to back (sdpa, moba, sdpa, moba ...), so slow drift of the machine (other jobs,
clocks) hits both alike.
"""

from __future__ import annotations

import argparse
import random
import statistics
from collections.abc import Sequence
from typing import Any

from .cli_args import UsageError, add_model_args, check_model, parse_lengths, positive_int

DEFAULT_SETTING = "moba:training-free"
DEFAULT_LENGTHS = "8000"  # one prompt at the length where the preset wins; 7984 tokens of SmolLM2's 8192
DEFAULT_TRIALS = 1
MIN_LENGTH = 128  # the passkey prompt alone is ~64 tokens; below this the timing is all overhead
WARMUP_TOKENS = 128
LONGER_RUN = (
    "moba-hf demo --lengths 2K,4K,8000 --trials 5: more prompts per length (accuracy) and the speed-up growing "
    "with the length (below about 4K tokens MoBA's gate costs what it saves); past this model's window up to 128K: "
    "docs/results.md"
)


def add_commands(sub: Any) -> None:
    p = sub.add_parser("demo", help="passkey retrieval on the embedded SmolLM2: dense attention vs MoBA")
    p.add_argument(
        "--lengths",
        type=parse_lengths,
        default=parse_lengths(DEFAULT_LENGTHS),
        help=f"prompt lengths in tokens, e.g. 2K,4K (>= {MIN_LENGTH}, up to the model's window; "
        f"default {DEFAULT_LENGTHS})",
    )
    p.add_argument(
        "--trials",
        type=positive_int,
        default=DEFAULT_TRIALS,
        help=f"prompts per length (depths spread evenly; default {DEFAULT_TRIALS})",
    )
    p.add_argument(
        "--attn",
        default=DEFAULT_SETTING,
        metavar="SETTING",
        help=f"the MoBA setting compared with sdpa (default {DEFAULT_SETTING})",
    )
    p.add_argument("--config", dest="attn", type=lambda x: f"moba:{x}", help=argparse.SUPPRESS)  # the old flag
    p.add_argument("--seed", type=int, default=0)
    add_model_args(p)
    p.set_defaults(func=run, prog=p.prog)


def _moba_setting(spec: str) -> Any:
    from .eval.settings import parse_setting

    try:
        setting = parse_setting(spec)
    except (ValueError, FileNotFoundError) as error:
        raise UsageError(f"--attn: {error}") from None
    if setting.attn != "moba":
        raise UsageError(f"--attn must be a MoBA setting (moba, moba:PRESET, moba:k=v,...), got {spec!r}")
    if setting.moba is None:  # plain "moba": the preset, never a silent MobaConfig()
        from .config import MobaConfig

        setting = type(setting)(setting.name, "moba", MobaConfig.preset("training-free"))
    return setting


def run(args: argparse.Namespace) -> int:
    too_short = [n for n in args.lengths if n < MIN_LENGTH]
    if too_short:
        raise UsageError(f"--lengths must be >= {MIN_LENGTH} tokens, got {too_short[0]}")
    check_model(args.model)
    moba = _moba_setting(args.attn)

    from .models import load_model, pick_dtype

    dtype = pick_dtype(args.dtype, args.device)
    model, tokenizer = load_model(args.model, dtype=dtype, device=args.device)
    window = getattr(model.config, "max_position_embeddings", None)
    if window and max(args.lengths) > window:
        raise UsageError(f"--lengths must be <= the model's window {window}, got {max(args.lengths)}")
    rows = run_demo(model, tokenizer, moba, args.lengths, args.trials, seed=args.seed, model_name=args.model)
    print()
    print(answer_table(rows, moba.name))
    print()
    print(table(rows))
    print(
        "\nspeed-up = sdpa prefill time / MoBA prefill time: higher = MoBA faster (below 1.00x, slower). prefill = "
        "median wall time of the first forward pass, sdpa and MoBA alternating on the same prompts after one untimed "
        "warm-up each (one prompt times each once: other jobs on the machine move it); sparsity = mean fraction of "
        "causal query-key pairs MoBA skipped (all layers). Stock checkpoints are not trained for MoBA: see README, "
        "'Presets'."
    )
    print(f"Longer runs: {LONGER_RUN}.")
    return 0


def run_demo(
    model: Any,
    tokenizer: Any,
    moba: Any,
    lengths: Sequence[int],
    trials: int,
    *,
    seed: int = 0,
    model_name: str = "",
    progress: bool = True,
) -> list[dict[str, Any]]:
    """One row per length: accuracy and median prefill of sdpa and `moba` (a Setting), MoBA's mean sparsity, and
    `prompts`: per prompt, its depth, passkey and each setting's answer (sdpa's, then MoBA's trial record)."""
    import dataclasses

    import torch
    from tqdm.auto import tqdm

    from .eval import passkey
    from .eval.grid import model_info, run_grid
    from .eval.run_store import ResultStore
    from .eval.settings import Setting, use_setting

    settings = [Setting("sdpa"), moba]
    rng = random.Random(seed)
    depths = [(i + 0.5) / trials for i in range(trials)]
    jobs = [{"length": n, "depth": d, "passkey": rng.randint(10000, 99999)} for n in lengths for d in depths]
    store = ResultStore(None, "demo", {"lengths": list(lengths), "trials": trials, "seed": seed}, model_info(model))

    print(f"model: {model_name or type(model).__name__}, torch {torch.__version__}, {torch.get_num_threads()} threads")
    print(f"MoBA: {moba.moba} (setting {moba.name})")
    print(f"{len(jobs)} passkey prompt(s) of {', '.join(map(str, lengths))} tokens, each answered by sdpa and MoBA")
    warmup = torch.tensor([tokenizer("The grass is green. " * WARMUP_TOKENS).input_ids[:WARMUP_TOKENS]])
    for setting in settings:
        try:
            with use_setting(model, setting), torch.no_grad():
                model(input_ids=warmup.to(model.device), use_cache=False)
        except ValueError as error:  # a setting this model cannot run, e.g. more full layers than it has
            raise UsageError(f"--attn {setting.name}: {error}") from None
    with tqdm(total=len(jobs) * len(settings), desc="passkey", unit="trial", disable=not progress) as bar:

        def run_cell(cell: dict[str, Any]) -> dict[str, Any]:
            trial = passkey.run_trial(model, tokenizer, cell["length"], cell["depth"], cell["passkey"])
            bar.update()
            return dataclasses.asdict(trial)

        for job in jobs:  # one prompt at a time, both settings back to back
            bar.set_postfix_str(f"{job['length']} tokens")
            run_grid(model, settings, [job], run_cell, store, progress=False)
            if store.failures:
                name, error = next(iter(store.failures.items()))
                raise RuntimeError(f"setting {name!r} failed: {error}")
    rows = []
    for length in lengths:
        full, sparse = ([r for r in store.records([s]) if r["length"] == length] for s in settings)
        rows.append(
            {
                "length": length,
                "prompt_tokens": full[0]["prompt_tokens"],
                "trials": len(full),
                "sdpa_correct": sum(t["correct"] for t in full),
                "moba_correct": sum(t["correct"] for t in sparse),
                "sdpa_prefill": statistics.median(t["prefill_seconds"] for t in full),
                "moba_prefill": statistics.median(t["prefill_seconds"] for t in sparse),
                "moba_sparsity": statistics.fmean(t["sparsity"] for t in sparse),
                "prompts": list(zip(full, sparse, strict=True)),
            }
        )
    return rows


def answer_table(rows: Sequence[dict[str, Any]], moba_name: str = "moba") -> str:
    """Each prompt's passkey and what each attention answered, with its prefill time and skipped pairs."""
    lines = [
        "| prompt tokens | depth | passkey | attention | answer | correct | prefill s | sparsity |",
        "|---:|---:|---:|---|---|---|---:|---:|",
    ]
    for r in rows:
        for pair in r["prompts"]:
            for name, t in zip(("sdpa (dense)", f"MoBA {moba_name}"), pair, strict=True):
                answer = " ".join(t["output"].split())[:40].replace("|", "\\|")
                lines.append(
                    f"| {t['prompt_tokens']} | {t['depth']:.2f} | {t['expected']} | {name} | `{answer}` "
                    f"| {'yes' if t['correct'] else 'no'} | {t['prefill_seconds']:.2f} | {t['sparsity'] or 0:.2f} |"
                )
    return "\n".join(lines)


def table(rows: Sequence[dict[str, Any]]) -> str:
    lines = [
        "| length | sdpa acc | moba acc | sdpa prefill s | moba prefill s | moba speed-up (higher = faster) "
        "| moba sparsity |",
        "|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['prompt_tokens']} | {r['sdpa_correct']}/{r['trials']} | {r['moba_correct']}/{r['trials']} "
            f"| {r['sdpa_prefill']:.2f} | {r['moba_prefill']:.2f} | {r['sdpa_prefill'] / r['moba_prefill']:.2f}x "
            f"| {r['moba_sparsity']:.2f} |"
        )
    return "\n".join(lines)
