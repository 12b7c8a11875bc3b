"""The files of a run's output directory, written whole or appended a line at a time, and read back checked
field by field (a damaged file is refused naming the file, the line and what is wrong).

    run.json       task, parameters, model (with its weights' fingerprint) and settings, written before the
                   first trial and checked on resume once a trial is stored (before that a rerun replaces it);
                   "changes" lists resumes run with --allow-changed
    trials.jsonl   one line per finished trial, appended as it finishes (crash-safe, read back on resume)
    results.json   model, versions, task parameters, settings, failures, warnings and every trial
    summary.md     the Markdown summary table (warnings under it)
    run.lock       held by the process running into the directory (its pid inside; `moba_hf.rundir`)
    *.png          plots (when matplotlib is installed)
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

from ..rundir import DirInUse, field_problem, kind

logger = logging.getLogger("moba_hf")

RUN_FILE = "run.json"
TRIALS_FILE = "trials.jsonl"
RESULTS_FILE = "results.json"
SUMMARY_FILE = "summary.md"

# the fields of a trial record that this package's tasks write, with their JSON types: a record read back from
# trials.jsonl is refused when one has another type ("correct": "false" would count as correct, "length": "128"
# would move the trial out of its column); fields a run_cell of another caller adds are not checked
CELL_FIELDS = {  # which trial (the key repeats them)
    "length": int,
    "depth": float,
    "trial": int,
    "family": str,
    "doc": int,
    "window": int,
    "task": str,
}
RESULT_FIELDS = {  # what it gave
    "correct": bool,
    "expected": str | int,
    "got": str | int | None,
    "output": str,
    "prompt_tokens": int,
    "needle_token": int,
    "batch": int,
    "nll_sum": float,
    "tokens_scored": int,
    "prefill_seconds": float,
    "decode_seconds": float,
    "sparsity": float | None,
    "sparsity_per_layer": dict[str, float],
}
TRIAL_FIELDS = {"key": str, "setting": str, **CELL_FIELDS, **RESULT_FIELDS}
# run.json: field -> (type, required)
RUN_FIELDS = {
    "task": (str, True),
    "model": (dict, True),
    "params": (dict, True),
    "settings": (dict, False),
    "changes": (list, False),
}


class RunDirError(ValueError):
    """An output directory that cannot take this run: another experiment, a damaged file, another run in it."""


class RunMismatch(RunDirError):
    """An output directory holds another experiment than the one asked for."""


class CorruptRunFile(RunDirError):
    """run.json or a line of trials.jsonl is not what this package writes there."""


class RunInUse(RunDirError, DirInUse):
    """Another process is running into the same output directory."""


def atomic_write_text(path: str | Path, text: str) -> Path:
    """Write via a temporary file and os.replace, so a reader never sees half a file."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    tmp.write_text(text)
    os.replace(tmp, path)
    return path


def read_run(path: Path) -> dict[str, Any]:
    """run.json, checked field by field: CorruptRunFile names the file and what is wrong."""
    fix = "restore it, or give a new --out"
    try:
        run = json.loads(path.read_bytes())
    except ValueError as error:  # JSONDecodeError, UnicodeDecodeError
        raise CorruptRunFile(
            f"{path} is not valid JSON ({error}); it is replaced whole, never left half-written, so it was damaged "
            f"afterwards: {fix}"
        ) from None
    if not isinstance(run, dict):
        raise CorruptRunFile(f"{path} holds {kind(run)}, not a run record (an object with task, model, params): {fix}")
    for key, (of_type, required) in RUN_FIELDS.items():
        if key not in run and not required:
            continue
        if not isinstance(run.get(key), of_type):
            got = json.dumps(run.get(key))[:80]
            raise CorruptRunFile(f"{path}: {key!r} must be {kind(of_type())}, got {got}: {fix}")
    bad = [name for name, value in run.get("settings", {}).items() if not isinstance(value, dict)]
    if bad:
        raise CorruptRunFile(f"{path}: setting {bad[0]!r} must be an object (its definition): {fix}")
    changes = run.get("changes", [])
    if not all(isinstance(c, dict) and isinstance(c.get("differences"), dict) for c in changes):
        raise CorruptRunFile(f"{path}: 'changes' must list objects with their 'differences': {fix}")
    return run


