"""`moba-hf presets [NAME]`: the named MoBA / DCA presets with their `[about]` text, or one preset's file."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from ..config import read_config_file
from . import names, path


def about(name: str) -> dict[str, str]:
    """The preset's `[about]` table: summary, measured."""
    return read_config_file(path(name)).about


def add_commands(sub: Any) -> None:
    p = sub.add_parser("presets", help="list the named MoBA / DCA presets (MobaConfig.preset(NAME), moba:NAME)")
    p.add_argument("name", nargs="?", help="show one preset's file")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if args.name is not None:
        try:
            print(path(args.name).read_text(), end="")
        except ValueError as err:
            print(f"moba-hf presets: {err}", file=sys.stderr)
            return 2
        return 0
    for name in names():
        settings = read_config_file(path(name))
        print(f"{name}\n  {settings.moba}\n  {settings.about.get('summary', '')}")
        print(f"  measured: {settings.about.get('measured', '')}")
    return 0
