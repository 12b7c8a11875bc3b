"""`MobaConfig`: the one validated, frozen description of how a model attends.

It is stored in ``model.config.moba_config`` as a plain dict, so ``save_pretrained`` writes it to
``config.json`` and ``from_pretrained(..., attn_implementation="moba")`` reads it back.
"""

from __future__ import annotations

import dataclasses
import functools
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
from .kernels.common import POOLINGS, GateOptions

DECODE_MODES = ("moba", "full")
from .kernels import BACKENDS  # noqa: E402 - "auto" and the registered backends (moba_hf.kernels), read live


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
    dense_tail:          the last n queries of every call that brings more than one new token (a prompt, or a
                         chunk of one) attend every earlier key, densely; the rest of the call stays sparse. The
                         end of a prompt usually holds the question, which needs to see the whole context.
                         Single-token decode steps follow `decode`.
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
    dense_tail: int = 0
    sparse: bool = True
    dca: DcaConfig | bool | None = None

    def __post_init__(self) -> None:
        _check_int("block_size", self.block_size, 1)
        _check_int("top_k", self.top_k, 1)
        _check_int("full_attn_layers", self.full_attn_layers, 0)
        _check_int("sink_blocks", self.sink_blocks, 0)
        _check_int("local_blocks", self.local_blocks, 0)
        _check_int("dense_tail", self.dense_tail, 0)
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

    @functools.cached_property  # read by every decode step; the fields it copies are frozen
    def gate(self) -> GateOptions:
        """The gate's pooling and forced blocks, as the kernels take them."""
        return GateOptions(self.pooling, self.sink_blocks, self.local_blocks)

    def kernel_kwargs(self) -> dict[str, Any]:
        """The MoBA keywords shared by the kernels' public functions (`moba_attention`, `moba_decode`,
        `dca_attention`); `prefill_kwargs` adds the dense tail."""
        return dict(block_size=self.block_size, top_k=self.top_k, **self.gate.as_kwargs())

    def tail_queries(self, num_queries: int) -> int:
        """How many of a call's `num_queries` new queries attend densely (`dense_tail`; none in a decode step)."""
        return min(self.dense_tail, num_queries) if num_queries > 1 else 0

    def prefill_kwargs(self, num_queries: int) -> dict[str, Any]:
        """`kernel_kwargs` plus the dense tail of a call with `num_queries` new queries (`moba_attention`,
        `dca_attention`)."""
        return dict(self.kernel_kwargs(), dense_tail=self.tail_queries(num_queries))

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
        gate picks other blocks), and the last `dense_tail` queries attend every earlier key.
        Full-attention layers are not counted here.
        """
        _check_int("seq_len", seq_len, 1)
        if not self.sparse:
            return 0.0
        bs = self.block_size
        causal_pairs = seq_len * (seq_len + 1) // 2
        extra = self.top_k - 1 + self.sink_blocks + self.local_blocks
        tail = self.tail_queries(seq_len)
        head = seq_len - tail  # queries that attend sparsely
        attended = 0
        for c in range(math.ceil(head / bs)):
            n = min(bs, head - c * bs)  # sparse queries in block c (they see the block's keys up to themselves)
            attended += n * (n + 1) // 2 + n * min(c, extra) * bs
        attended += causal_pairs - head * (head + 1) // 2  # the dense tail
        return 1.0 - attended / causal_pairs

    # --- (de)serialisation ------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        if out["full_attn_layer_ids"] is not None:
            out["full_attn_layer_ids"] = list(out["full_attn_layer_ids"])
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> MobaConfig:
        """From our keys (top level or under `moba`), the seed-style server keys or the reference MoBA's
        `moba_chunk_size` / `moba_topk`. Every key is used or refused; serving options are refused here
        (`read_config` returns them)."""
        if isinstance(data, MobaConfig):
            return data
        settings = read_config(data)
        if settings.serving:
            raise ValueError(
                f"{', '.join(f'{k}={v!r}' for k, v in settings.serving.items())}: serving options, not MoBA "
                "settings; the vLLM plugin takes them from the same file (MOBA_HF_CONFIG), or remove them"
            )
        return settings.moba

    @classmethod
    def from_file(cls, path: str | Path) -> MobaConfig:
        """Load from a .toml, .json or .yaml/.yml file (settings at top level or under a `moba` table)."""
        data = load_mapping(path)
        try:
            return cls.from_dict(data)
        except ValueError as err:
            raise ValueError(f"{path}: {err}") from None

    @classmethod
    def preset(cls, name: str) -> MobaConfig:
        """A named preset shipped with the package (`moba-hf presets` lists them), e.g. "training-free"."""
        from . import presets

        return cls.from_file(presets.path(name))

    @classmethod
    def from_spec(cls, spec: MobaConfig | Mapping[str, Any] | str | Path | None) -> MobaConfig:
        """A MobaConfig, a mapping, a preset name or a config file path; None gives the defaults."""
        if spec is None:
            return cls()
        if isinstance(spec, MobaConfig):
            return spec
        if isinstance(spec, Mapping):
            return cls.from_dict(spec)
        if isinstance(spec, (str, Path)):
            from . import presets

            if isinstance(spec, str) and spec in presets.names():
                return cls.preset(spec)
            if Path(spec).is_file():
                return cls.from_file(spec)
            raise ValueError(
                f"MoBA config {str(spec)!r} is neither a preset ({', '.join(presets.names())}) nor an existing "
                ".toml / .json / .yaml file"
            )
        raise ValueError(
            f"a MoBA config must be a MobaConfig, a mapping, a preset name or a file path, got {type(spec).__name__}"
        )

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
    """Read a TOML / JSON / YAML file into a dict; errors name the file, an empty file is refused."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"config file not found: {path}")
    suffix = path.suffix.lower()
    text = path.read_text()
    if suffix not in (".toml", ".json", ".yaml", ".yml"):
        raise ValueError(f"config file {path} must end in .toml, .json, .yaml or .yml, got {suffix!r}")
    try:
        if suffix == ".toml":
            data = tomllib.loads(text)
        elif suffix == ".json":
            data = json.loads(text) if text.strip() else None
        else:
            import yaml

            try:
                data = yaml.safe_load(text)
            except yaml.YAMLError as err:
                raise ValueError(f"{path}: invalid YAML: {err}") from None
    except (tomllib.TOMLDecodeError, json.JSONDecodeError) as err:
        raise ValueError(f"{path}: invalid {suffix[1:].upper()}: {err}") from None
    if not data:
        raise ValueError(f"config file {path} is empty: give settings (or remove the file to use the defaults)")
    if not isinstance(data, Mapping):
        raise ValueError(f"config file {path} must hold a table of settings, got {type(data).__name__}")
    return dict(data)


