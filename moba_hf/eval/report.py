"""Summaries of trial records: per-cell aggregates, the Markdown table, the heatmap and line plots."""

from __future__ import annotations

import logging
import math
import os
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

logger = logging.getLogger("moba_hf")


def _mean(values: list[float]) -> float | None:
    values = [v for v in values if v is not None]
    return sum(values) / len(values) if values else None


def aggregate(records: Sequence[dict[str, Any]], keys: Sequence[str]) -> dict[tuple, dict[str, Any]]:
    """Group records by `keys` (e.g. ("setting", "length")) -> n, accuracy, mean prefill, mean sparsity."""
    groups: dict[tuple, list[dict[str, Any]]] = defaultdict(list)
    for record in records:
        groups[tuple(record[k] for k in keys)].append(record)
    out = {}
    for group, rows in groups.items():
        cell: dict[str, Any] = {
            "n": len(rows),
            "prefill_seconds": _mean([r.get("prefill_seconds") for r in rows]),
            "sparsity": _mean([r.get("sparsity") for r in rows]),
            "prompt_tokens": _mean([r.get("prompt_tokens") for r in rows]),
        }
        if "correct" in rows[0]:
            cell["correct"] = sum(bool(r["correct"]) for r in rows)
            cell["accuracy"] = cell["correct"] / len(rows)
        if "nll_sum" in rows[0]:
            tokens = sum(r["tokens_scored"] for r in rows)
            cell["tokens_scored"] = tokens
            cell["ppl"] = math.exp(sum(r["nll_sum"] for r in rows) / tokens) if tokens else None
        out[group] = cell
    return out


def _fmt(value: float | None, spec: str) -> str:
    return "—" if value is None else format(value, spec)


def summary_table(
    records: Sequence[dict[str, Any]],
    settings: Sequence[str],
    lengths: Sequence[int],
    *,
    metric: str,
    failures: dict[str, str] | None = None,
    title: str = "",
) -> str:
    """Markdown: one row per setting; `metric` is "accuracy" or "ppl" per length, then prefill time, the speed-up
    over the first setting (its prefill time / this one's: higher = faster, as everywhere in moba_hf), and
    measured sparsity at the longest length."""
    by_length = aggregate(records, ("setting", "length"))
    longest = max(lengths)
    failures = failures or {}
    head = ["setting", *[f"{metric} @{n}" for n in lengths]]
    if metric == "accuracy":
        head.append("all")
    head += [f"prefill s @{longest}", f"speed-up vs {settings[0]} (>1 = faster)", f"sparsity @{longest}"]
    lines = ([f"### {title}", ""] if title else []) + ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    base = by_length.get((settings[0], longest), {}).get("prefill_seconds")
    for name in settings:
        row = [f"`{name}`"]
        for n in lengths:
            cell = by_length.get((name, n))
            if cell is None:
                row.append("—")
            elif metric == "accuracy":
                row.append(f"{cell['accuracy']:.2f} ({cell['correct']}/{cell['n']})")
            else:
                row.append(_fmt(cell.get("ppl"), ".3f"))
        if metric == "accuracy":
            rows = [r for r in records if r["setting"] == name]
            correct = sum(bool(r["correct"]) for r in rows)
            row.append(f"{correct / len(rows):.2f}" if rows else "—")
        cell = by_length.get((name, longest), {})
        prefill = cell.get("prefill_seconds")
        row.append(_fmt(prefill, ".3f"))
        row.append(f"{base / prefill:.2f}x" if prefill and base else "—")
        row.append(_fmt(cell.get("sparsity"), ".3f"))
        if name in failures:
            row[0] += " (failed)"
        lines.append("| " + " | ".join(row) + " |")
    if failures:
        lines += ["", "Failed settings:"] + [f"- `{name}`: {error}" for name, error in failures.items()]
    return "\n".join(lines) + "\n"


def family_table(
    records: Sequence[dict[str, Any]],
    settings: Sequence[str],
    families: Sequence[str],
    lengths: Sequence[int],
    *,
    failures: dict[str, str] | None = None,
    title: str = "",
) -> str:
    """Markdown, one row per setting: accuracy of every prompt family at every length side by side, the worst
    family and the measured sparsity at the longest length."""
    cells = aggregate([r for r in records if "family" in r], ("setting", "family", "length"))
    sparsity = aggregate([r for r in records if "family" in r], ("setting", "length"))
    longest = max(lengths)
    failures = failures or {}
    head = ["setting", *[f"{f} @{n}" for f in families for n in lengths]]
    head += [f"worst family @{longest}", f"sparsity @{longest}"]
    lines = ([f"### {title}", ""] if title else []) + ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name in settings:
        row = [f"`{name}`" + (" (failed)" if name in failures else "")]
        for f in families:
            for n in lengths:
                cell = cells.get((name, f, n))
                row.append("—" if cell is None else f"{cell['accuracy']:.2f} ({cell['correct']}/{cell['n']})")
        at_longest = [(cells[(name, f, longest)]["accuracy"], f) for f in families if (name, f, longest) in cells]
        worst = min(at_longest, key=lambda a: a[0]) if len(at_longest) == len(families) else None
        row.append("—" if worst is None else f"{worst[0]:.2f} ({worst[1]})")
        row.append(_fmt(sparsity.get((name, longest), {}).get("sparsity"), ".3f"))
        lines.append("| " + " | ".join(row) + " |")
    if failures:
        lines += ["", "Failed settings:"] + [f"- `{name}`: {error}" for name, error in failures.items()]
    return "\n".join(lines) + "\n"


