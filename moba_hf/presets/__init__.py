"""Named MoBA / DCA settings shipped with the package: `MobaConfig.preset("training-free")`.

Each preset is one TOML file beside this module: an `[about]` table (`summary`, `measured`) and the
`[moba]` settings. This module only finds them (no moba_hf import: `moba_hf.config` reads them through it);
`moba-hf presets` (presets/cli.py) lists them.
"""

from __future__ import annotations

import difflib
import os
from pathlib import Path

DIRECTORY = Path(__file__).resolve().parent


def names() -> list[str]:
    return sorted(p.stem for p in DIRECTORY.glob("*.toml"))


def path(name: str) -> Path:
    """The TOML file of preset `name`, one of `names()` (ValueError naming the valid presets otherwise; a path
    is refused, pointing to `MobaConfig.from_file`)."""
    if isinstance(name, str) and name in names():
        return DIRECTORY / f"{name}.toml"
    if isinstance(name, (str, os.PathLike)) and (
        any(sep in str(name) for sep in ("/", "\\")) or Path(name).suffix.lower() in (".toml", ".json", ".yaml", ".yml")
    ):
        raise ValueError(
            f"{str(name)!r} is a file path, not a preset name (presets: {', '.join(names())}); load a file with "
            "MobaConfig.from_file(path), or MobaConfig.from_spec, which takes a preset name or a file"
        )
    close = difflib.get_close_matches(name, names(), n=1) if isinstance(name, str) else []
    hint = f"; did you mean {close[0]!r}?" if close else ""
    raise ValueError(f"unknown MoBA preset {name!r}; presets: {', '.join(names())}{hint}")
