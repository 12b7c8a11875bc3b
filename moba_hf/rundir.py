"""What eval and train share about an output directory: the lock a run holds on it, and the records read back
from it, checked field by field; and `cache_root()`, the user's moba_hf cache (converted models, file digests,
compiled kernels).

    held = lock_dir(out, why="...", error=RunInUse)   # out/run.lock holds "PID on HOST" while the run lives
    try: ... finally: held.release()                  # or `with lock_dir(...):`; an exception or Ctrl-C releases it

The lock is a `flock` on out/run.lock, which the kernel drops when its process ends, however it ends (kill -9
included): a lock whose process is gone is never in force. Its file, left behind with the old pid, is taken over
with one log line. Without flock (Windows, a file system without locks: a log line) runs into one directory are
not kept apart.

`field_problem(record, {"correct": bool, "length": int, "sparsity": float | None})` names the first field whose
value has another JSON type (`float` is any JSON number, `int` an integer, neither takes a boolean; `dict[str,
float]` an object of numbers, `list[str]` an array of strings); the reader adds the file and line.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import platform
import types
import typing
from collections.abc import Mapping
from pathlib import Path
from typing import Any

try:
    import fcntl
except ImportError:  # Windows: no flock
    fcntl = None

logger = logging.getLogger("moba_hf")


def cache_root() -> Path:
    """$MOBA_HF_CACHE, default ~/.cache/moba_hf."""
    return Path(os.environ.get("MOBA_HF_CACHE", Path.home() / ".cache" / "moba_hf"))


LOCK_FILE = "run.lock"


class DirInUse(ValueError):
    """Another process runs into the same output directory."""


class DirLock:
    """The lock of one run on its output directory; `release()` (or leaving a `with` block) removes run.lock."""

    def __init__(self, handle: Any) -> None:
        self._handle = handle

    def release(self) -> None:
        """Remove run.lock, then release it (in that order, so a waiting process never locks a removed file)."""
        if self._handle is None:
            return
        with contextlib.suppress(OSError):
            os.unlink(self._handle.name)
        self._handle.close()
        self._handle = None

    def __enter__(self) -> DirLock:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.release()


def lock_dir(out_dir: str | Path, *, why: str, error: type[Exception] = DirInUse) -> DirLock:
    """An exclusive lock on out_dir/run.lock for this process's run (the file holds "PID on HOST" while it runs),
    or `error` naming the directory, the holder's pid and `why` two runs must not share it."""
    out_dir = Path(out_dir)
    if fcntl is None:
        return DirLock(None)
    path = out_dir / LOCK_FILE
    while True:
        handle = open(path, "a+")  # noqa: SIM115 - held open for the run: closing it releases the lock
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            handle.seek(0)
            holder = handle.read().strip()
            handle.close()
            raise error(f"{out_dir} is in use by another run ({_holder_text(holder)}, holding {path}): {why}") from None
        except OSError as err:  # a file system without locks (some network mounts)
            handle.close()
            logger.warning("moba_hf: cannot lock %s (%s): runs into %s are not kept apart", path, err, out_dir)
            return DirLock(None)
        try:
            if os.stat(path).st_ino == os.fstat(handle.fileno()).st_ino:
                break
        except FileNotFoundError:
            pass
        handle.close()  # the holder removed the file between our open and flock: lock the new one
    handle.seek(0)
    stale = handle.read().strip()
    if stale:  # a holder removes the file when it ends: this one ended without (killed, or the machine stopped)
        logger.warning("moba_hf: %s: took over the lock of pid %s, which ended without releasing it", path, stale)
    handle.seek(0)
    handle.truncate()
    handle.write(f"{os.getpid()} on {platform.node()}\n")
    handle.flush()
    return DirLock(handle)


def _holder_text(holder: str) -> str:
    """'pid 123 on host', with a note when that process is gone from this host (a child it started, e.g. a
    data-loader worker, still holds the lock)."""
    if not holder:
        return "pid unknown: it is starting"
    pid, _, host = holder.partition(" on ")
    text = f"pid {holder}"
    if host == platform.node() and pid.isdigit() and not _alive(int(pid)):
        text += ", which has ended; a process it started still holds the lock"
    return text


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # PermissionError: it exists under another user
        return True
    return True


# --- records read back --------------------------------------------------------------------------------------

_NAMES = {
    dict: "an object",
    list: "an array",
    str: "a string",
    int: "an integer",
    float: "a number",
    bool: "a boolean",
    type(None): "null",
}


def kind(value: Any) -> str:
    """The JSON kind of a parsed value: 'a string', 'a number', 'a boolean', 'null', ..."""
    if isinstance(value, float) or (isinstance(value, int) and not isinstance(value, bool)):
        return "a number"
    return _NAMES.get(type(value), type(value).__name__)


def expected(spec: Any) -> str:
    """'a number or null', 'an object of numbers', ... for a type spec."""
    if isinstance(spec, types.UnionType) or typing.get_origin(spec) is typing.Union:
        return " or ".join(expected(a) for a in typing.get_args(spec))
    origin, args = typing.get_origin(spec), typing.get_args(spec)
    if origin is dict and args:
        return f"an object of {_plural(args[1])}"
    if origin is list and args:
        return f"an array of {_plural(args[0])}"
    return _NAMES.get(spec, getattr(spec, "__name__", str(spec)))


def _plural(spec: Any) -> str:
    return {
        "an integer": "integers",
        "a number": "numbers",
        "a string": "strings",
        "a boolean": "booleans",
        "an object": "objects",
        "an array": "arrays",
    }.get(expected(spec), expected(spec))


def matches(value: Any, spec: Any) -> bool:
    """Whether a parsed JSON value has the type `spec` (bool is no number, an int is a float)."""
    if spec is Any:
        return True
    if isinstance(spec, types.UnionType) or typing.get_origin(spec) is typing.Union:
        return any(matches(value, a) for a in typing.get_args(spec))
    origin, args = typing.get_origin(spec), typing.get_args(spec)
    if origin is dict:
        return isinstance(value, dict) and all(matches(v, args[1]) for v in value.values())
    if origin is list:
        return isinstance(value, list) and all(matches(v, args[0]) for v in value)
    if spec is None or spec is type(None):
        return value is None
    if spec is bool:
        return isinstance(value, bool)
    if spec is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if spec is float:
        return isinstance(value, int | float) and not isinstance(value, bool)
    return isinstance(value, spec)


def field_problem(record: Mapping[str, Any], fields: Mapping[str, Any], required: tuple[str, ...] = ()) -> str | None:
    """The first field of `record` missing (of `required`) or of another type than `fields` gives, in words;
    fields not in `fields` are not checked."""
    for name in required:
        if name not in record:
            return f"no field {name!r} ({expected(fields[name])})"
    for name, spec in fields.items():
        if name in record and not matches(record[name], spec):
            value = json.dumps(record[name], default=str)
            value = value if len(value) <= 60 else value[:57] + "..."
            return f"field {name!r} is {value} ({kind(record[name])}), expected {expected(spec)}"
    return None
