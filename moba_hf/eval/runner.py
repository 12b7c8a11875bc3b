"""What every evaluation shares: timed prefill + greedy decoding, the resumable results store, the grid loop.

Output directory layout (one per run; re-running with the same directory resumes):

    run.json       task, parameters, model (with its weights' fingerprint) and settings, written before the
                   first trial and checked on resume once a trial is stored (before that a rerun replaces it);
                   "changes" lists resumes run with --allow-changed
    trials.jsonl   one line per finished trial, appended as it finishes (crash-safe, read back on resume)
    results.json   model, versions, task parameters, settings, failures, warnings and every trial
    summary.md     the Markdown summary table (warnings under it)
    run.lock       held by the process running into the directory (its pid inside)
    *.png          plots (when matplotlib is installed)
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import hashlib
import inspect
import json
import logging
import os
import platform
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from ..config import MobaConfig
from ..integration import track_sparsity
from ..rundir import LOCK_FILE as LOCK_FILE  # run.lock, beside the other files of the directory
from ..rundir import DirInUse, field_problem, lock_dir
from ..rundir import kind as _kind
from .settings import MOBA, Setting, use_setting

logger = logging.getLogger("moba_hf")

RUN_FILE = "run.json"
TRIALS_FILE = "trials.jsonl"
RESULTS_FILE = "results.json"
SUMMARY_FILE = "summary.md"
IN_USE = (
    "two runs into one directory would both run the unfinished trials; wait for it to finish, or give another --out"
)
# the fields of a trial record that this package's tasks write, with their JSON types: a record read back from
# trials.jsonl is refused when one has another type ("correct": "false" would count as correct, "length": "128"
# would move the trial out of its column); fields a run_cell of another caller adds are not checked
TRIAL_FIELDS = {
    "key": str, "setting": str,
    # the cell: which trial (the key repeats them)
    "length": int, "depth": float, "trial": int, "family": str, "doc": int, "window": int, "task": str,
    # what it gave
    "correct": bool, "expected": str | int, "got": str | int | None, "output": str, "prompt_tokens": int,
    "needle_token": int, "batch": int, "nll_sum": float, "tokens_scored": int,
    "prefill_seconds": float, "decode_seconds": float, "sparsity": float | None, "sparsity_per_layer": dict[str, float],
}  # fmt: skip


def versions() -> dict[str, str]:
    import transformers

    from .. import __version__

    return {
        "moba_hf": __version__,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
    }


def model_info(model: Any, name: str | None = None) -> dict[str, Any]:
    param = next(model.parameters())
    return {
        "name": name or getattr(model.config, "_name_or_path", "") or type(model).__name__,
        "class": type(model).__name__,
        "layers": getattr(model.config, "num_hidden_layers", None),
        "dtype": str(param.dtype).removeprefix("torch."),
        "device": str(param.device),
    }


def sync_device(device: torch.device) -> None:
    """Wait for the device's queued work, so a wall-clock reading covers it (CUDA; a no-op on CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def forward_kwargs(model: Any) -> tuple[str, bool]:
    """The cache keyword of model.forward ("cache" in transformers >= 5.2x, "past_key_values" before) and
    whether it takes logits_to_keep."""
    params = inspect.signature(model.forward).parameters
    return ("cache" if "cache" in params else "past_key_values"), "logits_to_keep" in params


def output_cache(out: Any) -> Any:
    for name in ("cache", "past_key_values"):
        value = getattr(out, name, None)
        if value is not None:
            return value
    return None


@dataclasses.dataclass
class Decoded:
    tokens: list[int]  # the first row's generated tokens
    prefill_seconds: float  # the whole batch's prefill
    decode_seconds: float
    sparsity: float | None  # fraction of causal query-key pairs the prefill skipped (None: not tracked)
    sparsity_per_layer: dict[int, float]
    rows: list[list[int]] = dataclasses.field(default_factory=list)  # generated tokens of every row

    def measurements(self) -> dict[str, Any]:
        """The timing and sparsity fields every trial record carries."""
        return {
            "prefill_seconds": self.prefill_seconds,
            "decode_seconds": self.decode_seconds,
            "sparsity": self.sparsity,
            "sparsity_per_layer": self.sparsity_per_layer,
        }


