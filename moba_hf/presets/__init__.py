"""Named MoBA / DCA settings shipped with the package: `MobaConfig.preset("training-free")`.

Each preset is one TOML file beside this module: an `[about]` table (`summary`, `measured`) and the
`[moba]` settings. `moba-hf presets` lists them.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

DIRECTORY = Path(__file__).resolve().parent


def names() -> list[str]:
    return sorted(p.stem for p in DIRECTORY.glob("*.toml"))


def path(name: str) -> Path:
    """The TOML file of preset `name` (ValueError naming the valid presets otherwise)."""
    if not isinstance(name, str) or not (DIRECTORY / f"{name}.toml").is_file():
        raise ValueError(f"unknown MoBA preset {name!r}; presets: {', '.join(names())}")
    return DIRECTORY / f"{name}.toml"


def about(name: str) -> dict[str, str]:
    """The preset's `[about]` table: summary, measured."""
    from ..config import load_mapping

    return dict(load_mapping(path(name)).get("about", {}))


def add_commands(sub: Any) -> None:
    p = sub.add_parser("presets", help="list the named MoBA / DCA presets (MobaConfig.preset(NAME), moba:NAME)")
    p.add_argument("name", nargs="?", help="show one preset's file")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from ..config import MobaConfig

    if args.name is not None:
        try:
            print(path(args.name).read_text(), end="")
        except ValueError as err:
            print(f"moba-hf presets: {err}", file=sys.stderr)
            return 2
        return 0
    for name in names():
        info = about(name)
        print(f"{name}\n  {MobaConfig.preset(name)}\n  {info.get('summary', '')}")
        print(f"  measured: {info.get('measured', '')}")
    return 0
