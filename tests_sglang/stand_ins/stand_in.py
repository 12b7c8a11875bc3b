"""What the stand-ins share (see __init__ of torchvision/ and sgl_kernel/ beside this file)."""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
from collections.abc import Callable
from typing import Any

LOG = "MOBA_HF_STAND_IN_LOG"  # a file: every stand-in name SGLang reads is appended to it (tests compare)


def unavailable(qualname: str) -> Callable[..., Any]:
    def call(*args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError(f"{qualname} is a test stand-in that computes nothing; SGLang called it")

    call.__name__ = call.__qualname__ = qualname.rsplit(".", 1)[-1]
    return call


def names(module: str, table: dict[str, Any]) -> Callable[[str], Any]:
    """A module `__getattr__` serving exactly `table`'s names (an import of any other fails, naming it) and
    logging each read to the file $MOBA_HF_STAND_IN_LOG."""

    def __getattr__(name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        if name not in table and hasattr(sys.modules[module], "__path__"):  # a submodule of a package
            if importlib.util.find_spec(f"{module}.{name}") is not None:
                return importlib.import_module(f"{module}.{name}")
        if name not in table:
            raise AttributeError(f"stand-in {module} has no {name!r} (stand_ins/README: only the names SGLang reads)")
        path = os.environ.get(LOG)
        if path:
            with open(path, "a") as log:
                log.write(f"{module}.{name}\n")
        return table[name]

    __getattr__.served = dict(table)  # what the tests compare with what a server read
    return __getattr__