@torch.no_grad()
def greedy_decode(
    model: Any,
    input_ids: torch.Tensor,
    max_new_tokens: int = 8,
    *,
    track: bool = True,
    eos_token_id: int | None = None,
) -> Decoded:
    """Greedy decoding of input_ids [batch, N] (rows of equal length, no padding); the prefill (first
    forward) is timed and, with `track`, its measured sparsity recorded (tracking recomputes the cheap
    block gate, inside the timed region). A single row stops at `eos_token_id`."""
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    cache_kw, has_keep = forward_kwargs(model)
    extra = {"logits_to_keep": 1} if has_keep else {}
    device = input_ids.device
    with track_sparsity() if track else contextlib.nullcontext() as stats:
        sync_device(device)
        start = time.perf_counter()
        out = model(input_ids=input_ids, use_cache=True, **extra)
        sync_device(device)
        prefill = time.perf_counter() - start
    next_token = out.logits[:, -1:].argmax(-1)
    steps = [next_token]
    start = time.perf_counter()
    for _ in range(max_new_tokens - 1):
        if eos_token_id is not None and input_ids.shape[0] == 1 and int(steps[-1]) == eos_token_id:
            break
        out = model(input_ids=next_token, use_cache=True, **{cache_kw: output_cache(out)}, **extra)
        next_token = out.logits[:, -1:].argmax(-1)
        steps.append(next_token)
    sync_device(device)
    decode = time.perf_counter() - start
    if stats is None or not stats.layers:
        sparsity, per_layer = (0.0, {}) if track else (None, {})
    else:
        sparsity, per_layer = stats.overall, stats.per_layer()
    rows = torch.cat(steps, dim=-1).tolist()
    return Decoded(rows[0], prefill, decode, sparsity, per_layer, rows)


@dataclasses.dataclass
class EvalResult:
    """What an evaluation returns: the trial records, failures, the Markdown summary and the files written."""

    task: str
    out_dir: Path
    settings: list[Setting]
    records: list[dict[str, Any]]
    failures: dict[str, str]
    summary: str
    files: list[Path]

    def cells(self, keys: Sequence[str] = ("setting", "length")) -> dict[tuple, dict[str, Any]]:
        """Aggregates per group of `keys`: n, accuracy / ppl, mean prefill seconds, mean sparsity."""
        from .report import aggregate

        return aggregate(self.records, keys)


def trial_key(setting: str, cell: dict[str, Any]) -> str:
    return "|".join([setting, *(f"{k}={cell[k]}" for k in sorted(cell))])


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


def _diffs(old: Any, new: Any, where: str = "") -> list[tuple[str, Any, Any]]:
    """Every (dotted name, old, new) where two JSON values differ, in key order."""
    if isinstance(old, dict) and isinstance(new, dict):
        found = []
        for key in sorted(set(old) | set(new), key=str):
            found += _diffs(old.get(key), new.get(key), f"{where}.{key}" if where else str(key))
        return found
    return [] if old == new else [(where, old, new)]


def _differences_text(diffs: list[tuple[str, Any, Any]]) -> str:
    """'a=1, this run has a=2' for the first difference, the others named in parentheses."""
    (name, was, now), rest = diffs[0], diffs[1:]
    text = f"{name}={json.dumps(was)}, this run has {name}={json.dumps(now)}"
    if rest:
        text += " (also differing: " + ", ".join(f"{n} {json.dumps(a)} -> {json.dumps(b)}" for n, a, b in rest) + ")"
    return text


# --- the weights' fingerprint -------------------------------------------------------------------------------

# the files from_pretrained reads weights from (Trainer checkpoints also hold optimizer.pt, rng_state.pth ...)
_WEIGHT_SUFFIXES = (".safetensors", ".gguf", ".index.json")
DIGESTS_FILE = "file_digests.json"  # under models.cache_root(): sha256 per (path, size, mtime_ns, ctime_ns, inode)
CACHE_MIN_BYTES = 1 << 26  # smaller files are hashed again (64 MiB: about 50 ms)


def _is_weight_file(path: Path) -> bool:
    name = path.name
    return name.endswith(_WEIGHT_SUFFIXES) or (name.startswith("pytorch_model") and name.endswith(".bin"))


def _stat_key(path: Path) -> list[int]:
    st = path.stat()
    # any write changes mtime and ctime, and ctime cannot be set back: an overwrite of the same size is seen
    return [st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino]


