"""The resumable results store of one run: its output directory locked, run.json checked against this run,
finished trials read back so a re-run skips them, each new trial appended as it finishes (`run_records` holds
the directory's files and how they are read back)."""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import platform
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from ..config import MobaConfig
from ..rundir import lock_dir
from .fingerprint import weights_fingerprint
from .run_records import (
    RESULTS_FILE,
    RUN_FILE,
    SUMMARY_FILE,
    TRIALS_FILE,
    RunInUse,
    RunMismatch,
    atomic_write_text,
    differences,
    differences_text,
    read_run,
    read_trials,
)
from .settings import Setting

logger = logging.getLogger("moba_hf")

IN_USE = (
    "two runs into one directory would both run the unfinished trials; wait for it to finish, or give another --out"
)


def versions() -> dict[str, str]:
    import transformers

    from .. import __version__

    return {
        "moba_hf": __version__,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
    }


class ResultStore(contextlib.AbstractContextManager):
    """Trials of one run in `out_dir`; finished trials are read back so a re-run skips them.

    run.json (task, parameters, model with its weights' fingerprint, and every setting's full definition) is
    written before the first trial and checked on every later run that finds a trial stored (a run that
    measured nothing blocks nothing; a setting never measured may be redefined): a re-run with other parameters,
    another model (other weights under the same path included) or a redefined setting name raises RunMismatch naming
    every differing key, instead of mixing two experiments. `allow_changed=True` (`--allow-changed`) resumes
    anyway (another task never) and appends the differences to run.json's "changes" (and results.json's),
    and every later summary says its trials are mixed. trials.jsonl is
    append-only, one write per line; an incomplete last line (a killed process) is dropped with a log line on
    the next run, any other line that is not a trial record is refused (CorruptRunFile, file and line named).
    The directory is locked (run.lock) while the store is open: a second process gets RunInUse. Close the
    store (or use it in a `with` block) when the run ends.
    out_dir None keeps the trials in memory only (a command that reports and forgets, like the demo).
    """

    def __init__(
        self,
        out_dir: str | Path | None,
        task: str,
        params: dict[str, Any],
        model: dict[str, Any],
        *,
        weights: Any = None,
        allow_changed: bool = False,
    ):
        self.task, self.params, self.model = task, _jsonable(params), dict(model)
        self.allow_changed = allow_changed
        self.settings: dict[str, dict[str, Any]] = {}
        self.failures: dict[str, str] = {}
        self.trials: dict[str, dict[str, Any]] = {}
        self.changes: list[dict[str, Any]] = []  # resumes that went on past differences (allow_changed)
        self.warnings: list[str] = []  # shown under summary.md's table and kept in results.json
        self._lock = None
        self.out_dir = None if out_dir is None else Path(out_dir)
        if self.out_dir is None:
            return
        if self.out_dir.exists() and not self.out_dir.is_dir():
            raise RunMismatch(f"output directory {self.out_dir} is a file; give a directory")
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self._lock = lock_dir(self.out_dir, why=IN_USE, error=RunInUse)
        try:
            self._open(weights)
        except BaseException:
            self.close()
            raise

    def _open(self, weights: Any) -> None:
        if weights is not None:
            self.model["weights"] = weights_fingerprint(weights)
        run = self.out_dir / RUN_FILE
        diffs = []
        if not run.is_file() and ((self.out_dir / TRIALS_FILE).exists() or (self.out_dir / RESULTS_FILE).exists()):
            raise RunMismatch(
                f"{self.out_dir} holds results without {RUN_FILE}, so their parameters are unknown: use a new --out"
            )
        old = read_run(run) if run.is_file() else None
        self.trials = read_trials(self.out_dir / TRIALS_FILE)
        if old is not None and self.trials:
            diffs = self._check(old)
        elif old is not None:  # a run that stopped before its first trial measured nothing: no run to resume
            logger.info("moba_hf eval: %s holds no trial yet; its %s is replaced by this run's", self.out_dir, RUN_FILE)
        if diffs:
            self._record_change(diffs)
        elif self.changes:  # resumed with differences before: every later summary says its trials are mixed
            keys = sorted({k for change in self.changes for k in change.get("differences") or {}})
            self.warnings.append(
                f"{self.out_dir} was resumed with --allow-changed ({len(self.changes)}x, differing in "
                f"{', '.join(keys)}): its trials come from runs that differed (run.json, 'changes')"
            )
        self._write_run()

    def close(self) -> None:
        """Release the output directory's lock (the store's trials stay readable)."""
        if self._lock is not None:
            self._lock.release()
            self._lock = None

    def __exit__(self, *exc: Any) -> None:  # (AbstractContextManager's __enter__ returns the store)
        self.close()

    def _identity(self) -> dict[str, Any]:
        # the device may change between runs (resume on another machine); the weights and dtype may not
        return {k: self.model.get(k) for k in ("name", "class", "layers", "dtype", "weights")}

    def _check(self, old: dict[str, Any]) -> list[tuple[str, Any, Any]]:
        """Every difference between this run and the stored one; RunMismatch unless allow_changed."""
        self.settings, self.changes = old.get("settings", {}), old.get("changes", [])
        mine = {"task": self.task, "model": self._identity(), "params": self.params}
        diffs = [(n.removeprefix("params."), a, b) for n, a, b in differences({k: old.get(k) for k in mine}, mine)]
        if old["task"] != self.task:  # other trials entirely (their keys may even collide): never resumed
            raise RunMismatch(f"{self.out_dir} holds a {old['task']} run, this is a {self.task} run: use a new --out")
        if diffs and not self.allow_changed:
            raise RunMismatch(
                f"{self.out_dir} holds a run with {differences_text(diffs)}: rerun with the same model and "
                "parameters to resume, resume anyway with --allow-changed (allow_changed=True; the differences are "
                "recorded in run.json), or use a new --out"
            )
        return diffs

    def _record_change(self, diffs: list[tuple[str, Any, Any]]) -> None:
        change = {
            "at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "trials_before": len(self.trials),
            "differences": {name: {"was": was, "now": now} for name, was, now in diffs},
        }
        self.changes.append(change)
        text = (
            f"{self.out_dir} resumed with --allow-changed: {differences_text(diffs)}; its {len(self.trials)} "
            f"earlier trials are kept (recorded in {RUN_FILE} under 'changes')"
        )
        logger.warning("moba_hf eval: %s", text)
        self.warnings.append(text)

    def _write_run(self) -> None:
        if self.out_dir is None:
            return
        run = {"task": self.task, "model": self._identity(), "params": self.params, "settings": self.settings}
        if self.changes:
            run["changes"] = self.changes
        atomic_write_text(self.out_dir / RUN_FILE, json.dumps(run, indent=1))

    def add_setting(self, setting: Setting) -> None:
        described = _jsonable(setting.describe())
        old = self.settings.get(setting.name)
        if old is not None and not any(r["setting"] == setting.name for r in self.trials.values()):
            old = None  # defined before, never measured: nothing to keep apart from this definition
        if old is not None and isinstance(old.get("moba"), dict):
            try:  # written before a MobaConfig field existed: the field's default is what that run used
                old = {**old, "moba": _jsonable(MobaConfig.from_dict(old["moba"]).to_dict())}
            except ValueError:
                pass  # a field this version does not know: the comparison below names it
        if old is not None:
            diffs = differences(old, described)
            if not diffs:
                return
            if not self.allow_changed:
                field, was, now = diffs[0]
                also = "".join(f", {n} {json.dumps(a)} -> {json.dumps(b)}" for n, a, b in diffs[1:])
                raise RunMismatch(
                    f"setting {setting.name!r} in {self.out_dir / RUN_FILE} has {field}={json.dumps(was)}, this run "
                    f"defines it with {field}={json.dumps(now)}{f' (also differing{also[1:]})' if also else ''}: "
                    "name it differently (NAME=SPEC), resume anyway with --allow-changed, or use a new --out"
                )
            self._record_change([(f"settings.{setting.name}.{n}", a, b) for n, a, b in diffs])
        self.settings[setting.name] = described
        self._write_run()

    def done(self, key: str) -> bool:
        return key in self.trials

    def add(self, record: dict[str, Any]) -> None:
        if self.out_dir is not None:
            path = self.out_dir / TRIALS_FILE
            line = (json.dumps(record) + "\n").encode()
            fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            try:
                start = os.fstat(fd).st_size
                written = os.write(fd, line)  # one write call: an interrupt lands before or after it, not inside
                if written < len(line):  # a full disk: take the part back, so the next record starts a line
                    os.ftruncate(fd, start)
                    what = f"wrote {written} of the {len(line)} bytes of a trial record"
                    raise OSError(errno.ENOSPC, what, str(path))
            finally:
                os.close(fd)
        self.trials[record["key"]] = record

    def records(self, settings: Sequence[Setting] | None = None) -> list[dict[str, Any]]:
        names = None if settings is None else {s.name for s in settings}
        return [r for r in self.trials.values() if names is None or r["setting"] in names]

    def annotated(self, summary_md: str) -> str:
        """The summary with this run's warnings under it (lengths past the window, a resume with changes)."""
        block = "".join(f"> warning: {w}\n" for w in self.warnings)
        if not block or summary_md.endswith(block):  # write() annotates too: once is enough
            return summary_md
        return summary_md.rstrip("\n") + "\n\n" + block

    def write(self, settings: Sequence[Setting], summary_md: str, extra: dict[str, Any] | None = None) -> Path:
        if self.out_dir is None:
            raise ValueError("this ResultStore keeps its trials in memory (out_dir None): nothing to write to")
        data = {
            "task": self.task,
            "model": self.model,
            "versions": versions(),
            "params": self.params,
            "settings": {s.name: self.settings[s.name] for s in settings if s.name in self.settings},
            "failures": self.failures,
            **({"warnings": self.warnings} if self.warnings else {}),
            **({"changes": self.changes} if self.changes else {}),
            "trials": self.records(settings),
            **(extra or {}),
        }
        path = atomic_write_text(self.out_dir / RESULTS_FILE, json.dumps(data, indent=1))
        atomic_write_text(self.out_dir / SUMMARY_FILE, self.annotated(summary_md))
        return path


def _jsonable(value: Any) -> Any:
    return json.loads(json.dumps(value, default=str))
