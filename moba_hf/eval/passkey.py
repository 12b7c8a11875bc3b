"""Passkey retrieval with the Landmark-attention prompt (Mohtashami & Jaggi, 2023).

    <intro> <filler x a> The pass key is N. Remember it. N is the pass key. <filler x b>
    What is the pass key? The pass key is

The prompt is sized in tokens of the model's tokenizer; `depth` in [0, 1] places the passkey line.
Scoring: the first integer in the generated continuation must equal N (`scoring.score_passkey`).

    result = passkey_eval(model, tokenizer, ["sdpa", ("moba-64x16", MobaConfig(block_size=64, top_k=16))],
                          lengths=[2048, 4096], depths=[0, 0.5, 1], trials=5, out_dir="runs/passkey")
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from ..prompts import build_prompt, encode, min_length, random_passkey
from .decoding import greedy_decode
from .grid import EvalResult, check_grid, depth_grid_eval, open_store, run_grid, window_warnings
from .report import family_table, heatmap
from .scoring import score_passkey
from .settings import SettingLike, resolve_settings


def check_fits(tokenizer: Any, lengths: Sequence[int]) -> None:
    shortest = min_length(tokenizer)
    if min(lengths) < shortest:
        raise ValueError(f"lengths must be >= {shortest} tokens to hold the passkey prompt, got {min(lengths)}")


def cell_prompt(tokenizer: Any, seed: int, length: int, depth: float, trial: int) -> tuple[list[int], int]:
    """Token ids and passkey of one grid cell: the same for every setting (paired comparison) and re-run."""
    passkey = trial_passkey(seed, length, depth, trial)
    return tokenizer(build_prompt(tokenizer, length, depth, passkey)).input_ids, passkey


def trial_passkey(seed: int, length: int, depth: float, index: int) -> int:
    """The passkey of one grid cell: the same for every setting (paired comparison) and every re-run."""
    return random_passkey(random.Random(f"passkey:{seed}:{length}:{depth}:{index}"))


@dataclasses.dataclass
class PasskeyTrial:
    length: int
    depth: float
    expected: int
    got: int | None
    correct: bool
    prompt_tokens: int
    prefill_seconds: float
    output: str
    sparsity: float | None = None


def run_trial(
    model: Any, tokenizer: Any, length: int, depth: float, passkey: int, max_new_tokens: int = 8
) -> PasskeyTrial:
    """One passkey trial: greedy decoding; the prefill (first forward) is timed separately."""
    ids = encode(tokenizer, build_prompt(tokenizer, length, depth, passkey), model.device)
    decoded = greedy_decode(model, ids, max_new_tokens, eos_token_id=tokenizer.eos_token_id)
    text = tokenizer.decode(decoded.tokens, skip_special_tokens=True)
    got, correct = score_passkey(passkey, text)
    prefill, sparsity = decoded.prefill_seconds, decoded.sparsity
    return PasskeyTrial(length, depth, passkey, got, correct, ids.shape[1], prefill, text, sparsity)


def passkey_eval(
    model: Any,
    tokenizer: Any,
    settings: Sequence[SettingLike] | None = None,
    lengths: Sequence[int] = (1024, 2048),
    depths: Sequence[float] = (0.0, 0.25, 0.5, 0.75, 1.0),
    trials: int = 3,
    out_dir: str | Path = "runs/passkey",
    *,
    seed: int = 0,
    max_new_tokens: int = 8,
    model_name: str | None = None,
    progress: bool = True,
    track: bool = True,
    families: Sequence[str] | str | None = None,
    allow_changed: bool = False,
) -> EvalResult:
    """Passkey accuracy, prefill time and measured sparsity for each setting on the lengths x depths grid.

    settings: e.g. ["sdpa", "moba:paper-8k", ("fine", MobaConfig(block_size=64, top_k=16))];
    (name, None) means dense sdpa. The one `model` is switched between settings with apply / revert.
    families: prompt families (`families.FAMILIES`, e.g. "passkey,prose-needle,kv-retrieval") run on the same
    grid instead of the fixed Landmark prompt, reported side by side. Re-running with the same out_dir skips
    finished trials; another model, other parameters or a redefined setting there are refused
    (`run_records.RunMismatch`) unless `allow_changed`. Lengths past the model's window are warned about
    (`grid.window_warnings`).
    """
    settings = resolve_settings(settings)
    lengths, depths = check_grid(lengths, depths, trials)
    if families is not None:
        grid = (lengths, depths, trials)
        common = {"model_name": model_name, "progress": progress, "allow_changed": allow_changed}
        return _families_eval(model, tokenizer, settings, grid, out_dir, families, seed, max_new_tokens, track, common)
    check_fits(tokenizer, lengths)
    params = {"lengths": lengths, "depths": depths, "trials": trials, "seed": seed, "max_new_tokens": max_new_tokens}
    warnings = window_warnings(model, settings, lengths, max_new_tokens)
    prompts: dict[tuple, tuple[list[int], int]] = {}  # built once, shared by every setting

    def run_cell(cell: dict[str, Any]) -> dict[str, Any]:
        key = (cell["length"], cell["depth"], cell["trial"])
        if key not in prompts:
            prompts[key] = cell_prompt(tokenizer, seed, *key)
        ids, passkey = prompts[key]
        ids = torch.tensor([ids], device=model.device)
        decoded = greedy_decode(model, ids, max_new_tokens, track=track, eos_token_id=tokenizer.eos_token_id)
        text = tokenizer.decode(decoded.tokens, skip_special_tokens=True)
        got, correct = score_passkey(passkey, text)
        return {
            "expected": passkey,
            "got": got,
            "correct": correct,
            "output": text,
            "prompt_tokens": ids.shape[1],
            **decoded.measurements(),
        }

    common = {"model_name": model_name, "progress": progress, "allow_changed": allow_changed, "warnings": warnings}
    grid = (lengths, depths, trials)
    return depth_grid_eval(model, settings, run_cell, grid, out_dir, "passkey", "passkey retrieval", params, **common)


def _families_eval(
    model: Any,
    tokenizer: Any,
    settings: Sequence[Any],
    grid: tuple[list[int], list[float], int],
    out_dir: str | Path,
    families: Sequence[str] | str,
    seed: int,
    max_new_tokens: int,
    track: bool,
    common: dict[str, Any],
) -> EvalResult:
    """The passkey grid over prompt families: cells keyed by family too; a family decodes at least its
    answer's `new_tokens`."""
    from .families import FAMILIES, check_fits, parse_families, text_params

    lengths, depths, trials = grid
    families = parse_families(families)
    check_fits(tokenizer, families, lengths)
    params = {"lengths": lengths, "depths": depths, "trials": trials, "seed": seed, "max_new_tokens": max_new_tokens}
    params.update(families=families, **text_params(families))
    new_tokens = max(max_new_tokens, *(FAMILIES[f].new_tokens for f in families))
    warnings = window_warnings(model, settings, lengths, new_tokens)

    def run_cell(cell: dict[str, Any]) -> dict[str, Any]:
        family = FAMILIES[cell["family"]]
        prompt = family.prompt(tokenizer, seed, cell["length"], cell["depth"], cell["trial"])
        ids = torch.tensor([prompt.ids], device=model.device)
        new_tokens = max(max_new_tokens, family.new_tokens)
        decoded = greedy_decode(model, ids, new_tokens, track=track, eos_token_id=tokenizer.eos_token_id)
        text = tokenizer.decode(decoded.tokens, skip_special_tokens=True)
        got, correct = family.score(prompt.expected, text)
        found = {"expected": prompt.expected, "got": got, "correct": correct, "output": text}
        return {**found, "prompt_tokens": ids.shape[1], "needle_token": prompt.needle_token, **decoded.measurements()}

    cells = [
        {"family": f, "length": n, "depth": d, "trial": i}
        for f in families
        for n in lengths
        for d in depths
        for i in range(trials)
    ]
    progress = common.pop("progress")
    with open_store(model, out_dir, "passkey", params, warnings=warnings, **common) as store:
        run_grid(model, settings, cells, run_cell, store, progress=progress, desc="passkey")
        names = [s.name for s in settings]
        records = store.records(settings)
        title = f"retrieval by prompt family, {store.model['name']}"
        table = family_table(records, names, families, lengths, failures=store.failures, title=title)
        summary = store.annotated(table)
        files = [store.write(settings, summary), store.out_dir / "summary.md"]
    for family in families:
        mine = [r for r in records if r["family"] == family]
        path, title = store.out_dir / f"{family}_heatmap.png", f"{family}: {store.model['name']}"
        png = heatmap(mine, names, lengths, depths, path, title=title, failures=store.failures)
        files += [png] if png else []
    return EvalResult("passkey", store.out_dir, list(settings), records, dict(store.failures), summary, files)
