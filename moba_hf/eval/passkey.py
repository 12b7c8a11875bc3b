"""Passkey retrieval with the Landmark-attention prompt (Mohtashami & Jaggi, 2023).

    <intro> <filler x a> The pass key is N. Remember it. N is the pass key. <filler x b>
    What is the pass key? The pass key is

The prompt is sized in tokens of the model's tokenizer; `depth` in [0, 1] places the passkey line.
Scoring: the first integer in the generated continuation must equal N.

    result = passkey_eval(model, tokenizer, ["sdpa", ("moba-64x16", MobaConfig(block_size=64, top_k=16))],
                          lengths=[2048, 4096], depths=[0, 0.5, 1], trials=5, out_dir="runs/passkey")
"""

from __future__ import annotations

import dataclasses
import random
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from ..prompts import (  # noqa: F401  (the prompt, importable from here too)
    FILLER,
    INTRO,
    QUESTION,
    WORDINGS,
    build_prompt,
    encode,
    min_length,
    passkey_line,
    random_passkey,
)
from .report import heatmap, summary_table
from .runner import EvalResult, ResultStore, greedy_decode, open_store, run_grid, window_warnings
from .settings import SettingLike, resolve_settings


def check_fits(tokenizer: Any, lengths: Sequence[int]) -> None:
    shortest = min_length(tokenizer)
    if min(lengths) < shortest:
        raise ValueError(f"lengths must be >= {shortest} tokens to hold the passkey prompt, got {min(lengths)}")


def cell_prompt(tokenizer: Any, seed: int, length: int, depth: float, trial: int) -> tuple[list[int], int]:
    """Token ids and passkey of one grid cell: the same for every setting (paired comparison) and re-run."""
    passkey = trial_passkey(seed, length, depth, trial)
    return tokenizer(build_prompt(tokenizer, length, depth, passkey)).input_ids, passkey


def first_integer(text: str) -> int | None:
    match = re.search(r"\d+", text)
    return int(match.group()) if match else None


def trial_passkey(seed: int, length: int, depth: float, index: int) -> int:
    """The passkey of one grid cell: the same for every setting (paired comparison) and every re-run."""
    return random_passkey(random.Random(f"passkey:{seed}:{length}:{depth}:{index}"))


def score(expected: int, output: str) -> tuple[int | None, bool]:
    """Exact match of the first integer in `output`."""
    got = first_integer(output)
    return got, got == expected


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
    got, correct = score(passkey, text)
    return PasskeyTrial(length, depth, passkey, got, correct, ids.shape[1], decoded.prefill_seconds, text,
                        decoded.sparsity)  # fmt: skip


def check_grid(lengths: Sequence[int], depths: Sequence[float], trials: int) -> tuple[list[int], list[float]]:
    lengths = [int(n) for n in lengths]
    depths = [float(d) for d in depths]
    if not lengths or any(n < 16 for n in lengths):
        raise ValueError(f"lengths must be a non-empty list of token counts >= 16, got {lengths}")
    if not depths or any(not 0.0 <= d <= 1.0 for d in depths):
        raise ValueError(f"depths must be a non-empty list of fractions in [0, 1], got {depths}")
    if isinstance(trials, bool) or not isinstance(trials, int) or trials < 1:
        raise ValueError(f"trials must be an integer >= 1, got {trials!r}")
    return sorted(set(lengths)), sorted(set(depths))


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
    (`runner.RunMismatch`) unless `allow_changed`. Lengths past the model's window are warned about
    (`runner.window_warnings`).
    """
    settings = resolve_settings(settings)
    lengths, depths = check_grid(lengths, depths, trials)
    if families is not None:
        return _families_eval(
            model, tokenizer, settings, lengths, depths, trials, out_dir, families, seed=seed,
            max_new_tokens=max_new_tokens, model_name=model_name, progress=progress, track=track,
            allow_changed=allow_changed,
        )  # fmt: skip
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
        got, correct = score(passkey, text)
        return {
            "expected": passkey,
            "got": got,
            "correct": correct,
            "output": text,
            "prompt_tokens": ids.shape[1],
            **decoded.measurements(),
        }

    cells = [{"length": n, "depth": d, "trial": i} for n in lengths for d in depths for i in range(trials)]
    with open_store(model, out_dir, "passkey", params, model_name=model_name, allow_changed=allow_changed,
                    warnings=warnings) as store:  # fmt: skip
        run_grid(model, settings, cells, run_cell, store, progress=progress, desc="passkey")
        return finish_grid_eval(store, settings, lengths, depths, "passkey", "passkey retrieval")


def _families_eval(
    model: Any,
    tokenizer: Any,
    settings: Sequence[Any],
    lengths: list[int],
    depths: list[float],
    trials: int,
    out_dir: str | Path,
    families: Sequence[str] | str,
    *,
    seed: int,
    max_new_tokens: int,
    model_name: str | None,
    progress: bool,
    track: bool,
    allow_changed: bool,
) -> EvalResult:
    """The passkey grid over prompt families: cells keyed by family too; a family decodes at least its
    answer's `new_tokens`."""
    from .families import FAMILIES, check_fits, parse_families, text_params
    from .report import family_table

    families = parse_families(families)
    check_fits(tokenizer, families, lengths)
    params = {"lengths": lengths, "depths": depths, "trials": trials, "seed": seed, "max_new_tokens": max_new_tokens,
              "families": families, **text_params(families)}  # fmt: skip
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
        return {
            "expected": prompt.expected, "got": got, "correct": correct, "output": text,
            "prompt_tokens": ids.shape[1], "needle_token": prompt.needle_token, **decoded.measurements(),
        }  # fmt: skip

    cells = [{"family": f, "length": n, "depth": d, "trial": i}
             for f in families for n in lengths for d in depths for i in range(trials)]  # fmt: skip
    with open_store(model, out_dir, "passkey", params, model_name=model_name, allow_changed=allow_changed,
                    warnings=warnings) as store:  # fmt: skip
        run_grid(model, settings, cells, run_cell, store, progress=progress, desc="passkey")
        names = [s.name for s in settings]
        records = store.records(settings)
        summary = store.annotated(family_table(records, names, families, lengths, failures=store.failures,
                                               title=f"retrieval by prompt family, {store.model['name']}"))  # fmt: skip
        files = [store.write(settings, summary), store.out_dir / "summary.md"]
    for family in families:
        png = heatmap([r for r in records if r["family"] == family], names, lengths, depths,
                      store.out_dir / f"{family}_heatmap.png", title=f"{family}: {store.model['name']}",
                      failures=store.failures)  # fmt: skip
        files += [png] if png else []
    return EvalResult("passkey", store.out_dir, list(settings), records, dict(store.failures), summary, files)


def finish_grid_eval(
    store: ResultStore, settings: Sequence[Any], lengths: list[int], depths: list[float], task: str, title: str
) -> EvalResult:
    """Summary table, results.json and the depth x length heatmap for a passkey / NIAH run."""
    names = [s.name for s in settings]
    records = store.records(settings)
    summary = store.annotated(summary_table(records, names, lengths, metric="accuracy", failures=store.failures,
                                            title=f"{title}, {store.model['name']}"))  # fmt: skip
    files = [store.write(settings, summary), store.out_dir / "summary.md"]
    png = heatmap(records, names, lengths, depths, store.out_dir / f"{task}_heatmap.png",
                  title=f"{title}: {store.model['name']}", failures=store.failures)  # fmt: skip
    files += [png] if png else []
    return EvalResult(task, store.out_dir, list(settings), records, dict(store.failures), summary, files)
