"""`TrainConfig`: a training run described by one TOML file (sections below; every key optional but noted).

[model]     name = "smollm2" (embedded) or a local path / hub id; dtype; gradient_checkpointing;
            trainable = ["q_proj", "k_proj"] to train only parameters whose name contains one of these
[moba]      the MobaConfig the run trains with (block_size, top_k, full_attn_layers, ...)
[schedule]  moba_fraction: MoBA for this fraction of the optimizer steps, then full attention (paper: 0.9);
            1.0 = MoBA throughout. The SFT recipe (last N layers full) is [moba] full_attn_layers = N.
[data]      source = "synthetic" | file.txt | file.jsonl | a `datasets` name; seq_len; split_documents ...
[train]     output_dir, max_steps, batch_size, gradient_accumulation_steps, learning_rate, precision,
            save_steps (checkpoints that `moba-hf train --resume` continues from), ...
[lora]      enabled, r, alpha, dropout, target_modules (peft)
"""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from ..config import MobaConfig
from ..config_files import load_mapping

PRECISIONS = ("fp32", "bf16")
DTYPES = ("float32", "bfloat16", "auto")


@dataclasses.dataclass(frozen=True)
class ModelSection:
    name: str = "smollm2"
    dtype: str = "float32"
    gradient_checkpointing: bool = False
    trainable: tuple[str, ...] | None = None  # None: all parameters (or the LoRA adapters)


@dataclasses.dataclass(frozen=True)
class ScheduleSection:
    moba_fraction: float = 1.0


@dataclasses.dataclass(frozen=True)
class DataSection:
    source: str = "synthetic"
    seq_len: int = 1024
    split_documents: bool = True
    text_field: str = "text"
    split: str = "train"
    max_documents: int | None = None
    # synthetic retrieval mixture (source = "synthetic")
    num_documents: int = 64
    min_length: int = 512
    max_length: int = 1024
    loss_on: str = "answer"
    eval_format_only: bool = False
    seed: int = 0


@dataclasses.dataclass(frozen=True)
class TrainSection:
    output_dir: str = "runs/moba"
    max_steps: int = 100
    batch_size: int = 1
    gradient_accumulation_steps: int = 1
    learning_rate: float = 1e-4
    optim: str = "adamw_torch"  # any TrainingArguments.optim name, e.g. "sgd", "adamw_torch_fused"
    weight_decay: float = 0.0
    warmup_steps: int = 0
    lr_scheduler: str = "constant"
    max_grad_norm: float = 1.0
    precision: str = "fp32"
    seed: int = 0
    logging_steps: int = 1
    save: bool = True  # the final model, in output_dir
    save_steps: int = 0  # a resumable checkpoint (output_dir/checkpoint-N) every N steps; 0 = none
    save_total_limit: int = 2  # checkpoints kept (oldest deleted); 0 = all
    sparsity_every: int = 10  # log measured per-layer sparsity every N steps (0 = never)
    fsdp: str = ""  # passed to TrainingArguments(fsdp=...), e.g. "full_shard auto_wrap"
    dataloader_num_workers: int = 0
    use_cpu: bool | None = None  # None: the CPU when there is no CUDA device (so torchrun gives gloo DDP)
    shuffle: bool = True  # False: rows in order (reproducible across process counts)


@dataclasses.dataclass(frozen=True)
class LoraSection:
    enabled: bool = False
    r: int = 16
    alpha: int = 32
    dropout: float = 0.0
    target_modules: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj")


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    model: ModelSection = ModelSection()
    moba: MobaConfig = MobaConfig()
    schedule: ScheduleSection = ScheduleSection()
    data: DataSection = DataSection()
    train: TrainSection = TrainSection()
    lora: LoraSection = LoraSection()

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            if f.name != "moba":
                _check_types(f.name, getattr(self, f.name))
        for name, (ok, valid) in _RULES.items():
            section, key = name.split(".")
            value = getattr(getattr(self, section), key)
            if value is not None and not ok(value, getattr(self, section)):
                raise ValueError(f"{name} must be {valid}, got {value!r}")

    @property
    def switch_step(self) -> int | None:
        """The optimizer step at which attention switches from MoBA to full (None: never)."""
        if self.schedule.moba_fraction >= 1.0:
            return None
        return round(self.schedule.moba_fraction * self.train.max_steps)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> TrainConfig:
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"unknown training config sections {unknown}; valid sections: {sorted(known)}")
        sections = {}
        for f in dataclasses.fields(cls):
            raw = data.get(f.name, {})
            if f.name == "moba":
                sections[f.name] = MobaConfig.from_dict(raw)
                continue
            section_type = type(f.default)
            names = {g.name for g in dataclasses.fields(section_type)}
            extra = sorted(set(raw) - names)
            if extra:
                raise ValueError(f"unknown keys {extra} in [{f.name}]; valid keys: {sorted(names)}")
            values = {k: tuple(v) if isinstance(v, list) else v for k, v in raw.items()}
            sections[f.name] = section_type(**values)
        return cls(**sections)

    @classmethod
    def from_file(cls, path: str | Path) -> TrainConfig:
        return cls.from_dict(load_mapping(path))

    def replace(self, section: str, **changes: Any) -> TrainConfig:
        """A copy with keys of one section changed, e.g. `cfg.replace("train", max_steps=10)`."""
        return dataclasses.replace(self, **{section: dataclasses.replace(getattr(self, section), **changes)})

    def to_dict(self) -> dict[str, Any]:
        out = {f.name: dataclasses.asdict(getattr(self, f.name)) for f in dataclasses.fields(self) if f.name != "moba"}
        out["moba"] = self.moba.to_dict()
        return out