# --- other vocabularies ---------------------------------------------------------------------------
# Seed-style server configs and the reference MoBA code name the same settings differently.
ALIASES = {
    "top_k_blocks": "top_k",
    "moba_topk": "top_k",
    "moba_chunk_size": "block_size",
    "score_pooling": "pooling",
}
# MoBA always attends the current block, causally: these may only say so.
ALWAYS_TRUE = {
    "force_current_block": "MoBA always attends the query's own block",
    "causal_mask": "MoBA attention is causal (a query never sees a later key)",
}
SERVING_KEYS = ("kv_cache_dtype", "max_context_tokens")
_NESTED = {  # nested TOML: (table path, key) -> flat seed key
    ("attention", "type"): "attention_type",
    ("attention", "fallback", "enable"): "enable_full_attention_fallback",
    ("attention", "fallback", "layers"): "fallback_layers",
    ("attention", "kv_cache", "dtype"): "kv_cache_dtype",
    ("attention", "kv_cache", "max_context_tokens"): "max_context_tokens",
}
_METADATA_TABLES = ("about",)  # preset descriptions, not settings


@dataclasses.dataclass(frozen=True)
class ConfigSettings:
    """What a config file or mapping holds: the MobaConfig and any serving options (vLLM's side)."""

    moba: MobaConfig
    serving: dict[str, Any]


