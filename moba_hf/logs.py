"""Log a message once per process, the way transformers' `logger.warning_once` does.

The one place moba_hf remembers what it has said: a line that would repeat on every layer, step or load is
written the first time its text comes, and never again. Nothing here decides what a forward computes.
"""

from __future__ import annotations

import functools
import logging

logger = logging.getLogger("moba_hf")


def once(level: int, message: str, *args: object) -> None:
    """Log `message % args` at `level` on the "moba_hf" logger, the first time this exact text is logged."""
    _emit(level, message % args if args else message)


@functools.cache
def _emit(level: int, text: str) -> None:
    logger.log(level, text)


def forget() -> None:
    """Say every message again (tests that check a message start from here)."""
    _emit.cache_clear()
