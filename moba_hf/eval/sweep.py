"""Training-free sweep: passkey accuracy and perplexity against measured sparsity, over many MoBA settings.

The grid runs through the same results store and grid loop as every evaluation (`runner.run_grid`: one
resume rule), with the passkey task's prompts; trials of one length go through the model in batches of
equal-length prompts (no padding), which makes dozens of settings affordable on one GPU.
Output: run.json, trials.jsonl, results.json (with one row per setting), pareto.md, pareto.png.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from ..config import MobaConfig
from .passkey import cell_prompt, check_fits, score
from .ppl import window_nll
from .report import _pyplot, save_figure
from .runner import ResultStore, atomic_write_text, greedy_decode, model_info, run_grid
from .settings import MOBA, SWEEP_GRID, Setting, parse_setting

NEW_TOKENS = 6

# (name, MobaConfig or None for dense): dense attention, then the named settings of `settings.SWEEP_GRID`
DEFAULT_GRID: list[tuple[str, MobaConfig | None]] = [("sdpa", None), *SWEEP_GRID.items()]


@dataclasses.dataclass
class SweepRow:
    name: str
    config: dict[str, Any] | None
    accuracy: dict[int, float]
    sparsity: dict[int, float]
    prefill_seconds: dict[int, float]
    ppl: float | None
    error: str | None = None


def sweep_cells(lengths: Sequence[int], trials: int, ppl_tokens: int | None) -> list[dict[str, Any]]:
    """Passkey cells (depths spread evenly over the trials) and, with a text, one perplexity cell."""
    cells: list[dict[str, Any]] = [
        {"task": "passkey", "length": n, "depth": (i + 0.5) / trials, "trial": i}
        for n in lengths
        for i in range(trials)
    ]
    if ppl_tokens:
        cells.append({"task": "ppl", "length": ppl_tokens})
    return cells


def run_sweep(
    model: Any,
    tokenizer: Any,
    grid: Sequence[tuple[str, MobaConfig | None] | Setting | str],
    *,
    lengths: Sequence[int],
    trials: int,
    text_ids: torch.Tensor | None,
    out_dir: str | Path = "runs/sweep",
    batch: int = 5,
    seed: int = 0,
    model_name: str | None = None,
    progress: bool = True,
) -> list[SweepRow]:
    """Passkey accuracy per length and perplexity of `text_ids` [1, T] for every setting of `grid`.

    Re-running with the same out_dir skips finished trials; other lengths, trials, batch, seed or text
    there are refused (`runner.RunMismatch`).
    """
    settings = [parse_setting(g) for g in grid]
    for setting in settings:
        if setting.attn not in ("sdpa", MOBA):
            raise ValueError(f"the sweep compares 'sdpa' with MoBA settings; got attn_implementation {setting.attn!r}")
    lengths = sorted({int(n) for n in lengths})
    if isinstance(trials, bool) or not isinstance(trials, int) or trials < 1:
        raise ValueError(f"trials must be an integer >= 1, got {trials!r}")
    if batch < 1:
        raise ValueError(f"batch must be >= 1, got {batch}")
    check_fits(tokenizer, lengths)
    ppl_tokens = None if text_ids is None else int(text_ids.shape[1])
    params = {
        "lengths": lengths, "trials": trials, "seed": seed, "batch": batch, "new_tokens": NEW_TOKENS,
        "ppl_tokens": ppl_tokens,
        "ppl_sha1": None if text_ids is None else hashlib.sha1(str(text_ids.tolist()).encode()).hexdigest()[:16],
    }  # fmt: skip
    store = ResultStore(out_dir, "sweep", params, model_info(model, model_name))
    device = next(model.parameters()).device
    built: dict[tuple, tuple[list[int], int]] = {}  # prompts are built once, shared by every setting

    def prompt(cell: dict[str, Any]) -> tuple[list[int], int]:
        key = (cell["length"], cell["depth"], cell["trial"])
        if key not in built:
            built[key] = cell_prompt(tokenizer, seed, *key)
        return built[key]

    def run_batch(cells: list[dict[str, Any]]) -> list[dict[str, Any]]:
        if cells[0]["task"] == "ppl":
            return [window_nll(model, text_ids.to(device), 1)]
        prompts = [prompt(c) for c in cells]
        records: list[dict[str, Any] | None] = [None] * len(cells)
        by_tokens: dict[int, list[int]] = {}  # whole-sentence prompts of one length are nearly always equal
        for i, (ids, _) in enumerate(prompts):
            by_tokens.setdefault(len(ids), []).append(i)
        for n, rows in by_tokens.items():
            ids = torch.tensor([prompts[i][0] for i in rows], device=device)
            decoded = greedy_decode(model, ids, NEW_TOKENS)
            for i, tokens in zip(rows, decoded.rows, strict=True):
                text = tokenizer.decode(tokens, skip_special_tokens=True)
                got, correct = score(prompts[i][1], text)
                records[i] = {
                    "expected": prompts[i][1], "got": got, "correct": correct, "output": text, "prompt_tokens": n,
                    "prefill_seconds": decoded.prefill_seconds / len(rows), "batch": len(rows),
                    "sparsity": decoded.sparsity,
                }  # fmt: skip
        return records

    cells = sweep_cells(lengths, trials, ppl_tokens)
    run_grid(model, settings, cells, None, store, progress=progress, desc="sweep", run_batch=run_batch,
             batch_size=batch, batch_key=lambda c: (c["task"], c["length"]))  # fmt: skip
    rows = sweep_rows(store.records(settings), settings, store.failures, lengths)
    store.write(settings, pareto_table(rows, lengths), extra={"rows": [dataclasses.asdict(r) for r in rows]})
    atomic_write_text(store.out_dir / "pareto.md", pareto_table(rows, lengths))
    return rows


def sweep_rows(
    records: Sequence[dict[str, Any]], settings: Sequence[Setting], failures: dict[str, str], lengths: Sequence[int]
) -> list[SweepRow]:
    """One row per setting: accuracy, mean sparsity and median prefill seconds per trial at each length, ppl."""
    rows = []
    for setting in settings:
        mine = [r for r in records if r["setting"] == setting.name]
        row = SweepRow(setting.name, setting.moba.to_dict() if setting.moba else None, {}, {}, {}, None,
                       failures.get(setting.name))  # fmt: skip
        for n in lengths:
            trials = [r for r in mine if r["task"] == "passkey" and r["length"] == n]
            if trials:
                row.accuracy[n] = sum(r["correct"] for r in trials) / len(trials)
                row.sparsity[n] = statistics.fmean(r["sparsity"] for r in trials)
                row.prefill_seconds[n] = statistics.median(r["prefill_seconds"] for r in trials)
        ppl = [r for r in mine if r["task"] == "ppl"]
        if ppl:
            row.ppl = math.exp(sum(r["nll_sum"] for r in ppl) / sum(r["tokens_scored"] for r in ppl))
        rows.append(row)
    return rows


def pareto_front(rows: Sequence[SweepRow], length: int) -> set[str]:
    """Settings no other setting beats on both accuracy and sparsity at `length`."""
    ok = [r for r in rows if r.error is None and length in r.accuracy]
    front = set()
    for r in ok:
        a, s = r.accuracy[length], r.sparsity[length]
        dominated = any(
            o.accuracy[length] >= a and o.sparsity[length] >= s and (o.accuracy[length], o.sparsity[length]) != (a, s)
            for o in ok
        )
        if not dominated:
            front.add(r.name)
    return front


def pareto_table(rows: Sequence[SweepRow], lengths: Sequence[int]) -> str:
    top = max(lengths)
    front = pareto_front(rows, top)
    head = ["setting", *[f"passkey {n // 1024}K" if n % 1024 == 0 else f"passkey {n}" for n in lengths]]
    head += [f"sparsity @{top}", f"prefill s/trial @{top}", "ppl", "Pareto"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        if r.error:
            lines.append(f"| {r.name} | failed: {r.error[:80]} |")
            continue
        cells = [r.name, *[f"{r.accuracy.get(n, float('nan')):.2f}" for n in lengths]]
        cells += [f"{r.sparsity.get(top, 0):.2f}", f"{r.prefill_seconds.get(top, float('nan')):.3f}"]
        cells += [f"{r.ppl:.2f}" if r.ppl else "-", "*" if r.name in front else ""]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def pareto_plot(rows: Sequence[SweepRow], length: int, path: str | Path) -> Path | None:
    """Accuracy against measured sparsity at `length`, the Pareto front in red (None without matplotlib)."""
    plt = _pyplot()
    if plt is None:
        return None

    ok = [r for r in rows if r.error is None and length in r.accuracy]
    front = sorted((r for r in ok if r.name in pareto_front(ok, length)), key=lambda r: r.sparsity[length])
    fig, ax = plt.subplots(figsize=(8, 5))
    ax.scatter([r.sparsity[length] for r in ok], [r.accuracy[length] for r in ok], color="tab:blue")
    for r in ok:
        ax.annotate(
            r.name, (r.sparsity[length], r.accuracy[length]), fontsize=7, xytext=(3, 3), textcoords="offset points"
        )
    ax.plot(
        [r.sparsity[length] for r in front], [r.accuracy[length] for r in front], color="tab:red", label="Pareto front"
    )
    ax.set_xlabel(f"measured sparsity at {length} tokens (fraction of causal pairs skipped, all layers)")
    ax.set_ylabel(f"passkey accuracy at {length} tokens")
    ax.set_ylim(-0.05, 1.05)
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    save_figure(fig, path)
    plt.close(fig)
    return Path(path)


def default_text(tokenizer: Any, length: int) -> torch.Tensor:
    """Offline long English text for perplexity: the docstrings of Python's standard library."""
    import importlib
    import inspect

    parts = []
    for name in (
        "argparse",
        "collections",
        "functools",
        "inspect",
        "json",
        "logging",
        "pathlib",
        "re",
        "typing",
        "unittest",
        "email",
        "http.client",
        "asyncio",
        "subprocess",
        "threading",
        "decimal",
        "textwrap",
    ):
        module = importlib.import_module(name)
        parts.append(inspect.getdoc(module) or "")
        for _, obj in inspect.getmembers(module):
            if (inspect.isclass(obj) or inspect.isfunction(obj)) and getattr(obj, "__module__", "") == module.__name__:
                parts.append(inspect.getdoc(obj) or "")
    ids = tokenizer("\n\n".join(p for p in parts if p), add_special_tokens=False).input_ids
    if len(ids) < length:
        raise ValueError(
            f"default perplexity text has only {len(ids)} tokens, need {length}: give --text or a smaller --ppl-length"
        )
    return torch.tensor([ids[:length]])


def grid_entry(spec: str) -> tuple[str, MobaConfig | None]:
    """A sweep row from a setting string (`moba_hf.eval.settings` grammar): MoBA settings or "sdpa"."""
    setting = parse_setting(spec)
    if setting.attn == "sdpa":
        return setting.name, None
    if setting.attn != MOBA:
        raise ValueError(f"the sweep compares 'sdpa' with MoBA settings; got attn_implementation {setting.attn!r}")
    return setting.name, setting.moba or MobaConfig()