def read_config_file(path: str | Path) -> ConfigSettings:
    """`read_config` of a file (the vLLM plugin reads server configs this way)."""
    data = load_mapping(path)
    try:
        return read_config(data)
    except ValueError as err:
        raise ValueError(f"{path}: {err}") from None


def _flatten_attention_table(table: Any) -> dict[str, Any]:
    if not isinstance(table, Mapping):
        raise ValueError(f"the [attention] table must be a table of settings, got {table!r}")
    flat: dict[str, Any] = {}

    def walk(prefix: tuple[str, ...], node: Mapping[str, Any]) -> None:
        for key, value in node.items():
            here = (*prefix, key)
            if isinstance(value, Mapping):
                walk(here, value)
            else:
                flat[_NESTED.get(here, ".".join(here[1:]))] = value

    walk(("attention",), table)
    return flat


def read_config(data: Mapping[str, Any]) -> ConfigSettings:
    """Map any supported vocabulary to a MobaConfig plus serving options; refuse every key without a use."""
    if not isinstance(data, Mapping):
        raise ValueError(f"a MoBA config must be a table of settings, got {type(data).__name__} {data!r}")
    data = {k: v for k, v in data.items() if k not in _METADATA_TABLES}
    for table in ("moba", "attention"):
        if table in data:
            rest = sorted(set(data) - {table})
            if rest:
                raise ValueError(
                    f"keys {rest} sit beside the [{table}] table and would be ignored: move them into [{table}] "
                    "or remove them"
                )
            inner = data[table]
            if table == "moba":
                if not isinstance(inner, Mapping):
                    raise ValueError(f"moba must be a table of settings, got {type(inner).__name__} {inner!r}")
                data = dict(inner)
            else:
                data = _flatten_attention_table(inner)
    fields: dict[str, Any] = {}
    serving: dict[str, Any] = {}
    known = {f.name for f in dataclasses.fields(MobaConfig)}
    unknown = []
    fallback_enabled = data.get("enable_full_attention_fallback")
    if fallback_enabled is not None and not isinstance(fallback_enabled, bool):
        raise ValueError(f"enable_full_attention_fallback must be true or false, got {fallback_enabled!r}")
    for key, value in data.items():
        if key in known:
            target = key
        elif key in ALIASES:
            target = ALIASES[key]
        elif key in ALWAYS_TRUE:
            if value is not True:
                raise ValueError(f"{key} = {value!r} is not possible: {ALWAYS_TRUE[key]}; it may only be true")
            continue
        elif key in SERVING_KEYS:
            serving[key] = value
            continue
        elif key == "attention_type":
            if value not in ("moba", "full"):
                raise ValueError(f"attention_type must be 'moba' or 'full', got {value!r}")
            target, value = "sparse", value == "moba"
        elif key == "enable_full_attention_fallback":
            continue  # read with fallback_layers
        elif key == "fallback_layers":
            if fallback_enabled is False and value:
                raise ValueError(
                    f"fallback_layers = {value!r} contradicts enable_full_attention_fallback = false: "
                    "enable it, or set fallback_layers = 0"
                )
            target = "full_attn_layer_ids" if isinstance(value, (list, tuple)) else "full_attn_layers"
        elif key == "flash_attn_version":
            if value != 2:
                raise ValueError(f"flash_attn_version must be 2 (the flash backend uses flash-attn 2), got {value!r}")
            target, value = "backend", "flash"
        else:
            unknown.append(key)
            continue
        if target in fields:
            raise ValueError(f"{target} is given twice (as {key!r} and under another name); keep one")
        fields[target] = value
    if unknown:
        raise ValueError(f"unknown MoBA config keys {sorted(unknown)}; valid keys: {sorted(known)}")
    if fallback_enabled and "full_attn_layers" not in fields and "full_attn_layer_ids" not in fields:
        raise ValueError("enable_full_attention_fallback = true needs fallback_layers (how many last layers are dense)")
    if isinstance(fields.get("pooling"), str) and fields["pooling"] == "avg":
        fields["pooling"] = "mean"
    return ConfigSettings(MobaConfig(**fields), serving)