def file_digests(paths: Sequence[Path]) -> dict[Path, str]:
    """sha256 of each file's content, streamed; files of CACHE_MIN_BYTES or more are cached under
    `models.cache_root()` per (path, size, mtime_ns, ctime_ns, inode), so a multi-GB checkpoint is read once
    (sha256 runs at about 1.2 GB/s on one core of this project's 2-core build machine, measured 2026-12-03)
    and a resume costs a stat per file."""
    from ..models import cache_root

    cache_path = cache_root() / DIGESTS_FILE
    try:
        cache = json.loads(cache_path.read_text())
        cache = cache if isinstance(cache, dict) else {}
    except (OSError, ValueError):
        cache = {}  # a missing or damaged cache only costs a re-read
    out, fresh = {}, False
    for path in paths:
        real, key = str(path.resolve()), _stat_key(path)
        entry = cache.get(real)
        if isinstance(entry, dict) and entry.get("stat") == key and isinstance(entry.get("sha256"), str):
            out[path] = entry["sha256"]
            continue
        if key[0] > 1 << 30:
            logger.info("moba_hf eval: hashing %s (%.1f GB) for the weights' fingerprint", path, key[0] / 1e9)
        digest = hashlib.sha256()
        with open(path, "rb") as fh:
            for chunk in iter(lambda fh=fh: fh.read(1 << 23), b""):
                digest.update(chunk)
        out[path] = digest.hexdigest()
        if key[0] >= CACHE_MIN_BYTES:
            cache[real], fresh = {"stat": key, "sha256": out[path]}, True
    if fresh:
        cache = {p: e for p, e in cache.items() if os.path.exists(p)}  # forget deleted files
        try:
            cache_path.parent.mkdir(parents=True, exist_ok=True)
            atomic_write_text(cache_path, json.dumps(cache))
        except OSError as error:
            logger.info("moba_hf eval: could not cache file digests in %s: %s", cache_path, error)
    return out


