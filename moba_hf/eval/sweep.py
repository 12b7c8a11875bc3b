"""Training-free sweep: retrieval accuracy on several prompt families and perplexity, against measured sparsity,
over many MoBA settings.

The grid runs through the same results store and grid loop as every evaluation (`grid.run_grid`: one
resume rule), with the prompts of `families.FAMILIES` (passkey, prose-needle, kv-retrieval); trials of one
family and length go through the model in batches of equal-length prompts (no padding), which makes dozens
of settings affordable on one GPU. Settings are ranked, and the Pareto front drawn, on the accuracy of their
worst family: a preset must hold on every kind of text, not on the one it was tuned on.
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
from .decoding import greedy_decode
from .families import FAMILIES, Prompt, check_fits, parse_families, text_params
from .grid import check_trials, open_store, run_grid, window_warnings
from .ppl import window_nll
from .report import load_pyplot, save_figure
from .run_records import atomic_write_text
from .settings import MOBA, SWEEP_GRID, Setting, parse_setting

# (name, MobaConfig or None for dense): dense attention, then the named settings of `settings.SWEEP_GRID`
DEFAULT_GRID: list[tuple[str, MobaConfig | None]] = [("sdpa", None), *SWEEP_GRID.items()]


@dataclasses.dataclass
class SweepRow:
    name: str
    config: dict[str, Any] | None
    accuracy: dict[str, dict[int, float]]  # family -> length -> accuracy
    sparsity: dict[int, float]  # length -> mean measured sparsity over every family's trials
    prefill_seconds: dict[int, float]  # length -> median prefill seconds per trial
    ppl: float | None
    error: str | None = None
    worst: dict[int, float] = dataclasses.field(default_factory=dict)  # length -> lowest family accuracy
    worst_family: dict[int, str] = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        lengths = {n for by_length in self.accuracy.values() for n in by_length}
        for n in lengths:
            if n not in self.worst and all(n in by_length for by_length in self.accuracy.values()):
                family = min(self.accuracy, key=lambda f: self.accuracy[f][n])  # first family wins a tie
                self.worst[n], self.worst_family[n] = self.accuracy[family][n], family


def sweep_cells(
    lengths: Sequence[int], trials: int, ppl_tokens: int | None, families: Sequence[str] = ("passkey",)
) -> list[dict[str, Any]]:
    """Retrieval cells of every family (depths spread evenly over the trials) and, with a text, one
    perplexity cell."""
    cells: list[dict[str, Any]] = [
        {"family": f, "length": n, "depth": (i + 0.5) / trials, "trial": i}
        for f in families
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
    families: Sequence[str] | str | None = None,
    out_dir: str | Path = "runs/sweep",
    batch: int = 5,
    seed: int = 0,
    model_name: str | None = None,
    progress: bool = True,
    allow_changed: bool = False,
) -> list[SweepRow]:
    """Accuracy per prompt family and length, and perplexity of `text_ids` [1, T], for every setting of `grid`.

    families: names of `families.FAMILIES` (default: all). Re-running with the same out_dir skips finished
    trials; another model, other lengths, trials, batch, seed, families or text there are refused
    (`run_records.RunMismatch`) unless `allow_changed`. Lengths past the model's window are warned about.
    """
    settings = [parse_setting(g) for g in grid]
    for setting in settings:
        if setting.attn not in ("sdpa", MOBA):
            raise ValueError(f"the sweep compares 'sdpa' with MoBA settings; got attn_implementation {setting.attn!r}")
    families = parse_families(families)
    lengths = sorted({int(n) for n in lengths})
    check_trials(trials)
    if batch < 1:
        raise ValueError(f"batch must be >= 1, got {batch}")
    check_fits(tokenizer, families, lengths)
    ppl_tokens = None if text_ids is None else int(text_ids.shape[1])
    ppl_sha1 = None if text_ids is None else hashlib.sha1(str(text_ids.tolist()).encode()).hexdigest()[:16]
    new_tokens = {f: FAMILIES[f].new_tokens for f in families}
    params = {"lengths": lengths, "trials": trials, "seed": seed, "batch": batch, "families": families}
    params.update(new_tokens=new_tokens, **text_params(families), ppl_tokens=ppl_tokens, ppl_sha1=ppl_sha1)
    warnings = window_warnings(model, settings, lengths, max(FAMILIES[f].new_tokens for f in families))
    warnings += window_warnings(model, settings, [ppl_tokens] if ppl_tokens else [])
    device = next(model.parameters()).device
    built: dict[tuple, Prompt] = {}  # prompts are built once, shared by every setting

    def prompt(cell: dict[str, Any]) -> Prompt:
        key = (cell["family"], cell["length"], cell["depth"], cell["trial"])
        if key not in built:
            built[key] = FAMILIES[key[0]].prompt(tokenizer, seed, *key[1:])
        return built[key]

    def run_batch(cells: list[dict[str, Any]]) -> list[dict[str, Any]]:
        if cells[0].get("task") == "ppl":
            return [window_nll(model, text_ids.to(device), 1)]
        family = FAMILIES[cells[0]["family"]]
        prompts = [prompt(c) for c in cells]
        records: list[dict[str, Any] | None] = [None] * len(cells)
        by_tokens: dict[int, list[int]] = {}  # only prompts of equal token count share a forward
        for i, p in enumerate(prompts):
            by_tokens.setdefault(len(p.ids), []).append(i)
        for n, rows in by_tokens.items():
            ids = torch.tensor([prompts[i].ids for i in rows], device=device)
            decoded = greedy_decode(model, ids, family.new_tokens)
            for i, tokens in zip(rows, decoded.rows, strict=True):
                text = tokenizer.decode(tokens, skip_special_tokens=True)
                got, correct = family.score(prompts[i].expected, text)
                found = {"expected": prompts[i].expected, "got": got, "correct": correct, "output": text}
                cell = {"prompt_tokens": n, "needle_token": prompts[i].needle_token, "batch": len(rows)}
                timing = {"prefill_seconds": decoded.prefill_seconds / len(rows), "sparsity": decoded.sparsity}
                records[i] = {**found, **cell, **timing}
        return records

    cells = sweep_cells(lengths, trials, ppl_tokens, families)
    common = {"model_name": model_name, "allow_changed": allow_changed, "warnings": warnings}

    def batch_key(cell: dict[str, Any]) -> tuple[str, int]:
        return cell.get("family", cell.get("task")), cell["length"]

    with open_store(model, out_dir, "sweep", params, **common) as store:
        grid = {"run_batch": run_batch, "batch_size": batch, "batch_key": batch_key}
        run_grid(model, settings, cells, None, store, progress=progress, desc="sweep", **grid)
        rows = sweep_rows(store.records(settings), settings, store.failures, lengths, families)
        table = store.annotated(pareto_table(rows, lengths, families))
        store.write(settings, table, extra={"rows": [dataclasses.asdict(r) for r in rows]})
        atomic_write_text(store.out_dir / "pareto.md", table)
    return rows


def sweep_rows(
    records: Sequence[dict[str, Any]],
    settings: Sequence[Setting],
    failures: dict[str, str],
    lengths: Sequence[int],
    families: Sequence[str],
) -> list[SweepRow]:
    """One row per setting: accuracy per family and length, mean sparsity and median prefill seconds per
    trial at each length (over all families), perplexity."""
    rows = []
    for setting in settings:
        mine = [r for r in records if r["setting"] == setting.name]
        accuracy: dict[str, dict[int, float]] = {f: {} for f in families}
        sparsity, prefill = {}, {}
        for n in lengths:
            at_n = [r for r in mine if r.get("family") in accuracy and r["length"] == n]
            for f in families:
                trials = [r for r in at_n if r["family"] == f]
                if trials:
                    accuracy[f][n] = sum(r["correct"] for r in trials) / len(trials)
            if at_n:
                sparsity[n] = statistics.fmean(r["sparsity"] for r in at_n)
                prefill[n] = statistics.median(r["prefill_seconds"] for r in at_n)
        ppl = [r for r in mine if r.get("task") == "ppl"]
        ppl_value = math.exp(sum(r["nll_sum"] for r in ppl) / sum(r["tokens_scored"] for r in ppl)) if ppl else None
        config = setting.moba.to_dict() if setting.moba else None
        rows.append(SweepRow(setting.name, config, accuracy, sparsity, prefill, ppl_value, failures.get(setting.name)))
    return rows


def pareto_front(rows: Sequence[SweepRow], length: int) -> set[str]:
    """Settings no other setting beats on both worst-family accuracy and sparsity at `length`."""
    ok = [r for r in rows if r.error is None and length in r.worst and length in r.sparsity]
    front = set()
    for r in ok:
        a, s = r.worst[length], r.sparsity[length]
        dominated = any(
            o.worst[length] >= a and o.sparsity[length] >= s and (o.worst[length], o.sparsity[length]) != (a, s)
            for o in ok
        )
        if not dominated:
            front.add(r.name)
    return front


def ranking(rows: Sequence[SweepRow], length: int) -> list[str]:
    """Settings that ran at `length`, best first: worst-family accuracy, then sparsity, both descending."""
    ok = [r for r in rows if r.error is None and length in r.worst and length in r.sparsity]
    return [r.name for r in sorted(ok, key=lambda r: (-r.worst[length], -r.sparsity[length]))]


def _short(n: int) -> str:
    return f"{n // 1024}K" if n % 1024 == 0 else str(n)


def pareto_table(rows: Sequence[SweepRow], lengths: Sequence[int], families: Sequence[str] | None = None) -> str:
    """Markdown, one row per setting: accuracy of every family at every length side by side, the worst family
    (which ranks the settings), measured sparsity, prefill, perplexity, rank and Pareto front at the longest
    length."""
    families = list(families or dict.fromkeys(f for r in rows for f in r.accuracy))
    top = max(lengths)
    front, order = pareto_front(rows, top), ranking(rows, top)
    head = ["setting", *[f"{f} {_short(n)}" for f in families for n in lengths]]
    head += [f"worst family @{_short(top)}", f"sparsity @{_short(top)}", f"prefill s/trial @{_short(top)}"]
    head += ["ppl", "rank", "Pareto"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    nan = float("nan")
    for r in rows:
        if r.error:
            lines.append(f"| {r.name} | failed: {r.error[:80]} |")
            continue
        cells = [r.name, *[f"{r.accuracy.get(f, {}).get(n, nan):.2f}" for f in families for n in lengths]]
        cells.append(f"{r.worst[top]:.2f} ({r.worst_family[top]})" if top in r.worst else "-")
        cells += [f"{r.sparsity.get(top, 0):.2f}", f"{r.prefill_seconds.get(top, nan):.3f}"]
        cells += [f"{r.ppl:.2f}" if r.ppl else "-", str(order.index(r.name) + 1) if r.name in order else "-"]
        cells.append("*" if r.name in front else "")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


_MARKERS = ("o", "s", "^", "D", "v", "P")


def pareto_plot(rows: Sequence[SweepRow], length: int, path: str | Path) -> Path | None:
    """Accuracy against measured sparsity at `length`: one marker per family, the worst family as a black
    cross, the worst-family Pareto front in red; beside it, when the run scored a text, perplexity against the
    same sparsity (None without matplotlib)."""
    plt = load_pyplot()
    if plt is None:
        return None

    ok = [r for r in rows if r.error is None and length in r.worst and length in r.sparsity]
    front = sorted((r for r in ok if r.name in pareto_front(ok, length)), key=lambda r: r.sparsity[length])
    families = list(dict.fromkeys(f for r in ok for f in r.accuracy))
    scored = [r for r in ok if r.ppl]
    if scored:
        fig, (ax, ppl_ax) = plt.subplots(1, 2, figsize=(13, 5), gridspec_kw={"width_ratios": [3, 2]})
        ppl_ax.scatter([r.sparsity[length] for r in scored], [r.ppl for r in scored], color="black")
        _label_points(ppl_ax, [(r.name, r.sparsity[length], r.ppl) for r in scored])
        ppl_ax.set_xlabel(f"measured sparsity at {length} tokens")
        ppl_ax.set_ylabel("perplexity of the text window (lower is better)")
        ppl_ax.grid(alpha=0.3)
    else:
        fig, ax = plt.subplots(figsize=(8, 5))
    for family, marker in zip(families, _MARKERS * 2, strict=False):
        mine = [r for r in ok if length in r.accuracy.get(family, {})]
        accuracy = [r.accuracy[family][length] for r in mine]
        ax.scatter([r.sparsity[length] for r in mine], accuracy, marker=marker, alpha=0.6, label=family)
    worst = [r.worst[length] for r in ok]
    ax.scatter([r.sparsity[length] for r in ok], worst, marker="x", color="black", label="worst family")
    _label_points(ax, [(r.name, r.sparsity[length], r.worst[length]) for r in ok])
    line = {"color": "tab:red", "marker": "o", "markerfacecolor": "none", "markersize": 11}
    front_xy = [r.sparsity[length] for r in front], [r.worst[length] for r in front]
    ax.plot(*front_xy, **line, label="Pareto front (worst family)")
    ax.set_xlabel(f"measured sparsity at {length} tokens (fraction of causal pairs skipped, all layers)")
    ax.set_ylabel(f"retrieval accuracy at {length} tokens")
    ax.set_ylim(-0.05, 1.05)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    save_figure(fig, path)
    plt.close(fig)
    return Path(path)


def _label_points(ax: Any, points: Sequence[tuple[str, float, float]]) -> None:
    """Name each (name, x, y) point; labels of points close to an already labelled one stack upwards."""
    x_span = max((p[1] for p in points), default=1) - min((p[1] for p in points), default=0) or 1
    y_span = max((p[2] for p in points), default=1) - min((p[2] for p in points), default=0) or 1
    placed: list[tuple[float, float]] = []
    for name, x, y in points:
        near = sum(abs(x - px) < 0.15 * x_span and abs(y - py) < 0.05 * y_span for px, py in placed)
        ax.annotate(name, (x, y), fontsize=7, xytext=(3, 3 + 9 * near), textcoords="offset points")
        placed.append((x, y))


def default_text(tokenizer: Any, length: int) -> torch.Tensor:
    """Offline long English text for perplexity: the docstrings of Python's standard library."""
    from .texts import stdlib_docstrings

    parts = stdlib_docstrings()
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