def load_pyplot():
    """matplotlib.pyplot on the Agg backend, or None (with one warning) when matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        logger.warning("moba_hf eval: matplotlib is not installed (pip install 'moba-hf[eval]'); no PNG written")
        return None
    return plt


def save_figure(fig: Any, path: str | Path) -> Path:
    """Save through a temporary file and os.replace: an interrupted run leaves no half-written PNG."""
    path = Path(path)
    tmp = path.with_name(f".{path.stem}.tmp{os.getpid()}{path.suffix}")
    fig.savefig(tmp, dpi=120)
    os.replace(tmp, path)
    return path


def heatmap(
    records: Sequence[dict[str, Any]],
    settings: Sequence[str],
    lengths: Sequence[int],
    depths: Sequence[float],
    path: str | Path,
    *,
    title: str = "needle in a haystack",
    failures: dict[str, str] | None = None,
) -> Path | None:
    """Depth (rows) x length (columns) accuracy, red (0) to green (1), one panel per setting."""
    plt = load_pyplot()
    if plt is None:
        return None
    import numpy as np

    cells = aggregate(records, ("setting", "length", "depth"))
    failures = failures or {}
    size = (1.2 + 0.9 * len(lengths) * len(settings) + 1.0, 0.5 * len(depths) + 1.8)
    fig, axes = plt.subplots(1, len(settings), figsize=size, squeeze=False, constrained_layout=True)
    image = None
    for ax, name in zip(axes[0], settings, strict=True):
        grid = np.full((len(depths), len(lengths)), np.nan)
        for i, depth in enumerate(depths):
            for j, length in enumerate(lengths):
                cell = cells.get((name, length, depth))
                if cell is not None:
                    grid[i, j] = cell["accuracy"]
        image = ax.imshow(grid, cmap="RdYlGn", vmin=0.0, vmax=1.0, aspect="auto")
        for i in range(len(depths)):
            for j in range(len(lengths)):
                if not np.isnan(grid[i, j]):
                    color = "white" if not 0.25 < grid[i, j] < 0.75 else "black"  # both ends of RdYlGn are dark
                    ax.text(j, i, f"{grid[i, j]:.2f}", ha="center", va="center", fontsize=8, color=color)
        ax.set_xticks(range(len(lengths)), [_short(n) for n in lengths])
        ax.set_yticks(range(len(depths)), [f"{d:.0%}" for d in depths])
        ax.set_xlabel("context length (tokens)")
        ax.set_title(name + (" (failed)" if name in failures else ""), fontsize=9)
    axes[0][0].set_ylabel("needle depth")
    fig.colorbar(image, ax=list(axes[0]), label="accuracy", shrink=0.8)
    fig.suptitle(title)
    save_figure(fig, path)
    plt.close(fig)
    return Path(path)


def line_plot(
    records: Sequence[dict[str, Any]],
    settings: Sequence[str],
    lengths: Sequence[int],
    path: str | Path,
    *,
    metric: str = "ppl",
    title: str = "perplexity",
) -> Path | None:
    """`metric` (ppl or accuracy) and prefill time against context length, one line per setting."""
    plt = load_pyplot()
    if plt is None:
        return None
    cells = aggregate(records, ("setting", "length"))
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4), constrained_layout=True)
    for name in settings:
        xs = [n for n in lengths if (name, n) in cells and cells[(name, n)].get(metric) is not None]
        if not xs:
            continue
        left.plot(xs, [cells[(name, n)][metric] for n in xs], marker="o", label=name)
        right.plot(xs, [cells[(name, n)]["prefill_seconds"] for n in xs], marker="o", label=name)
    for ax, ylabel in ((left, metric), (right, "prefill seconds")):
        ax.set_xscale("log", base=2)
        ax.set_xticks(list(lengths), [_short(n) for n in lengths])
        ax.set_xlabel("context length (tokens)")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
    left.legend(fontsize=8)
    fig.suptitle(title)
    save_figure(fig, path)
    plt.close(fig)
    return Path(path)


def _short(n: int) -> str:
    return f"{n // 1024}K" if n % 1024 == 0 else str(n)
