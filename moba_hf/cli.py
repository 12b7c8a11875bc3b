"""`moba-hf` command line. Each feature module adds its own subcommand through `add_commands(subparsers)`."""

from __future__ import annotations

import argparse
import importlib
import logging
import sys

# modules that contribute subcommands, each with add_commands(subparsers)
COMMAND_MODULES = (
    "moba_hf.demo",
    "moba_hf.train.cli",
    "moba_hf.eval.cli",
    "moba_hf.dca.cli",
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="moba-hf", description="MoBA / DCA attention for Hugging Face models")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging (shows the kernel backend)")
    sub = parser.add_subparsers(dest="command", required=True)
    for name in COMMAND_MODULES:
        importlib.import_module(name).add_commands(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.WARNING, format="%(message)s")
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