# key -> (test of a value of the declared type, given its section; what is accepted, for the error)
_RULES: dict[str, tuple[Callable[[Any, Any], bool], str]] = {
    "model.dtype": (lambda v, _: v in DTYPES, f"one of {DTYPES}"),
    "schedule.moba_fraction": (lambda v, _: 0.0 <= v <= 1.0, "a number in [0, 1]"),
    "data.seq_len": (lambda v, _: v >= 2, "an integer >= 2"),
    "data.max_documents": (lambda v, _: v >= 1, "an integer >= 1 or none"),
    "data.num_documents": (lambda v, _: v >= 1, "an integer >= 1"),
    "data.min_length": (lambda v, d: 1 <= v <= d.max_length, "an integer in [1, data.max_length]"),
    "data.max_length": (lambda v, _: v >= 1, "an integer >= 1"),
    "data.loss_on": (lambda v, _: v in ("answer", "all"), "'answer' or 'all'"),
    "train.max_steps": (lambda v, _: v >= 1, "an integer >= 1"),
    "train.batch_size": (lambda v, _: v >= 1, "an integer >= 1"),
    "train.gradient_accumulation_steps": (lambda v, _: v >= 1, "an integer >= 1"),
    "train.learning_rate": (lambda v, _: v > 0, "a finite number > 0"),
    "train.weight_decay": (lambda v, _: v >= 0, "a finite number >= 0"),
    "train.warmup_steps": (lambda v, _: v >= 0, "an integer >= 0"),
    "train.max_grad_norm": (lambda v, _: v >= 0, "a finite number >= 0 (0: no clipping)"),
    "train.precision": (lambda v, _: v in PRECISIONS, f"one of {PRECISIONS}"),
    "train.logging_steps": (lambda v, _: v >= 1, "an integer >= 1"),
    "train.save_steps": (lambda v, _: v >= 0, "an integer >= 0"),
    "train.save_total_limit": (lambda v, _: v >= 0, "an integer >= 0"),
    "train.sparsity_every": (lambda v, _: v >= 0, "an integer >= 0"),
    "train.dataloader_num_workers": (lambda v, _: v >= 0, "an integer >= 0"),
    "lora.r": (lambda v, _: v >= 1, "an integer >= 1"),
    "lora.alpha": (lambda v, _: v > 0, "an integer > 0"),
    "lora.dropout": (lambda v, _: 0.0 <= v < 1.0, "a number in [0, 1)"),
}
_KINDS = {bool: "true or false", int: "an integer", float: "a finite number", str: "a string"}


def _check_types(section: str, values: Any) -> None:
    """Each key of a section holds its declared type: a bool is no integer, a string no number, a number is
    finite. A quoted number is refused, not read: TOML, JSON and `--set` all write numbers bare."""
    hints = typing.get_type_hints(type(values))
    for f in dataclasses.fields(values):
        name, value, hint = f"{section}.{f.name}", getattr(values, f.name), hints[f.name]
        options = typing.get_args(hint) if typing.get_origin(hint) in (typing.Union, types.UnionType) else (hint,)
        if value is None and type(None) in options:
            continue
        kind = next(o for o in options if o is not type(None))
        if typing.get_origin(kind) is tuple:
            if isinstance(value, (str, bytes)) or not isinstance(value, (tuple, list)):
                raise ValueError(f"{name} must be a list of strings, got {value!r}")
            bad = [v for v in value if not isinstance(v, str)]
            if bad:
                raise ValueError(f"{name} must be a list of strings, got {bad[0]!r} in {list(value)!r}")
            continue
        if kind is float:
            ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
        elif kind is int:
            ok = isinstance(value, int) and not isinstance(value, bool)
        else:
            ok = isinstance(value, kind)
        if not ok:
            note = ""
            if isinstance(value, str) and kind in (int, float) and _is_number(value):
                note = " (a quoted number is a string: write it without quotes"
                note += "; YAML reads 1e-4 as a string, 1.0e-4 as a number)" if kind is float else ")"
            valid = _RULES[name][1] if name in _RULES else _KINDS[kind] + (" or none" if type(None) in options else "")
            raise ValueError(f"{name} must be {valid}, got {value!r}{note}")


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True
