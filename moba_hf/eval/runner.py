"""What every evaluation shares: timed prefill + greedy decoding, the resumable results store, the grid loop.

Output directory layout (one per run; re-running with the same directory resumes):

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

from ..integration import track_sparsity
from .settings import Setting, use_setting

logger = logging.getLogger("moba_hf")

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
    tokens: list[int]
    prefill_seconds: float
    decode_seconds: float
    sparsity: float | None  # fraction of causal query-key pairs the prefill skipped (None: not tracked)
    sparsity_per_layer: dict[int, float]

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
    """Greedy decoding of input_ids [1, N]; the prefill (first forward) is timed and, with `track`, its
    measured sparsity recorded (tracking recomputes the cheap block gate, inside the timed region)."""
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
    tokens = [int(next_token)]
    start = time.perf_counter()
    for _ in range(max_new_tokens - 1):
        if eos_token_id is not None and tokens[-1] == eos_token_id:
            break
        out = model(input_ids=next_token, use_cache=True, **{cache_kw: output_cache(out)}, **extra)
        next_token = out.logits[:, -1:].argmax(-1)
        tokens.append(int(next_token))
    _sync(device)
    decode = time.perf_counter() - start
    if stats is None or not stats.layers:
        sparsity, per_layer = (0.0, {}) if track else (None, {})
    else:
        sparsity, per_layer = stats.overall, stats.per_layer()
    return Decoded(tokens, prefill, decode, sparsity, per_layer)


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


class ResultStore:
    """Trials of one run in `out_dir`; finished trials are read back so a re-run skips them.

    A re-run must use the same task parameters and, for every setting name already present, the same
    setting; otherwise ValueError (results of different experiments would mix).
    """

    def __init__(self, out_dir: str | Path, task: str, params: dict[str, Any], model: dict[str, Any]):
        self.out_dir = Path(out_dir)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self.task, self.params, self.model = task, _jsonable(params), model
        self.settings: dict[str, dict[str, Any]] = {}
        self.failures: dict[str, str] = {}
        self.trials: dict[str, dict[str, Any]] = {}
        previous = self.out_dir / RESULTS_FILE
        if previous.is_file():
            old = json.loads(previous.read_text())
            if old.get("task") != task or old.get("params") != self.params:
                raise ValueError(
                    f"{self.out_dir} holds a {old.get('task')} run with parameters {old.get('params')}; this run is "
                    f"{task} with {self.params}: use another output directory"
                )
            self.settings = old.get("settings", {})
        lines = self.out_dir / TRIALS_FILE
        if lines.is_file():
            for line in lines.read_text().splitlines():
                if line.strip():
                    record = json.loads(line)
                    self.trials[record["key"]] = record

    def add_setting(self, setting: Setting) -> None:
        described = setting.describe()
        old = self.settings.get(setting.name)
        if old is not None and old != described:
            raise ValueError(
                f"setting {setting.name!r} in {self.out_dir / RESULTS_FILE} was {old}, now {described}: "
                "rename it or use another output directory"
            )
        self.settings[setting.name] = described

    def done(self, key: str) -> bool:
        return key in self.trials

    def add(self, record: dict[str, Any]) -> None:
        self.trials[record["key"]] = record
        with open(self.out_dir / TRIALS_FILE, "a") as fh:
            fh.write(json.dumps(record) + "\n")

    def records(self, settings: Sequence[Setting] | None = None) -> list[dict[str, Any]]:
        names = None if settings is None else {s.name for s in settings}
        return [r for r in self.trials.values() if names is None or r["setting"] in names]

    def write(self, settings: Sequence[Setting], summary_md: str, extra: dict[str, Any] | None = None) -> Path:
        data = {
            "task": self.task,
            "model": self.model,
            "versions": versions(),
            "params": self.params,
            "settings": self.settings,
            "failures": self.failures,
            "trials": self.records(settings),
            **(extra or {}),
        }
        path = self.out_dir / RESULTS_FILE
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        tmp.write_text(json.dumps(data, indent=1))
        tmp.replace(path)
        (self.out_dir / SUMMARY_FILE).write_text(summary_md)
        return path


def _jsonable(value: Any) -> Any:
    return json.loads(json.dumps(value, default=str))


def run_grid(
    model: Any,
    settings: Sequence[Setting],
    cells: Sequence[dict[str, Any]],
    run_cell: Callable[[dict[str, Any]], dict[str, Any]],
    store: ResultStore,
    *,
    progress: bool = True,
    desc: str = "eval",
) -> None:
    """Run `run_cell` for every (setting, cell) not finished yet, one setting at a time on the one model.

    A setting that raises is recorded in store.failures (with the error) and the grid moves on.
    """
    from tqdm.auto import tqdm

    for setting in settings:
        store.add_setting(setting)
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
                    for cell in todo:
                        record = run_cell(cell)
                        store.add({"key": trial_key(setting.name, cell), "setting": setting.name, **cell, **record})
                        finished += 1
                        bar.update(1)
            except Exception as error:  # noqa: BLE001 - a failing setting is reported, the grid goes on
                message = f"{type(error).__name__}: {error}"
                logger.warning("moba_hf eval: setting %r failed: %s", setting.name, message)
                store.failures[setting.name] = message
                bar.update(len(todo) - finished)
                if torch.cuda.is_available():
                    torch.cuda.empty_cache()  # after an out-of-memory, leave room for the next setting
    finally:
        bar.close()