def trial_problem(record: Any) -> str | None:
    """Why a parsed trials.jsonl line is not a trial record, or None."""
    if not isinstance(record, dict):
        return f"{kind(record)}, not an object"
    missing = [k for k in ("key", "setting") if not isinstance(record.get(k), str)]
    if missing:
        return f"an object without a string {' or '.join(map(repr, missing))} field"
    problem = field_problem(record, TRIAL_FIELDS)
    if problem:
        return problem
    key, setting = record["key"], record["setting"]
    if key.startswith(setting + "|"):  # the key names the cell: a field must say the same
        for part in key[len(setting) + 1 :].split("|"):
            name, _, value = part.partition("=")
            if name in record and str(record[name]) != value:
                return f"field {name!r} is {json.dumps(record[name])}, its key says {name}={value}"
    return None


def read_trials(path: Path) -> dict[str, dict[str, Any]]:
    """The trial records of trials.jsonl by key (the last record of a key counts). An incomplete last line (a
    killed process) is dropped from the file with a log line; any other line that is not a trial record raises
    CorruptRunFile naming the file and the line."""
    trials: dict[str, dict[str, Any]] = {}
    if not path.is_file():
        return trials
    data = path.read_bytes()
    lines = data.split(b"\n")  # the last piece is b"" when the file ends with a newline
    offset, repeated = 0, 0
    for i, line in enumerate(lines):
        if line.strip():
            try:
                record = json.loads(line)
            except ValueError as error:  # JSONDecodeError, UnicodeDecodeError
                # only the last line can lack its newline: a record cut by a killed process, or the zeros
                # of a write the file system lost
                torn = i == len(lines) - 1 and (line.startswith(b"{") or not line.strip(b"\0"))
                if not torn:
                    raise CorruptRunFile(
                        f"{path} line {i + 1} is not a trial record (not JSON: {error}): fix or delete the line, "
                        "or use a new --out"
                    ) from None
                logger.warning(
                    "moba_hf eval: dropped the incomplete last line of %s (line %d, an interrupted write); its trial "
                    "runs again",
                    path,
                    i + 1,
                )
                with open(path, "r+b") as fh:
                    fh.truncate(offset)
                break
            problem = trial_problem(record)
            if problem:
                raise CorruptRunFile(
                    f"{path} line {i + 1} is not a trial record ({problem}: {line[:60].decode(errors='replace')}): "
                    "fix or delete the line, or use a new --out"
                )
            repeated += record["key"] in trials
            trials[record["key"]] = record
        offset += len(line) + 1
    else:
        if data and not data.endswith(b"\n"):  # a whole record whose newline was cut: end the line
            with open(path, "ab") as fh:
                fh.write(b"\n")
    if repeated:
        logger.warning("moba_hf eval: %s holds %d trials twice; the last record of each counts", path, repeated)
    return trials


def differences(old: Any, new: Any, where: str = "") -> list[tuple[str, Any, Any]]:
    """Every (dotted name, old, new) where two JSON values differ, in key order."""
    if isinstance(old, dict) and isinstance(new, dict):
        found = []
        for key in sorted(set(old) | set(new), key=str):
            found += differences(old.get(key), new.get(key), f"{where}.{key}" if where else str(key))
        return found
    return [] if old == new else [(where, old, new)]


def differences_text(diffs: list[tuple[str, Any, Any]]) -> str:
    """'a=1, this run has a=2' for the first difference, the others named in parentheses."""
    (name, was, now), rest = diffs[0], diffs[1:]
    text = f"{name}={json.dumps(was)}, this run has {name}={json.dumps(now)}"
    if rest:
        text += " (also differing: " + ", ".join(f"{n} {json.dumps(a)} -> {json.dumps(b)}" for n, a, b in rest) + ")"
    return text
