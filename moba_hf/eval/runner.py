"""What every evaluation shares: timed prefill + greedy decoding, the resumable results store, the grid loop.

Output directory layout (one per run; re-running with the same directory resumes):

    run.json       task, parameters, model and settings, written before the first trial (checked on resume)
    trials.jsonl   one line per finished trial, appended as it finishes (crash-safe, read back on resume)
    results.json   model, versions, task parameters, settings, failures and every trial
    summary.md     the Markdown summary table
    *.png          plots (when matplotlib is installed)
"""

from __future__ import annotations

import contextlib
import dataclasses
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
from .settings import MOBA, Setting, use_setting

logger = logging.getLogger("moba_hf")

RUN_FILE = "run.json"
TRIALS_FILE = "trials.jsonl"
RESULTS_FILE = "results.json"
SUMMARY_FILE = "summary.md"


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


def _sync(device: torch.device) -> None:
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
        _sync(device)
        start = time.perf_counter()
        out = model(input_ids=input_ids, use_cache=True, **extra)
        _sync(device)
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
    _sync(device)
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


class RunMismatch(ValueError):
    """An output directory holds another experiment than the one asked for."""


def atomic_write_text(path: str | Path, text: str) -> Path:
    """Write via a temporary file and os.replace, so a reader never sees half a file."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    tmp.write_text(text)
    os.replace(tmp, path)
    return path


def _diff(old: Any, new: Any, where: str = "") -> tuple[str, Any, Any] | None:
    """The first (dotted name, old, new) where two JSON values differ, or None."""
    if isinstance(old, dict) and isinstance(new, dict):
        for key in sorted(set(old) | set(new), key=str):
            found = _diff(old.get(key), new.get(key), f"{where}.{key}" if where else str(key))
            if found:
                return found
        return None
    return None if old == new else (where, old, new)


class ResultStore:
    """Trials of one run in `out_dir`; finished trials are read back so a re-run skips them.

    run.json (task, parameters, model and every setting's full definition) is written before the first
    trial and checked on every later run: a re-run with other parameters, another model or a redefined
    setting name raises RunMismatch instead of mixing two experiments. trials.jsonl is append-only, one
    write per line; an incomplete last line (a killed process) is dropped on the next run.
    out_dir None keeps the trials in memory only (a command that reports and forgets, like the demo).
    """

    def __init__(self, out_dir: str | Path | None, task: str, params: dict[str, Any], model: dict[str, Any]):
        self.task, self.params, self.model = task, _jsonable(params), model
        self.settings: dict[str, dict[str, Any]] = {}
        self.failures: dict[str, str] = {}
        self.trials: dict[str, dict[str, Any]] = {}
        self.out_dir = None if out_dir is None else Path(out_dir)
        if self.out_dir is None:
            return
        if self.out_dir.exists() and not self.out_dir.is_dir():
            raise RunMismatch(f"output directory {self.out_dir} is a file; give a directory")
        self.out_dir.mkdir(parents=True, exist_ok=True)
        run = self.out_dir / RUN_FILE
        if run.is_file():
            self._check(json.loads(run.read_text()))
        elif (self.out_dir / TRIALS_FILE).exists() or (self.out_dir / RESULTS_FILE).exists():
            raise RunMismatch(
                f"{self.out_dir} holds results without {RUN_FILE}, so their parameters are unknown: use a new --out"
            )
        self._write_run()
        self._read_trials()

    def _identity(self) -> dict[str, Any]:
        # the device may change between runs (resume on another machine); the weights and dtype may not
        return {k: self.model.get(k) for k in ("name", "class", "layers", "dtype")}

    def _check(self, old: dict[str, Any]) -> None:
        mine = {"task": self.task, "model": self._identity(), "params": self.params}
        found = _diff({k: old.get(k) for k in mine}, mine)
        if found:
            name, was, now = found
            name = name.removeprefix("params.")
            raise RunMismatch(
                f"{self.out_dir} holds a run with {name}={json.dumps(was)}, this run has {name}={json.dumps(now)}: "
                "rerun with the same parameters to resume, or use a new --out"
            )
        self.settings = old.get("settings", {})

    def _write_run(self) -> None:
        if self.out_dir is None:
            return
        run = {"task": self.task, "model": self._identity(), "params": self.params, "settings": self.settings}
        atomic_write_text(self.out_dir / RUN_FILE, json.dumps(run, indent=1))

    def _read_trials(self) -> None:
        path = self.out_dir / TRIALS_FILE
        if not path.is_file():
            return
        data = path.read_bytes()
        offset = 0
        lines = data.split(b"\n")
        for i, line in enumerate(lines):
            last = i == len(lines) - 1 or (i == len(lines) - 2 and not lines[-1])
            try:
                record = json.loads(line) if line.strip() else None
            except json.JSONDecodeError as error:
                if not last:
                    raise ValueError(f"{path} line {i + 1} is not a trial record ({error}): use a new --out") from None
                logger.warning("moba_hf eval: dropped the incomplete last line of %s (an interrupted write)", path)
                with open(path, "r+b") as fh:
                    fh.truncate(offset)
                return
            if record is not None:
                self.trials[record["key"]] = record
            offset += len(line) + 1
        if data and not data.endswith(b"\n"):  # a whole record whose newline was cut: end the line
            with open(path, "ab") as fh:
                fh.write(b"\n")

    def add_setting(self, setting: Setting) -> None:
        described = _jsonable(setting.describe())
        old = self.settings.get(setting.name)
        if old is not None and isinstance(old.get("moba"), dict):
            try:  # written before a MobaConfig field existed: the field's default is what that run used
                old = {**old, "moba": _jsonable(MobaConfig.from_dict(old["moba"]).to_dict())}
            except ValueError:
                pass  # a field this version does not know: the comparison below names it
        if old is not None:
            found = _diff(old, described)
            if found:
                field, was, now = found
                raise RunMismatch(
                    f"setting {setting.name!r} in {self.out_dir / RUN_FILE} has {field}={json.dumps(was)}, this run "
                    f"defines it with {field}={json.dumps(now)}: name it differently (NAME=SPEC) or use a new --out"
                )
            return
        self.settings[setting.name] = described
        self._write_run()

    def done(self, key: str) -> bool:
        return key in self.trials

    def add(self, record: dict[str, Any]) -> None:
        if self.out_dir is not None:
            line = (json.dumps(record) + "\n").encode()
            fd = os.open(self.out_dir / TRIALS_FILE, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            try:
                os.write(fd, line)  # one write call: an interrupt lands before or after it, not inside
            finally:
                os.close(fd)
        self.trials[record["key"]] = record

    def records(self, settings: Sequence[Setting] | None = None) -> list[dict[str, Any]]:
        names = None if settings is None else {s.name for s in settings}
        return [r for r in self.trials.values() if names is None or r["setting"] in names]

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
            "trials": self.records(settings),
            **(extra or {}),
        }
        path = atomic_write_text(self.out_dir / RESULTS_FILE, json.dumps(data, indent=1))
        atomic_write_text(self.out_dir / SUMMARY_FILE, summary_md)
        return path


def _jsonable(value: Any) -> Any:
    return json.loads(json.dumps(value, default=str))


def resolved(setting: Setting, model: Any) -> Setting:
    """`setting` with plain "moba" replaced by the config it runs: the checkpoint's moba_config or the defaults
    (so run.json records, and a resume checks, what actually ran)."""
    if setting.attn != MOBA or setting.moba is not None:
        return setting
    return dataclasses.replace(setting, moba=MobaConfig.from_spec(getattr(model.config, "moba_config", None)))


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
