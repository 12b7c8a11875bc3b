"""The grid loop every evaluation runs: each (setting, cell) not finished yet, one setting at a time on the one
model, each record stored as it finishes (`run_store.ResultStore`), a failing setting recorded and the grid
going on; and what a grid is checked for before it runs (lengths, depths, trials, the model's window)."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from ..config import MobaConfig
from .report import aggregate, heatmap, summary_table
from .run_store import ResultStore
from .settings import MOBA, Setting, use_setting

logger = logging.getLogger("moba_hf")


def model_info(model: Any, name: str | None = None) -> dict[str, Any]:
    param = next(model.parameters())
    return {
        "name": name or getattr(model.config, "_name_or_path", "") or type(model).__name__,
        "class": type(model).__name__,
        "layers": getattr(model.config, "num_hidden_layers", None),
        "dtype": str(param.dtype).removeprefix("torch."),
        "device": str(param.device),
    }


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
        return aggregate(self.records, keys)


def trial_key(setting: str, cell: dict[str, Any]) -> str:
    return "|".join([setting, *(f"{k}={cell[k]}" for k in sorted(cell))])


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
    info = model_info(model, model_name)
    store = ResultStore(out_dir, task, params, info, weights=model, allow_changed=allow_changed)
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


def check_trials(trials: int) -> int:
    if isinstance(trials, bool) or not isinstance(trials, int) or trials < 1:
        raise ValueError(f"trials must be an integer >= 1, got {trials!r}")
    return trials


def check_grid(lengths: Sequence[int], depths: Sequence[float], trials: int) -> tuple[list[int], list[float]]:
    """(sorted lengths, sorted depths) of a lengths x depths grid, each checked, and `trials` checked."""
    lengths = [int(n) for n in lengths]
    depths = [float(d) for d in depths]
    if not lengths or any(n < 16 for n in lengths):
        raise ValueError(f"lengths must be a non-empty list of token counts >= 16, got {lengths}")
    if not depths or any(not 0.0 <= d <= 1.0 for d in depths):
        raise ValueError(f"depths must be a non-empty list of fractions in [0, 1], got {depths}")
    check_trials(trials)
    return sorted(set(lengths)), sorted(set(depths))


def depth_grid_eval(
    model: Any,
    settings: Sequence[Setting],
    run_cell: Callable[[dict[str, Any]], dict[str, Any]],
    grid: tuple[list[int], list[float], int],
    out_dir: str | Path,
    task: str,
    title: str,
    params: dict[str, Any],
    **store_kwargs: Any,
) -> EvalResult:
    """The lengths x depths x trials `grid` of a passkey / NIAH run through `run_cell`, then the summary table,
    results.json and the depth x length heatmap. `store_kwargs`: open_store's (model_name, allow_changed,
    warnings) and run_grid's progress."""
    lengths, depths, trials = grid
    progress = store_kwargs.pop("progress", True)
    cells = [{"length": n, "depth": d, "trial": i} for n in lengths for d in depths for i in range(trials)]
    with open_store(model, out_dir, task, params, **store_kwargs) as store:
        run_grid(model, settings, cells, run_cell, store, progress=progress, desc=task)
        names = [s.name for s in settings]
        records = store.records(settings)
        table = summary_table(
            records, names, lengths, metric="accuracy", failures=store.failures, title=f"{title}, {store.model['name']}"
        )
        summary = store.annotated(table)
        files = [store.write(settings, summary), store.out_dir / "summary.md"]
        png_path = store.out_dir / f"{task}_heatmap.png"
        png_title = f"{title}: {store.model['name']}"
        png = heatmap(records, names, lengths, depths, png_path, title=png_title, failures=store.failures)
        files += [png] if png else []
        return EvalResult(task, store.out_dir, list(settings), records, dict(store.failures), summary, files)