def _normalized_config(path: Path) -> str:
    """config.json without the transformers version that wrote it (a re-save by a newer version is the same model)."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return hashlib.sha256(path.read_bytes()).hexdigest()
    if isinstance(data, dict):
        data.pop("transformers_version", None)
    return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()


def weights_fingerprint(model: Any) -> str:
    """What run.json pins a run's model by, beside its name:

    files:sha256:...   the checkpoint directory the model was loaded from (config._name_or_path): the content of
                       its weight files (*.safetensors, pytorch_model*.bin, *.gguf, their indexes) and its
                       config.json
    hub:ID@COMMIT      a hub model without a local directory: the commit transformers resolved
    params:sha256:...  a model built in Python: the bytes of every tensor of its state_dict
    """
    config = getattr(model, "config", None)
    source = str(getattr(config, "_name_or_path", "") or "")
    directory = Path(source).expanduser() if source else None
    weights = sorted(p for p in directory.iterdir() if p.is_file() and _is_weight_file(p)) if (
        directory is not None and directory.is_dir()) else []  # fmt: skip
    if weights:
        digest = hashlib.sha256()
        for path, content in file_digests(weights).items():
            digest.update(f"{path.name}\0{content}\0".encode())
        if (directory / "config.json").is_file():
            digest.update(f"config.json\0{_normalized_config(directory / 'config.json')}\0".encode())
        return f"files:sha256:{digest.hexdigest()[:32]}"
    commit = getattr(config, "_commit_hash", None)
    if source and commit:
        return f"hub:{source}@{commit}"
    digest = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        tensor = tensor.detach()
        digest.update(f"{name}\0{str(tensor.dtype)}\0{tuple(tensor.shape)}\0".encode())
        digest.update(tensor.reshape(-1).contiguous().cpu().view(torch.uint8).numpy())
    return f"params:sha256:{digest.hexdigest()[:32]}"


# --- the output directory -----------------------------------------------------------------------------------


def _read_run(path: Path) -> dict[str, Any]:
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
        raise CorruptRunFile(f"{path} holds {_kind(run)}, not a run record (an object with task, model, params): {fix}")
    for key, kind, required in (("task", str, True), ("model", dict, True), ("params", dict, True),
                                ("settings", dict, False), ("changes", list, False)):  # fmt: skip
        if key not in run and not required:
            continue
        if not isinstance(run.get(key), kind):
            raise CorruptRunFile(f"{path}: {key!r} must be {_kind(kind())}, got {json.dumps(run.get(key))[:80]}: {fix}")
    bad = [name for name, value in run.get("settings", {}).items() if not isinstance(value, dict)]
    if bad:
        raise CorruptRunFile(f"{path}: setting {bad[0]!r} must be an object (its definition): {fix}")
    changes = run.get("changes", [])
    if not all(isinstance(c, dict) and isinstance(c.get("differences"), dict) for c in changes):
        raise CorruptRunFile(f"{path}: 'changes' must list objects with their 'differences': {fix}")
    return run


def _trial_problem(record: Any) -> str | None:
    """Why a parsed trials.jsonl line is not a trial record, or None."""
    if not isinstance(record, dict):
        return f"{_kind(record)}, not an object"
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


class ResultStore:
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
        old = _read_run(run) if run.is_file() else None
        self._read_trials()
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

    def __enter__(self) -> ResultStore:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def _identity(self) -> dict[str, Any]:
        # the device may change between runs (resume on another machine); the weights and dtype may not
        return {k: self.model.get(k) for k in ("name", "class", "layers", "dtype", "weights")}

    def _check(self, old: dict[str, Any]) -> list[tuple[str, Any, Any]]:
        """Every difference between this run and the stored one; RunMismatch unless allow_changed."""
        self.settings, self.changes = old.get("settings", {}), old.get("changes", [])
        mine = {"task": self.task, "model": self._identity(), "params": self.params}
        diffs = [(n.removeprefix("params."), a, b) for n, a, b in _diffs({k: old.get(k) for k in mine}, mine)]
        if old["task"] != self.task:  # other trials entirely (their keys may even collide): never resumed
            raise RunMismatch(f"{self.out_dir} holds a {old['task']} run, this is a {self.task} run: use a new --out")
        if diffs and not self.allow_changed:
            raise RunMismatch(
                f"{self.out_dir} holds a run with {_differences_text(diffs)}: rerun with the same model and "
                "parameters to resume, resume anyway with --allow-changed (allow_changed=True; the differences are "
                "recorded in run.json), or use a new --out"
            )
        return diffs

    def _record_change(self, diffs: list[tuple[str, Any, Any]]) -> None:
        self.changes.append({
            "at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "trials_before": len(self.trials),
            "differences": {name: {"was": was, "now": now} for name, was, now in diffs},
        })  # fmt: skip
        text = (
            f"{self.out_dir} resumed with --allow-changed: {_differences_text(diffs)}; its {len(self.trials)} "
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

    def _read_trials(self) -> None:
        path = self.out_dir / TRIALS_FILE
        if not path.is_file():
            return
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
                        "moba_hf eval: dropped the incomplete last line of %s (line %d, an interrupted write); its "
                        "trial runs again", path, i + 1,
                    )  # fmt: skip
                    with open(path, "r+b") as fh:
                        fh.truncate(offset)
                    break
                problem = _trial_problem(record)
                if problem:
                    raise CorruptRunFile(
                        f"{path} line {i + 1} is not a trial record ({problem}: {line[:60].decode(errors='replace')}): "
                        "fix or delete the line, or use a new --out"
                    )
                repeated += record["key"] in self.trials
                self.trials[record["key"]] = record
            offset += len(line) + 1
        else:
            if data and not data.endswith(b"\n"):  # a whole record whose newline was cut: end the line
                with open(path, "ab") as fh:
                    fh.write(b"\n")
        if repeated:
            logger.warning("moba_hf eval: %s holds %d trials twice; the last record of each counts", path, repeated)

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
            diffs = _diffs(old, described)
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


def resolved(setting: Setting, model: Any) -> Setting:
    """`setting` with plain "moba" replaced by the config it runs: the checkpoint's moba_config or the defaults
    (so run.json records, and a resume checks, what actually ran)."""
    if setting.attn != MOBA or setting.moba is not None:
        return setting
    return dataclasses.replace(setting, moba=MobaConfig.from_spec(getattr(model.config, "moba_config", None)))


def _reads_past_window(setting: Setting, model: Any) -> bool:
    """Whether `setting` runs DCA on `model` (every query-key distance kept inside the trained window)."""
    if setting.attn != MOBA:
        return False
    from ..integration.rope_remap import resolve

    moba = resolved(setting, model).moba
    try:
        return resolve(moba.dca, model.config, moba.block_size if moba.sparse else None) is not None
    except ValueError:
        return False  # DCA cannot run on this model: the setting fails on its own when it runs


def window_warnings(model: Any, settings: Sequence[Setting], lengths: Sequence[int], new_tokens: int = 0) -> list[str]:
    """The warning for `lengths` (plus `new_tokens` generated after each prompt) past the model's trained window,
    naming the settings that run them without DCA (`moba_hf.window`); raises PastWindow where the model has no
    position past its window (a learned position table, no RoPE)."""
    from ..window import check_positions, model_window

    window = model_window(model.config)
    past = sorted(n for n in set(lengths) if window is not None and n + new_tokens > window.positions)
    if not past:
        return []
    what = f"length{'s' if len(past) > 1 else ''} {', '.join(map(str, past))}"
    what += f" (+{new_tokens} generated tokens)" if new_tokens else ""
    text = check_positions(model.config, past[-1] + new_tokens, what)
    plain = [s.name for s in settings if not _reads_past_window(s, model)]
    if text is None or not plain:
        return []
    return [f"{text}. Settings without DCA: {', '.join(plain)}"]


def open_store(
    model: Any,
    out_dir: str | Path | None,
    task: str,
    params: dict[str, Any],
    *,
    model_name: str | None = None,
    allow_changed: bool = False,
    warnings: Sequence[str] = (),
) -> ResultStore:
    """The ResultStore of one evaluation of `model` (its weights fingerprinted into run.json), with `warnings`
    (from `window_warnings`) logged and kept for summary.md and results.json."""
    store = ResultStore(out_dir, task, params, model_info(model, model_name), weights=model,
                        allow_changed=allow_changed)  # fmt: skip
    for text in warnings:
        logger.warning("moba_hf eval: %s", text)
        store.warnings.append(text)
    return store


def _batches(cells: Sequence[dict[str, Any]], size: int, key: Callable[[dict[str, Any]], Any]) -> list[list[dict]]:
    """Consecutive cells sharing `key`, at most `size` per batch."""
    out: list[list[dict[str, Any]]] = []
    for cell in cells:
        if out and len(out[-1]) < size and key(out[-1][0]) == key(cell):
            out[-1].append(cell)
        else:
            out.append([cell])
    return out


def run_grid(
    model: Any,
    settings: Sequence[Setting],
    cells: Sequence[dict[str, Any]],
    run_cell: Callable[[dict[str, Any]], dict[str, Any]] | None,
    store: ResultStore,
    *,
    progress: bool = True,
    desc: str = "eval",
    run_batch: Callable[[list[dict[str, Any]]], list[dict[str, Any]]] | None = None,
    batch_size: int = 1,
    batch_key: Callable[[dict[str, Any]], Any] = lambda cell: cell.get("length"),
) -> None:
    """Run every (setting, cell) not finished yet, one setting at a time on the one model.

    `run_cell(cell)` returns one record; or `run_batch(cells)` returns one record per cell, for batches of
    up to `batch_size` unfinished cells that share `batch_key`. Each record is stored as it finishes, so an
    interrupted run resumes at the first unfinished cell. A setting that raises is recorded in
    store.failures (with the error) and the grid moves on.
    """
    from tqdm.auto import tqdm

    if (run_cell is None) == (run_batch is None):
        raise ValueError("run_grid needs exactly one of run_cell and run_batch")
    if run_batch is None:

        def run_batch(batch: list[dict[str, Any]]) -> list[dict[str, Any]]:
            return [run_cell(batch[0])]

        batch_size = 1
    settings = [resolved(setting, model) for setting in settings]
    for setting in settings:
        store.add_setting(setting)  # every definition is checked before any trial runs
    bar = tqdm(total=len(settings) * len(cells), desc=desc, disable=not progress, dynamic_ncols=True)
    try:
        for setting in settings:
            store.failures.pop(setting.name, None)
            todo = [c for c in cells if not store.done(trial_key(setting.name, c))]
            bar.update(len(cells) - len(todo))
            if not todo:
                continue
            bar.set_postfix_str(setting.name)
            finished = 0
            try:
                with use_setting(model, setting):
                    for batch in _batches(todo, batch_size, batch_key):
                        records = run_batch(batch)
                        for cell, record in zip(batch, records, strict=True):
                            store.add({"key": trial_key(setting.name, cell), "setting": setting.name, **cell, **record})
                        finished += len(batch)
                        bar.update(len(batch))
            except Exception as error:  # noqa: BLE001 - a failing setting is reported, the grid goes on
                message = f"{type(error).__name__}: {error}"
                logger.warning("moba_hf eval: setting %r failed: %s", setting.name, message)
                store.failures[setting.name] = message
                bar.update(len(todo) - finished)
                if torch.cuda.is_available():
                    torch.cuda.empty_cache()  # after an out-of-memory, leave room for the next setting
    finally:
        bar.close()
