"""Names of a package loaded on first use (PEP 562), so that importing the package (and `--help`) stays cheap.

    __getattr__ = lazy_names(__name__, {"TrainConfig": "config", ...})   # name -> the submodule defining it

Standard library only: every layer may import it.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from typing import Any


def lazy_names(package: str, where: Mapping[str, str]) -> Callable[[str], Any]:
    """A module `__getattr__` for `package` that imports `name` from its submodule `where[name]` when first read;
    any other name is an AttributeError, as without it."""

    def __getattr__(name: str) -> Any:
        if name not in where:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        return getattr(importlib.import_module(f".{where[name]}", package), name)

    return __getattr__


__all__ = ["lazy_names"]
