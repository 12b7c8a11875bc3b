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
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ..config import MobaConfig, load_mapping

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
        m, s, d, t, lo = self.model, self.schedule, self.data, self.train, self.lora
        _check(m.dtype in DTYPES, "model.dtype", m.dtype, f"one of {DTYPES}")
        _check(0.0 <= s.moba_fraction <= 1.0, "schedule.moba_fraction", s.moba_fraction, "[0, 1]")
        _check(d.seq_len >= 2, "data.seq_len", d.seq_len, ">= 2")
        _check(d.num_documents >= 1, "data.num_documents", d.num_documents, ">= 1")
        _check(1 <= d.min_length <= d.max_length, "data.min_length", d.min_length, f"[1, max_length={d.max_length}]")
        _check(d.loss_on in ("answer", "all"), "data.loss_on", d.loss_on, "'answer' or 'all'")
        _check(t.max_steps >= 1, "train.max_steps", t.max_steps, ">= 1")
        _check(t.batch_size >= 1, "train.batch_size", t.batch_size, ">= 1")
        _check(
            t.gradient_accumulation_steps >= 1,
            "train.gradient_accumulation_steps",
            t.gradient_accumulation_steps,
            ">= 1",
        )
        _check(t.learning_rate > 0, "train.learning_rate", t.learning_rate, "> 0")
        _check(t.precision in PRECISIONS, "train.precision", t.precision, f"one of {PRECISIONS}")
        _check(t.save_steps >= 0, "train.save_steps", t.save_steps, ">= 0")
        _check(t.save_total_limit >= 0, "train.save_total_limit", t.save_total_limit, ">= 0")
        _check(t.sparsity_every >= 0, "train.sparsity_every", t.sparsity_every, ">= 0")
        _check(lo.r >= 1, "lora.r", lo.r, ">= 1")

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


def _check(ok: bool, name: str, value: Any, valid: str) -> None:
    if not ok:
        raise ValueError(f"{name} must be {valid}, got {value!r}")
