"""Datasets for the moba_hf lm-eval tasks: rows of a local JSONL file (prompt, answer, length, depth).

lm-eval loads this file by path (`custom_dataset: !function utils.passkey_dataset`), so it only imports
the standard library and `datasets`. Options come from `--metadata '{...}'`:
    passkey_jsonl / niah_jsonl   another JSONL file (e.g. made by `moba-hf eval lm-eval-data`)
    max_length                   keep only rows whose prompt length (tokens) is at most this
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent


def _rows(path: Path, max_length: int | None) -> list[dict[str, Any]]:
    if not path.is_file():
        raise FileNotFoundError(f"lm-eval task data not found: {path} (make it with `moba-hf eval lm-eval-data`)")
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    if max_length is not None:
        rows = [r for r in rows if int(r["length"]) <= int(max_length)]
    if not rows:
        raise ValueError(f"{path} has no rows with length <= max_length={max_length}")
    return rows


def _dataset(task: str, kwargs: dict[str, Any]):
    import datasets

    path = Path(kwargs.get(f"{task}_jsonl") or HERE / f"{task}.jsonl")
    rows = _rows(path, kwargs.get("max_length"))
    for row in rows:
        row["answer"] = str(row["answer"])
    return datasets.DatasetDict({"test": datasets.Dataset.from_list(rows)})


def passkey_dataset(**kwargs: Any):
    return _dataset("passkey", kwargs)


def niah_dataset(**kwargs: Any):
    return _dataset("niah", kwargs)
