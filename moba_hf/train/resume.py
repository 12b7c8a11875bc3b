"""Resume: which checkpoint is whole, and whether the resumed run is the run that wrote it.

    output_dir/
      run_config.json        the run: config, data fingerprint, model, and `config_changes` (resumes that changed it)
      checkpoint-N/          every train.save_steps (the HF Trainer's files, plus ours):
        model.safetensors    weights (adapter_model.safetensors with LoRA, pytorch_model_fsdp.bin under FSDP)
        optimizer.pt         optimizer state (optimizer.bin under FSDP); scheduler.pt, rng_state*.pth
        trainer_state.json   written last: a checkpoint without it was cut mid-write
        attention_schedule.json, run_config.json

`resume_checkpoint` takes the newest checkpoint whose files all read back (truncated weights or a corrupt JSON
file: skipped, with a log line naming the file); `check_resume` compares the new run with the checkpoint's
`run_config.json` and refuses a difference, naming each key with both values, unless the caller allows changes;
then the change is logged and appended to `config_changes`. A changed `train.max_steps` needs no permission
and is recorded there too. `run_files` lists what a run leaves in its directory (a new run into it is refused).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import zipfile
from pathlib import Path
from typing import Any

from ..rundir import field_problem

logger = logging.getLogger("moba_hf")

RUN_FILE = "run_config.json"
SUMMARY_FILE = "train_summary.json"
SPARSITY_FILE = "sparsity.jsonl"
# run_config.json's fields with their JSON types: a record read back is refused when one has another type
RUN_FIELDS = {
    "config": dict[str, dict],
    "switch_step": int | None,
    "data_fingerprint": str | None,
    "model_type": str,
    "model_parameters": int,
    "config_changes": list[dict],
}
CHANGE_FIELDS = {"step": int, "checkpoint": str, "changes": dict[str, list]}  # one entry of config_changes
ALLOW_FLAG = "--allow-config-change"
# keys that change bookkeeping, not what is trained: a resume may change them freely
FREE = {
    "train.output_dir",
    "train.max_steps",  # the step count of a run that goes on; the MoBA / full switch step is compared instead
    "train.logging_steps",
    "train.save",
    "train.save_steps",
    "train.save_total_limit",
    "train.sparsity_every",
    "train.dataloader_num_workers",
    "model.gradient_checkpointing",  # recomputes the same arithmetic
}
# keys a checkpoint fixes: a resume cannot apply another value, with or without the override
FIXED = {
    "model.type": "the checkpoint's weights belong to the old model",
    "model.parameters": "the checkpoint's weights belong to the old model",
    "model.dtype": "the checkpoint's weights and optimizer state are in the old dtype",
    "model.trainable": "optimizer.pt holds the state of the old trainable parameters",
    "lora.": "the checkpoint holds the LoRA adapters of the old setting",
    "train.optim": "optimizer.pt holds the old optimizer's state",
    "train.seed": "the checkpoint's RNG state and data order come from the old seed",
}
# keys the Trainer would restore from the checkpoint's optimizer state; `MobaTrainer` puts the new value back
RESTORED_FROM_OPTIMIZER = ("train.learning_rate", "train.weight_decay")
WEIGHT_FILES = (
    "model.safetensors",
    "model.safetensors.index.json",
    "adapter_model.safetensors",
    "pytorch_model.bin",
    "adapter_model.bin",
    "pytorch_model_fsdp.bin",
)


class RunRefused(ValueError):
    """A run refused before its first step: a config, data, checkpoint or resume problem, named in the message
    (a resume that would not continue the same run, or has no whole checkpoint to continue from)."""


def is_main_process() -> bool:
    return os.environ.get("RANK", "0") == "0"


def checkpoints(output_dir: str | Path) -> list[Path]:
    """checkpoint-N directories, newest first."""
    found = []
    for path in Path(output_dir).glob("checkpoint-*"):
        match = re.fullmatch(r"checkpoint-(\d+)", path.name)
        if match and path.is_dir():
            found.append((int(match.group(1)), path))
    return [path for _, path in sorted(found, reverse=True)]


def checkpoint_problem(checkpoint: Path) -> str | None:
    """Why `checkpoint` cannot be resumed from (a file missing, truncated or corrupt), or None.

    Reads headers and zip directories, not whole tensors: a truncated file is caught, a bit flip inside a
    tensor is not."""
    state = checkpoint / "trainer_state.json"
    if not state.is_file():
        return "no trainer_state.json (written last: the checkpoint was cut mid-write)"
    problem = _json_problem(state)
    if problem is None:
        step = json.loads(state.read_text()).get("global_step")
        if isinstance(step, bool) or not isinstance(step, int):
            problem = f"trainer_state.json has no integer global_step (got {step!r})"
    if problem:
        return problem
    for name, needed in (("attention_schedule.json", ("modes", "history")), (RUN_FILE, ("config",))):
        path = checkpoint / name
        if path.is_file():
            problem = _json_problem(path)
            missing = [] if problem else [key for key in needed if key not in json.loads(path.read_text())]
            if problem or missing:
                return problem or f"{name} lacks the keys {missing}"
    weights = [checkpoint / name for name in WEIGHT_FILES if (checkpoint / name).is_file()]
    if not weights and not any(p.is_dir() and "pytorch_model_fsdp" in p.name for p in checkpoint.iterdir()):
        return f"no model weights (none of {', '.join(WEIGHT_FILES)})"
    for path in sorted(checkpoint.iterdir()):
        if path.is_dir():
            continue
        if path.suffix == ".safetensors":
            problem = _safetensors_problem(path)
        elif path.suffix in (".pt", ".pth", ".bin"):
            problem = _torch_file_problem(path)
        elif path.suffix == ".json":
            problem = _json_problem(path)
            if problem is None and path.name.endswith(".index.json"):
                shards = set(json.loads(path.read_text()).get("weight_map", {}).values())
                missing = sorted(s for s in shards if not (checkpoint / s).is_file())
                problem = f"{path.name} names shards that are missing: {missing}" if missing else None
        if problem:
            return problem
    return None


def missing_state(checkpoint: Path) -> list[str]:
    """The optimizer / scheduler files the checkpoint lacks (the Trainer would then start both fresh)."""
    names = [p.name for p in checkpoint.iterdir()]
    optimizer_dirs = [n for n in names if "optimizer" in n and (checkpoint / n).is_dir()]  # FSDP sharded state
    missing = []
    if not optimizer_dirs and not {"optimizer.pt", "optimizer.bin"} & set(names):
        missing.append("optimizer.pt")
    if "scheduler.pt" not in names:
        missing.append("scheduler.pt")
    return missing


def resume_checkpoint(output_dir: str | Path) -> Path:
    """The newest whole checkpoint in output_dir; each newer one that is not whole is skipped with a log line."""
    found = checkpoints(output_dir)
    skipped = []
    for checkpoint in found:
        problem = checkpoint_problem(checkpoint)
        if problem is None:
            return checkpoint
        skipped.append(f"{checkpoint.name}: {problem}")
        if is_main_process():
            logger.warning("moba_hf: resume: skipping %s: %s", checkpoint, problem)
    if not found:
        raise RunRefused(
            f"resume: no whole checkpoint (checkpoint-N with trainer_state.json) in {output_dir}; runs leave them "
            "when train.save_steps > 0"
        )
    raise RunRefused(f"resume: no whole checkpoint in {output_dir}: " + "; ".join(skipped))


def checkpoint_step(checkpoint: Path) -> int:
    """The optimizer step a whole checkpoint was written at (trainer_state.json's global_step)."""
    return json.loads((checkpoint / "trainer_state.json").read_text())["global_step"]


def run_files(output_dir: str | Path) -> list[str]:
    """The files and checkpoints a training run leaves in output_dir (empty: no run has written there)."""
    out = Path(output_dir)
    if not out.is_dir():
        return []
    names = [p.name for p in checkpoints(out)[::-1]]
    return [name for name in (RUN_FILE, SUMMARY_FILE, SPARSITY_FILE) if (out / name).exists()] + names


def read_run_record(path: Path) -> dict[str, Any]:
    """A run_config.json read back, its fields type-checked: RunRefused names the file, field, value and type."""
    record = json.loads(path.read_text())
    problem = field_problem(record, RUN_FIELDS, required=("config",)) if isinstance(record, dict) else "not an object"
    for i, change in enumerate(record.get("config_changes", []) if problem is None else []):
        inner = field_problem(change, CHANGE_FIELDS, required=tuple(CHANGE_FIELDS))
        problem = problem or (inner and f"config_changes[{i}]: {inner}")
    if problem:
        raise RunRefused(f"{path}: {problem} (this package writes the file whole: it was edited since); restore it")
    return record


def data_fingerprint(dataset: Any) -> str | None:
    """sha256 (16 hex digits) of every row the Trainer reads (input_ids, labels, position_ids), in order."""
    import torch

    try:
        n = len(dataset)
    except TypeError:  # an iterable dataset: no fingerprint
        return None
    digest = hashlib.sha256()
    for i in range(n):
        row = dataset[i]
        for key in sorted(row):
            value = torch.as_tensor(row[key]).contiguous()
            digest.update(f"{key}:{value.dtype}:{tuple(value.shape)}".encode())
            digest.update(value.numpy().tobytes())
    return digest.hexdigest()[:16]


def run_record(config: Any, model: Any, dataset: Any) -> dict[str, Any]:
    """What the run is: its config, the switch step, the data's fingerprint and the model's type and size."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    parameters = sum(p.numel() for name, p in base.named_parameters() if "lora_" not in name)
    return {
        "config": json.loads(json.dumps(config.to_dict(), default=str)),
        "switch_step": config.switch_step,
        "data_fingerprint": data_fingerprint(dataset),
        "model_type": getattr(base.config, "model_type", type(base).__name__),
        "model_parameters": parameters,
        "config_changes": [],
    }


def _flat(record: dict[str, Any]) -> dict[str, Any]:
    out = {f"{section}.{key}": value for section, keys in record["config"].items() for key, value in keys.items()}
    out["schedule.switch_step"] = record.get("switch_step")
    out["data.fingerprint"] = record.get("data_fingerprint")
    out["model.type"] = record.get("model_type")
    out["model.parameters"] = record.get("model_parameters")
    return out


def differences(old: dict[str, Any], new: dict[str, Any]) -> dict[str, tuple[Any, Any]]:
    """key -> (old, new) for every compared key whose value differs between two run records."""
    a, b = _flat(old), _flat(new)
    return {k: (a.get(k), b.get(k)) for k in sorted(set(a) | set(b)) if k not in FREE and a.get(k) != b.get(k)}


def fixed_reason(key: str) -> str | None:
    return next((why for prefix, why in FIXED.items() if key == prefix or key.startswith(prefix)), None)


def check_resume(
    checkpoint: Path, record: dict[str, Any], *, allow_config_change: bool = False
) -> tuple[dict[str, Any], dict[str, list[Any]]]:
    """(the run record to continue with, this resume's changes: key -> [old, new]).

    The record is `record` plus the checkpoint's config_changes and this resume's, when `allow_config_change`
    lets them through. Refuses a changed config, a missing run record or missing optimizer state, naming each;
    a key the checkpoint fixes (FIXED) is refused even when allowed."""
    where = f"resume from {checkpoint}"
    allow = f"pass {ALLOW_FLAG} (train(..., allow_config_change=True)) to continue"
    saved_path = checkpoint / RUN_FILE
    changes: dict[str, list[Any]] = {}
    if saved_path.is_file():
        saved = read_run_record(saved_path)
        diff = differences(saved, record)
        fixed = {k: v for k, v in diff.items() if fixed_reason(k)}
        if fixed:
            listed = "; ".join(f"{k}: {v[0]!r} -> {v[1]!r} ({fixed_reason(k)})" for k, v in fixed.items())
            raise RunRefused(f"{where}: cannot change on resume: {listed}; start a new run in another output_dir")
        if diff and not allow_config_change:
            listed = "; ".join(f"{k}: {v[0]!r} -> {v[1]!r}" for k, v in diff.items())
            raise RunRefused(
                f"{where}: the config differs from the run that wrote the checkpoint: {listed}. Resume with the "
                f"run's config, or {allow} with the new values (recorded in {RUN_FILE} under config_changes)"
            )
        changes.update({k: [v[0], v[1]] for k, v in diff.items()})
        steps = [_flat(r).get("train.max_steps") for r in (saved, record)]
        if steps[0] != steps[1]:  # free to change (no flag), but recorded: the run's length is part of its story
            changes["train.max_steps"] = steps
        history = list(saved.get("config_changes", []))
    else:
        if not allow_config_change:
            raise RunRefused(
                f"{where}: the checkpoint has no {RUN_FILE}, so the resumed config cannot be checked against "
                f"the run's; {allow} unchecked"
            )
        changes["run_config"] = [None, "unchecked: the checkpoint has no run_config.json"]
        history = []
    missing = missing_state(checkpoint)
    if missing:
        files = ", ".join(str(checkpoint / name) for name in missing)
        if not allow_config_change:
            raise RunRefused(
                f"{where}: {files} missing, so the optimizer state (Adam moments, learning-rate schedule) would "
                f"start fresh; {allow} with a fresh optimizer and scheduler"
            )
        changes["optimizer_state"] = [f"{checkpoint.name}/{'+'.join(missing)}", "fresh (files missing)"]
    if changes and is_main_process():
        for key, (old, new) in changes.items():
            flag = "" if key == "train.max_steps" else f" ({ALLOW_FLAG})"
            logger.warning("moba_hf: %s: %s changed on resume: %r -> %r%s", where, key, old, new, flag)
    step = checkpoint_step(checkpoint)
    if changes:
        history.append({"step": step, "checkpoint": checkpoint.name, "changes": changes})
    return {**record, "config_changes": history}, changes


def write_record(path: Path, record: dict[str, Any]) -> None:
    """Write a run record; replace() so a kill mid-write leaves no half file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(record, indent=1, default=str))
    tmp.replace(path)


def _json_problem(path: Path) -> str | None:
    """None when the file holds a JSON object (every JSON file of a checkpoint does)."""
    try:
        data = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as err:
        return f"{path.name} is not valid JSON ({err})"
    return None if isinstance(data, dict) else f"{path.name} holds a {type(data).__name__}, not a JSON object"


def _safetensors_problem(path: Path) -> str | None:
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            return f"{path.name} is truncated ({size} bytes: no header)"
        n = int.from_bytes(head, "little")
        if n > size - 8:
            return f"{path.name} is truncated ({size} bytes; its header alone needs {n + 8})"
        try:
            header = json.loads(f.read(n))
        except (json.JSONDecodeError, UnicodeDecodeError):
            return f"{path.name} has a corrupt header"
    if not isinstance(header, dict):
        return f"{path.name} has a corrupt header"
    try:
        end = max((v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"), default=0)
    except (TypeError, KeyError, IndexError):
        return f"{path.name} has a corrupt header"
    if 8 + n + end != size:
        return f"{path.name} is truncated ({size} bytes; its header describes {8 + n + end})"
    return None


def _torch_file_problem(path: Path) -> str | None:
    try:  # torch.save writes a zip archive; a cut file has no central directory
        with zipfile.ZipFile(path) as archive:
            if not archive.namelist():
                return f"{path.name} is empty"
    except (zipfile.BadZipFile, OSError) as err:
        return f"{path.name} is truncated or corrupt ({err})"
    return None
