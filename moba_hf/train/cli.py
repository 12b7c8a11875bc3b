"""`moba-hf train CONFIG.toml`: continued training with MoBA (run under `accelerate launch` for DDP / FSDP)."""

from __future__ import annotations

import argparse
import ast
import os
import sys
from pathlib import Path
from typing import Any

# the CPU example config, shipped in the wheel (a clone has the same file as configs/train_cpu_demo.toml)
EXAMPLE_CONFIG = Path(__file__).resolve().parent / "train_cpu_demo.toml"


def add_commands(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "train", help="continue-train a model with MoBA (Trainer; accelerate launch for multi-GPU)"
    )
    p.add_argument(
        "config",
        nargs="?",
        help="training config (.toml / .json / .yaml); `moba-hf train --example` writes the CPU example "
        f"({EXAMPLE_CONFIG.name}: the embedded SmolLM2, 24 steps)",
    )
    p.add_argument(
        "--example",
        nargs="?",
        const=EXAMPLE_CONFIG.name,
        metavar="FILE",
        help=f"write the shipped CPU training config to FILE (default ./{EXAMPLE_CONFIG.name}) and exit; then moba-hf "
        "train FILE",
    )
    p.add_argument("--model", help="override [model] name: an embedded name, a local path or a hub id")
    p.add_argument("--out", "--output-dir", dest="output_dir", help="override [train] output_dir (default runs/moba)")
    p.add_argument("--max-steps", type=int, help="override [train] max_steps")
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="SECTION.KEY=VALUE",
        help="override any key, e.g. --set moba.top_k=4 --set train.learning_rate=2e-4 (repeatable)",
    )
    p.add_argument(
        "--resume",
        action="store_true",
        help="continue from the newest whole checkpoint in the output dir (written every [train] save_steps); "
        "a config that differs from the checkpoint's run is refused, naming each key",
    )
    p.add_argument(
        "--allow-config-change",
        action="store_true",
        help="with --resume: continue although the config (or data) differs from the checkpoint's run, or the "
        "checkpoint lacks optimizer state; each change is logged and recorded in run_config.json",
    )
    p.set_defaults(func=run)


def parse_override(text: str) -> tuple[str, str, Any]:
    """ "train.learning_rate=2e-4" -> ("train", "learning_rate", 0.0002); values are Python / TOML-like literals."""
    key, sep, raw = text.partition("=")
    section, dot, name = key.partition(".")
    if not sep or not dot or not section or not name:
        raise ValueError(f"--set must look like SECTION.KEY=VALUE, got {text!r}")
    lowered = {"true": "True", "false": "False"}.get(raw.strip().lower(), raw)
    try:
        value = ast.literal_eval(lowered)
    except (ValueError, SyntaxError):
        value = raw  # a bare string
    return section, name, value


def load_config(path: str, overrides: list[str] = (), direct: dict[tuple[str, str], Any] | None = None):
    from ..config_files import load_mapping
    from .config import TrainConfig

    data = load_mapping(path)
    changes = [parse_override(o) for o in overrides]
    changes += [(s, k, v) for (s, k), v in (direct or {}).items() if v is not None]
    for section, name, value in changes:
        data.setdefault(section, {})[name] = value
    return TrainConfig.from_dict(data)


def write_example(target: str) -> int:
    """`--example FILE`: the shipped CPU config, copied to FILE (an existing file is left alone)."""
    from ..cli_args import UsageError

    path = Path(target).expanduser()
    if path.exists():
        raise UsageError(f"--example {target}: the file exists; give another path or remove it")
    if not path.parent.is_dir():
        raise UsageError(f"--example {target}: no directory {path.parent}")
    path.write_text(EXAMPLE_CONFIG.read_text())
    print(f"wrote {path}; run it with: moba-hf train {target}")
    return 0


def run(args: argparse.Namespace) -> int:
    from ..cli_args import UsageError, check_model, check_out

    if args.example is not None:
        if args.config is not None:
            raise UsageError(f"--example writes a config and exits: drop the config {args.config}")
        return write_example(args.example)
    if args.config is None:
        raise UsageError("give a training config file (moba-hf train --example writes the CPU example)")
    if args.allow_config_change and not args.resume:
        raise UsageError("--allow-config-change applies to a resume: add --resume")
    try:
        config = load_config(
            args.config,
            args.set,
            {
                ("model", "name"): args.model,
                ("train", "output_dir"): args.output_dir,
                ("train", "max_steps"): args.max_steps,
            },
        )
    except (ValueError, FileNotFoundError) as err:
        raise UsageError(str(err)) from None  # names the key (from the file or --set) or the file
    check_model(config.model.name, "--model" if args.model else f"{args.config}: [model] name")
    check_out(config.train.output_dir)
    from .resume import RunRefused
    from .trainer import last_checkpoint, train

    try:
        result = train(config, resume=args.resume, allow_config_change=args.allow_config_change)
    except RunRefused as err:
        raise UsageError(str(err)) from None
    except KeyboardInterrupt:
        checkpoint = last_checkpoint(config.train.output_dir)
        where = f"the last checkpoint is {checkpoint}; continue with --resume" if checkpoint else "no checkpoint saved"
        if os.environ.get("RANK", "0") == "0":  # one line per run, not per process
            print(f"moba-hf train: interrupted; {where}", file=sys.stderr)
        return 130
    if not result.is_main_process or result.finished_at is not None:  # a finished run: train() logged one line
        return 0
    if result.resumed_from is not None:
        print(f"resumed from {result.resumed_from}")
    if result.losses:
        print(f"loss: first {result.losses[0]:.4f} last {result.losses[-1]:.4f} over {len(result.losses)} logs")
    if result.output_dir is not None:
        print(f"saved to {result.output_dir} (reload: from_pretrained(path, attn_implementation='moba'))")
    return 0
