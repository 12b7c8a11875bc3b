"""`MobaConfig`: the one validated, frozen description of how a model attends.

It is stored in ``model.config.moba_config`` as a plain dict, so ``save_pretrained`` writes it to
``config.json`` and ``from_pretrained(..., attn_implementation="moba")`` reads it back.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

try:
    import tomllib
except ImportError:  # Python 3.10
    import tomli as tomllib

from .dca.config import DcaConfig, check_block_multiple
from .kernels.common import POOLINGS

DECODE_MODES = ("moba", "full")
BACKENDS = ("auto", "reference", "torch", "flex", "triton", "flash")


def _check_int(name: str, value: Any, low: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")


def _check_choice(name: str, value: Any, choices: Sequence[str]) -> None:
    if value not in choices:
        raise ValueError(f"{name} must be one of {', '.join(map(repr, choices))}, got {value!r}")


@dataclasses.dataclass(frozen=True)
class MobaConfig:
    """How MoBA attends.

    block_size:          keys per block (the last block of a sequence may be shorter).
    top_k:               blocks each query attends, counting its own (current) block; 1 = own block only.
    full_attn_layers:    the last N decoder layers keep full attention (0 = none).
    full_attn_layer_ids: explicit layer indices that keep full attention (alternative to N; negative
                         indices count from the end).
    decode:              what single-token decode steps do: "moba" (sparse) or "full" (dense over the cache).
    backend:             kernel backend, see `moba_hf.kernels.BACKENDS`; "auto" picks the fastest available.
    pooling:             how a block's keys are pooled for the gate: "mean" (the paper), "max", or
                         "mean+max" (sum of both scores), or "bound" (Quest's per-channel upper bound of q.k
                         over the block's keys, from each channel's max and min).
    sink_blocks:         always attend the first n blocks, on top of the top_k selection.
    local_blocks:        always attend the n blocks before the current one, on top of the top_k selection.
    sparse:              False: every layer attends densely (e.g. DCA alone, without MoBA).
    dca:                 Dual Chunk Attention (`moba_hf.DcaConfig`; True = its defaults; False = off). None: on
                         only if the checkpoint carries Qwen's dual_chunk_attention_config.
    """

    block_size: int = 512
    top_k: int = 3
    full_attn_layers: int = 0
    full_attn_layer_ids: tuple[int, ...] | None = None
    decode: str = "moba"
    backend: str = "auto"
    pooling: str = "mean"
    sink_blocks: int = 0
    local_blocks: int = 0
    sparse: bool = True
    dca: DcaConfig | bool | None = None

    def __post_init__(self) -> None:
        _check_int("block_size", self.block_size, 1)
        _check_int("top_k", self.top_k, 1)
        _check_int("full_attn_layers", self.full_attn_layers, 0)
        _check_int("sink_blocks", self.sink_blocks, 0)
        _check_int("local_blocks", self.local_blocks, 0)
        _check_choice("decode", self.decode, DECODE_MODES)
        _check_choice("backend", self.backend, BACKENDS)
        _check_choice("pooling", self.pooling, POOLINGS)
        if not isinstance(self.sparse, bool):
            raise ValueError(f"sparse must be true or false, got {self.sparse!r}")
        if isinstance(self.dca, Mapping):
            object.__setattr__(self, "dca", DcaConfig.from_dict(self.dca))
        if self.dca is not None and not isinstance(self.dca, (bool, DcaConfig)):
            raise ValueError(f"dca must be a DcaConfig, a mapping, true, false or None, got {self.dca!r}")
        dca = self.dca if isinstance(self.dca, DcaConfig) else None
        if self.sparse and dca is not None and dca.chunk_size is not None:
            limit = dca.pretraining_length or dca.chunk_size + self.block_size + 1
            check_block_multiple(dca.chunk_size, self.block_size, limit)
        if self.full_attn_layer_ids is not None:
            ids = self.full_attn_layer_ids
            if isinstance(ids, (str, bytes)) or not isinstance(ids, Sequence):
                raise ValueError(f"full_attn_layer_ids must be a list of integers, got {ids!r}")
            for i in ids:
                if isinstance(i, bool) or not isinstance(i, int):
                    raise ValueError(f"full_attn_layer_ids must be a list of integers, got {ids!r}")
            if self.full_attn_layers:
                raise ValueError(
                    "give either full_attn_layers (last N layers) or full_attn_layer_ids (explicit list), "
                    f"not both: got full_attn_layers={self.full_attn_layers}, full_attn_layer_ids={list(ids)}"
                )
            object.__setattr__(self, "full_attn_layer_ids", tuple(ids))

    # --- which layers are dense -------------------------------------------------------------------
    def full_layer_set(self, num_layers: int) -> frozenset[int]:
        """Indices of the decoder layers that use full attention in a model of `num_layers` layers."""
        if self.full_attn_layer_ids is not None:
            resolved = set()
            for i in self.full_attn_layer_ids:
                if not -num_layers <= i < num_layers:
                    raise ValueError(
                        f"full_attn_layer_ids contains {i}, outside the model's layers "
                        f"[{-num_layers}, {num_layers - 1}]"
                    )
                resolved.add(i % num_layers)
            return frozenset(resolved)
        if self.full_attn_layers > num_layers:
            raise ValueError(
                f"full_attn_layers={self.full_attn_layers} exceeds the model's {num_layers} layers "
                f"(valid range 0..{num_layers})"
            )
        return frozenset(range(num_layers - self.full_attn_layers, num_layers))

    # --- cost -------------------------------------------------------------------------------------
    def theoretical_sparsity(self, seq_len: int) -> float:
        """Fraction of causal query-key pairs a prefill of `seq_len` tokens skips.

        Exact for the block layout: each query attends its own block causally plus up to
        `top_k - 1` full earlier blocks (sink and local blocks included in the count, assuming the
        gate picks other blocks). Full-attention layers are not counted here.
        """
        _check_int("seq_len", seq_len, 1)
        if not self.sparse:
            return 0.0
        bs = self.block_size
        causal_pairs = seq_len * (seq_len + 1) // 2
        extra = self.top_k - 1 + self.sink_blocks + self.local_blocks
        attended = 0
        for c in range(math.ceil(seq_len / bs)):
            n = min(bs, seq_len - c * bs)  # queries (and keys) in block c
            attended += n * (n + 1) // 2 + n * min(c, extra) * bs
        return 1.0 - attended / causal_pairs

    # --- (de)serialisation ------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        if out["full_attn_layer_ids"] is not None:
            out["full_attn_layer_ids"] = list(out["full_attn_layer_ids"])
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> MobaConfig:
        if isinstance(data, MobaConfig):
            return data
        if not isinstance(data, Mapping):
            raise ValueError(f"a MoBA config must be a mapping, got {type(data).__name__}")
        section = data.get("moba", data)  # files may nest the settings under [moba]
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(section) - known)
        if unknown:
            raise ValueError(f"unknown MoBA config keys {unknown}; valid keys: {sorted(known)}")
        return cls(**dict(section))

    @classmethod
    def from_file(cls, path: str | Path) -> MobaConfig:
        """Load from a .toml, .json or .yaml/.yml file (settings at top level or under a `moba` table)."""
        return cls.from_dict(load_mapping(path))

    def replace(self, **changes: Any) -> MobaConfig:
        return dataclasses.replace(self, **changes)

    def __str__(self) -> str:
        parts = [f"block_size={self.block_size}", f"top_k={self.top_k}"]
        default = MobaConfig()
        for f in dataclasses.fields(self):
            if f.name not in ("block_size", "top_k") and getattr(self, f.name) != getattr(default, f.name):
                parts.append(f"{f.name}={getattr(self, f.name)}")
        return f"MobaConfig({', '.join(parts)})"


def load_mapping(path: str | Path) -> dict[str, Any]:
    """Read a TOML / JSON / YAML file into a dict."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"config file not found: {path}")
    suffix = path.suffix.lower()
    if suffix == ".toml":
        return tomllib.loads(path.read_text())
    if suffix == ".json":
        return json.loads(path.read_text())
    if suffix in (".yaml", ".yml"):
        import yaml

        return yaml.safe_load(path.read_text()) or {}
    raise ValueError(f"config file {path} must end in .toml, .json, .yaml or .yml, got {suffix!r}")


def flop_ratio(config: MobaConfig, seq_len: int) -> float:
    """Dense causal attention pairs divided by MoBA's attended pairs (the ideal speed-up)."""
    return 1.0 / max(1.0 - config.theoretical_sparsity(seq_len), math.ulp(1.0))
