"""Training-free sweep: passkey accuracy and perplexity against measured sparsity, over many MoBA settings.

Trials of one length are run as one batch of exact-length prompts (built at the token level, so no padding),
which makes a grid of dozens of settings affordable on one GPU. Output: results.json, pareto.md, pareto.png.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from ..config import MobaConfig
from ..integration import apply, revert, track_sparsity
from .passkey import FILLER, INTRO, QUESTION, first_integer, passkey_line
from .runner import _sync, forward_kwargs, output_cache, versions
from .settings import MOBA, parse_setting

# (name, MobaConfig or None for dense). Budgets chosen around 70-80% sparsity at 8K, plus the paper's setting.
DEFAULT_GRID: list[tuple[str, MobaConfig | None]] = [("sdpa", None)]
for _bs, _k, _full, _extra in [
    (512, 3, 0, {}),
    (512, 3, 3, {}),
    (512, 3, 0, {"pooling": "bound"}),
    (256, 4, 3, {}),
    (128, 6, 3, {}),
    (128, 8, 3, {}),
    (64, 12, 3, {}),
    (64, 16, 3, {}),
    (32, 24, 3, {}),
    (32, 32, 3, {}),
    (64, 12, 0, {}),
    (64, 12, 3, {"sink_blocks": 1}),
    (64, 12, 3, {"local_blocks": 1}),
    (64, 12, 3, {"sink_blocks": 1, "local_blocks": 1}),
    (64, 12, 3, {"pooling": "max"}),
    (64, 12, 3, {"pooling": "mean+max"}),
    (64, 12, 3, {"pooling": "mean+max", "sink_blocks": 1, "local_blocks": 1}),
    (64, 12, 3, {"pooling": "bound"}),
    (64, 12, 3, {"pooling": "bound", "sink_blocks": 1, "local_blocks": 1}),
    (128, 6, 3, {"sink_blocks": 1, "local_blocks": 1}),
    (32, 24, 3, {"pooling": "mean+max", "sink_blocks": 1, "local_blocks": 1}),
    (32, 24, 0, {"sink_blocks": 1, "local_blocks": 1}),
]:
    _cfg = MobaConfig(block_size=_bs, top_k=_k, full_attn_layers=_full, **_extra)
    _name = f"b{_bs}-k{_k}-f{_full}" + "".join(f"-{k.split('_')[0]}{v}" for k, v in _extra.items())
    DEFAULT_GRID.append((_name, _cfg))


def passkey_token_prompts(
    tokenizer: Any, length: int, depths: Sequence[float], passkeys: Sequence[int]
) -> torch.Tensor:
    """[trials, length] token ids: intro, filler, passkey line at `depth`, filler, question; exactly `length`."""

    def ids(text: str) -> list[int]:
        return tokenizer(text, add_special_tokens=False).input_ids

    bos = tokenizer("").input_ids  # whatever special tokens the tokenizer adds to any prompt by default
    intro, question, filler = ids(INTRO), ids(" " + QUESTION), ids(" " + FILLER)
    rows = []
    for depth, key in zip(depths, passkeys, strict=True):
        needle = ids(" " + passkey_line(key))
        room = length - len(bos) - len(intro) - len(needle) - len(question)
        if room < 0:
            raise ValueError(f"length={length} is too short for the passkey prompt (needs > {length - room})")
        stream = (filler * (room // len(filler) + 1))[:room]
        before = round(room * depth)
        rows.append(bos + intro + stream[:before] + needle + stream[before:] + question)
    return torch.tensor(rows)


@torch.no_grad()
def batched_passkey(model: Any, prompts: torch.Tensor, passkeys: Sequence[int], tokenizer: Any, new_tokens: int = 6):
    """Greedy-decode a batch of same-length prompts; returns (got, correct, prefill_seconds, sparsity)."""
    cache_kw, has_keep = forward_kwargs(model)
    extra = {"logits_to_keep": 1} if has_keep else {}
    device = prompts.device
    with track_sparsity() as stats:
        _sync(device)
        start = time.perf_counter()
        out = model(input_ids=prompts, use_cache=True, **extra)
        _sync(device)
        prefill = time.perf_counter() - start
    sparsity = stats.overall
    token = out.logits[:, -1:].argmax(-1)
    generated = [token]
    for _ in range(new_tokens - 1):
        out = model(input_ids=token, use_cache=True, **{cache_kw: output_cache(out)}, **extra)
        token = out.logits[:, -1:].argmax(-1)
        generated.append(token)
    texts = tokenizer.batch_decode(torch.cat(generated, dim=-1), skip_special_tokens=True)
    got = [first_integer(t) for t in texts]
    return got, [g == k for g, k in zip(got, passkeys, strict=True)], prefill, sparsity


@torch.no_grad()
def perplexity(model: Any, ids: torch.Tensor) -> tuple[float, float]:
    """Perplexity of the first ids.shape[1] tokens (one forward) and the measured sparsity."""
    with track_sparsity() as stats:
        out = model(input_ids=ids, labels=ids, use_cache=False)
    return float(torch.exp(out.loss)), stats.overall


@dataclasses.dataclass
class SweepRow:
    name: str
    config: dict[str, Any] | None
    accuracy: dict[int, float]
    sparsity: dict[int, float]
    prefill_seconds: dict[int, float]
    ppl: float | None
    error: str | None = None


def run_sweep(
    model: Any,
    tokenizer: Any,
    grid: Sequence[tuple[str, MobaConfig | None]],
    *,
    lengths: Sequence[int],
    trials: int,
    text_ids: torch.Tensor | None,
    out_dir: Path,
    batch: int = 5,
    seed: int = 0,
    progress: bool = True,
) -> list[SweepRow]:
    from tqdm.auto import tqdm

    out_dir.mkdir(parents=True, exist_ok=True)
    done = _load_rows(out_dir / "results.json")
    device = next(model.parameters()).device
    depths = [(i + 0.5) / trials for i in range(trials)]
    gen = torch.Generator().manual_seed(seed)
    keys = torch.randint(10000, 100000, (trials,), generator=gen).tolist()
    rows: list[SweepRow] = []
    bar = tqdm(total=len(grid) * len(lengths), desc="sweep", disable=not progress)
    for name, cfg in grid:
        if name in done:
            rows.append(done[name])
            bar.update(len(lengths))
            continue
        row = SweepRow(name, cfg.to_dict() if cfg else None, {}, {}, {}, None)
        try:
            revert(model) if cfg is None else apply(model, cfg)
            for length in lengths:
                prompts = passkey_token_prompts(tokenizer, length, depths, keys).to(device)
                correct, times, sparsities = [], [], []
                for s in range(0, trials, batch):
                    _, ok, prefill, sparsity = batched_passkey(
                        model, prompts[s : s + batch], keys[s : s + batch], tokenizer
                    )
                    correct += ok
                    times.append(prefill / len(ok))
                    sparsities.append(sparsity)
                row.accuracy[length] = sum(correct) / len(correct)
                row.sparsity[length] = sum(sparsities) / len(sparsities)
                row.prefill_seconds[length] = sorted(times)[len(times) // 2]
                bar.update()
            if text_ids is not None:
                row.ppl, _ = perplexity(model, text_ids.to(device))
        except Exception as err:  # a failing setting is reported, not fatal
            row.error = f"{type(err).__name__}: {err}"
        rows.append(row)
        _save(rows, out_dir, lengths)
    _save(rows, out_dir, lengths)  # also when the last settings were all reused from an earlier run
    bar.close()
    revert(model)
    return rows


def _load_rows(path: Path) -> dict[str, SweepRow]:
    if not path.is_file():
        return {}
    data = json.loads(path.read_text())
    rows = {}
    for r in data["rows"]:
        if r.get("error"):
            continue
        for field in ("accuracy", "sparsity", "prefill_seconds"):
            r[field] = {int(k): v for k, v in r[field].items()}
        rows[r["name"]] = SweepRow(**r)
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


def _save(rows: Sequence[SweepRow], out_dir: Path, lengths: Sequence[int]) -> None:
    meta = {"versions": versions(), "lengths": list(lengths)}
    (out_dir / "results.json").write_text(
        json.dumps({"meta": meta, "rows": [dataclasses.asdict(r) for r in rows]}, indent=1)
    )
    (out_dir / "pareto.md").write_text(pareto_table(rows, lengths))


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


def pareto_plot(rows: Sequence[SweepRow], length: int, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

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
    fig.savefig(path, dpi=120)
    plt.close(fig)


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
        raise ValueError(f"default perplexity text has only {len(ids)} tokens, need {length}; pass --text")
    return torch.tensor([ids[:length]])


def grid_entry(spec: str) -> tuple[str, MobaConfig | None]:
    """A sweep row from a setting string (`moba_hf.eval.settings` grammar): MoBA settings or "sdpa"."""
    setting = parse_setting(spec)
    if setting.attn == "sdpa":
        return setting.name, None
    if setting.attn != MOBA:
        raise ValueError(f"the sweep compares 'sdpa' with MoBA settings; got attn_implementation {setting.attn!r}")
    return setting.name, setting.moba or MobaConfig()


def add_sweep_task(tasks: Any) -> None:
    """`moba-hf eval sweep`."""
    p = tasks.add_parser("sweep", help="training-free sweep: passkey + perplexity vs measured sparsity (Pareto table)")
    p.add_argument("--model", default="smollm2", help="embedded model name, local path or hub id")
    p.add_argument("--lengths", default="2048,4096,8000")
    p.add_argument("--trials", type=int, default=20)
    p.add_argument("--batch", type=int, default=5, help="trials per forward pass")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--text", default=None, help="text file for perplexity (default: stdlib docstrings)")
    p.add_argument("--ppl-length", type=int, default=8000)
    p.add_argument("--only", default=None, help="comma-separated setting names from the default grid")
    p.add_argument(
        "--setting",
        action="append",
        default=None,
        help="a setting outside the grid, e.g. 'b64-dense-decode=moba:block_size=64,decode=full' or 'sdpa' "
        "(repeatable; with --only, added to those grid rows)",
    )
    p.add_argument("--out", default="outputs/sweep")
    p.set_defaults(func=_main)


def _main(args: argparse.Namespace) -> int:
    from ..models import EMBEDDED, load

    if args.model in EMBEDDED:
        model, tokenizer = load(args.model)
    else:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        model = AutoModelForCausalLM.from_pretrained(args.model, attn_implementation="sdpa").eval()
        tokenizer = AutoTokenizer.from_pretrained(args.model)
    model.to(args.device)
    grid = DEFAULT_GRID
    if args.only or args.setting:
        wanted = set(args.only.split(",")) if args.only else set()
        unknown = wanted - {name for name, _ in DEFAULT_GRID}
        if unknown:
            raise SystemExit(f"--only: {sorted(unknown)} not in the default grid; give other settings with --setting")
        grid = [g for g in DEFAULT_GRID if g[0] in wanted] + [grid_entry(spec) for spec in args.setting or []]
    if args.text:
        ids = tokenizer(Path(args.text).read_text(), add_special_tokens=False).input_ids[: args.ppl_length]
        text_ids = torch.tensor([ids])
    else:
        text_ids = default_text(tokenizer, args.ppl_length)
    lengths = [int(x) for x in args.lengths.split(",")]
    out = Path(args.out)
    rows = run_sweep(
        model, tokenizer, grid, lengths=lengths, trials=args.trials, text_ids=text_ids, out_dir=out, batch=args.batch
    )
    pareto_plot(rows, max(lengths), out / "pareto.png")
    print(pareto_table(rows, lengths))
    return 0
